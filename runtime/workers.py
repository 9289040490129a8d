"""Worker processes and per-plugin pools (the trio side; the worker itself is ``sandbox.worker``).

How this works:

* A pool keeps between ``min_workers`` and ``limits.max_concurrency`` pre-started workers of one
  plugin. A worker runs the calls sent to it one at a time, in order.
* A call goes to an idle worker if there is one: not at once, but at the pool's next dispatch,
  which runs right after the tasks the scheduler is running now (one tick, microseconds later),
  so calls that arrive together (HTTP requests read in one scheduler pass, a burst on stdio) are
  split across the idle workers in one write each instead of one write per call. Otherwise it
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
  worker (not started, so safe to run elsewhere) go back to the front of the pool's queue, and a
  replacement worker is started. Only that one call fails. A cancelled call that was sent but has not
  started is withdrawn with a ``CancelCall`` frame instead.
* A watcher task per worker relays its captured stdout/stderr (capped) to the log and notices
  when it exits.
"""

from __future__ import annotations

import collections
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from typing import Any, Callable

import msgspec
import trio

from runtime import egress
from runtime.clock import clock_reader
from runtime.egress_rules import Grant
from runtime.logs import log
from runtime.protocol.errors import LIMIT_KINDS, PoolBusy, WorkerFailure
from runtime import spares, worker_frames
from runtime.worker_frames import FrameRejected
from sandbox.isolation import cgroups
from runtime.processes import (
    LIVE_WORKER_PIDS,
    LIVE_WORKER_TOKENS,
    SPAWNED,
    WORKER_SYS_PATH,
    PoolSpec,
    kill_tree,
    spawn_process,
    sweep_orphans,
)
from sandbox import wire

_FRAME_OVERHEAD = 64 * 1024
_MAX_LOGGED_OUTPUT = 256 * 1024
START_TIMEOUT_S = 20.0
#: Most queued calls handed to a worker in one write.
BATCH_MAX = 32
#: Worker frames a pool's reader handles at a time before it lets the rest of the daemon run (a
#: worker that keeps its socket full never makes the reader wait).
FRAMES_PER_CHECKPOINT = 256


class _Phases:
    """Whether calls are timed by phase (queue, channel, worker): only while metrics are exported
    (``runtime.metrics`` turns it on), so that the hot path pays nothing for it otherwise."""

    on = False


PHASES = _Phases()


