"""The per-call zygote: one fresh forked process per call, so no state survives between calls.

``serve(chan, tools, init)`` runs in the worker after the plugin is imported and ``Ready`` was sent
(``init.mode == "per_call"``). The zygote is single-threaded and holds no secrets; it already runs
under every isolation layer, and so does each child it forks.

How a call runs:

1. The zygote reads one ``Call`` frame from the daemon channel, makes a private socketpair and forks.
2. The child closes the daemon channel (it never writes to it), enters a nested Landlock domain
   that is scoped (it cannot signal, ptrace or reach abstract sockets of the zygote's domain; ABI
   >= 6), runs the call with ``sandbox.worker.run_call`` and writes its ``Progress``/``Log``/
   ``Result`` frames to its end of the pair, then ``_exit``s.
3. The zygote relays only complete, well-formed frames carrying the call's id to the daemon, and
   stops at the first ``Result``. A child that dies without a result (crash, OOM kill, ``_exit``)
   gets an error ``Result`` from the zygote. A half-written frame of a dying child never reaches the
   daemon channel, so the stream stays in sync.
4. After each call the zygote (pid 1 of the worker's pid namespace) SIGKILLs every other process in
   the namespace (``kill(-1)``), so a call's background processes do not outlive it, and reaps them.

The zygote never reads the daemon channel while a child runs: one call at a time. Signals from a
child to pid 1 are dropped by the kernel unless pid 1 handles them, so the zygote handles none;
it is not dumpable, so a child cannot open ``/proc/1/mem``.
"""

from __future__ import annotations

import gc
import os
import select
import signal
import socket
from typing import Any

from sandbox import api
from sandbox.wire import (
    HEADER,
    MAX_FRAME_BYTES,
    Call,
    Init,
    Result,
    Shutdown,
    encode_frame,
    from_worker_decoder,
    split_frames,
    to_worker_decoder,
)


def _child(chan: Any, tools: dict[str, api.ToolDef], call: Call, out: socket.socket) -> None:
    """Run one call in the forked child. Never returns."""
    code = 0
    try:
        chan.sock.close()
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from sandbox.isolation import landlock

        try:
            landlock.apply_scope_only()
        except OSError:
            pass
        from sandbox.worker import encode_result, run_call

        def send(msg: Any) -> None:
            out.sendall(encode_frame(msg))

        result = run_call(tools, call, send)
        out.sendall(encode_result(result))
    except BaseException:  # noqa: BLE001 (the zygote answers for a child that fails)
        code = 1
    finally:
        os._exit(code)


def _describe(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _relay(chan: Any, call: Call, pid: int, inp: socket.socket) -> None:
    """Forward the child's frames for ``call`` until its Result; answer for it if it dies without one."""
    buf = bytearray()
    done = False
    status: int | None = None
    pidfd = os.pidfd_open(pid)
    inp.setblocking(False)
    try:
        while not done and status is None:
            readable, _, _ = select.select([inp.fileno(), pidfd], [], [])
            if pidfd in readable:
                _, status = os.waitpid(pid, 0)
                _kill_others()  # nothing else may write to the pair while we drain it
            drained = 0
            while drained <= MAX_FRAME_BYTES:  # what is there (all of it once the child is gone)
                try:
                    chunk = inp.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    break
                if not chunk:
                    break
                buf += chunk
                drained += len(chunk)
            try:
                frames = split_frames(buf, MAX_FRAME_BYTES)
            except ValueError:
                os.kill(pid, signal.SIGKILL)
                frames, buf = [], bytearray()
            for raw in frames:
                try:
                    msg = from_worker_decoder.decode(raw)
                except Exception:  # noqa: BLE001, S112 (malformed, never forwarded; msgspec raises several types)
                    continue
                if getattr(msg, "id", None) != call.id:
                    continue
                chan.sock.sendall(HEADER.pack(len(raw)) + raw)  # forwarded as checked, not re-encoded
                if isinstance(msg, Result):
                    done = True
                    break
    finally:
        os.close(pidfd)
        inp.close()
    if not done:
        if status is None:
            _, status = os.waitpid(pid, 0)
        text = f"tool process ended without a result ({_describe(status)})"
        chan.send(Result(call.id, [{"type": "text", "text": text}], is_error=True))
    elif status is None:
        # It has answered: kill it now and let it be torn down while the next call starts (reaped later).
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _kill_others() -> None:
    """SIGKILL every process of the namespace but us (only as pid 1: kill(-1) then stays inside it)."""
    if os.getpid() == 1:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass


def _reap() -> None:
    """Reap every child that has exited, without blocking (SIGKILLed ones finish dying in parallel)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_one(chan: Any, tools: dict[str, api.ToolDef], call: Call) -> None:
    parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pid = os.fork()
    if pid == 0:
        parent_end.close()
        _child(chan, tools, call, child_end)
    child_end.close()
    _relay(chan, call, pid, parent_end)
    # Whatever the call left behind (background processes, double forks) dies before the next one.
    # SIGKILL never lets a process run again, so the next call may start while they are torn down.
    _kill_others()
    _reap()


def serve(chan: Any, tools: dict[str, api.ToolDef], init: Init) -> None:
    """Serve ``Call`` frames one at a time, each in a fresh child, until Shutdown or EOF."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    try:
        from sandbox.isolation import syscalls

        syscalls.prctl(syscalls.PR_SET_DUMPABLE, 0)
    except OSError:
        pass
    # Objects the zygote already has are never collected in the children: without this, a child's
    # first GC pass would touch (and so copy) every page of the zygote's heap.
    gc.collect()
    gc.freeze()
    while True:
        try:
            frames = chan.recv_frames()
        except EOFError:
            return
        for raw in frames:
            msg = to_worker_decoder.decode(raw)
            if isinstance(msg, Shutdown):
                return
            if isinstance(msg, Call):
                run_one(chan, tools, msg)
