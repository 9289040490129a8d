"""A plugin's pool of workers: scheduling only (the workers themselves: ``runtime.execution.worker``;
what runs in them: ``sandbox.worker``).

How this works:

* A pool keeps between ``min_workers`` and ``limits.max_concurrency`` pre-started workers of one
  plugin. A worker runs the calls sent to it one at a time, in order. The pool starts its workers
  through a factory (``WorkerFactory``: real processes, or a test's fakes) and hears of them only
  through ``result``, ``returned``, ``relay``, ``ask`` and ``fail_worker``.
* Sizing: within ``max_concurrency`` (the operator's ceiling) the pool is as big as the cores can keep
  busy. Each ``Result`` says how much of the call's time it was blocked (``blocked_ns``: sleeping,
  waiting on I/O or on its client, not waiting for a CPU); with ``r`` the share of recent calls' time
  spent running (decayed sums), the pool wants ``ceil(cores / r)`` workers, plus one for every call
  waiting on its client. So CPU-bound calls get as many workers as there are cores (more would only
  add context switches and memory), calls that sleep get one each, up to the ceiling. Before any call
  has finished, calls count as CPU-bound. When the size grows, it serves the queue from then on;
  calls already batched behind a running one stay on their worker (it may have started them
  already: a worker goes on to its next call before the daemon reads the last one's answer, and a
  call is never run twice). A worker with nothing to do for ``IDLE_RETIRE_S`` stops, down to
  ``min_workers``.
* A call goes to an idle worker if there is one: not at once, but at the pool's next dispatch,
  which runs right after the tasks the scheduler is running now (one tick, microseconds later),
  so calls that arrive together (HTTP requests read in one scheduler pass, a burst on stdio) are
  split across the idle workers in one write each instead of one write per call. A call that
  finds nothing else in flight in its pool goes at once (there is nothing to share a write with,
  and a lone call should not wait for the rest of the pass: at c=1 that was ~10% of its time). Otherwise it
  waits in the pool's bounded FIFO queue (full queue -> ``PoolBusy``). When a worker finishes everything it was given, it takes
  up to ``BATCH_MAX`` queued calls in one write: under saturation one wake-up of the worker and one
  syscall on each side serve many calls; with spare workers nothing waits. If the call heading such a
  batch asks its client something (it may wait up to ``ask_timeout_s``), the calls behind it, not
  started, are taken back (``_take_back``: a ``CancelCall`` each, answered unrun to a stub) and go to
  the front of the pool's queue, so a slow question never holds up a fast call.
* Each worker has one reader task that matches ``Result`` frames to the calls in order and relays
  progress/log frames. The calling task waits on its slot. A call's ``Result`` answers its client at
  once, but the worker stays busy with it, and its deadline runs, until the worker's runtime sends
  ``CallReturned`` (plugin code shares the worker's process and can write a ``Result`` of its own,
  then run on); a second ``Result``, or ``CallReturned`` before any, ends the worker.
* A call's deadline starts when the call starts running (it heads its worker's queue), as a cancel
  scope deadline. Expiry, client cancellation of a running call, a crash, garbage on the channel or
  an over-size frame all end the same way: the worker's whole process tree is killed (process group,
  psutil descendants, then orphans re-parented to us as subreaper), the calls queued behind it on that
  worker go back to the front of the pool's queue, and a replacement worker is started. "Not
  started" is checked, not assumed (``_settle_after_kill``): a worker writes each answer and goes on
  to its next call at once, so when the pool kills it the last answers may still be in its socket.
  The socket stays open after the kill until its end has been read: a call answered there gets that
  answer, the call after the last finished one may have started and fails (never run twice), and
  only the calls after it are requeued. Only the killed call fails (and, in that race, the one that
  may have started after it). A cancelled call that was sent but has not
  started is withdrawn with a ``CancelCall`` frame instead.
* The deadlines are enforced by the one watchdog (``runtime.execution.watchdog``); a worker's output
  and its exit are watched by its ``ChildProcess`` (``runtime.execution.child``).
"""

from __future__ import annotations

import collections
import math
import os
import time
from typing import Any, Callable, Iterator, Protocol

import msgspec
import trio

from runtime.clock import clock_reader
from runtime.egress_rules import Grant
from runtime.execution.runner import CallsInFlight, CallSlot, EventSink, PluginLoadError
from runtime.execution.watchdog import DeadlineWatchdog
from runtime.execution.worker import ProcessWorkers
from runtime.logs import log
from runtime.protocol.errors import LIMIT_KINDS, PoolBusy, WorkerFailure
from runtime import worker_frames
from runtime.processes import PoolSpec
from sandbox import wire