class PluginLoadError(Exception):
    """The plugin's first worker could not start or load the plugin."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


class Worker:
    """One worker process and its IPC socket (used raw: trio only waits for readiness)."""

    __slots__ = ("output_done", "proc", "raw", "buf", "pid", "ready", "dead", "scratch", "max_frame", "calls", "layers",
                 "output_tail", "exited", "pending", "out", "out_wake", "sending", "token", "egress", "fds", "oom_seen")

    def __init__(self, proc: trio.Process, raw: socket.socket, scratch: str, max_frame: int) -> None:
        self.proc = proc
        self.raw = raw
        self.buf = bytearray()
        self.pid = proc.pid
        self.ready: wire.Ready | None = None
        self.dead = False
        self.scratch = scratch
        self.max_frame = max_frame
        self.calls = 0
        self.layers: list[str] = []
        #: The last few KiB the worker printed (shown when it fails to start).
        self.output_tail = b""
        self.exited = trio.Event()
        #: Set once everything the worker printed has been relayed (its output pipe is at EOF).
        self.output_done = trio.Event()
        #: Calls sent to this worker and not yet answered, in the order it runs them.
        self.pending: collections.deque[Slot] = collections.deque()
        self.out: list[bytes] = []
        self.out_wake = trio.Event()
        self.sending = False
        self.token = ""
        #: Cancels this worker's egress proxy (``runtime.egress``), if its plugin has a network grant.
        self.egress: trio.CancelScope | None = None
        #: File descriptors that came over the IPC socket during start-up (only the egress listener is kept).
        self.fds: list[int] = []
        #: OOM kills of this worker's cgroup already reported (per_call: one per killed call).
        self.oom_seen = 0

    def close_fds(self) -> None:
        while self.fds:
            try:
                os.close(self.fds.pop())
            except OSError:
                pass

    def write(self, data: bytes) -> bool:
        """Send ``data`` now if the socket takes it, else leave it to the writer task.

        Returns False if the worker's socket is broken."""
        if self.dead:
            return False
        if not self.out and not self.sending:
            try:
                sent = self.raw.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return False
            if sent == len(data):
                return True
            data = data[sent:]
        self.out.append(data)
        self.out_wake.set()
        return True

    async def read_message(self, with_fds: bool = False) -> Any:
        """The next frame (used only during start-up, before the reader task runs).

        ``Ready`` carries every tool definition, so it is capped by the protocol-wide frame limit,
        not the plugin's output cap; the definitions are checked (and refused) afterwards."""
        while True:
            try:
                frames = wire.split_frames(self.buf, wire.MAX_FRAME_BYTES, max_count=1)
            except ValueError:
                raise WorkerFailure("output_cap", "the worker sent a frame over the size limit") from None
            if frames:
                try:
                    msg = wire.from_worker_decoder.decode(frames[0])
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError, ValueError):
                    raise WorkerFailure("garbage", "the worker sent a malformed frame") from None
                if type(msg) is wire.Ready:
                    try:
                        worker_frames.check_ready(msg)
                    except FrameRejected as exc:
                        raise WorkerFailure("garbage", f"the worker sent a malformed frame: {exc}") from None
                return msg
            data = await self.recv(with_fds)
            self.buf += data
            # A worker that keeps its socket full never makes ``recv`` wait: start-up reading must not
            # hold the event loop either (start-up only: a yield per read costs nothing that counts).
            await trio.lowlevel.checkpoint()

    async def recv(self, with_fds: bool = False) -> bytes:
        """Some bytes; ``with_fds`` also keeps passed file descriptors in ``fds`` (a plain ``recv`` makes
        the kernel discard them)."""
        while True:
            try:
                if with_fds:
                    data, fds, _, _ = socket.recv_fds(self.raw, 1 << 18, 4)
                    for fd in fds:
                        # One descriptor is ever expected (the egress listener): any other is closed
                        # at once, so a worker cannot fill the daemon's descriptor table while it starts.
                        if self.fds:
                            os.close(fd)
                        else:
                            self.fds.append(fd)
                else:
                    data = self.raw.recv(1 << 18)
            except (BlockingIOError, InterruptedError):
                try:
                    await trio.lowlevel.wait_readable(self.raw)
                except (trio.ClosedResourceError, OSError, ValueError):
                    raise WorkerFailure("crashed", "the worker process exited unexpectedly") from None
                continue
            except OSError:
                data = b""
            if not data:
                raise WorkerFailure("crashed", "the worker process exited unexpectedly")
            return data


class Slot(msgspec.Struct, eq=False):
    """One call on its way through a pool. ``on_done(slot)`` runs once, when it has an outcome.

    Made by ``WorkerPool.new_slot`` (one per call: a Struct fills its defaults in C, in half the time
    of a class's ``__init__``; compared by identity)."""

    call: wire.Call
    #: The encoded Call frame.
    frame: bytes
    on_event: Callable[[Any], None] | None = None
    on_done: Callable[[Slot], None] | None = None
    event: trio.Event | None = None
    result: wire.Result | None = None
    error: WorkerFailure | None = None
    deadline: float = float("inf")
    abandoned: bool = False
    finished: bool = False
    #: Progress/log notifications relayed so far, their bytes, and how many were dropped.
    notes: int = 0
    note_bytes: int = 0
    notes_dropped: int = 0
    #: The round of questions the call waits on (``wire.Ask``), until the pool sends its ``Answer``.
    asking: wire.Ask | None = None
    #: What was left of the call's deadline when it asked (the deadline does not run meanwhile).
    run_left_s: float = 0.0
    #: Questions asked so far (``limits.max_asks``).
    asks: int = 0
    #: perf_counter() when the pool took the call, and when a worker started on it.
    queued_at: float = 0.0
    started_at: float = 0.0

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        # Dropped once used: the callbacks belong to whoever owns the call (a ``RunningCall``, which
        # holds this slot), and a cycle between them would leave both to the cyclic collector.
        on_done, self.on_done, self.on_event = self.on_done, None, None
        try:
            if on_done is not None:
                on_done(self)
        except Exception as exc:  # our bug; the pool must keep running
            log("internal_error", level="error", where="call completion", error=f"{type(exc).__name__}: {exc}")
        if self.event is not None:
            self.event.set()


