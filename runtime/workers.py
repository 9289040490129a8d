"""Worker processes and per-plugin pools (the trio side; the worker itself is ``sandbox.worker``).

How this works:

* A pool keeps between ``min_workers`` and ``limits.max_concurrency`` pre-started workers of one
  plugin. A worker runs one call at a time. A call takes an idle worker, or waits in a bounded
  FIFO queue (full queue -> ``PoolBusy``); a released worker is handed straight to the oldest waiter.
* The calling task owns the worker's socket for the whole call: it writes the ``Call`` frame and
  reads frames until the matching ``Result`` (progress/log frames are passed to a callback). No
  extra task or channel sits on the hot path.
* The deadline is one cancel scope around that exchange. Expiry, client cancellation, a crash,
  garbage on the channel or an over-size frame all end the same way: the worker's whole process
  tree is killed (process group, psutil descendants, then orphans re-parented to us as subreaper),
  the worker is dropped and a replacement is started. Only that call fails.
* A watcher task per worker relays its captured stdout/stderr (capped) to the log and notices
  when it exits while idle.
"""

from __future__ import annotations

import collections
import ctypes
import os
import shutil
import signal
import socket
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import msgspec
import psutil
import trio

import sandbox
from runtime.logs import log
from runtime.manifest import Manifest
from sandbox import wire

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sandbox.__file__)))
_PYTHON = os.path.realpath(sys.executable)
_FRAME_OVERHEAD = 64 * 1024
_MAX_LOGGED_OUTPUT = 256 * 1024
START_TIMEOUT_S = 20.0


class WorkerFailure(Exception):
    """A call failed because of its worker; ``kind`` says how (for the client and for metrics)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class PoolBusy(Exception):
    """Every worker is busy and the wait queue is full."""


class PluginLoadError(Exception):
    """The plugin's first worker could not start or load the plugin."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


def _worker_sys_path() -> list[str]:
    paths = [_ROOT, os.path.dirname(os.path.dirname(os.path.abspath(msgspec.__file__)))]
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            paths.append(p)
    out: list[str] = []
    for p in paths:
        if p not in out:
            out.append(p)
    return out


WORKER_SYS_PATH = _worker_sys_path()