#: Most queued calls handed to a worker in one write.
BATCH_MAX = 32
#: A killed worker's last frames (``_settle_after_kill``): how long to wait for its socket's end, and
#: the room beyond the output cap. Failures that broke the frame protocol leave nothing to believe.
LAST_WORDS_S = 2.0
LAST_WORDS_OVERHEAD = 64 * 1024
_NO_LAST_WORDS = frozenset({"garbage", "output_cap", "unavailable"})
#: Sizing: how much the last call counts against those before it (per call), the smallest share of
#: time running that is believed (a pool of tools that only sleep is ``cores / 1/1024`` big, before
#: ``max_concurrency``), and how long a worker may find nothing to do before it is stopped.
SIZING_DECAY = 0.9
MIN_RUNNING_SHARE = 1 / 1024
IDLE_RETIRE_S = 30.0


class _Phases:
    """Whether calls are timed by phase (queue, channel, worker): only while metrics are exported
    (``runtime.metrics`` turns it on), so that the hot path pays nothing for it otherwise."""

    on = False


PHASES = _Phases()


class PoolWorker(Protocol):
    """What the pool needs of one worker (``runtime.execution.worker.Worker``, or a test's fake)."""

    pid: int
    dead: bool
    calls: int
    layers: list[str]
    pending: collections.deque[CallSlot]

    hold_socket: bool

    def write(self, data: bytes) -> bool: ...
    def wrote_nothing(self) -> bool:
        """After ``write`` returned False: whether no byte of what it was given reached the worker."""
    def kill(self) -> None: ...
    async def last_words(self, limit_s: float, max_bytes: int) -> bytes:
        """After ``kill`` with ``hold_socket`` set: what the worker wrote that was not handled yet."""


class WorkerFactory(Protocol):
    """Starts a pool's workers. Once ``start`` returns, the worker's frames reach the pool as
    ``result`` / ``relay`` / ``ask`` / ``fail_worker``, and its end as ``fail_worker``."""

    async def start(self, pool: WorkerPool) -> tuple[Any, wire.Ready]:
        """A started worker and its ``Ready``. Raises ``PluginLoadError``."""