class WorkerPool:
    """Pre-started workers for one plugin version; see the module docstring for the rules."""

    def __init__(self, spec: PoolSpec, nursery: trio.Nursery) -> None:
        self.spec = spec
        self.name = spec.manifest.name
        #: trio's clock, read in one call (``runtime.clock``).
        self._clock = clock_reader()
        self.limits = spec.manifest.limits
        self.nursery = nursery
        self.idle: list[Worker] = []
        self.workers: set[Worker] = set()
        self.starting = 0
        #: Calls waiting for a worker, oldest first.
        self.queue: collections.deque[Slot] = collections.deque()
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
        self._drain_event: trio.Event | None = None
        self._next_call_id = 0
        self._max_frame = self.limits.max_output_bytes + _FRAME_OVERHEAD
        #: The plugin's network grant, enforced by each worker's egress proxy (the manifest check parsed it).
        self.grant = Grant.parse(spec.manifest.permissions.network)
        self._watch_wake = trio.Event()
        self._watch_at = float("inf")
        self._watchdog_started = False
        #: Deferred dispatch to idle workers (see the module doc): the dispatcher parks here.
        self._dispatch_lot = trio.lowlevel.ParkingLot()
        self._dispatch_due = False

    # -- start-up ------------------------------------------------------------------------------

    def _init_frame(self, scratch: str, token: str) -> wire.Init:
        m = self.spec.manifest
        return wire.Init(
            plugin_name=m.name,
            plugin_dir=self.spec.plugin_dir,
            entry=m.entry,
            sys_path=[*self.spec.extra_sys_path, *WORKER_SYS_PATH],
            env=self.spec.env(token),
            limits=m.limits,
            permissions=self.spec.permissions(),
            policy=self.spec.policy,
            scratch_dir=scratch,
            mode=m.isolation,
            describe_only=self.spec.describe_only,
        )

    async def start_worker(self) -> Worker:
        """Start one worker (the daemon's spare interpreter if it fits, see ``runtime.spares``) and
        wait for its ``Ready``. Raises ``PluginLoadError``."""
        os.makedirs(self.spec.state_dir, mode=0o711, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=f"{os.getpid()}~{self.name}-", dir=self.spec.state_dir)
        keeper = spares.current.get()
        spare = keeper.take(self.spec) if keeper is not None and not self.spec.describe_only else None
        if keeper is not None and spare is not None:
            try:
                return await self._start(spare.proc, spare.raw, spare.token, scratch)
            finally:
                keeper.restock()  # the next spare starts now, not while this one was starting
        token = secrets.token_hex(8)
        LIVE_WORKER_TOKENS.add(token)
        try:
            proc, parent = await spawn_process(self.spec.env(token), scratch)
        except OSError as exc:
            LIVE_WORKER_TOKENS.discard(token)
            shutil.rmtree(scratch, ignore_errors=True)
            raise PluginLoadError("spawn", f"could not start a worker: {exc}") from None
        return await self._start(proc, parent, token, scratch)

    async def _start(self, proc: trio.Process, parent: socket.socket, token: str, scratch: str) -> Worker:
        """Send a started worker process its ``Init`` and wait for its ``Ready``."""
        worker = Worker(proc, parent, scratch, self._max_frame)
        worker.token = token
        LIVE_WORKER_PIDS.add(proc.pid)
        self.nursery.start_soon(self._watch, worker)
        self.nursery.start_soon(self._write_loop, worker)
        try:
            if not worker.write(wire.encode_frame(self._init_frame(scratch, token))):
                raise WorkerFailure("crashed", "the worker process exited unexpectedly")
            with trio.fail_after(START_TIMEOUT_S):
                msg = await worker.read_message(with_fds=True)
                if isinstance(msg, wire.EgressListener):
                    self._start_egress(worker, msg)
                    msg = await worker.read_message(with_fds=True)
        except BaseException as exc:
            if not isinstance(exc, (WorkerFailure, trio.TooSlowError, OSError)):
                # Cancelled (daemon shutting down) or our bug: never leave the process behind.
                self._discard(worker, kill=True)
                raise
            text = exc.message if isinstance(exc, WorkerFailure) else f"no answer within {START_TIMEOUT_S:.0f} s"
            with trio.move_on_after(1.0):
                await worker.exited.wait()
            self._discard(worker, kill=True)
            tail = worker.output_tail.decode("utf-8", "replace").strip()
            if tail:
                text += "; it printed: " + tail[-1500:]
            raise PluginLoadError("start", f"worker failed to start: {text}") from None
        finally:
            worker.close_fds()
        if isinstance(msg, wire.LoadFailed):
            self._discard(worker, kill=True)
            raise PluginLoadError(msg.stage, msg.error)
        if not isinstance(msg, wire.Ready):
            self._discard(worker, kill=True)
            raise PluginLoadError("start", "worker sent something other than Ready")
        problem = self._check_layers(msg, worker)
        if problem:
            self._discard(worker, kill=True)
            raise PluginLoadError("isolation", problem)
        if self.ready is None:
            self.ready = msg
        elif msg.tools != self.ready.tools:
            self._discard(worker, kill=True)
            raise PluginLoadError("definition", "a new worker reported different tools than the first one")
        worker.ready = msg
        worker.layers = list(msg.layers)
        self.workers.add(worker)
        self.nursery.start_soon(self._read_loop, worker)
        if not self._watchdog_started:
            self._watchdog_started = True
            self.nursery.start_soon(self._watchdog)
            self.nursery.start_soon(self._dispatcher)
        return worker

    def _start_egress(self, worker: Worker, msg: wire.EgressListener) -> None:
        """Serve the proxy socket the worker handed over (see ``runtime.egress``)."""
        worker.egress = egress.start_proxy(self.nursery, self.grant, self.name, worker.pid, worker.fds, msg.port,
                                           worker.egress is not None, self.spec.secrets)

    def _check_layers(self, ready: wire.Ready, worker: Worker) -> str | None:
        from runtime.policy import EGRESS_LAYER, check_layers

        if EGRESS_LAYER in ready.layers and worker.egress is None:
            return "the worker reported an egress proxy but handed over no socket"
        return check_layers(self.spec.policy, ready.layers, ready.missing, self.name, network=bool(self.grant))

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
            self._discard(worker, kill=True)
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
            self._discard(worker, kill=True)
            for slot in pending:
                if not slot.finished:
                    slot.error = error
                    self._complete(slot)

    def _fail_queue(self, error: WorkerFailure) -> None:
        while self.queue:
            slot = self.queue.popleft()
            slot.error = error
            slot.finish()

    def _start_deadline(self, slot: Slot) -> None:
        if PHASES.on:
            slot.started_at = time.perf_counter()
        slot.deadline = self._clock() + self.limits.timeout_s
        if slot.deadline < self._watch_at:
            self._watch_wake.set()

    def _dispatch(self, worker: Worker, slots: list[Slot]) -> None:
        """Give ``slots`` to ``worker`` in one write. The head starts its deadline."""
        if not worker.pending:
            self._start_deadline(slots[0])
        worker.pending.extend(slots)
        data = slots[0].frame if len(slots) == 1 else b"".join(slot.frame for slot in slots)
        if not worker.write(data):
            self._fail_worker(worker, WorkerFailure("crashed", "the worker process exited unexpectedly"))

    async def _dispatcher(self) -> None:
        """Hand queued calls to idle workers, once per scheduler tick in which calls arrived."""
        while True:
            if not self._dispatch_due:
                await self._dispatch_lot.park()
            self._dispatch_due = False
            self._dispatch_to_idle()

    def _room(self) -> int:
        """How many more workers the pool may start now."""
        return self.limits.max_concurrency - len(self.workers) - self.starting

    def _grow_for_queue(self) -> None:
        """Start a worker for every queued call that no worker being started will take (up to the
        pool's size): a burst is met by the whole pool, not queued on the workers there are."""
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

    def _make_available(self, worker: Worker) -> None:
        """``worker`` has nothing pending: hand it its share of the queue, or mark it idle."""
        if worker.dead or worker.pending:
            return
        if not self.queue:
            if not self.closed:
                self.idle.append(worker)
            return
        share = self._share(1)
        self._dispatch(worker, [self.queue.popleft() for _ in range(min(share, len(self.queue)))])
        if self.queue:
            self._grow_for_queue()

    def new_slot(self, tool: str, arguments: dict[str, Any], progress: bool, log_level: int,
                 on_event: Callable[[Any], None] | None, on_done: Callable[[Slot], None] | None = None,
                 trace: str = "") -> Slot:
        self._next_call_id += 1
        call = wire.Call(self._next_call_id, tool, arguments, progress, log_level, trace)
        # Encoding the frame raises here (OverflowError for integers beyond 64 bits, ...): an
        # unencodable argument fails its own call, before it is queued anywhere.
        return Slot(call, wire.encode_frame(call), on_event, on_done)

    def submit(self, slot: Slot) -> None:
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
            if not self._dispatch_due:
                self._dispatch_due = True
                self._dispatch_lot.unpark()
            return
        self.in_flight += 1
        self.queue.append(slot)
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

    def _owner(self, slot: Slot) -> Worker | None:
        for worker in self.workers:
            if slot in worker.pending:
                return worker
        return None

    def withdraw(self, slot: Slot) -> None:
        """The client cancelled ``slot``: nothing more is reported for it; if it runs, its worker dies."""
        if slot.finished:
            return
        slot.on_done = None
        slot.on_event = None
        slot.abandoned = True
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
            self._fail_worker(owner, WorkerFailure("cancelled", "cancelled"))
        elif not owner.write(wire.encode_frame(wire.CancelCall(slot.call.id))):
            self._fail_worker(owner, WorkerFailure("crashed", "the worker process exited unexpectedly"))

    async def _drained(self) -> None:
        """Wait until no call given to this pool is left (queued, sent or running)."""
        while self.in_flight:
            self._drain_event = trio.Event()
            await self._drain_event.wait()

    def _account(self, slot: Slot, run_ns: int) -> None:
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

    def _release(self) -> None:
        self.in_flight -= 1
        if not self.in_flight and self._drain_event is not None:
            self._drain_event.set()

    def _complete(self, slot: Slot) -> None:
        self._release()
        if slot.error is not None and slot.error.kind in LIMIT_KINDS:
            self.limit_kills += 1
        slot.finish()

    def _fail_worker(self, worker: Worker, error: WorkerFailure, requeue: bool = True,
                     head_started: bool = True) -> None:
        """Kill ``worker``: its running call gets ``error``; calls queued behind it go back to the pool.
        ``head_started=False``: no call is running there (it retired after a result): all go back."""
        pending = list(worker.pending)
        worker.pending.clear()
        self._discard(worker, kill=True)
        if pending:
            rest = pending
            if head_started:
                head, rest = pending[0], pending[1:]
                if not head.finished:
                    head.error = error
                    self._complete(head)
                elif head.result is not None and error.kind != "unavailable":
                    # Its client has its answer; nobody else hears why the worker ended.
                    log("worker_killed_after_answer", level="warning", plugin=self.name, pid=worker.pid,
                        tool=head.call.tool, reason=error.message,
                        note="the call was answered, but its code had not returned (sandbox.wire, CallReturned)")
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
        if not self.closed and (self.queue or len(self.workers) + self.starting < max(1, self.spec.min_workers)):
            if len(self.workers) + self.starting < self.limits.max_concurrency:
                self._spawn_background()

    async def _watchdog(self) -> None:
        """Enforce deadlines: the head call of each worker must finish before its deadline."""
        while not self.closed:
            # While a pass runs, any deadline set (by a call it starts, directly or through a callback)
            # wakes the next pass at once, rather than being compared with the expired ``_watch_at``.
            self._watch_wake = trio.Event()
            self._watch_at = float("inf")
            now = trio.current_time()
            nearest = float("inf")
            for worker in list(self.workers):
                if worker.pending:
                    head = worker.pending[0]
                    if head.deadline <= now and head.asking is not None:
                        # A question that found no answer in time: the tool hears so and goes on.
                        self.answer(head, [], "timeout",
                                    f"the client did not answer within {_fmt_s(self.limits.ask_timeout_s)}")
                        nearest = min(nearest, head.deadline)
                    elif head.deadline <= now:
                        # Also when answered: its code has not returned (plugin code wrote a Result
                        # itself and ran on), so it is killed all the same (logged by _fail_worker).
                        self._fail_worker(worker, WorkerFailure("timeout", f"timed out after {_fmt_s(self.limits.timeout_s)}"))
                    else:
                        nearest = min(nearest, head.deadline)
            self._watch_at = nearest
            with trio.move_on_at(nearest):
                await self._watch_wake.wait()

    async def _write_loop(self, worker: Worker) -> None:
        raw = worker.raw
        while not worker.dead:
            await worker.out_wake.wait()
            worker.out_wake = trio.Event()
            while worker.out and not worker.dead:
                data = b"".join(worker.out)
                worker.out.clear()
                worker.sending = True
                try:
                    while data:
                        try:
                            sent = raw.send(data)
                        except (BlockingIOError, InterruptedError):
                            await trio.lowlevel.wait_writable(raw)
                            continue
                        data = data[sent:]
                except (OSError, trio.ClosedResourceError, ValueError):
                    if not worker.dead:
                        self._fail_worker(worker, WorkerFailure("crashed", "the worker process exited unexpectedly"))
                    return
                finally:
                    worker.sending = False

    async def _read_loop(self, worker: Worker) -> None:
        """Match the worker's frames to its pending calls, in order.

        Every frame is untrusted (``runtime.worker_frames``): checked before anything uses it, and any
        exception while handling one fails the running call and recycles the worker, never the pool."""
        decode = wire.from_worker_decoder.decode
        try:
            while True:
                try:
                    frames = wire.split_frames(worker.buf, worker.max_frame, FRAMES_PER_CHECKPOINT) if worker.buf else []
                except ValueError:
                    raise WorkerFailure("output_cap", "the tool's output exceeded its size limit") from None
                for raw_frame in frames:
                    try:
                        msg = decode(raw_frame)
                    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError, ValueError):
                        raise WorkerFailure("garbage", "the worker sent a malformed frame") from None
                    pending = worker.pending
                    head = pending[0] if pending else None
                    kind = type(msg)
                    if kind is wire.Result:
                        # The answer goes to the client now; the worker stays busy, and the call's
                        # deadline runs, until its runtime says the call's code returned (CallReturned):
                        # plugin code can write a Result of its own and run on (``sandbox.wire``).
                        if head is None or msg.id != head.call.id:
                            raise WorkerFailure("garbage", "the worker answered a call it was not given")
                        if head.result is not None:
                            raise WorkerFailure("garbage", "the worker answered the same call twice")
                        worker_frames.check_result(msg)
                        if msg.killed:
                            msg = self._name_kill(worker, msg)
                        head.result = msg
                        worker.calls += 1
                        if PHASES.on:
                            self._account(head, msg.run_ns)
                        self._complete(head)
                        if msg.retire is not None:
                            # Calls sent after this one never run there: back to the pool's queue.
                            pending.popleft()
                            log("worker_retired", level="warning", plugin=self.name, pid=worker.pid,
                                reason=str(msg.retire)[:300])
                            self._fail_worker(worker, WorkerFailure("unavailable", "the worker retired"),
                                              head_started=False)
                            return
                    elif kind is wire.CallReturned:
                        if head is None or msg.id != head.call.id or head.result is None:
                            raise WorkerFailure("garbage", "the worker said a call returned before answering it")
                        pending.popleft()
                        if pending:
                            self._start_deadline(pending[0])
                        else:
                            self._make_available(worker)
                    elif (kind is wire.Progress or kind is wire.Log) and head is not None and msg.id == head.call.id \
                            and head.result is None:
                        self._relay(head, msg, len(raw_frame))
                    elif kind is wire.Ask and head is not None and msg.id == head.call.id and head.asking is None \
                            and head.result is None:
                        self._ask(head, msg, worker)
                    else:
                        raise WorkerFailure("garbage", "the worker sent an unexpected frame")
                if worker.dead:
                    return
                if len(frames) == FRAMES_PER_CHECKPOINT:
                    # More may be buffered, and a worker that keeps its socket full never makes ``recv``
                    # wait: let the rest of the daemon (other clients, the watchdog that enforces this
                    # call's deadline) run before the next frames.
                    await trio.lowlevel.checkpoint()
                    if worker.dead:
                        return
                    continue
                worker.buf += await worker.recv()
        except FrameRejected as exc:
            if not worker.dead:
                self._fail_worker(worker, WorkerFailure("garbage", f"the worker sent a malformed frame: {exc}"))
        except WorkerFailure as exc:
            if worker.dead:
                return
            if exc.kind == "crashed":
                with trio.move_on_after(0.5):
                    await worker.exited.wait()
                exc = explain_exit(worker.proc.returncode, worker.pid, self.limits)
            self._fail_worker(worker, exc)
        except Exception as exc:  # our bug, triggered by what this worker sent: fail its call only
            log("internal_error", level="error", where="worker frame", plugin=self.name,
                error=f"{type(exc).__name__}: {str(exc)[:300]}")
            if not worker.dead:
                self._fail_worker(worker, WorkerFailure("garbage", "the daemon could not handle what the worker sent"))

    def _ask(self, slot: Slot, msg: wire.Ask, worker: Worker | None = None) -> None:
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
        now = trio.current_time()
        slot.run_left_s = max(0.0, slot.deadline - now)
        slot.asking = msg
        slot.deadline = now + limits.ask_timeout_s
        if slot.deadline < self._watch_at:
            self._watch_wake.set()  # the watchdog sleeps until the nearest deadline: this one may be nearer
        if slot.on_event is None:
            self.answer(slot, [], "cancelled", "the call is being cancelled")
            return
        slot.on_event(msg)

    def _take_back(self, worker: Worker) -> None:
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
        back: list[Slot] = []
        for i in range(1, len(pending)):
            slot = pending[i]
            if slot.abandoned or slot.finished:
                continue  # withdrawn (its CancelCall already sent) or a stub of an earlier round
            pending[i] = Slot(slot.call, b"", abandoned=True)
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
            self._fail_worker(worker, WorkerFailure("crashed", "the worker process exited unexpectedly"))
            return
        self.queue.extendleft(reversed(back))
        log("calls_taken_back", plugin=self.name, pid=worker.pid, count=len(back),
            note="the worker's call asked its client; the calls batched behind it run elsewhere")
        self._dispatch_to_idle()

    def answer(self, slot: Slot, responses: list[wire.InputResponse], missing: str = "error",
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
        slot.asking = None
        slot.deadline = trio.current_time() + slot.run_left_s
        self._watch_wake.set()
        try:
            frame = wire.encode_frame(wire.Answer(slot.call.id, ordered))
        except (OverflowError, TypeError, ValueError) as exc:  # the client's answer cannot travel as msgpack
            bad = f"the client's answer could not be passed to the tool ({type(exc).__name__})"
            frame = wire.encode_frame(wire.Answer(slot.call.id, [wire.InputResponse(q.key, "error", message=bad)
                                                                 for q in ask.requests]))
        if not worker.write(frame):
            self._fail_worker(worker, WorkerFailure("crashed", "the worker process exited unexpectedly"))
        return True

    def _name_kill(self, worker: Worker, msg: wire.Result) -> wire.Result:
        """per_call: a call process SIGKILLed before it answered; say "out of memory" when the worker's
        cgroup counted an OOM kill since the last one we saw."""
        try:
            oom = cgroups.limit_events(worker.pid).get("oom_kill", 0)
        except Exception:  # noqa: BLE001 (reading the cgroup is best effort)
            return msg
        if oom <= worker.oom_seen:
            return msg
        worker.oom_seen = oom
        text = f"the call ran out of memory (its limit is {self.limits.memory_mb} MB) and was killed"
        return wire.Result(msg.id, [{"type": "text", "text": text}], is_error=True)

    def _relay(self, slot: Slot, msg: Any, size: int) -> None:
        """Pass one progress/log frame of ``slot`` to its client, within the call's budget.

        Budget (``Limits``): at most ``max_notifications`` notifications whose bytes, together, stay within
        ``max_output_bytes``; one over ``max_notification_bytes`` is truncated. Beyond the budget
        notifications are dropped (the reader keeps draining the worker, so nothing piles up here) and
        the log says so once per call."""
        if type(msg) is wire.Log:
            worker_frames.check_log(msg)
        else:
            worker_frames.check_progress(msg)
        if slot.on_event is None:
            return
        msg = worker_frames.within_budget(slot, msg, size, self.limits, self.name, slot.call.tool)
        if msg is not None:
            slot.on_event(msg)

    # -- teardown ------------------------------------------------------------------------------

    def _discard(self, worker: Worker, kill: bool) -> None:
        first = not worker.dead
        worker.dead = True
        self.workers.discard(worker)
        if worker in self.idle:
            self.idle.remove(worker)
        if kill:
            if worker.proc.returncode is None:
                # Not reaped yet, so the pid is still this worker's. Once reaped it may be reused by
                # another process: then only the token sweep below (by marker) finds what is left.
                kill_tree(worker.pid)
            if first:
                # Escaped grandchildren carry this worker's token: retire it and sweep them now.
                LIVE_WORKER_TOKENS.discard(worker.token)
                sweep_orphans()
        if first:
            if worker.egress is not None:
                worker.egress.cancel()
            worker.out_wake.set()
            try:
                trio.lowlevel.notify_closing(worker.raw)
            except (RuntimeError, ValueError, OSError):
                pass
            try:
                worker.raw.close()
            except OSError:
                pass

    async def _pump_output(self, worker: Worker) -> None:
        """Relay what the worker prints to the log (capped); keeps a tail for start-up errors."""
        logged = 0
        stdout = worker.proc.stdout
        if stdout is None:
            worker.output_done.set()
            return
        try:
            while True:
                try:
                    chunk = await stdout.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                if not chunk:
                    break
                worker.output_tail = (worker.output_tail + chunk)[-4096:]
                if logged < _MAX_LOGGED_OUTPUT:
                    text = chunk[: _MAX_LOGGED_OUTPUT - logged].decode("utf-8", "replace")
                    logged += len(chunk)
                    log("plugin_output", plugin=self.name, pid=worker.pid, output=text.rstrip("\n"))
                    if logged >= _MAX_LOGGED_OUTPUT:
                        log("plugin_output_capped", plugin=self.name, pid=worker.pid, cap_bytes=_MAX_LOGGED_OUTPUT)
        finally:
            worker.output_done.set()
            with trio.CancelScope(shield=True):
                await stdout.aclose()

    async def _watch(self, worker: Worker) -> None:
        """Wait for the worker process to exit, then clean up after it.

        The exit, not the end of its output, drives the clean-up: a grandchild that inherited the
        stdout pipe must not keep us from killing it."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump_output, worker)
                with trio.CancelScope(shield=True):
                    await worker.proc.wait()
                worker.exited.set()
                with trio.move_on_after(0.5):  # let the last output drain, then stop listening
                    await worker.output_done.wait()
                nursery.cancel_scope.cancel()
        finally:
            worker.exited.set()
            if not worker.dead and not self.closed:
                self.restarts += 1
                log("worker_exited", level="warning", plugin=self.name, pid=worker.pid,
                    returncode=worker.proc.returncode)
            self._fail_worker(worker, explain_exit(worker.proc.returncode, worker.pid, self.limits))
            LIVE_WORKER_TOKENS.discard(worker.token)
            if worker.proc.returncode is not None:
                LIVE_WORKER_PIDS.discard(worker.pid)
                SPAWNED.pop(worker.pid, None)
            sweep_orphans()
            with trio.CancelScope(shield=True):
                # Whatever is left in the worker's cgroup dies with it; the cgroup goes away.
                await trio.to_thread.run_sync(cgroups.cleanup, worker.pid)
            shutil.rmtree(worker.scratch, ignore_errors=True)

    async def retire(self) -> None:
        """Let every call already given to this pool finish (each within its deadline), then close."""
        self.retiring = True
        try:
            await self._drained()
        finally:
            with trio.CancelScope(shield=True):
                await self.aclose(grace_s=0)

    async def aclose(self, grace_s: float = 2.0) -> None:
        """Stop accepting calls, let in-flight ones finish for up to ``grace_s``, then kill all."""
        self.closed = True
        self._fail_queue(WorkerFailure("unavailable", f"plugin {self.name} was unloaded"))
        with trio.move_on_after(grace_s):
            await self._drained()
        for worker in list(self.workers):
            self._fail_worker(worker, WorkerFailure("unavailable", f"plugin {self.name} was unloaded"), requeue=False)
        self.idle.clear()
        self._watch_wake.set()


def describe_exit(returncode: int | None) -> str:
    """A worker's end in words, from its exit status alone (``explain_exit`` knows the limits too)."""
    if returncode is None:
        return "the worker process stopped answering"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"the worker process crashed: killed by {name}"
    return f"the worker process crashed: it exited with status {returncode}"


def explain_exit(returncode: int | None, worker_id: int, limits: wire.Limits) -> WorkerFailure:
    """Why a worker ended, by name: a limit that fired (memory, CPU, processes) or a crash."""
    from sandbox.call_guard import CPU_LIMIT_EXIT

    if returncode in (CPU_LIMIT_EXIT, -signal.SIGXCPU):
        return WorkerFailure("cpu", f"exceeded its CPU limit ({limits.cpu_s} s of CPU for one call)")
    try:
        events = cgroups.limit_events(worker_id)
    except Exception:  # noqa: BLE001 (reading the cgroup is best effort)
        events = {}
    if events.get("oom_kill"):
        return WorkerFailure("memory", f"ran out of memory (its limit is {limits.memory_mb} MB) and was killed")
    if returncode is not None and returncode < 0 and events.get("pids_max"):
        return WorkerFailure("processes", f"hit its limit of {limits.max_processes} processes and threads and was killed")
    return WorkerFailure("crashed", describe_exit(returncode))


def _fmt_s(seconds: float) -> str:
    return f"{seconds:g} s"
