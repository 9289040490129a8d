"""The task store's rules, on both backends (SQLite and a real Redis): scoping, the cap, the
compare-and-set of transitions, mailboxes between daemons, orphans, expiry, sizes, cursors."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest
import trio
from store_harness import FakeClock, OpenStore, record

from runtime.task_store import (
    ORPHAN_ERROR_CODE,
    Limits,
    TaskCapReached,
    TaskExists,
    TaskMailboxFull,
    TaskPayloadTooLarge,
    TaskRecord,
    encode_cursor,
    wall_clock_ms,
)


async def test_a_created_task_reads_back_whole_for_its_principal_and_as_unknown_for_anyone_else(
        open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    rec = record(created_at_ms=clock.now_ms, poll_interval_ms=500, status_message="starting", era="2025-11-25")
    await store.create(rec, 10)
    assert await store.get(rec.task_id, "alice") == rec
    assert await store.get(rec.task_id, "bob") is None
    assert await store.get(rec.task_id, "") is None
    assert await store.get("no-such-task-id", "alice") is None
    assert await store.inspect(rec.task_id) == rec  # the operator's view is not scoped


async def test_a_second_daemon_reads_a_task_as_soon_as_create_returns(open_store: OpenStore) -> None:
    clock = FakeClock()
    daemon_a, daemon_b = await open_store(clock_ms=clock), await open_store(clock_ms=clock)
    rec = record(created_at_ms=clock.now_ms)
    await daemon_a.create(rec, 10)
    assert await daemon_b.get(rec.task_id, "alice") == rec


async def test_a_task_survives_its_store_being_closed_and_opened_again(open_store: OpenStore) -> None:
    clock = FakeClock()
    first = await open_store(clock_ms=clock)
    rec = record(created_at_ms=clock.now_ms)
    await first.create(rec, 10)
    await first.aclose()
    again = await open_store(clock_ms=clock)
    assert await again.get(rec.task_id, "alice") == rec


async def test_a_duplicate_id_and_a_malformed_record_are_refused(open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    rec = record(created_at_ms=clock.now_ms)
    await store.create(rec, 10)
    with pytest.raises(TaskExists):
        await store.create(rec, 10)
    with pytest.raises(ValueError, match="URL-safe"):
        await store.create(record(created_at_ms=clock.now_ms, task_id="bad id!"), 10)
    with pytest.raises(ValueError, match="working or input_required"):
        await store.create(record(created_at_ms=clock.now_ms, status="completed"), 10)


async def test_the_list_pages_newest_first_without_gaps_or_repeats_even_as_tasks_arrive(open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    base = clock.now_ms
    made: list[TaskRecord] = []
    for i in range(25):
        # Several tasks share a millisecond: the id breaks the tie, so the order is still total.
        rec = record(created_at_ms=base + i // 3, result=b'{"big": true}' if i == 0 else None)
        await store.create(rec, 100)
        made.append(rec)
    await store.create(record(created_at_ms=base, principal="bob"), 100)
    expected = sorted(made, key=lambda r: (r.created_at_ms, r.task_id), reverse=True)
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        page, cursor = await store.list("alice", cursor, 7)
        pages += 1
        seen += [r.task_id for r in page]
        assert all(r.result is None for r in page)  # pages carry no payloads; get reads them
        if pages == 1:  # a task created mid-listing is newer than the cursor: it never shows up later
            await store.create(record(created_at_ms=base + 100), 100)
        if cursor is None:
            break
    assert seen == [r.task_id for r in expected]
    assert pages == 4
    everyone, _ = await store.list_all(None, 100)
    assert len(everyone) == 27 and {r.principal for r in everyone} == {"alice", "bob"}


async def test_a_principal_never_lists_another_principals_tasks(open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    for principal in ("alice", "bob", ""):
        await store.create(record(principal=principal, created_at_ms=clock.now_ms), 10)
    for principal in ("alice", "bob", ""):
        page, cursor = await store.list(principal, None, 10)
        assert [r.principal for r in page] == [principal] and cursor is None
    assert await store.list("carol", None, 10) == ([], None)


TAMPERED = base64.urlsafe_b64encode(msgspec.msgpack.encode([1, "not an id!"])).decode()


@pytest.mark.parametrize("cursor", ["not a cursor!", "", "AAAA", encode_cursor(1, "ok-id-12")[:-3] + "%%%", TAMPERED,
                                    5, ["x"], "A" * 100_000])
async def test_a_bad_cursor_is_a_value_error(open_store: OpenStore, cursor: Any) -> None:
    """A client sends the cursor back: whatever its type or size, it is a bad cursor (-32602), not a
    store failure (a number used to raise TypeError, answered 503 and logged as an outage)."""
    store = await open_store()
    with pytest.raises(ValueError, match="cursor"):
        await store.list("alice", cursor, 10)
    with pytest.raises(ValueError, match="cursor"):
        await store.list_all(cursor, 10)


async def test_the_cap_counts_only_one_principals_unfinished_tasks(open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    live = [record(created_at_ms=clock.now_ms) for _ in range(3)]
    for rec in live:
        await store.create(rec, 3)
    with pytest.raises(TaskCapReached, match="3"):
        await store.create(record(created_at_ms=clock.now_ms), 3)
    await store.create(record(principal="bob", created_at_ms=clock.now_ms), 3)  # bob has his own count
    await store.transition(live[0].task_id, status="completed", now_ms=clock.now_ms, result=b"{}")
    await store.create(record(created_at_ms=clock.now_ms), 3)  # a finished task frees its place
    with pytest.raises(TaskCapReached):
        await store.create(record(created_at_ms=clock.now_ms), 3)


async def test_concurrent_creates_from_two_daemons_never_pass_the_cap(open_store: OpenStore) -> None:
    clock = FakeClock()
    daemons = [await open_store(clock_ms=clock), await open_store(clock_ms=clock)]
    outcomes: list[str] = []

    async def create(i: int) -> None:
        try:
            await daemons[i % 2].create(record(created_at_ms=clock.now_ms), 5)
            outcomes.append("created")
        except TaskCapReached:
            outcomes.append("refused")

    async with trio.open_nursery() as nursery:
        for i in range(24):
            nursery.start_soon(create, i)
    assert sorted(outcomes).count("created") == 5 and outcomes.count("refused") == 19
    page, _ = await daemons[0].list("alice", None, 100)
    assert len(page) == 5


async def test_a_task_moves_through_input_required_and_its_terminal_state_never_changes(open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    rec = record(created_at_ms=clock.now_ms)
    await store.create(rec, 10)
    asked = await store.transition(rec.task_id, status="input_required", now_ms=clock.now_ms + 1,
                                   input_requests=b'{"k1": {"method": "elicitation/create"}}',
                                   status_message="waiting for you")
    assert asked is not None and asked.status == "input_required" and asked.updated_at_ms == clock.now_ms + 1
    assert asked.input_requests == b'{"k1": {"method": "elicitation/create"}}'
    back = await store.transition(rec.task_id, status="working", now_ms=clock.now_ms + 2, input_requests=None,
                                  status_message=None)
    assert back is not None and back.input_requests is None and back.status_message is None
    done = await store.transition(rec.task_id, status="completed", now_ms=clock.now_ms + 3,
                                  result=b'{"content": [], "isError": true}')
    assert done is not None and done.status == "completed"
    for status in ("cancelled", "failed", "working", "completed"):
        assert await store.transition(rec.task_id, status=status, now_ms=clock.now_ms + 4,  # type: ignore[arg-type]
                                      result=b'{"other": 1}', error=b'{"code": 1}') is None
    assert await store.get(rec.task_id, "alice") == done
    assert await store.transition("unknown-task-id", status="completed", now_ms=clock.now_ms) is None


async def test_of_racing_transitions_from_two_daemons_exactly_one_wins(open_store: OpenStore) -> None:
    clock = FakeClock()
    daemons = [await open_store(clock_ms=clock), await open_store(clock_ms=clock)]
    rec = record(created_at_ms=clock.now_ms)
    await daemons[0].create(rec, 10)
    winners: list[TaskRecord] = []

    async def finish(i: int) -> None:
        status = "cancelled" if i % 3 == 0 else "completed"
        new = await daemons[i % 2].transition(rec.task_id, status=status, now_ms=clock.now_ms,  # type: ignore[arg-type]
                                              result=json.dumps({"by": i}).encode())
        if new is not None:
            winners.append(new)

    async with trio.open_nursery() as nursery:
        for i in range(32):
            nursery.start_soon(finish, i)
    assert len(winners) == 1
    assert await daemons[1].get(rec.task_id, "alice") == winners[0]


async def test_messages_posted_by_any_daemon_reach_the_owner_once_and_in_order(open_store: OpenStore) -> None:
    clock = FakeClock()
    owner, other = await open_store(clock_ms=clock), await open_store(clock_ms=clock)
    first, second, quiet = (record(created_at_ms=clock.now_ms) for _ in range(3))
    for rec in (first, second, quiet):
        await owner.create(rec, 10)
    assert await owner.take([first.task_id, second.task_id, quiet.task_id]) == {}
    assert await other.post(first.task_id, b'{"cancel": true}')
    assert await owner.post(first.task_id, b'{"inputResponses": {"k1": {}}}')
    assert await other.post(second.task_id, b'{"n": 2}')
    taken = await owner.take([first.task_id, second.task_id, quiet.task_id])
    assert taken == {first.task_id: [b'{"cancel": true}', b'{"inputResponses": {"k1": {}}}'],
                     second.task_id: [b'{"n": 2}']}
    assert await owner.take([first.task_id, second.task_id]) == {}


async def test_nothing_is_delivered_to_an_unknown_or_finished_task_and_finishing_empties_the_mailbox(
        open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    rec = record(created_at_ms=clock.now_ms)
    await store.create(rec, 10)
    assert not await store.post("unknown-task-id", b"{}")
    assert await store.post(rec.task_id, b'{"late": true}')
    await store.transition(rec.task_id, status="cancelled", now_ms=clock.now_ms)
    assert await store.take([rec.task_id]) == {}
    assert not await store.post(rec.task_id, b"{}")


async def test_a_full_mailbox_refuses_more_until_its_owner_takes(open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock, limits=Limits(mailbox_max_messages=3))
    rec = record(created_at_ms=clock.now_ms)
    await store.create(rec, 10)
    for i in range(3):
        assert await store.post(rec.task_id, str(i).encode())
    with pytest.raises(TaskMailboxFull):
        await store.post(rec.task_id, b"3")
    assert await store.take([rec.task_id]) == {rec.task_id: [b"0", b"1", b"2"]}
    assert await store.post(rec.task_id, b"4")


async def test_an_oversized_result_is_refused_with_the_limit_named_and_the_task_untouched(
        open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock, limits=Limits(max_payload_bytes=1024))
    rec = record(created_at_ms=clock.now_ms)
    await store.create(rec, 10)
    with pytest.raises(TaskPayloadTooLarge, match=r"result is 2000 bytes, over the store's limit of 1024 bytes"):
        await store.transition(rec.task_id, status="completed", now_ms=clock.now_ms, result=b"x" * 2000)
    assert await store.get(rec.task_id, "alice") == rec
    with pytest.raises(TaskPayloadTooLarge, match="input requests"):
        await store.create(record(created_at_ms=clock.now_ms, status="input_required",
                                  input_requests=b"x" * 1025), 10)
    with pytest.raises(TaskPayloadTooLarge, match="message"):
        await store.post(rec.task_id, b"x" * 1025)
    at_limit = b'{"x":"' + b"x" * 1016 + b'"}'  # 1024 bytes, and a result object (read back, it is checked)
    done = await store.transition(rec.task_id, status="completed", now_ms=clock.now_ms, result=at_limit)
    assert done is not None and done.result == at_limit


async def test_a_silent_owners_tasks_fail_while_finished_results_and_live_owners_are_kept(
        open_store: OpenStore) -> None:
    clock = FakeClock()
    limits = Limits(orphan_after_ms=10_000)
    daemon_a, daemon_b = await open_store(clock_ms=clock, limits=limits), await open_store(clock_ms=clock, limits=limits)
    t0 = clock.now_ms
    await daemon_a.heartbeat("host-a:1:aa", t0)
    running = record(created_at_ms=t0, owner="host-a:1:aa")
    asking = record(created_at_ms=t0, owner="host-a:1:aa", status="input_required", input_requests=b"{}")
    finished = record(created_at_ms=t0, owner="host-a:1:aa")
    elsewhere = record(created_at_ms=t0, owner="host-b:2:bb", principal="bob")
    for rec in (running, asking, finished, elsewhere):
        await daemon_a.create(rec, 10)
    await daemon_a.transition(finished.task_id, status="completed", now_ms=t0 + 1, result=b'{"answer": 42}')
    await daemon_a.post(running.task_id, b'{"cancel": true}')
    await daemon_b.heartbeat("host-b:2:bb", t0 + 9_000)

    assert await daemon_b.recover_orphans(None, t0 + 9_999, "found at start-up") == 0  # not silent for long enough
    assert await daemon_b.recover_orphans(None, t0 + 10_001, "found at start-up") == 2
    for rec in (running, asking):
        failed = await daemon_b.get(rec.task_id, "alice")
        assert failed is not None and failed.status == "failed" and failed.updated_at_ms == t0 + 10_001
        assert failed.status_message == "the daemon running this task stopped before it finished (found at start-up)"
        assert failed.error is not None
        assert json.loads(failed.error) == {"code": ORPHAN_ERROR_CODE, "message": failed.status_message}
    kept = await daemon_b.get(finished.task_id, "alice")
    assert kept is not None and kept.status == "completed" and kept.result == b'{"answer": 42}'
    other = await daemon_b.get(elsewhere.task_id, "bob")
    assert other is not None and other.status == "working"
    assert await daemon_a.take([running.task_id]) == {}
    # The dead owner's daemon, were it only slow, finds its task decided and cannot change it.
    assert await daemon_a.transition(running.task_id, status="completed", now_ms=t0 + 10_002) is None
    assert await daemon_b.recover_orphans(None, t0 + 10_003, "again") == 0


async def test_a_heartbeat_keeps_an_owners_tasks_and_a_verdict_overrides_the_heartbeat(open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock, limits=Limits(orphan_after_ms=10_000))
    t0 = clock.now_ms
    stale = record(created_at_ms=t0, owner="host-a:1:aa")
    fresh = record(created_at_ms=t0, owner="host-b:2:bb")
    await store.create(stale, 10)
    await store.create(fresh, 10)
    await store.heartbeat("host-a:1:aa", t0 + 19_000)
    await store.heartbeat("host-b:2:bb", t0 + 19_000)
    assert await store.recover_orphans(None, t0 + 20_000, "periodic check") == 0
    # The verdict is asked first: True spares a silent owner, False condemns a beating one.
    verdicts = {"host-a:1:aa": True, "host-b:2:bb": False}
    assert await store.recover_orphans(verdicts.get, t0 + 60_000, "its process is gone") == 1
    a, b = await store.get(stale.task_id, "alice"), await store.get(fresh.task_id, "alice")
    assert a is not None and a.status == "working"
    assert b is not None and b.status == "failed"
    assert await store.recover_orphans(lambda owner: None, t0 + 60_000, "periodic check") == 1


async def test_a_task_is_gone_after_its_ttl_on_trios_virtual_clock(open_store: OpenStore,
                                                                    autojump_clock: trio.testing.MockClock) -> None:
    base, start = wall_clock_ms(), trio.current_time()

    def clock_ms() -> int:
        return base + round((trio.current_time() - start) * 1000)

    store = await open_store(clock_ms=clock_ms)
    rec = record(created_at_ms=clock_ms(), ttl_ms=60_000)
    forever = record(created_at_ms=clock_ms(), ttl_ms=None)
    await store.create(rec, 2)
    await store.create(forever, 2)
    assert await store.post(rec.task_id, b'{"cancel": true}')
    await trio.sleep(59.5)
    assert await store.get(rec.task_id, "alice") is not None
    await trio.sleep(1)
    assert await store.get(rec.task_id, "alice") is None
    assert await store.inspect(rec.task_id) is None
    assert [r.task_id for r in (await store.list("alice", None, 10))[0]] == [forever.task_id]
    assert await store.transition(rec.task_id, status="completed", now_ms=clock_ms()) is None
    assert not await store.post(rec.task_id, b"{}")
    assert await store.expire(clock_ms()) == 1
    assert await store.expire(clock_ms()) == 0
    assert await store.take([rec.task_id]) == {}
    await store.create(record(created_at_ms=clock_ms()), 2)  # its place under the cap is free again
    await trio.sleep(10 * 365 * 86_400)
    assert await store.expire(clock_ms()) == 1
    kept = await store.get(forever.task_id, "alice")
    assert kept is not None and kept.ttl_ms is None


async def test_expire_deletes_exactly_the_tasks_past_their_deadline(open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    t0 = clock.now_ms
    short = record(created_at_ms=t0, ttl_ms=1_000)
    long = record(created_at_ms=t0, ttl_ms=100_000, principal="bob")
    await store.create(short, 10)
    await store.create(long, 10)
    await store.transition(short.task_id, status="completed", now_ms=t0, result=b'{"done": 1}')
    assert await store.expire(t0 + 1_000) == 0  # created + ttl < now: the deadline itself is still alive
    assert await store.expire(t0 + 1_001) == 1
    clock.now_ms = t0 + 1_001
    assert await store.inspect(short.task_id) is None
    assert await store.get(long.task_id, "bob") is not None
    assert [r.task_id for r in (await store.list_all(None, 10))[0]] == [long.task_id]


async def test_daemons_sharing_a_store_see_each_others_catalog_fingerprints_until_one_falls_silent(
        open_store: OpenStore) -> None:
    clock = FakeClock()
    limits = Limits(orphan_after_ms=10_000)
    daemon_a, daemon_b = await open_store(clock_ms=clock, limits=limits), await open_store(clock_ms=clock, limits=limits)
    t0 = clock.now_ms
    assert await daemon_a.compare_catalogs("host-a:1:aa", "f-one", t0) == {"host-a:1:aa": "f-one"}
    assert await daemon_b.compare_catalogs("host-b:2:bb", "f-two", t0 + 1_000) == {
        "host-a:1:aa": "f-one", "host-b:2:bb": "f-two"}
    # A reload changes one daemon's fingerprint; a daemon silent for orphan_after_ms is forgotten.
    assert await daemon_a.compare_catalogs("host-a:1:aa", "f-two", t0 + 5_000) == {
        "host-a:1:aa": "f-two", "host-b:2:bb": "f-two"}
    assert await daemon_a.compare_catalogs("host-a:1:aa", "f-two", t0 + 11_001) == {"host-a:1:aa": "f-two"}
    # A daemon that stops cleanly is forgotten at once, not once it falls silent.
    assert await daemon_b.compare_catalogs("host-b:2:bb", "f-two", t0 + 12_000) == {
        "host-a:1:aa": "f-two", "host-b:2:bb": "f-two"}
    await daemon_b.forget_catalog("host-b:2:bb")
    assert await daemon_a.compare_catalogs("host-a:1:aa", "f-two", t0 + 12_001) == {"host-a:1:aa": "f-two"}


async def test_catalog_fingerprints_read_back_are_bounded_whoever_wrote_them(open_store: OpenStore) -> None:
    """Anyone who can write to the store (a replica, an attacker with the Redis URL) writes owners and
    fingerprints: every replica reads them back at each heartbeat, logs and shows them (``/healthz``).
    Hundreds of fake daemons or megabyte-long values are read back bounded; this daemon's own is kept."""
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    t0 = clock.now_ms
    for i in range(400):
        await store.compare_catalogs(f"fake:{i}:00", "f-other", t0)
    await store.compare_catalogs("x" * 100_000, "f-long-owner", t0)
    await store.compare_catalogs("fake:long:00", "y" * 100_000, t0)
    seen = await store.compare_catalogs("host-a:1:aa", "f-mine", t0)
    assert seen["host-a:1:aa"] == "f-mine"
    assert len(seen) <= 257
    assert max(len(k) + len(v) for k, v in seen.items()) <= 600
