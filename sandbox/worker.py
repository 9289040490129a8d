"""The worker process: isolate itself, import one plugin, then serve calls over the IPC fd.

Started by the daemon as ``python -I -S -c <bootstrap>`` with the IPC socket on fd 3. The order
matters and is the point of this module:

1. read the ``Init`` frame (configuration never travels in argv or the environment);
2. apply the isolation layers the policy asks for (``sandbox.isolation``) -- before any plugin
   code is imported, so the plugin never runs un-isolated;
3. import the plugin's entry module, collect its ``@tool`` definitions, report ``Ready`` with
   the layers actually applied (the daemon compares them with the policy);
4. serve ``Call`` frames one at a time, in this single thread.

Never imports trio.
"""

from __future__ import annotations

import collections
import importlib
import os
import socket
import sys
import time
import traceback
from typing import Any

import msgspec

from sandbox import api
from sandbox.call_guard import LEFTOVER_EXIT, CallGuard
from sandbox.calls import encode_result, run_call
from sandbox.wire import (
    Answer,
    Ask,
    Call,
    CancelCall,
    Init,
    LoadFailed,
    Ready,
    Result,
    ResultReturned,
    Shutdown,
    ToolSpec,
    decode_frames,
    encode_frame,
    to_worker_decoder,
)

IPC_FD = 3
_json = msgspec.json.Encoder()


class Channel:
    """Blocking frame I/O over the IPC socket."""

    def __init__(self, fd: int) -> None:
        self.sock = socket.socket(fileno=fd)
        self.buf = bytearray()
        self.pending: list[bytes] = []

    def send(self, msg: Any) -> None:
        self.sock.sendall(encode_frame(msg))

    def poll_messages(self) -> list[Any]:
        """Whatever complete frames are available now, decoded, without blocking."""
        try:
            chunk = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return decode_frames(self.buf, to_worker_decoder)
        if not chunk:
            raise EOFError
        self.buf += chunk
        return decode_frames(self.buf, to_worker_decoder)

    def recv_messages(self) -> list[Any]:
        """The next complete frames, decoded; blocks until there is one."""
        while True:
            messages = decode_frames(self.buf, to_worker_decoder)
            if messages:
                return messages
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise EOFError
            self.buf += chunk


def _tool_specs(tools: list[api.ToolDef]) -> list[ToolSpec]:
    return [
        ToolSpec(
            name=t.name,
            description=t.description,
            input_schema=t.input_schema,
            output_schema=t.output_schema,
            title=t.title,
            annotations=t.annotations,
            icons=t.icons,
            meta=t.meta,
            task_support=t.task_support,
            task_after_ms=t.task_after_ms,
        )
        for t in tools
    ]


def load_plugin(init: Init) -> list[api.ToolDef]:
    """Import the plugin's entry module from its folder and return the tools it registered."""
    if init.plugin_dir not in sys.path:
        sys.path.insert(0, init.plugin_dir)
    api.TOOLS.clear()
    importlib.import_module(init.entry)
    return list(api.TOOLS)


#: Between the calls of a batch, the socket is polled (for a ``CancelCall`` of a queued call, more
#: calls, ``Shutdown``) once this long has passed since it was last read: a poll between every two
#: quick calls nearly always finds nothing (a failed ``recv`` and an exception each). A cancel that
#: arrives meanwhile is honoured from the next poll on; the call already started is never withdrawn
#: this way (the daemon stops the worker for that).
POLL_EVERY_S = 0.0005


