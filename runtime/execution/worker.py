"""A plugin's worker processes as a pool sees them: ``ProcessWorkers`` starts them (the real process
factory; tests give the pool a fake one), and each worker's reader task turns its frames into the
pool's events (``WorkerEvents``).

Every frame is untrusted (``runtime.worker_frames``): checked before anything uses it, and any
exception while handling one fails the running call and recycles the worker, never the pool.
"""

from __future__ import annotations

import collections
from typing import Any, Protocol

import msgspec
import trio

from runtime.egress_rules import Grant
from runtime.execution.child import ChildProcess, explain_exit, spawn_child
from runtime.execution.runner import CallSlot, PluginLoadError
from runtime.logs import log
from runtime.processes import WORKER_SYS_PATH, PoolSpec
from runtime.protocol.errors import WorkerFailure
from runtime import worker_frames
from runtime.worker_frames import FrameRejected
from sandbox import wire
from sandbox.isolation import cgroups

START_TIMEOUT_S = 20.0
#: Room for a frame's envelope beyond the plugin's output cap.
FRAME_OVERHEAD = 64 * 1024
#: Worker frames a reader handles at a time before it lets the rest of the daemon run (a worker that
#: keeps its socket full never makes the reader wait).
FRAMES_PER_CHECKPOINT = 256


class WorkerEvents(Protocol):
    """The pool as its workers see it: where their tasks run, and what their readers tell it."""

    name: str
    limits: wire.Limits
    closed: bool
    restarts: int
    nursery: trio.Nursery
    grant: Grant

    def result(self, worker: Any, head: CallSlot, msg: wire.Result) -> None: ...
    def returned(self, worker: Any) -> None: ...
    def relay(self, slot: CallSlot, msg: Any, size: int) -> None: ...
    def ask(self, slot: CallSlot, msg: wire.Ask, worker: Any) -> None: ...
    def fail_worker(self, worker: Any, error: WorkerFailure, requeue: bool = True,
                    head_started: bool = True) -> None: ...


class Worker(ChildProcess):
    """One worker process of a pool: its child process and the calls it was given."""

    __slots__ = ("pending", "calls", "ready", "layers", "oom_seen", "max_frame", "reader_done")

    def __init__(self, child: ChildProcess, max_frame: int) -> None:
        super().__init__(child.proc, child.raw, child.scratch, child.token)
        self.log_name = child.log_name
        self.max_frame = max_frame
        #: Calls sent to this worker and not yet answered, in the order it runs them.
        self.pending: collections.deque[CallSlot] = collections.deque()
        self.calls = 0
        self.ready: wire.Ready | None = None
        self.layers: list[str] = []
        #: OOM kills of this worker's cgroup already reported (per_call: one per killed call).
        self.oom_seen = 0
        #: Set when its reader (``read_frames``) has stopped: ``last_words`` reads the socket after it.
        self.reader_done = trio.Event()

    async def last_words(self, limit_s: float, max_bytes: int) -> bytes:
        """``ChildProcess.last_words`` once the reader has stopped (``kill`` wakes it), so that the two
        never read the socket at once and nothing the reader took is missed."""
        with trio.move_on_after(limit_s):
            await self.reader_done.wait()
        return await super().last_words(limit_s, max_bytes)


class ProcessWorkers:
    """The real process factory of a pool: sandboxed worker processes."""

    def __init__(self, spec: PoolSpec) -> None:
        self.spec = spec

    def _init_frame(self, scratch: str, env: dict[str, str]) -> wire.Init:
        m = self.spec.manifest
        return wire.Init(
            plugin_name=m.name,
            plugin_dir=self.spec.plugin_dir,
            entry=m.entry,
            sys_path=[*self.spec.extra_sys_path, *WORKER_SYS_PATH],
            env=env,
            limits=m.limits,
            permissions=self.spec.permissions(),
            policy=self.spec.policy,
            scratch_dir=scratch,
            mode=m.isolation,
            describe_only=self.spec.describe_only,
        )

    async def start(self, pool: WorkerEvents) -> tuple[Worker, wire.Ready]:
        """Start one worker (the daemon's spare interpreter if it fits, see ``runtime.spares``) and
        wait for its ``Ready``; its reader and watcher run in the pool's nursery. Raises
        ``PluginLoadError``."""
        spec = self.spec
        child, env, keeper = await spawn_child(spec, use_spare=not spec.describe_only)
        try:
            return await self._start(pool, child, env)
        finally:
            if keeper is not None:
                keeper.restock()  # the next spare starts now, not while this one was starting

    async def _start(self, pool: WorkerEvents, child: ChildProcess, env: dict[str, str]) -> tuple[Worker, wire.Ready]:
        worker = Worker(child, pool.limits.max_output_bytes + FRAME_OVERHEAD)
        nursery = pool.nursery
        nursery.start_soon(worker.watch, worker.proc.stdout, lambda: _exited(pool, worker))
        nursery.start_soon(worker.channel.serve, lambda: _broken(pool, worker))
        try:
            with trio.fail_after(START_TIMEOUT_S):
                ready = await worker.handshake(self._init_frame(worker.scratch, env), nursery, self.spec, pool.grant)
        except PluginLoadError:
            worker.kill()
            raise
        except BaseException as exc:
            if not isinstance(exc, (WorkerFailure, trio.TooSlowError, OSError)):
                # Cancelled (daemon shutting down) or our bug: never leave the process behind.
                worker.kill()
                raise
            text = exc.message if isinstance(exc, WorkerFailure) else f"no answer within {START_TIMEOUT_S:.0f} s"
            with trio.move_on_after(1.0):
                await worker.exited.wait()
            worker.kill()
            tail = worker.tail()
            if tail:
                text += "; it printed: " + tail[-1500:]
            raise PluginLoadError("start", f"worker failed to start: {text}") from None
        worker.ready = ready
        worker.layers = list(ready.layers)
        nursery.start_soon(read_frames, pool, worker)
        return worker, ready