def become_subreaper() -> None:
    """Orphans of killed workers (double-forked grandchildren) get re-parented to us."""
    PR_SET_CHILD_SUBREAPER = 36
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def kill_tree(pid: int) -> None:
    """SIGKILL a worker, its process group and every descendant we can find."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    for sig_target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            sig_target()
        except (ProcessLookupError, PermissionError):
            pass
    for proc in descendants:
        try:
            proc.kill()
        except psutil.Error:
            pass


def sweep_orphans(live_pids: set[int]) -> int:
    """Kill and reap our children that are not live workers (escaped grandchildren)."""
    swept = 0
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return 0
    for child in children:
        if child.pid in live_pids:
            continue
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                child.kill()
            os.waitpid(child.pid, os.WNOHANG)
            swept += 1
        except (psutil.Error, ChildProcessError, OSError):
            pass
    return swept


@dataclass(frozen=True)
class PoolSpec:
    """Everything needed to start workers for one plugin (one version of it)."""

    manifest: Manifest
    plugin_dir: str
    policy: str
    state_dir: str
    min_workers: int = 1
    describe_only: bool = False

    def env(self) -> dict[str, str]:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TZ": os.environ.get("TZ", "UTC")}
        for name in self.manifest.env.allow:
            if name in os.environ:
                env[name] = os.environ[name]
        env.update(self.manifest.env.set)
        return env


class Worker:
    __slots__ = ("proc", "stream", "buf", "pid", "ready", "dead", "scratch", "max_frame", "calls", "layers",
                 "output_tail", "exited")

    def __init__(self, proc: trio.Process, stream: trio.SocketStream, scratch: str, max_frame: int) -> None:
        self.proc = proc
        self.stream = stream
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

    async def read_message(self) -> Any:
        """The next frame from the worker, decoded strictly. Raises ``WorkerFailure``."""
        while True:
            try:
                frames = wire.split_frames(self.buf, self.max_frame)
            except ValueError:
                raise WorkerFailure("output_cap", "the tool's output exceeded its size limit") from None
            if frames:
                if len(frames) > 1:
                    # Put back all but the first: they belong to later reads.
                    rest = b"".join(wire.HEADER.pack(len(f)) + f for f in frames[1:])
                    self.buf[:0] = rest
                try:
                    return wire.from_worker_decoder.decode(frames[0])
                except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError, ValueError):
                    raise WorkerFailure("garbage", "the worker sent a malformed frame") from None
            try:
                data = await self.stream.receive_some(1 << 18)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                raise WorkerFailure("crashed", "the worker process exited unexpectedly")
            self.buf += data

    async def call(self, call: wire.Call, on_event: Callable[[Any], None] | None) -> wire.Result:
        try:
            await self.stream.send_all(wire.encode_frame(call))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise WorkerFailure("crashed", "the worker process exited unexpectedly") from None
        while True:
            msg = await self.read_message()
            if isinstance(msg, wire.Result):
                if msg.id != call.id:
                    raise WorkerFailure("garbage", "the worker answered a call it was not given")
                return msg
            if isinstance(msg, (wire.Progress, wire.Log)) and msg.id == call.id:
                if on_event is not None:
                    on_event(msg)
                continue
            raise WorkerFailure("garbage", "the worker sent an unexpected frame")


class _Waiter:
    __slots__ = ("event", "worker", "error")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.worker: Worker | None = None
        self.error: BaseException | None = None


class WorkerPool:
    """Pre-started workers for one plugin version; see the module docstring for the rules."""

    def __init__(self, spec: PoolSpec, nursery: trio.Nursery, on_kill: Callable[[str], None] | None = None) -> None:
        self.spec = spec
        self.name = spec.manifest.name
        self.limits = spec.manifest.limits
        self.nursery = nursery
        self.idle: list[Worker] = []
        self.workers: set[Worker] = set()
        self.starting = 0
        self.waiters: collections.deque[_Waiter] = collections.deque()
        self.ready: wire.Ready | None = None
        self.closed = False
        self.restarts = 0
        self.limit_kills = 0
        self.start_failures = 0
        self.in_flight = 0
        self._on_kill = on_kill
        self._next_call_id = 0
        self._max_frame = self.limits.max_output_bytes + _FRAME_OVERHEAD

    # -- start-up ------------------------------------------------------------------------------

    def _init_frame(self, scratch: str) -> wire.Init:
        m = self.spec.manifest
        return wire.Init(
            plugin_name=m.name,
            plugin_dir=self.spec.plugin_dir,
            entry=m.entry,
            sys_path=WORKER_SYS_PATH,
            env=self.spec.env(),
            limits=m.limits,
            permissions=m.permissions,
            policy=self.spec.policy,
            scratch_dir=scratch,
            mode=m.isolation,
            describe_only=self.spec.describe_only,
        )

    async def start_worker(self) -> Worker:
        """Spawn one worker and wait for its ``Ready``. Raises ``PluginLoadError``."""
        os.makedirs(self.spec.state_dir, mode=0o711, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix=f"{self.name}-", dir=self.spec.state_dir)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        fd = child.fileno()
        bootstrap = (
            f"import sys;sys.path[:0]={WORKER_SYS_PATH!r};"
            f"from sandbox.worker import main;main({fd})"
        )
        try:
            proc = await trio.lowlevel.open_process(
                [_PYTHON, "-I", "-S", "-B", "-c", bootstrap],
                stdin=open(os.devnull, "rb"),
                stdout=__import__("subprocess").PIPE,
                stderr=__import__("subprocess").STDOUT,
                pass_fds=(fd,),
                start_new_session=True,
                env=self.spec.env(),
                cwd=scratch,
            )
        except OSError as exc:
            parent.close()
            shutil.rmtree(scratch, ignore_errors=True)
            raise PluginLoadError("spawn", f"could not start a worker: {exc}") from None
        finally:
            child.close()
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(parent))
        worker = Worker(proc, stream, scratch, self._max_frame)
        self.nursery.start_soon(self._watch, worker)
        try:
            await stream.send_all(wire.encode_frame(self._init_frame(scratch)))
            with trio.fail_after(START_TIMEOUT_S):
                msg = await worker.read_message()
        except (WorkerFailure, trio.TooSlowError, trio.BrokenResourceError, OSError) as exc:
            text = exc.message if isinstance(exc, WorkerFailure) else f"no answer within {START_TIMEOUT_S:.0f} s"
            with trio.move_on_after(1.0):
                await worker.exited.wait()
            self._discard(worker, kill=True)
            tail = worker.output_tail.decode("utf-8", "replace").strip()
            if tail:
                text += "; it printed: " + tail[-1500:]
            raise PluginLoadError("start", f"worker failed to start: {text}") from None
        if isinstance(msg, wire.LoadFailed):
            self._discard(worker, kill=True)
            raise PluginLoadError(msg.stage, msg.error)
        if not isinstance(msg, wire.Ready):
            self._discard(worker, kill=True)
            raise PluginLoadError("start", "worker sent something other than Ready")
        problem = self._check_layers(msg)
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
        return worker

    def _check_layers(self, ready: wire.Ready) -> str | None:
        from runtime.policy import check_layers

        return check_layers(self.spec.policy, ready.layers, ready.missing, self.name)

    async def start(self) -> wire.Ready:
        """Start the first worker (which reports the tools) and the rest of ``min_workers``."""
        first = await self.start_worker()
        self._release(first)
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
                # Nothing will ever serve the waiters: fail them now rather than let them hang.
                while self.waiters:
                    waiter = self.waiters.popleft()
                    waiter.error = exc
                    waiter.event.set()
            await trio.sleep(min(5.0, 0.1 * 2 ** min(self.start_failures, 6)))
            return
        self.starting -= 1
        self.start_failures = 0
        if self.closed:
            self._discard(worker, kill=True)
            return
        self._release(worker)

    # -- the call path -------------------------------------------------------------------------

    async def acquire(self) -> Worker:
        if self.idle:
            return self.idle.pop()
        if self.closed:
            raise WorkerFailure("unavailable", f"plugin {self.name} is shutting down")
        if len(self.waiters) >= self.limits.max_queue:
            raise PoolBusy(f"plugin {self.name} is busy ({self.limits.max_queue} calls waiting); retry later")
        if len(self.workers) + self.starting < self.limits.max_concurrency:
            self._spawn_background()
        waiter = _Waiter()
        self.waiters.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:
            if waiter.worker is not None:
                self._release(waiter.worker)
            else:
                try:
                    self.waiters.remove(waiter)
                except ValueError:
                    pass
            raise
        if waiter.error is not None:
            raise WorkerFailure("unavailable", f"plugin {self.name} has no working worker: {waiter.error}")
        assert waiter.worker is not None
        return waiter.worker

    def _release(self, worker: Worker) -> None:
        if worker.dead or self.closed:
            self._discard(worker, kill=True)
            return
        while self.waiters:
            waiter = self.waiters.popleft()
            if waiter.event.is_set():
                continue
            waiter.worker = worker
            waiter.event.set()
            return
        self.idle.append(worker)

    async def run(self, tool: str, arguments: dict[str, Any], progress: bool, log_level: int,
                  on_event: Callable[[Any], None] | None) -> wire.Result:
        """Run one call on a worker. Raises ``PoolBusy`` or ``WorkerFailure``; honours cancellation."""
        worker = await self.acquire()
        self._next_call_id += 1
        call = wire.Call(self._next_call_id, tool, arguments, progress, log_level)
        self.in_flight += 1
        ok = False
        try:
            with trio.move_on_after(self.limits.timeout_s) as scope:
                result = await worker.call(call, on_event)
                ok = True
                worker.calls += 1
                return result
            self.limit_kills += 1
            raise WorkerFailure("timeout", f"timed out after {_fmt_s(self.limits.timeout_s)}")
        except WorkerFailure as exc:
            if exc.kind == "output_cap":
                self.limit_kills += 1
            raise
        finally:
            self.in_flight -= 1
            if ok:
                self._release(worker)
            else:
                # Timed out, cancelled by the client, crashed or misbehaved: the worker may be
                # mid-call, so it can never be reused.
                self._discard(worker, kill=True)
                if not self.closed:
                    self._spawn_background()

    # -- teardown ------------------------------------------------------------------------------

    def _discard(self, worker: Worker, kill: bool) -> None:
        first = not worker.dead
        worker.dead = True
        self.workers.discard(worker)
        if worker in self.idle:
            self.idle.remove(worker)
        if kill:
            kill_tree(worker.pid)
            if self._on_kill is not None and first:
                self._on_kill(self.name)
        try:
            worker.stream.socket.close()
        except OSError:
            pass

    async def _watch(self, worker: Worker) -> None:
        """Relay the worker's output to the log (capped) and clean up once it exits."""
        logged = 0
        stdout = worker.proc.stdout
        try:
            if stdout is not None:
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
            with trio.CancelScope(shield=True):
                await worker.proc.wait()
            worker.exited.set()
        finally:
            worker.exited.set()
            with trio.CancelScope(shield=True):
                if stdout is not None:
                    await stdout.aclose()
            was_dead = worker.dead
            self._discard(worker, kill=True)
            sweep_orphans({w.pid for w in self.workers})
            shutil.rmtree(worker.scratch, ignore_errors=True)
            if not was_dead and not self.closed:
                self.restarts += 1
                log("worker_exited", plugin=self.name, pid=worker.pid, returncode=worker.proc.returncode)
                if len(self.workers) + self.starting < max(1, self.spec.min_workers):
                    self._spawn_background()

    async def aclose(self, grace_s: float = 2.0) -> None:
        """Stop accepting calls, let in-flight ones finish for up to ``grace_s``, then kill all."""
        self.closed = True
        while self.waiters:
            waiter = self.waiters.popleft()
            waiter.error = WorkerFailure("unavailable", f"plugin {self.name} was unloaded")
            waiter.event.set()
        with trio.move_on_after(grace_s):
            while self.in_flight:
                await trio.sleep(0.01)
        for worker in list(self.workers):
            self._discard(worker, kill=True)
        self.idle.clear()


def _fmt_s(seconds: float) -> str:
    return f"{seconds:g} s"
