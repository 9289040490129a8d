"""A call that asks its client must not hold up the calls batched behind it on its worker.

At full pool size a worker that frees up takes up to ``BATCH_MAX`` queued calls in one write. When
the first of them asks its client something, it may wait up to ``ask_timeout_s`` for the answer: the
calls behind it (not started) are taken back (a ``CancelCall`` each, answered by the worker unrun, in
order, to a stub) and run on another worker, once each; their deadlines start there.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from fake_pool import fake_pool, socket_worker
from stdio_peer import open_toolcell, text_of

from sandbox import wire

ELICIT = {"elicitation": {"form": {}}}
ANN = {"action": "accept", "content": {"name": "Ann"}}

PLUGIN = r'''
import time
from sandbox import current, tool

FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@tool
def hold(seconds: float = 1.0) -> str:
    time.sleep(seconds)
    return "held"


@tool
def ask() -> str:
    answer = current().elicit("Name?", FORM, key="name")
    return f"answered {answer.content!r}"


@tool
def fast(path: str, tag: str) -> str:
    with open(path, "a") as f:  # one line per run: a call run twice shows twice
        f.write(tag + "\n")
    return "fast " + tag
'''


@pytest.mark.parametrize("mode", ["pooled", "per_call"])
async def test_calls_batched_behind_an_asking_call_run_on_another_worker(
        make_plugin: Callable[..., Path], tmp_path: Path, mode: str) -> None:
    plugins = make_plugin("hol", PLUGIN, limits={"max_concurrency": 2, "timeout_s": 5, "ask_timeout_s": 60},
                          manifest={"isolation": mode})
    runs = tmp_path / "runs.txt"
    runs.touch()
    runs.chmod(0o666)
    async with open_toolcell(plugins, policy="none", stderr_path=tmp_path / "daemon.log") as peer:
        result = await peer.request("initialize", {"protocolVersion": "2025-11-25", "capabilities": ELICIT,
                                                   "clientInfo": {"name": "raw", "version": "0"}})
        assert "result" in result
        await peer.notify("notifications/initialized")
        # Both workers started and warm.
        warm = [await peer.start_call("hold", {"seconds": 0.3}) for _ in range(2)]
        for rid in warm:
            assert text_of(await peer.response(rid)) == "held"
        # Both busy; then the asking call and three fast ones queue, and the first worker to free up
        # takes all four in one batch (the pool is at its full size, nothing is idle).
        holds = [await peer.start_call("hold", {"seconds": 1.0}) for _ in range(2)]
        await trio.sleep(0.3)
        asking = await peer.start_call("ask")
        fasts = [await peer.start_call("fast", {"path": str(runs), "tag": f"f{i}"}) for i in range(3)]

        question = await peer.wait_for(lambda m: m.get("method") == "elicitation/create" and "id" in m, 20)
        # Not answered yet: the fast calls finish anyway (on the other worker, once its hold ends),
        # long before ask_timeout_s.
        for i, rid in enumerate(fasts):
            assert text_of(await peer.response(rid, 10)) == f"fast f{i}"
        for rid in holds:
            assert text_of(await peer.response(rid)) == "held"
        assert not peer.responses_to(asking)
        await peer.send({"jsonrpc": "2.0", "id": question["id"], "result": ANN})
        assert text_of(await peer.response(asking)) == "answered {'name': 'Ann'}"
        # The asking worker answered the calls taken back as cancelled, to stubs: each fast call ran
        # once and was answered once; the pool still serves.
        again = await peer.start_call("fast", {"path": str(runs), "tag": "after"})
        assert text_of(await peer.response(again)) == "fast after"
        for rid in fasts:
            assert len(peer.responses_to(rid)) == 1
    assert sorted(runs.read_text().split()) == ["after", "f0", "f1", "f2"]


# -- the pool's side, with fake workers -----------------------------------------------------------------

async def _frames(sock: Any, buf: bytearray, count: int) -> list[Any]:
    out: list[Any] = []
    while len(out) < count:
        frames = wire.split_frames(buf)
        out += [wire.to_worker_decoder.decode(f) for f in frames]
        if len(out) < count:
            data = await sock.recv(1 << 16)
            assert data, "the pool closed the worker's socket"
            buf += data
    return out


async def _send(sock: Any, msg: Any) -> None:
    data = wire.encode_frame(msg)
    while data:
        data = data[await sock.send(data):]


async def test_the_pool_takes_back_batched_calls_and_the_stubs_take_the_cancelled_results(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, no_kills: list[int]) -> None:
    limits = wire.Limits(timeout_s=5, ask_timeout_s=100, max_concurrency=2)
    done: list[Any] = []
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, limits)
        busy, busy_sock = socket_worker(pool, tmp_path)
        other, other_sock = socket_worker(pool, tmp_path)
        pool.watchdog.start(nursery)
        events: list[Any] = []
        head = pool.new_slot("ask", {}, False, -1, events.append, done.append)
        behind = [pool.new_slot("fast", {"i": i}, False, -1, None, done.append) for i in range(3)]
        pool.in_flight += 4
        pool._dispatch(busy, [head, *behind])
        busy_buf, other_buf = bytearray(), bytearray()
        assert [m.id for m in await _frames(busy_sock, busy_buf, 4)] == [s.call.id for s in (head, *behind)]
        await trio.sleep(1)
        # One withdrawn by its client before the question: its CancelCall is already on its way.
        pool.withdraw(behind[2])
        assert await _frames(busy_sock, busy_buf, 1) == [wire.CancelCall(behind[2].call.id)]
        await _send(busy_sock, wire.Ask(head.call.id, [wire.InputRequest("k", "roots/list", {})]))
        await trio.testing.wait_all_tasks_blocked()
        assert events and type(events[0]) is wire.Ask
        # The two live ones are withdrawn from the busy worker, in order, and queued for any worker.
        assert await _frames(busy_sock, busy_buf, 2) == [wire.CancelCall(s.call.id) for s in behind[:2]]
        assert list(pool.queue) == behind[:2]
        assert busy.pending[0] is head and all(s.abandoned for s in list(busy.pending)[1:])
        assert not any(s in busy.pending for s in behind[:2])
        assert all(s.deadline == float("inf") for s in behind[:2])
        # The other worker frees up and takes them; the first one's deadline starts now.
        freed_at = trio.current_time()
        pool._make_available(other)
        assert [m.id for m in await _frames(other_sock, other_buf, 2)] == [s.call.id for s in behind[:2]]
        assert not pool.queue and list(other.pending) == behind[:2]
        assert behind[0].deadline == pytest.approx(freed_at + 5)
        for slot in behind[:2]:
            await _send(other_sock, wire.Result(slot.call.id, [{"type": "text", "text": "ran"}]))
            await _send(other_sock, wire.CallReturned(slot.call.id))
        await trio.testing.wait_all_tasks_blocked()
        assert done == behind[:2] and all(s.result is not None and s.result.content[0]["text"] == "ran"
                                          for s in behind[:2])
        # The question is answered; the busy worker finishes its call, then answers what it was told
        # to drop as cancelled, in order: the stubs take those, nobody hears of them.
        assert pool.answer(head, [wire.InputResponse("k", "result", {"roots": []})])
        assert type((await _frames(busy_sock, busy_buf, 1))[0]) is wire.Answer
        await _send(busy_sock, wire.Result(head.call.id, [{"type": "text", "text": "asked"}]))
        await _send(busy_sock, wire.CallReturned(head.call.id))
        for slot in behind:
            await _send(busy_sock, wire.Result(slot.call.id, [{"type": "text", "text": "cancelled"}], is_error=True))
            await _send(busy_sock, wire.CallReturned(slot.call.id))
        await trio.testing.wait_all_tasks_blocked()
        assert done == [*behind[:2], head]
        assert not busy.dead and not busy.pending and not other.pending and pool.in_flight == 0
        assert behind[0].result.content[0]["text"] == "ran"  # type: ignore[union-attr]
        assert behind[2].finished and behind[2].result is not None  # the withdrawn one: its own result
        assert not no_kills
        nursery.cancel_scope.cancel()