def _broken(pool: WorkerEvents, worker: Worker) -> None:
    pool.fail_worker(worker, WorkerFailure("crashed", "the worker process exited unexpectedly"))


def _exited(pool: WorkerEvents, worker: Worker) -> None:
    if not worker.dead and not pool.closed:
        pool.restarts += 1
        log("worker_exited", level="warning", plugin=pool.name, pid=worker.pid, returncode=worker.proc.returncode)
    pool.fail_worker(worker, explain_exit(worker.proc.returncode, worker.pid, pool.limits))


def name_kill(worker: Worker, msg: wire.Result, limits: wire.Limits) -> wire.Result:
    """per_call: a call process SIGKILLed before it answered; say "out of memory" when the worker's
    cgroup counted an OOM kill since the last one we saw."""
    try:
        oom = cgroups.limit_events(worker.pid).get("oom_kill", 0)
    except Exception:  # noqa: BLE001 (reading the cgroup is best effort)
        return msg
    if oom <= worker.oom_seen:
        return msg
    worker.oom_seen = oom
    text = f"the call ran out of memory (its limit is {limits.memory_mb} MB) and was killed"
    return wire.Result(msg.id, [{"type": "text", "text": text}], is_error=True)


def _misbehaved(pool: WorkerEvents, worker: Worker, why: str) -> None:
    """A worker is ended for what it sent while no call of its was running: nobody's call carries
    the reason, so the log does (with a call running, its failure says it)."""
    if not worker.pending:
        log("worker_misbehaved", level="warning", plugin=pool.name, pid=worker.pid, reason=why[:300])


async def read_frames(pool: WorkerEvents, worker: Worker) -> None:
    """Match the worker's frames to its pending calls, in order, and tell the pool."""
    try:
        await _read_frames(pool, worker)
    finally:
        worker.reader_done.set()


async def _read_frames(pool: WorkerEvents, worker: Worker) -> None:
    decode = wire.from_worker_decoder.decode
    try:
        while True:
            if worker.dead:
                return  # what it read and did not handle stays in ``buf`` (``last_words``)
            try:
                frames = wire.split_frames(worker.buf, worker.max_frame, FRAMES_PER_CHECKPOINT) if worker.buf else []
            except ValueError:
                raise WorkerFailure("output_cap", "the tool's output exceeded its size limit") from None
            for i, raw_frame in enumerate(frames):
                try:
                    msg = decode(raw_frame)
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError, ValueError):
                    raise WorkerFailure("garbage", "the worker sent a malformed frame") from None
                pending = worker.pending
                head = pending[0] if pending else None
                kind = type(msg)
                if kind is wire.ResultReturned or kind is wire.Result:
                    # The answer goes to the client now; the worker stays busy, and the call's
                    # deadline runs, until its runtime says the call's code returned (CallReturned,
                    # or this frame being a ResultReturned): plugin code can write a Result of its
                    # own and run on (``sandbox.wire``).
                    if head is None or msg.id != head.call.id:
                        raise WorkerFailure("garbage", "the worker answered a call it was not given")
                    if head.result is not None:
                        raise WorkerFailure("garbage", "the worker answered the same call twice")
                    worker_frames.check_result(msg)
                    if msg.killed:
                        msg = name_kill(worker, msg, pool.limits)
                    pool.result(worker, head, msg)
                    if kind is wire.ResultReturned and not worker.dead and pending and pending[0] is head:
                        pool.returned(worker)
                elif kind is wire.CallReturned:
                    if head is None or msg.id != head.call.id or head.result is None:
                        raise WorkerFailure("garbage", "the worker said a call returned before answering it")
                    pool.returned(worker)
                elif (kind is wire.Progress or kind is wire.Log) and head is not None and msg.id == head.call.id \
                        and head.result is None:
                    pool.relay(head, msg, len(raw_frame))
                elif kind is wire.Ask and head is not None and msg.id == head.call.id and head.asking is None \
                        and head.result is None:
                    pool.ask(head, msg, worker)
                else:
                    raise WorkerFailure("garbage", "the worker sent an unexpected frame")
                if worker.dead:
                    # Ended while this batch was handled (a call cancelled by what an answer set off):
                    # the frames not handled go back, for ``last_words``.
                    worker.buf[0:0] = b"".join(wire.HEADER.pack(len(f)) + f for f in frames[i + 1:])
                    return
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
            _misbehaved(pool, worker, f"the worker sent a malformed frame: {exc}")
            pool.fail_worker(worker, WorkerFailure("garbage", f"the worker sent a malformed frame: {exc}"))
    except WorkerFailure as exc:
        if worker.dead:
            return
        if exc.kind == "crashed":
            with trio.move_on_after(0.5):
                await worker.exited.wait()
            exc = explain_exit(worker.proc.returncode, worker.pid, pool.limits)
        else:
            _misbehaved(pool, worker, exc.message)
        pool.fail_worker(worker, exc)
    except Exception as exc:  # our bug, triggered by what this worker sent: fail its call only
        log("internal_error", level="error", where="worker frame", plugin=pool.name,
            error=f"{type(exc).__name__}: {str(exc)[:300]}")
        if not worker.dead:
            pool.fail_worker(worker, WorkerFailure("garbage", "the daemon could not handle what the worker sent"))
