"""The daemon's store upkeep on trio's virtual clock: it heartbeats, fails what a dead daemon left
running (at start-up and later), and deletes expired tasks; a broken store never stops it."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import pytest
import trio
import trio.testing
from store_harness import OpenStore, record

from runtime import logs
from runtime.task_store import Limits, TaskRecord, TaskStore, wall_clock_ms
from runtime.task_store_open import serve_task_store_upkeep


class CountingStore:
    """A store that counts the upkeep's heartbeats, one per pass, and gives up waiting after a number."""

    def __init__(self, store: TaskStore, max_beats: int) -> None:
        self.store = store
        self.max_beats = max_beats
        self.beats = 0
        self.gave_up = trio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.store, name)

    async def heartbeat(self, owner: str, now_ms: int) -> None:
        self.beats += 1
        if self.beats > self.max_beats:
            self.gave_up.set()
        await self.store.heartbeat(owner, now_ms)

    async def until(self, event: trio.Event) -> None:
        """Wait for ``event``; fail if the upkeep ran ``max_beats`` passes without it."""
        async with trio.open_nursery() as nursery:
            async def watch(e: trio.Event) -> None:
                await e.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch, event)
            nursery.start_soon(watch, self.gave_up)
        assert event.is_set(), f"not seen in {self.beats} passes of the upkeep"


async def test_upkeep_fails_orphans_at_start_and_later_and_expires_old_tasks(
        open_store: OpenStore, autojump_clock: trio.testing.MockClock) -> None:
    # The store works on a thread, and trio's autojump clock jumps to the next deadline whenever
    # every task waits, a call out on that thread included: a fail_after here would fire while the
    # upkeep is mid-pass. So the test sets no deadline of its own: it waits for what the upkeep
    # reports, bounded by a count of the upkeep's passes, and reads when things happened from the
    # records instead of expecting a pass at a given instant.
    base, start = wall_clock_ms(), trio.current_time()

    def clock_ms() -> int:
        return base + round((trio.current_time() - start) * 1000)

    store = await open_store(clock_ms=clock_ms, limits=Limits(orphan_after_ms=20_000))
    me, crashed, quiet = "this-host:100:me", "this-host:200:crashed", "other-host:300:quiet"
    left_running = record(created_at_ms=base, owner=crashed)
    mine = record(created_at_ms=base, owner=me, ttl_ms=100_000)
    theirs = record(created_at_ms=base, owner=quiet)
    for rec in (left_running, mine, theirs):
        await store.create(rec, 10)
    verdicts = {me: True, crashed: False}  # "quiet" is left to its heartbeat
    orphans_failed, expired = [trio.Event(), trio.Event()], trio.Event()
    tally = {"task_orphans_failed": 0, "tasks_expired": 0}

    def sink(entry: dict[str, object]) -> None:
        event = str(entry["event"])
        if event in tally:
            tally[event] += int(str(entry["tasks"]))
        if tally["task_orphans_failed"] >= 1:
            orphans_failed[0].set()
        if tally["task_orphans_failed"] >= 2:
            orphans_failed[1].set()
        if tally["tasks_expired"] >= 3:
            expired.set()

    logs.add_sink(sink)
    counted = CountingStore(store, max_beats=100)  # 100 passes: 500 virtual seconds

    async def get(rec: TaskRecord) -> TaskRecord:
        got = await store.get(rec.task_id, "alice")
        assert got is not None
        return got

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_task_store_upkeep(
                counted, me, heartbeat_s=5, expire_every_s=60, owner_alive=verdicts.get, clock_ms=clock_ms,
                task_status=task_status))
            failed = await get(left_running)  # by the first pass, before start() returned
            assert failed.status == "failed" and failed.error is not None
            assert "noticed at " in json.loads(failed.error)["message"]
            assert (await get(theirs)).status == "working"
            assert orphans_failed[0].is_set() and not orphans_failed[1].is_set()
            await counted.until(orphans_failed[1])
            late = await get(theirs)
            assert late.status == "failed" and late.updated_at_ms - base > 20_000  # failed only after 20 s without a heartbeat
            assert (await get(mine)).status == "working"  # its owner's own heartbeats keep it
            await counted.until(expired)  # every ttl ends by 100 s; a pass every 60 s deletes them
            nursery.cancel_scope.cancel()
    finally:
        logs.remove_sink(sink)
    assert await store.expire(clock_ms() + 10**9) == 0  # deleted, not only hidden


async def test_upkeep_outlives_a_store_that_fails(autojump_clock: trio.testing.MockClock) -> None:
    seen: list[dict[str, object]] = []
    logs.add_sink(seen.append)

    class Broken:
        def __getattr__(self, name: str) -> object:
            async def fail(*args: object, **kwargs: object) -> None:
                raise ConnectionError("the store is away")
            return fail

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: serve_task_store_upkeep(
                Broken(), "me", heartbeat_s=1, task_status=task_status))  # type: ignore[arg-type]
            await trio.sleep(3.5)
            nursery.cancel_scope.cancel()
    finally:
        logs.remove_sink(seen.append)
    failures = [r for r in seen if r["event"] == "task_store_upkeep_failed"]
    assert len(failures) == 4 and "the store is away" in str(failures[0]["error"])