class WorkerPool(CallsInFlight):
    """Pre-started workers for one plugin version; see the module docstring for the rules."""

    def __init__(self, spec: PoolSpec, nursery: trio.Nursery, factory: WorkerFactory | None = None) -> None:
        self.spec = spec
        #: Starts the workers: real processes, or a test's fakes.
        self.factory: WorkerFactory = factory if factory is not None else ProcessWorkers(spec)
        self.name = spec.manifest.name
        #: trio's clock, read in one call (``runtime.clock``).
        self._clock = clock_reader()
        self.limits = spec.manifest.limits
        self.nursery = nursery
        self.idle: list[PoolWorker] = []
        self.workers: set[PoolWorker] = set()
        self.starting = 0
        #: Calls waiting for a worker, oldest first.
        self.queue: collections.deque[CallSlot] = collections.deque()
        self.ready: wire.Ready | None = None
        self.closed = False
        #: Set when a newer version replaced this pool: no new calls, queued and running ones finish.
        self.retiring = False
        self.restarts = 0
        #: Completed calls, and the seconds they spent in the queue, the channel and the worker.
        self.phase_totals = [0.0, 0.0, 0.0, 0.0]
        self.limit_kills = 0
        self.start_failures = 0
        self.in_flight = 0
        self._next_call_id = 0
        #: The plugin's network grant, enforced by each worker's egress proxy (the manifest check parsed it).
        self.grant = Grant.parse(spec.manifest.permissions.network)
        self.watchdog = DeadlineWatchdog(self._running, self._ask_timed_out, self._timed_out)
        self._dispatcher_started = False
        #: Deferred dispatch to idle workers (see the module doc): the dispatcher parks here.
        self._dispatch_lot = trio.lowlevel.ParkingLot()
        self._dispatch_due = False
        #: Sizing (module docstring): the cores this daemon may run on, the size they give for the share
        #: of blocked time the calls have shown (decayed sums), and the calls waiting on their client.
        self.cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self._cpu_size = self.cores
        self._run_ns = 0.0
        self._blocked_ns = 0.0
        self.asking = 0
        self._idle_since: dict[PoolWorker, float] = {}

    # -- start-up ------------------------------------------------------------------------------

    async def start_worker(self) -> PoolWorker:
        """Start one worker and wait for its ``Ready``. Raises ``PluginLoadError``."""
        worker: PoolWorker
        worker, ready = await self.factory.start(self)
        if self.ready is None:
            self.ready = ready
        elif ready.tools != self.ready.tools:
            self._discard(worker)
            raise PluginLoadError("definition", "a new worker reported different tools than the first one")
        self.workers.add(worker)
        self.watchdog.start(self.nursery)
        if not self._dispatcher_started:
            self._dispatcher_started = True
            self.nursery.start_soon(self._dispatcher)
            self.nursery.start_soon(self._shrink_when_idle)
        return worker

    async def start(self) -> wire.Ready:
        """Start the first worker (which reports the tools) and the rest of ``min_workers``."""
        first = await self.start_worker()
        self._make_available(first)
        for _ in range(max(0, min(self.spec.min_workers, self.limits.max_concurrency) - 1)):
            self._spawn_background()
        assert self.ready is not None
        return self.ready

    def _spawn_background(self) -> None:
        self.starting += 1
        self.nursery.start_soon(self._spawn_one)

    async def _spawn_one(self) -> None:
        try:
            worker = await self.start_worker()
        except PluginLoadError as exc:
            self.start_failures += 1
            log("worker_start_failed", plugin=self.name, stage=exc.stage, error=exc.message)
            self.starting -= 1
            if not self.workers and not self.starting:
                # Nothing will ever serve the queue: fail it now rather than let it hang.
                self._fail_queue(WorkerFailure("unavailable", f"plugin {self.name} has no working worker: {exc.message}"))
            await trio.sleep(min(5.0, 0.1 * 2 ** min(self.start_failures, 6)))
            return
        self.starting -= 1
        self.start_failures = 0
        if self.closed:
            self._discard(worker)
            return
        self._make_available(worker)

    # -- the call path -------------------------------------------------------------------------

    def abort_all(self, reason: str) -> None:
        """Shutdown's end: every call given to this pool, queued or running, fails now with ``reason``
        (its client is answered through the call's completion, whatever the transport)."""
        error = WorkerFailure("unavailable", reason)
        self._fail_queue(error)
        for worker in list(self.workers):
            pending = list(worker.pending)
            worker.pending.clear()
            self._discard(worker)
            for slot in pending:
                if not slot.finished:
                    slot.error = error
                    self._complete(slot)

    def _fail_queue(self, error: WorkerFailure) -> None:
        while self.queue:
            slot = self.queue.popleft()
            slot.error = error
            slot.finish()

    def _start_deadline(self, slot: CallSlot) -> None:
        if PHASES.on:
            slot.started_at = time.perf_counter()
        slot.deadline = self._clock() + self.limits.timeout_s
        self.watchdog.wake(slot.deadline)

    def _dispatch(self, worker: PoolWorker, slots: list[CallSlot]) -> None:
        """Give ``slots`` to ``worker`` in one write. The head starts its deadline."""
        if not worker.pending:
            self._start_deadline(slots[0])
        worker.pending.extend(slots)
        data = slots[0].frame if len(slots) == 1 else b"".join(slot.frame for slot in slots)
        if not worker.write(data):
            # Only a worker with nothing pending is given calls (``_dispatch_to_idle``,
            # ``_make_available``). If no byte of them reached it (its socket closed or broken at the
            # first send: a worker that ended while idle, before its end was seen), none of them
            # started there, and they go to another worker instead of failing. Not from a worker that
            # never ran a call: a plugin whose workers end as soon as they are ready would have the
            # pool start worker after worker for the same calls, forever; those fail, as before.
            self.fail_worker(worker, WorkerFailure("crashed", "the worker process exited unexpectedly"),
                             head_started=not (worker.calls and worker.wrote_nothing()))

    async def _dispatcher(self) -> None:
        """Hand queued calls to idle workers, once per scheduler tick in which calls arrived."""
        while True:
            if not self._dispatch_due:
                await self._dispatch_lot.park()
            self._dispatch_due = False
            self._dispatch_to_idle()

    def _size(self) -> int:
        """How many workers the pool wants at most now (see the module docstring: sizing)."""
        return min(self.limits.max_concurrency, self._cpu_size + self.asking)

    def _room(self) -> int:
        """How many more workers the pool may start now."""
        return self._size() - len(self.workers) - self.starting

    def _learn(self, msg: wire.Result) -> None:
        """Fold a finished call's share of blocked time into the pool's size (``_cpu_size``). A larger
        size serves the queue from now on; calls already batched onto a worker stay there: they may
        be running already (a worker goes on to its next call before the daemon has read the answer
        to the last), and a call is never run twice. (A call that *asks* is different: its worker is
        provably blocked in it, so the calls behind it have not started: ``ask``.)"""
        run_ns = msg.run_ns if msg.run_ns > 0 else 0
        blocked_ns = msg.blocked_ns
        self._run_ns = self._run_ns * SIZING_DECAY + run_ns
        if blocked_ns <= 0 and not self._blocked_ns:
            return  # the common case of CPU-bound calls: nothing blocked, the size is the cores'
        blocked_ns = min(blocked_ns, run_ns) if blocked_ns > 0 else 0
        self._blocked_ns = self._blocked_ns * SIZING_DECAY + blocked_ns
        if self._blocked_ns < 1.0:
            self._blocked_ns = 0.0  # decayed to nothing: back on the fast path
        if self._run_ns > 0:
            running_share = max(MIN_RUNNING_SHARE, 1.0 - self._blocked_ns / self._run_ns)
            self._cpu_size = max(1, math.ceil(self.cores / running_share - 1e-9))

    async def _shrink_when_idle(self) -> None:
        """Stop workers that found nothing to do for ``IDLE_RETIRE_S``, down to ``min_workers``."""
        while not self.closed:
            await trio.sleep(IDLE_RETIRE_S / 2)
            now = self._clock()
            keep = max(1, self.spec.min_workers)
            for worker in list(self.idle):
                if len(self.workers) <= keep:
                    break
                if now - self._idle_since.get(worker, now) >= IDLE_RETIRE_S:
                    log("worker_stopped_idle", plugin=self.name, pid=worker.pid, idle_s=IDLE_RETIRE_S,
                        workers=len(self.workers) - 1)
                    self._discard(worker)
            self._idle_since = {w: t for w, t in self._idle_since.items() if w in self.workers}

    def _grow_for_queue(self) -> None:
        """Start a worker for every queued call that no worker being started will take (up to the
        pool's size, ``_size``): a burst is met by the whole pool, not queued on the workers there are."""
        for _ in range(min(len(self.queue) - self.starting, self._room())):
            self._spawn_background()

    def _share(self, idle_workers: int) -> int:
        """Calls to hand one idle worker now. While the pool can still grow (or is growing) one each:
        a call never waits behind another on a busy worker while a worker could start. At full size
        the queue is split evenly, at most ``BATCH_MAX`` a worker, so a saturated pool is fed in
        few writes."""
        if self._room() > 0 or self.starting > 0:
            return 1
        return min(BATCH_MAX, -(-len(self.queue) // max(1, idle_workers)))

    def _dispatch_to_idle(self) -> None:
        queue, idle = self.queue, self.idle
        while queue and idle:
            worker = idle.pop()
            if worker.dead or worker.pending:
                continue
            share = self._share(len(idle) + 1)
            self._dispatch(worker, [queue.popleft() for _ in range(min(share, len(queue)))])
        if queue:
            self._grow_for_queue()

    def _make_available(self, worker: PoolWorker) -> None:
        """``worker`` has nothing pending: hand it its share of the queue, or mark it idle."""
        if worker.dead or worker.pending:
            return
        if not self.queue:
            if not self.closed:
                self.idle.append(worker)
                self._idle_since[worker] = self._clock()
            return
        share = self._share(1)
        self._dispatch(worker, [self.queue.popleft() for _ in range(min(share, len(self.queue)))])
        if self.queue:
            self._grow_for_queue()

    def new_slot(self, tool: str, arguments: dict[str, Any], progress: bool, log_level: int,
                 on_event: EventSink | None, on_done: Callable[[CallSlot], None] | None = None,
                 principal: str | None = None, trace: str = "") -> CallSlot:
        self._next_call_id += 1
        call = wire.Call(self._next_call_id, tool, arguments, progress, log_level, trace)
        # Encoding the frame raises here (OverflowError for integers beyond 64 bits, ...): an
        # unencodable argument fails its own call, before it is queued anywhere.
        return CallSlot(call, wire.encode_frame(call), on_event, on_done)

    def submit(self, slot: CallSlot) -> None:
        """Start ``slot`` on an idle worker or queue it. Raises ``PoolBusy`` / ``WorkerFailure``."""
        if self.closed or self.retiring:
            raise WorkerFailure("unavailable", f"plugin {self.name} is shutting down")
        # Every live worker runs one call; everything else in flight is waiting (in the pool's
        # queue or batched behind a running call on a worker) and is bounded by max_queue.
        if self.in_flight >= len(self.workers) + self.limits.max_queue:
            raise PoolBusy(f"plugin {self.name} is busy ({self.limits.max_queue} calls waiting); retry later")
        if PHASES.on:
            slot.queued_at = time.perf_counter()
        if self.idle:
            self.in_flight += 1
            self.queue.append(slot)
            if self.in_flight == 1:
                # Nothing else in flight: there is nothing to share a write with, so no reason to
                # wait for the end of the pass (a lone call's latency; under load calls batch).
                self._dispatch_to_idle()
            elif not self._dispatch_due:
                self._dispatch_due = True
                self._dispatch_lot.unpark()
            return
        self.in_flight += 1
        self.queue.append(slot)
        # ``_room() > 0`` written out: a saturated pool (the common case under load) asks nothing more.
        if min(self.limits.max_concurrency, self._cpu_size + self.asking) > len(self.workers) + self.starting:
            self._grow_for_queue()

    async def run(self, tool: str, arguments: dict[str, Any], progress: bool, log_level: int,
                  on_event: Callable[[Any], None] | None) -> wire.Result:
        """Run one call and wait for it. Raises ``PoolBusy`` or ``WorkerFailure``; honours cancellation."""
        slot = self.new_slot(tool, arguments, progress, log_level, on_event)
        slot.event = trio.Event()
        self.submit(slot)
        try:
            await slot.event.wait()
        except trio.Cancelled:
            self.withdraw(slot)
            raise
        if slot.error is not None:
            raise slot.error
        assert slot.result is not None
        return slot.result

    def queued(self) -> int:
        return len(self.queue)

    def alive(self) -> int:
        return len(self.workers)

    def _owner(self, slot: CallSlot) -> PoolWorker | None:
        for worker in self.workers:
            if slot in worker.pending:
                return worker
        return None

    def withdraw(self, slot: CallSlot) -> None:
        """The client cancelled ``slot``: nothing more is reported for it; if it runs, its worker dies."""
        if not slot.abandon():
            return
        try:
            self.queue.remove(slot)
            self._release()
            slot.finish()
            return
        except ValueError:
            pass
        owner = self._owner(slot)
        if owner is None:
            return
        if owner.pending and owner.pending[0] is slot:
            self.fail_worker(owner, WorkerFailure("cancelled", "cancelled"))
        elif not owner.write(wire.encode_frame(wire.CancelCall(slot.call.id))):
            self.fail_worker(owner, WorkerFailure("crashed", "the worker process exited unexpectedly"))

    def _account(self, slot: CallSlot, run_ns: int) -> None:
        """Add a completed call's phases to the pool's totals (read by ``runtime.metrics``)."""
        if not slot.started_at or not slot.queued_at:
            return
        service_s = time.perf_counter() - slot.started_at
        worker_s = min(service_s, max(0, run_ns) / 1e9)
        totals = self.phase_totals
        totals[0] += 1
        totals[1] += max(0.0, slot.started_at - slot.queued_at)
        totals[2] += service_s - worker_s
        totals[3] += worker_s

    def _complete(self, slot: CallSlot) -> None:
        self._release()
        if slot.error is not None and slot.error.kind in LIMIT_KINDS:
            self.limit_kills += 1
        slot.finish()

    def fail_worker(self, worker: PoolWorker, error: WorkerFailure, requeue: bool = True,
                     head_started: bool = True) -> None:
        """Kill ``worker``: its running call gets ``error``; calls queued behind it go back to the pool.
        ``head_started=False``: no call is running there (it retired after a result): all go back."""
        pending = list(worker.pending)
        worker.pending.clear()
        # The worker may have gone on past its running call (its answer still on the way: the worker
        # writes it, then starts the next call at once): the calls behind it wait until what it wrote
        # last has been read (``_settle_after_kill``), so that none that may have started runs again.
        # Not while it asks (it is blocked in that call), nor when its frames broke the protocol.
        hold = (head_started and requeue and not self.closed and len(pending) > 1
                and pending[0].asking is None and error.kind not in _NO_LAST_WORDS)
        if hold:
            worker.hold_socket = True
        self._discard(worker)
        if pending:
            rest = pending
            if head_started:
                head, rest = pending[0], pending[1:]
                if head.asking is not None:  # its question goes unanswered: it is no longer waiting
                    head.asking = None
                    self.asking -= 1
                if not head.finished:
                    head.error = error
                    self._complete(head)
                elif head.result is not None and error.kind != "unavailable":
                    # Its client has its answer; nobody else hears why the worker ended.
                    log("worker_killed_after_answer", level="warning", plugin=self.name, pid=worker.pid,
                        tool=head.call.tool, reason=error.message,
                        note="the call was answered, but its code had not returned (sandbox.wire, CallReturned)")
            if hold:
                for slot in rest:
                    slot.deadline = float("inf")
                self.nursery.start_soon(self._settle_after_kill, worker, pending)
                rest = []
            for slot in reversed(rest):
                if slot.finished:
                    continue
                if slot.abandoned:
                    self._complete(slot)
                    continue
                slot.deadline = float("inf")
                if requeue and not self.closed:
                    self.queue.appendleft(slot)
                else:
                    slot.error = WorkerFailure("unavailable", f"plugin {self.name} was unloaded")
                    self._complete(slot)
        if not self.closed:
            if len(self.workers) + self.starting < max(1, min(self.spec.min_workers, self.limits.max_concurrency)) \
                    or (self.queue and self._room() > 0):
                self._spawn_background()

    async def _settle_after_kill(self, worker: PoolWorker, pending: list[CallSlot]) -> None:
        """The calls that were behind ``pending[0]`` on a killed worker, decided by what the worker wrote
        last (read to the socket's end: the worker is dead): a call it answered ran, and gets that
        answer; the call after the last one it finished may have started, and fails (a call is never
        run twice); the calls after that cannot have started, and go back to the front of the queue."""
        data = await worker.last_words(LAST_WORDS_S, self.limits.max_output_bytes + LAST_WORDS_OVERHEAD)
        try:
            self._settle(worker, pending, data)
        except Exception as exc:  # our bug, set off by what a worker wrote: its calls fail, the pool goes on
            log("internal_error", level="error", where="a killed worker's last frames", plugin=self.name,
                error=f"{type(exc).__name__}: {str(exc)[:300]}")
            for slot in pending[1:]:
                if not slot.finished:
                    slot.error = WorkerFailure("garbage", "the daemon could not handle what the worker sent")
                    self._complete(slot)

    def _settle(self, worker: PoolWorker, pending: list[CallSlot], data: bytes) -> None:
        done = 1  # pending[:done] are finished on the worker: the head's fate is already decided
        answers: dict[int, wire.Result] = {}
        head = pending[0]
        head_answered = head.result is not None
        try:
            frames = wire.split_frames(bytearray(data), self.limits.max_output_bytes + LAST_WORDS_OVERHEAD)
        except ValueError:
            frames = []
        gone_on = False  # the worker finished the head (and so may have started the next call)
        for raw in frames:
            try:
                msg = wire.from_worker_decoder.decode(raw)
            except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError):
                break
            kind = type(msg)
            current = head if not gone_on else (pending[done] if done < len(pending) else None)
            if current is None or getattr(msg, "id", None) != current.call.id:
                break  # not what a worker running its calls in order writes: believe nothing more
            if kind is wire.ResultReturned or kind is wire.CallReturned or kind is wire.Result:
                if kind is not wire.CallReturned:
                    if current is head:
                        if head_answered:
                            break  # a second answer
                        head_answered = True
                    elif current.call.id in answers:
                        break
                    else:
                        answers[current.call.id] = msg
                if kind is wire.Result:
                    continue  # answered; its code returns with a CallReturned
                if current is head:
                    if not head_answered:
                        break  # returned before answering
                    gone_on = True
                else:
                    if current.call.id not in answers:
                        break
                    done += 1
        started = pending[done] if gone_on and done < len(pending) else None
        back: list[CallSlot] = []
        for slot in pending[1:]:
            if slot.finished:
                continue
            if slot.abandoned:
                self._complete(slot)
                continue
            msg = answers.get(slot.call.id)
            if msg is not None:
                try:
                    worker_frames.check_result(msg)
                except (worker_frames.FrameRejected, RecursionError, ValueError) as exc:
                    slot.error = WorkerFailure("garbage", f"the worker sent a malformed frame: {exc}")
                    self._complete(slot)
                    continue
                slot.result = msg
                self._complete(slot)
            elif slot is started:
                slot.error = WorkerFailure("crashed", "its worker was stopped just as this call may have started "
                                           "(the call before it had ended); it was not run again")
                self._complete(slot)
                log("call_not_rerun", level="warning", plugin=self.name, pid=worker.pid, tool=slot.call.tool,
                    note="the call may have started on a stopped worker: failed rather than run twice")
            elif self.closed:
                slot.error = WorkerFailure("unavailable", f"plugin {self.name} was unloaded")
                self._complete(slot)
            else:
                back.append(slot)
        if back:
            self.queue.extendleft(reversed(back))
            self._dispatch_to_idle()

    def ask(self, slot: CallSlot, msg: wire.Ask, worker: PoolWorker | None = None) -> None:
        """The running call asks its client something: stop its deadline, hand the round to whoever
        relays it (``on_event``), who answers with ``answer``; ``ask_timeout_s`` bounds the wait.
        Calls batched behind it on its worker are taken back first (``_take_back``)."""
        worker_frames.check_ask(msg)
        slot.asks += len(msg.requests)
        limits = self.limits
        if slot.asks > limits.max_asks:
            raise WorkerFailure("asks", f"asked its client more than {limits.max_asks} questions (limits.max_asks)")
        if worker is None:
            worker = self._owner(slot)
        if worker is not None and len(worker.pending) > 1:
            self._take_back(worker)
            if worker.dead:
                return
        self.watchdog.pause_for_question(slot, msg, limits.ask_timeout_s)
        self.asking += 1  # its worker is blocked until the answer: it does not count against the cores
        if self.queue:
            self._grow_for_queue()
        if slot.on_event is None:
            self.answer(slot, [], "cancelled", "the call is being cancelled")
            return
        slot.on_event(msg)

    def _take_back(self, worker: PoolWorker,
                   why: str = "the worker's call asked its client; the calls batched behind it run elsewhere") -> None:
        """``worker``'s running call asked its client something and may wait for the answer for up to
        ``ask_timeout_s``: the calls batched behind it, which have not started (a worker runs one call at
        a time, in order), must not wait with it while another worker could run them.

        Each goes back to the front of the pool's queue (in order, its deadline unset: it starts when
        the call is dispatched again) and the worker is sent a ``CancelCall`` for it, before anything
        else (an ``Answer``) can reach it, so the worker answers it, unrun, in its turn: in its place in
        ``worker.pending`` stays an abandoned stub (same call id, no callbacks) that takes that result.
        The slot itself is requeued, not a copy, so the handle its owner holds (``withdraw``,
        ``answer``) still names it. A stub counts in ``in_flight`` until its result arrives, like a
        withdrawn call batched on a worker. Never run twice: the worker drops the call; never
        answered twice: the stub, not the slot, takes the worker's "cancelled"."""
        if self.closed or worker.dead:
            return
        pending = worker.pending
        frames: list[bytes] = []
        back: list[CallSlot] = []
        for i in range(1, len(pending)):
            slot = pending[i]
            if slot.abandoned or slot.finished:
                continue  # withdrawn (its CancelCall already sent) or a stub of an earlier round
            pending[i] = CallSlot(slot.call, b"", abandoned=True)
            self.in_flight += 1
            frames.append(wire.encode_frame(wire.CancelCall(slot.call.id)))
            slot.deadline = float("inf")
            back.append(slot)
        if not back:
            return
        if not worker.write(b"".join(frames)):
            # Nothing of it can have reached the worker: ``_fail_worker`` requeues the rest anyway
            # (the stubs are completed there); the slots taken back go first.
            self.queue.extendleft(reversed(back))
            self.fail_worker(worker, WorkerFailure("crashed", "the worker process exited unexpectedly"))
            return
        self.queue.extendleft(reversed(back))
        log("calls_taken_back", plugin=self.name, pid=worker.pid, count=len(back), note=why)
        self._dispatch_to_idle()

    def answer(self, slot: CallSlot, responses: list[wire.InputResponse], missing: str = "error",
               why: str = "the client gave no answer", to: wire.Ask | None = None) -> bool:
        """Send the running call the answers to its questions (one per key it asked; a key without
        one gets outcome ``missing``). ``to``: the round they answer (answers to an earlier round,
        which timed out, are dropped). False if it is not waiting on them any more."""
        ask = slot.asking
        if ask is None or slot.finished or (to is not None and to is not ask):
            return False
        given = {r.key: r for r in responses}
        ordered = [given.get(q.key) or wire.InputResponse(q.key, missing, message=why) for q in ask.requests]
        worker = self._owner(slot)
        if worker is None or not worker.pending or worker.pending[0] is not slot:
            return False
        self.watchdog.resume_after_answer(slot)
        self.asking -= 1
        try:
            frame = wire.encode_frame(wire.Answer(slot.call.id, ordered))
        except (OverflowError, TypeError, ValueError) as exc:  # the client's answer cannot travel as msgpack
            bad = f"the client's answer could not be passed to the tool ({type(exc).__name__})"
            frame = wire.encode_frame(wire.Answer(slot.call.id, [wire.InputResponse(q.key, "error", message=bad)
                                                                 for q in ask.requests]))
        if not worker.write(frame):
            self.fail_worker(worker, WorkerFailure("crashed", "the worker process exited unexpectedly"))
        return True

    def result(self, worker: PoolWorker, head: CallSlot, msg: wire.Result) -> None:
        """``worker`` answered its running call ``head`` (checked by its reader): the client hears it now;
        the worker stays busy with it until ``returned``."""
        head.result = msg
        worker.calls += 1
        self._learn(msg)
        if PHASES.on:
            self._account(head, msg.run_ns)
        self._complete(head)
        if msg.retire is not None:
            # Calls sent after this one never run there: back to the pool's queue.
            worker.pending.popleft()
            log("worker_retired", level="warning", plugin=self.name, pid=worker.pid, reason=str(msg.retire)[:300])
            self.fail_worker(worker, WorkerFailure("unavailable", "the worker retired"), head_started=False)

    def returned(self, worker: PoolWorker) -> None:
        """``worker``'s runtime says its running call's code returned: the worker is free for the next."""
        pending = worker.pending
        pending.popleft()
        if pending:
            self._start_deadline(pending[0])
        else:
            self._make_available(worker)

    # -- deadlines (``runtime.execution.watchdog``) ----------------------------------------------

    def _running(self) -> Iterator[tuple[CallSlot, PoolWorker]]:
        for worker in list(self.workers):
            if worker.pending:
                yield worker.pending[0], worker

    def _ask_timed_out(self, slot: CallSlot, worker: PoolWorker) -> None:
        self.answer(slot, [], "timeout", f"the client did not answer within {_fmt_s(self.limits.ask_timeout_s)}")

    def _timed_out(self, slot: CallSlot, worker: PoolWorker) -> None:
        if worker.dead or not worker.pending or worker.pending[0] is not slot:
            return  # ended earlier in this pass
        # Also when answered: its code has not returned (plugin code wrote a Result itself and ran on),
        # so it is killed all the same (logged by fail_worker).
        self.fail_worker(worker, WorkerFailure("timeout", f"timed out after {_fmt_s(self.limits.timeout_s)}"))

    def relay(self, slot: CallSlot, msg: Any, size: int) -> None:
        """Pass one progress/log frame of ``slot`` to its client, within the call's budget.

        Budget (``Limits``): at most ``max_notifications`` notifications whose bytes, together, stay within
        ``max_output_bytes``; one over ``max_notification_bytes`` is truncated. Beyond the budget
        notifications are dropped (the reader keeps draining the worker, so nothing piles up here) and
        the log says so once per call."""
        worker_frames.check_notification(msg)
        slot.relay(msg, size, self.limits, self.name)

    # -- teardown ------------------------------------------------------------------------------

    def _discard(self, worker: PoolWorker) -> None:
        """Kill ``worker`` and forget it."""
        self.workers.discard(worker)
        if worker in self.idle:
            self.idle.remove(worker)
        worker.kill()

    async def aclose(self, grace_s: float = 2.0) -> None:
        """Stop accepting calls, let in-flight ones finish for up to ``grace_s``, then kill all."""
        self.closed = True
        self._fail_queue(WorkerFailure("unavailable", f"plugin {self.name} was unloaded"))
        with trio.move_on_after(grace_s):
            await self._drained()
        for worker in list(self.workers):
            self.fail_worker(worker, WorkerFailure("unavailable", f"plugin {self.name} was unloaded"), requeue=False)
        self.idle.clear()
        self.watchdog.stop()


def _fmt_s(seconds: float) -> str:
    return f"{seconds:g} s"
