"""The pool's scheduling rules, against fake workers (no processes) on trio's virtual clock: queueing,
bursts, batches, retire, requeue, cancel, the parked dispatcher, deadlines. What only processes can
show (isolation, kills, real frames) stays in test_workers_via_daemon.py and tests/sandbox."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from fake_pool import KILLED, FakeWorkers, fake_pool, socket_worker
from runtime.execution.pool import BATCH_MAX, IDLE_RETIRE_S, WorkerPool
from runtime.execution.runner import CallSlot
from runtime.protocol.errors import PoolBusy, WorkerFailure
from sandbox import wire


@pytest.fixture(autouse=True)
def _kills() -> Iterator[None]:
    KILLED.clear()
    yield
    KILLED.clear()


def _call(pool: WorkerPool, done: list[CallSlot], i: int = 0) -> CallSlot:
    slot = pool.new_slot("t", {"i": i}, False, -1, None, done.append)
    pool.submit(slot)
    return slot


async def _started(pool: WorkerPool) -> None:
    await pool.start()
    await trio.testing.wait_all_tasks_blocked()


async def test_calls_that_arrive_together_go_to_the_idle_workers_at_the_next_tick_one_write_each(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """A call that finds nothing else in flight goes to an idle worker at once (nothing to share a
    write with); the calls after it in the same pass wait for the dispatcher's turn, which gives
    each idle worker its share in one write."""
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=3), factory, min_workers=3)
        await _started(pool)
        assert len(pool.idle) == 3
        done: list[CallSlot] = []
        slots = [_call(pool, done, 0)]
        assert sum(len(w.calls_received()) for w in factory.started) == 1  # the lone call: at once
        slots += [_call(pool, done, i) for i in range(1, 3)]
        assert sum(len(w.calls_received()) for w in factory.started) == 1  # parked until the dispatcher's turn
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(len(w.calls_received()) for w in factory.started) == [1, 1, 1]
        assert all(w.writes == 1 for w in factory.started)
        assert not pool.queue and all(s.deadline < float("inf") for s in slots)
        nursery.cancel_scope.cancel()


async def test_a_burst_of_calls_that_block_starts_a_worker_for_every_queued_call_up_to_max_concurrency(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers(start_s=0.5)
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=4), factory, cores=2)
        await _started(pool)
        done: list[CallSlot] = []
        _call(pool, done)
        await trio.testing.wait_all_tasks_blocked()
        factory.started[0].finish(pool, run_s=0.1, blocked_s=0.099)  # the tool sleeps
        first = _call(pool, done)
        await trio.testing.wait_all_tasks_blocked()  # the one worker runs it
        [_call(pool, done, i) for i in range(1, 10)]
        assert pool.starting == 3  # the pool's room, not one per call
        await trio.sleep(1)
        assert len(factory.alive()) == 4
        running = [w.pending[0] for w in factory.alive() if w.pending]
        assert first in running and len(running) == 4
        nursery.cancel_scope.cancel()


async def test_calls_that_keep_a_cpu_busy_get_no_more_workers_than_there_are_cores(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers(start_s=0.5)
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=8, max_queue=100), factory, cores=2)
        await _started(pool)
        done: list[CallSlot] = []
        for round_ in range(5):
            for i in range(16):
                _call(pool, done, i)
            await trio.sleep(1)
            while any(w.pending for w in factory.alive()):
                for worker in factory.alive():
                    if worker.pending:
                        worker.finish(pool, run_s=0.001, blocked_s=0.0)
                await trio.testing.wait_all_tasks_blocked()
            assert len(factory.started) == 2, round_
        assert len(done) == 80
        nursery.cancel_scope.cancel()


async def test_when_calls_turn_out_to_block_the_pool_grows_for_new_calls_and_never_takes_back_a_batched_one(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """A worker goes on to its next call before the daemon has read the answer to the last one, so a
    call batched behind a finished one may be running already: taking it back to run elsewhere ran it
    twice (a replica fault test caught a tool recorded twice). Growing serves the queue; the batched
    calls stay and run, once, where they are."""
    factory = FakeWorkers(start_s=0.1)
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=64, max_queue=1000), factory, cores=2)
        await _started(pool)
        done: list[CallSlot] = []
        first = [_call(pool, done, i) for i in range(32)]
        await trio.sleep(1)
        assert len(factory.alive()) == 2  # nothing known yet: as if CPU-bound
        batched = {w.pid: list(w.pending)[1:] for w in factory.alive()}
        for worker in factory.alive():
            worker.finish(pool, run_s=0.1, blocked_s=0.0995)  # 0.5 % running: 2 cores keep 400 busy
        await trio.sleep(1)
        for worker in factory.alive():
            if worker.pid in batched:  # nothing withdrawn: no CancelCall, the same calls, none a stub
                assert not any(type(m) is wire.CancelCall for m in worker.received)
                assert list(worker.pending) == batched[worker.pid]
                assert not any(slot.abandoned for slot in worker.pending)
        assert not pool.queue and all(slot.call.id in {c.id for w in factory.started for c in w.calls_received()}
                                      for slot in first)
        # The pool's size is the demand now: each new call runs at once, none waits behind another.
        later = [_call(pool, done, 100 + i) for i in range(20)]
        await trio.sleep(1)
        assert len(factory.alive()) >= 20  # (a first worker whose only call ended takes one of them)
        assert all(any(w.pending and w.pending[0] is slot for w in factory.alive()) for slot in later)
        nursery.cancel_scope.cancel()


async def test_a_call_waiting_on_its_client_frees_its_core_for_a_new_worker(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers(start_s=0.1)
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=8, max_queue=100, ask_timeout_s=60), factory,
                         cores=1)
        await _started(pool)
        events: list[Any] = []
        asking = pool.new_slot("t", {}, False, -1, events.append, None)
        pool.submit(asking)
        await trio.testing.wait_all_tasks_blocked()
        done: list[CallSlot] = []
        waiting = _call(pool, done, 1)
        await trio.sleep(1)
        assert len(factory.alive()) == 1 and list(pool.queue) == [waiting]  # one core, one worker
        (worker,) = factory.alive()
        pool.ask(asking, wire.Ask(asking.call.id, [wire.InputRequest("k", "roots/list", {})]), worker)
        await trio.sleep(1)
        assert len(factory.alive()) == 2 and not pool.queue  # the question's worker is blocked
        assert pool.answer(asking, [wire.InputResponse("k", "result", {"roots": []})])
        assert pool.asking == 0
        nursery.cancel_scope.cancel()


async def test_workers_with_nothing_to_do_stop_after_a_while_down_to_min_workers(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=4), factory, min_workers=1, cores=4)
        await _started(pool)
        done: list[CallSlot] = []
        for i in range(4):
            _call(pool, done, i)
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.1)
        for worker in factory.alive():
            while worker.pending:
                worker.finish(pool)
        await trio.testing.wait_all_tasks_blocked()
        assert len(factory.alive()) == 4
        await trio.sleep(IDLE_RETIRE_S * 0.4)
        assert len(factory.alive()) == 4
        await trio.sleep(IDLE_RETIRE_S * 1.2)
        assert len(factory.alive()) == 1 and len(pool.workers) == 1
        nursery.cancel_scope.cancel()


async def test_a_saturated_pool_hands_a_freed_worker_its_share_of_the_queue_in_one_write(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=1, max_queue=100), factory)
        await _started(pool)
        done: list[CallSlot] = []
        slots = [_call(pool, done, 0)]
        await trio.testing.wait_all_tasks_blocked()
        slots += [_call(pool, done, i) for i in range(1, BATCH_MAX + 5)]  # the one worker is busy: queued
        (worker,) = factory.started
        assert len(worker.pending) == 1 and worker.writes == 1 and len(pool.queue) == BATCH_MAX + 4
        worker.finish(pool)
        assert len(worker.pending) == BATCH_MAX and worker.writes == 2  # one write for the batch
        assert done == slots[:1]
        nursery.cancel_scope.cancel()


async def test_a_full_queue_refuses_with_pool_busy(tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=1, max_queue=2))
        await _started(pool)
        done: list[CallSlot] = []
        for i in range(3):  # one runs, two wait
            _call(pool, done, i)
        with pytest.raises(PoolBusy):
            _call(pool, done, 3)
        nursery.cancel_scope.cancel()


async def test_a_crashed_worker_fails_its_running_call_and_requeues_the_calls_batched_behind_it(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=1, max_queue=10), factory)
        await _started(pool)
        done: list[CallSlot] = []
        slots = [_call(pool, done, i) for i in range(4)]
        await trio.testing.wait_all_tasks_blocked()
        (first,) = factory.started
        first.finish(pool)  # the other three are batched on it now
        assert list(first.pending) == slots[1:]
        first.crash(pool)
        assert KILLED == [first.pid]
        assert slots[1].error is not None and slots[1].error.kind == "crashed"
        await trio.testing.wait_all_tasks_blocked()  # a replacement starts and takes the rest
        (second,) = factory.alive()
        assert [c.id for c in second.calls_received()] == [s.call.id for s in slots[2:]]
        assert all(s.error is None and not s.finished for s in slots[2:])
        nursery.cancel_scope.cancel()


async def test_a_retiring_worker_sends_the_calls_after_its_result_back_to_the_queue(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=1, max_queue=10), factory)
        await _started(pool)
        done: list[CallSlot] = []
        slots = [_call(pool, done, i) for i in range(3)]
        await trio.testing.wait_all_tasks_blocked()
        (first,) = factory.started
        first.finish(pool)
        first.finish(pool, "last one", retire="memory grew")
        assert done == slots[:2] and slots[1].result is not None and first.dead
        await trio.testing.wait_all_tasks_blocked()
        (second,) = factory.alive()
        assert [c.id for c in second.calls_received()] == [slots[2].call.id]
        assert not slots[2].finished
        nursery.cancel_scope.cancel()


async def test_cancelling_a_queued_call_drops_it_a_batched_one_is_withdrawn_a_running_one_kills_its_worker(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=1, max_queue=10), factory)
        await _started(pool)
        done: list[CallSlot] = []
        slots = [_call(pool, done, 0)]
        await trio.testing.wait_all_tasks_blocked()
        slots += [_call(pool, done, i) for i in (1, 2)]  # queued behind the running one
        (worker,) = factory.started
        pool.withdraw(slots[2])  # still in the pool's queue
        assert slots[2].finished and slots[2] not in pool.queue and pool.in_flight == 2
        worker.finish(pool)
        pool.withdraw(slots[1])  # running now
        assert worker.dead and KILLED == [worker.pid] and done == slots[:1]
        await trio.testing.wait_all_tasks_blocked()
        assert pool.in_flight == 0
        nursery.cancel_scope.cancel()


async def test_a_call_batched_behind_a_running_one_is_withdrawn_with_cancel_call(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=1, max_queue=10), factory)
        await _started(pool)
        done: list[CallSlot] = []
        slots = [_call(pool, done, i) for i in range(3)]
        await trio.testing.wait_all_tasks_blocked()
        (worker,) = factory.started
        worker.finish(pool)
        pool.withdraw(slots[2])
        assert worker.received[-1] == wire.CancelCall(slots[2].call.id) and not worker.dead
        nursery.cancel_scope.cancel()


async def test_a_call_past_its_deadline_kills_its_worker_and_only_that_call_fails(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=2, timeout_s=2), factory, min_workers=2)
        await _started(pool)
        done: list[CallSlot] = []
        slow, fast = _call(pool, done, 0), _call(pool, done, 1)
        await trio.testing.wait_all_tasks_blocked()
        busy = [w for w in factory.started if w.pending]
        fast_worker = next(w for w in busy if w.pending[0] is fast)
        await trio.sleep(1)
        fast_worker.finish(pool)
        await trio.sleep(1.5)
        assert slow.error is not None and slow.error.kind == "timeout" and fast.error is None
        assert KILLED and fast_worker.pid not in KILLED
        nursery.cancel_scope.cancel()


async def test_retire_lets_every_given_call_finish_then_closes(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=1, max_queue=10), factory)
        await _started(pool)
        done: list[CallSlot] = []
        slots = [_call(pool, done, i) for i in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(pool.retire)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(WorkerFailure):
            _call(pool, done, 9)
        (worker,) = factory.started
        worker.finish(pool)
        worker.finish(pool)
        await trio.testing.wait_all_tasks_blocked()
        assert done == slots and pool.closed and worker.dead
        nursery.cancel_scope.cancel()


async def test_when_no_worker_can_start_the_queue_fails_rather_than_hangs(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=1, max_queue=10), factory)
        await _started(pool)
        done: list[CallSlot] = []
        slots = [_call(pool, done, i) for i in range(2)]
        await trio.testing.wait_all_tasks_blocked()
        factory.fail_next = 1
        factory.started[0].crash(pool)
        await trio.testing.wait_all_tasks_blocked()
        errors: list[Any] = [s.error.kind if s.error else None for s in slots]
        assert errors == ["crashed", "unavailable"]
        nursery.cancel_scope.cancel()


async def test_an_answered_call_keeps_its_worker_busy_until_it_returns_and_its_deadline_still_holds(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=1, max_queue=10, timeout_s=2), factory)
        await _started(pool)
        done: list[CallSlot] = []
        first = _call(pool, done, 0)
        await trio.testing.wait_all_tasks_blocked()
        second = _call(pool, done, 1)
        (worker,) = factory.started
        worker.answer(pool)  # answered, but its code has not returned
        assert done == [first] and list(worker.pending) == [first] and list(pool.queue) == [second]
        await trio.sleep(2.5)
        assert worker.dead and KILLED == [worker.pid] and first.error is None  # its client had its answer
        await trio.testing.wait_all_tasks_blocked()
        (replacement,) = factory.alive()
        assert [c.id for c in replacement.calls_received()] == [second.call.id]
        nursery.cancel_scope.cancel()


async def _batched_on_one_worker(nursery: trio.Nursery, tmp_path: Path, count: int, limits: wire.Limits
                                 ) -> tuple[WorkerPool, FakeWorkers, Any, list[CallSlot]]:
    """A one-worker pool given ``count`` calls, whose first has finished: the rest are batched on the
    worker (``first``), ``slots[1]`` running. Returns (pool, factory, first, slots)."""
    factory = FakeWorkers()
    pool = fake_pool(nursery, tmp_path, limits, factory)
    await _started(pool)
    done: list[CallSlot] = []
    slots = [_call(pool, done, i) for i in range(count)]
    await trio.testing.wait_all_tasks_blocked()
    (first,) = factory.started
    first.finish(pool)
    return pool, factory, first, slots


def _answer_frame(slot: CallSlot, text: str) -> bytes:
    """The frame a pooled worker writes when a call's code returned (what may be on its way when the
    pool kills the worker)."""
    return wire.encode_frame(wire.ResultReturned(slot.call.id, [{"type": "text", "text": text}]))


@pytest.mark.parametrize("how", ["cancel", "timeout"])
@pytest.mark.parametrize("answered_unread", [0, 1, 2])
async def test_a_killed_workers_last_answers_decide_which_batched_calls_may_run_elsewhere(
        how: str, answered_unread: int, tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """The pool kills a worker for its running call (cancelled, or past its deadline) while the worker's
    last answers are still unread: it may have finished that call and gone on to the next. What it
    wrote decides: a call it answered gets that answer, the call after the last one it finished may
    have started and fails (never run twice), only the calls after that run elsewhere."""
    async with trio.open_nursery() as nursery:
        pool, factory, first, slots = await _batched_on_one_worker(
            nursery, tmp_path, 5, wire.Limits(max_concurrency=1, max_queue=10, timeout_s=5))
        assert list(first.pending) == slots[1:]
        running, behind = slots[1], slots[2:]
        # Unread: the running call's answer, and then maybe the next one's.
        first.unread = b"".join(_answer_frame(s, f"ran {i}") for i, s in enumerate(slots[1:1 + answered_unread]))
        if how == "cancel":
            pool.withdraw(running)
        else:
            await trio.sleep(5.5)
        assert first.dead
        await trio.testing.wait_all_tasks_blocked()
        (second,) = factory.alive()
        rerun = [c.id for c in second.calls_received()]
        if answered_unread == 0:  # it never finished the running call: nothing behind it started
            assert rerun == [s.call.id for s in behind]
        else:
            # behind[:answered_unread - 1] were answered on the dead worker; the next may have started.
            answered = behind[:answered_unread - 1]
            maybe_started = behind[answered_unread - 1]
            assert [s.result.content[0]["text"] for s in answered if s.result] == \
                [f"ran {i}" for i in range(1, answered_unread)]
            assert maybe_started.error is not None and "not run again" in maybe_started.error.message
            assert rerun == [s.call.id for s in behind[answered_unread:]]
            assert maybe_started.call.id not in rerun and all(s.call.id not in rerun for s in answered)
        nursery.cancel_scope.cancel()


async def test_a_killed_workers_last_frames_out_of_order_are_not_believed(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """A worker's last frames that are not what a worker running its calls in order writes (an answer
    for a later call first) are not believed: the calls behind run elsewhere, as when nothing came."""
    async with trio.open_nursery() as nursery:
        pool, factory, first, slots = await _batched_on_one_worker(
            nursery, tmp_path, 4, wire.Limits(max_concurrency=1, max_queue=10))
        first.unread = _answer_frame(slots[3], "forged") + b"\x00\x00\x00\x05junk!"
        pool.withdraw(slots[1])
        await trio.testing.wait_all_tasks_blocked()
        (second,) = factory.alive()
        assert [c.id for c in second.calls_received()] == [slots[2].call.id, slots[3].call.id]
        assert slots[3].result is None
        nursery.cancel_scope.cancel()


async def test_over_a_real_socket_an_answer_unread_at_the_kill_is_read_before_anything_runs_again(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """The same rule through a real ``Worker`` and its reader over a socket pair: the running call's
    answer is in the socket, unread, when its client cancels it; the pool still reads it (the socket
    stays open after the kill until its end), so the next call, which may have started, is not run
    again, and the one after it is."""
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=1, max_queue=10))
        worker, theirs = socket_worker(pool, tmp_path)
        done: list[CallSlot] = []
        slots = [pool.new_slot("t", {"i": i}, False, -1, None, done.append) for i in range(3)]
        pool.in_flight += 3
        pool._dispatch(worker, slots)
        await trio.testing.wait_all_tasks_blocked()  # the reader waits on the socket
        os.write(theirs.fileno(), _answer_frame(slots[0], "first ran"))  # on its way (no checkpoint: unread)
        pool.withdraw(slots[0])  # the client cancels at that instant
        assert worker.dead
        theirs.close()  # the worker process is gone: its end of the socket closes
        await trio.testing.wait_all_tasks_blocked()
        assert slots[1].error is not None and "not run again" in slots[1].error.message
        # Never started: back in the pool (queued, or already on the worker that replaced this one).
        assert not slots[2].finished and slots[2].error is None
        assert slots[2] in pool.queue or any(slots[2] in w.pending for w in pool.workers if w is not worker)
        assert worker.raw.fileno() == -1  # closed once read
        nursery.cancel_scope.cancel()


async def test_a_call_given_to_a_worker_that_died_idle_unseen_runs_on_another_worker(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """An idle worker's process ended and the pool has not seen it yet (its reader and its watcher
    have not run): a call given to it meets a broken socket at the first send. No byte of it reached
    the worker, so it did not start there: it runs on another worker instead of failing "exited"."""
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=2, max_queue=10), factory)
        worker, theirs = socket_worker(pool, tmp_path)
        worker.calls = 3  # it has served calls (a worker that never ran one: the test below)
        await trio.testing.wait_all_tasks_blocked()
        pool._make_available(worker)
        assert list(pool.idle) == [worker]
        theirs.close()  # the process is gone; nothing has run in the daemon since
        done: list[CallSlot] = []
        slot = _call(pool, done)  # a lone call: written at once, to the dead worker
        assert worker.dead and worker not in pool.workers
        assert not slot.finished and slot.error is None
        await trio.testing.wait_all_tasks_blocked()
        (replacement,) = factory.alive()
        assert [c.id for c in replacement.calls_received()] == [slot.call.id]
        replacement.finish(pool)
        assert done == [slot] and slot.error is None and slot.result is not None
        nursery.cancel_scope.cancel()


async def test_a_call_refused_by_a_worker_that_never_ran_one_fails_so_a_plugin_cannot_loop_the_pool(
        tmp_path: Path, autojump_clock: trio.testing.MockClock) -> None:
    """A plugin whose workers end as soon as they are ready: the call given to such a worker fails
    ("exited") rather than go back to the queue, or the pool would start worker after worker for it,
    forever."""
    factory = FakeWorkers()
    async with trio.open_nursery() as nursery:
        pool = fake_pool(nursery, tmp_path, wire.Limits(max_concurrency=2, max_queue=10), factory)
        worker, theirs = socket_worker(pool, tmp_path)
        await trio.testing.wait_all_tasks_blocked()
        pool._make_available(worker)
        theirs.close()
        done: list[CallSlot] = []
        slot = _call(pool, done)
        assert done == [slot] and slot.error is not None and "exited unexpectedly" in slot.error.message
        nursery.cancel_scope.cancel()


async def test_a_bug_while_reading_a_killed_workers_last_frames_fails_its_calls_not_the_pool(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime import worker_frames

    def broken(msg: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(worker_frames, "check_result", broken)
    async with trio.open_nursery() as nursery:
        pool, factory, first, slots = await _batched_on_one_worker(
            nursery, tmp_path, 4, wire.Limits(max_concurrency=1, max_queue=10))
        first.unread = _answer_frame(slots[1], "a") + _answer_frame(slots[2], "b")
        pool.withdraw(slots[1])
        await trio.testing.wait_all_tasks_blocked()
        assert all(s.finished and s.error is not None and s.error.kind == "garbage" for s in slots[2:])
        monkeypatch.undo()
        later = _call(pool, [], 9)
        await trio.testing.wait_all_tasks_blocked()
        (second,) = factory.alive()
        second.finish(pool, "still serving")
        assert later.result is not None and later.result.content[0]["text"] == "still serving"
        nursery.cancel_scope.cancel()