def serve(chan: Channel, tools: dict[str, api.ToolDef], cpu_s: int = 0) -> None:
    """Run calls in arrival order. Frames that arrive while a batch runs are absorbed between
    calls (without blocking), so a ``CancelCall`` for a call not yet started is honoured.

    ``cpu_s``: each call's CPU budget; a call that leaves a thread or a process running ends this
    worker after its result is sent (``sandbox.call_guard``)."""
    guard = CallGuard(cpu_s) if cpu_s else None
    queue: collections.deque[Call] = collections.deque()
    cancelled: set[int] = set()
    out: list[bytes] = []

    def flush() -> None:
        if out:
            chan.sock.sendall(b"".join(out))
            out.clear()

    def absorb(messages: list[Any]) -> bool:
        for msg in messages:
            if isinstance(msg, Call):
                queue.append(msg)
            elif isinstance(msg, CancelCall):
                # Answered in its turn, not now: the daemon matches results to calls in order.
                if any(queued.id == msg.id for queued in queue):
                    cancelled.add(msg.id)
            elif isinstance(msg, Shutdown):
                return False
        return True

    def send(m: Any) -> None:
        # Progress/log frames must follow the results already produced: flush those first.
        flush()
        chan.send(m)

    def exchange(call_id: int, requests: list[Any]) -> list[Any]:
        """Ask the daemon for the call ``call_id``, block until its ``Answer``; frames that arrive
        meanwhile (more calls, cancels of queued ones) are absorbed as usual. One function for every
        call: each call's context passes its own id (``api.CallContext``)."""
        flush()
        chan.send(Ask(call_id, requests))
        while True:
            try:
                messages = chan.recv_messages()
            except EOFError:
                os._exit(0)  # the daemon is gone: nobody is waiting for this call
            for i, msg in enumerate(messages):
                if isinstance(msg, Answer) and msg.id == call_id:
                    if not absorb(messages[i + 1:]):
                        os._exit(0)
                    return list(msg.responses)
                if not isinstance(msg, Answer) and not absorb([msg]):
                    os._exit(0)  # Shutdown while a call waits: the daemon stops this worker

    read_at = 0.0  # when the socket was last read to its end
    while True:
        if not queue:
            flush()
            try:
                messages = chan.recv_messages()
            except EOFError:
                return
            if not absorb(messages):
                return
            read_at = time.monotonic()
            continue
        if time.monotonic() - read_at >= POLL_EVERY_S:
            try:
                more = chan.poll_messages()
            except EOFError:
                return
            read_at = time.monotonic()
            if not absorb(more):
                flush()
                return
            if not queue:
                continue
        call = queue.popleft()
        # Each answer below is a ResultReturned (a Result and its CallReturned in one frame), written
        # only here, after the call's code returned (and the guard found nothing left): the daemon
        # keeps this worker busy, with the call's deadline running, until it reads one.
        if call.id in cancelled:
            cancelled.discard(call.id)
            out.append(encode_frame(ResultReturned(call.id, [{"type": "text", "text": "cancelled"}], is_error=True)))
            continue  # nothing ran: it may share the next write
        # Every earlier answer leaves before this call starts: the daemon must always know which call
        # runs (its deadline is the one running; if the worker dies or times out, that call fails and
        # only the calls after it, which cannot have started, run elsewhere). Held back while a slow
        # call ran, an answer made the daemon blame the wrong call and run the slow one again.
        if out:
            flush()
        if guard is None:
            out.append(encode_result(run_call(tools, call, send, exchange, returned=True)))
        else:
            guard.before()
            result = run_call(tools, call, send, exchange, returned=True)
            left = guard.after()
            if left is not None:
                # The daemon sends this worker nothing more and requeues what it had sent after this
                # call. A plain Result: something of the call still runs.
                reason = f"call {call.tool!r} left {left} running"
                out.append(encode_result(Result(
                    result.id, result.content, result.structured, result.has_structured, result.is_error,
                    result.traceback, reason, result.killed, result.missing_capability, result.request_error,
                    result.run_ns, result.blocked_ns)))
                flush()
                os.write(2, f"toolcell worker: {reason}; this worker retires and a fresh one takes its place\n".encode())
                os._exit(LEFTOVER_EXIT)
            out.append(encode_result(result))


def _adopt_env(env: dict[str, str]) -> None:
    """Take the plugin's environment from ``Init`` (a spare was started with a generic one)."""
    if dict(os.environ) == env:
        return
    os.environ.clear()
    os.environ.update(env)
    time.tzset()


def main(fd: int = IPC_FD, spare: bool = False) -> None:
    """Run a worker. ``spare``: started before its plugin was known (``runtime.spares``): import
    what every worker needs while waiting, and adopt the environment ``Init`` carries."""
    if spare:
        try:
            # Lazy: a spare loads isolation (~30 ms) while it waits for Init; a failure is reported below.
            from sandbox import isolation
        except Exception:  # noqa: BLE001, S110 (imported again below, where a failure is reported)
            pass
    chan = Channel(fd)
    init = chan.recv_messages()[0]
    if not isinstance(init, Init):
        raise SystemExit("toolcell worker: first frame was not Init")
    if spare:
        _adopt_env(init.env)
    sys.path[:0] = [p for p in init.sys_path if p not in sys.path]
    try:
        # Imported here, not at the top: a failing import reaches the daemon as LoadFailed (stage isolation).
        from sandbox import isolation

        layers, missing = isolation.apply(init)
    except Exception as exc:
        chan.send(LoadFailed(f"isolation failed: {type(exc).__name__}: {exc}", stage="isolation"))
        return
    if init.command:
        # Lazy: only a worker that hosts an MCP server (init.command) uses it (~1 ms the others skip).
        from sandbox import hosted

        hosted.run(chan, init, layers, missing)
        return
    try:  # a plugin's print() reaches the daemon log line by line (stdout is a pipe to the daemon)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    except (AttributeError, ValueError):
        pass
    try:
        defs = load_plugin(init)
    except BaseException as exc:  # SystemExit from a plugin's import is a load failure too
        chan.send(LoadFailed("".join(traceback.format_exception_only(type(exc), exc)).strip(), stage="import"))
        return
    if any(t.is_async for t in defs):
        # Only then: asyncio costs ~30 ms of every worker start. Imported here, before the
        # per-call zygote forks, so that its children do not each import it again.
        import asyncio  # noqa: F401
    chan.send(Ready(os.getpid(), _tool_specs(defs), layers=layers, missing=missing))
    if init.describe_only:
        return
    tools = {t.name: t for t in defs}
    if init.mode == "per_call":
        # Lazy: only per_call workers fork a zygote; pooled workers skip its ~20 ms of imports.
        from sandbox import zygote

        zygote.serve(chan, tools, init)
    else:
        serve(chan, tools, init.limits.cpu_s)


if __name__ == "__main__":
    main()