async def test_a_closing_daemon_stops_its_upkeep_before_it_closes_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A heartbeat in flight while the daemon closes (``toolcell call`` opens and closes one at once)
    is stopped, not run against the closed store: no spurious ``task_store_failed`` line."""
    from runtime import daemon as daemon_module
    from runtime.config import load_config

    seen: list[dict[str, object]] = []
    beating = trio.Event()
    closed = trio.Event()

    class SlowToBeat:
        def __init__(self, store: TaskStore) -> None:
            self.store = store
            self.beats = 0

        def __getattr__(self, name: str) -> object:
            return getattr(self.store, name)

        async def heartbeat(self, owner: str, now_ms: int) -> None:
            self.beats += 1
            if self.beats == 1:
                return await self.store.heartbeat(owner, now_ms)
            beating.set()
            await closed.wait()  # a store call still in flight when the store is closed
            raise trio.ClosedResourceError("the store was closed under the call")

        async def aclose(self) -> None:
            closed.set()
            await trio.testing.wait_all_tasks_blocked()
            await self.store.aclose()

    real_open = daemon_module._open_task_store

    async def slow_store(config: object) -> object:
        return SlowToBeat(await real_open(config))  # type: ignore[arg-type]

    monkeypatch.setattr(daemon_module, "_open_task_store", slow_store)
    (tmp_path / "plugins").mkdir()
    cfg = load_config(None, {"plugins": [str(tmp_path / "plugins")], "policy": "none", "watch": False,
                             "state_dir": str(tmp_path / "state"), "log_level": "error",
                             "tasks": {"heartbeat_s": 0.1, "orphan_after_s": 0.2}})
    logs.add_sink(seen.append)
    try:
        async with daemon_module.open_daemon(cfg):
            with trio.fail_after(10):
                await beating.wait()
    finally:
        logs.remove_sink(seen.append)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(36, 0, 0, 0, 0)  # open_daemon made us a subreaper: undo it
        except (OSError, AttributeError):
            pass
    assert closed.is_set()
    assert [r for r in seen if r["event"] == "task_store_failed"] == []


async def test_a_listen_on_task_ids_that_do_not_exist_is_not_polled_again(open_store: OpenStore) -> None:
    """Listened tasks that another daemon runs are read from the store ten times a second; ids that name
    no task (made up by the client, or expired) would be read for as long as the listen lasts."""
    from runtime.config import TasksConfig
    from runtime.tasks import TaskManager

    store = await open_store()
    reads: list[str] = []

    class Counting:
        def __getattr__(self, name: str) -> object:
            return getattr(store, name)

        async def inspect(self, task_id: str) -> TaskRecord | None:
            reads.append(task_id)
            return await store.inspect(task_id)

    real = record(created_at_ms=wall_clock_ms() - 10_000, owner="another-host:1:aa", ttl_ms=600_000)

    class Sink:
        def emit(self, data: bytes) -> None:
            pass

    await store.create(real, 10)
    async with trio.open_nursery() as nursery:
        tasks = TaskManager(None, None, Counting(), TasksConfig(), nursery)  # type: ignore[arg-type]
        made_up = tuple(f"t-{i:09d}" for i in range(50))
        tasks.subscribe("alice", (*made_up, real.task_id), Sink(), b'"s"')  # type: ignore[arg-type]
        await tasks._watch_remote()
        assert len(reads) == 51
        reads.clear()
        await tasks._watch_remote()
        assert reads == [real.task_id]  # still working: still watched; the others never again


async def test_a_daemon_that_stops_cleanly_takes_its_catalog_out_of_the_store(tmp_path: Path) -> None:
    """Daemons sharing a store compare their catalogs (``catalog_differs``); one that stopped stayed
    listed until it was ``orphan_after_s`` old, so the others warned about a replica already gone."""
    from runtime import daemon as daemon_module
    from runtime.config import load_config
    from runtime.task_store_open import connect_task_store

    (tmp_path / "plugins").mkdir()
    cfg = load_config(None, {"plugins": [str(tmp_path / "plugins")], "policy": "none", "watch": False,
                             "state_dir": str(tmp_path / "state"), "log_level": "error"})
    try:
        async with daemon_module.open_daemon(cfg) as daemon:
            assert daemon.tasks is not None
            owner = daemon.tasks.owner
            assert owner in daemon.tasks.catalogs  # published at its first heartbeat
    finally:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(36, 0, 0, 0, 0)  # open_daemon made us a subreaper: undo it
        except (OSError, AttributeError):
            pass
    store = await connect_task_store(cfg.tasks.store, cfg.state_dir)
    try:
        seen = await store.compare_catalogs("probe:1:00", "f-probe", wall_clock_ms())
    finally:
        await store.aclose()
    assert owner not in seen and seen == {"probe:1:00": "f-probe"}
