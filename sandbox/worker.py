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
import errno
import importlib
import inspect
import os
import socket
import sys
import time
import traceback
from typing import Any

import msgspec

from sandbox import api
from sandbox.call_guard import LEFTOVER_EXIT, CallGuard
from sandbox.wire import (
    Call,
    CancelCall,
    Init,
    LoadFailed,
    Ready,
    Result,
    Shutdown,
    ToolSpec,
    encode_frame,
    split_frames,
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

    def poll_frames(self) -> list[bytes]:
        """Whatever complete frames are available now, without blocking."""
        try:
            chunk = self.sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return split_frames(self.buf)
        if not chunk:
            raise EOFError
        self.buf += chunk
        return split_frames(self.buf)

    def recv_frames(self) -> list[bytes]:
        while True:
            frames = split_frames(self.buf)
            if frames:
                return frames
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


_CONTENT_TYPES = frozenset({"text", "image", "audio", "resource_link", "resource"})


def _is_content(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") in _CONTENT_TYPES


def _to_content(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if _is_content(value):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) or _is_content(v) for v in value):
        return [v if isinstance(v, dict) else {"type": "text", "text": v} for v in value]
    return [{"type": "text", "text": _json.encode(value).decode()}]


def run_call(tools: dict[str, api.ToolDef], call: Call, send: Any) -> Result:
    """Run one call and build its result. Never raises."""
    tdef = tools.get(call.tool)
    if tdef is None:
        return Result(call.id, [{"type": "text", "text": f"Unknown tool: {call.tool}"}], is_error=True)
    api._set_current(api.CallContext(call.id, send, call.progress, call.log_level))
    try:
        if tdef.args_type is not None:
            try:
                args = msgspec.convert(call.arguments, tdef.args_type, strict=False)
            except msgspec.ValidationError as exc:
                return Result(call.id, [{"type": "text", "text": f"Invalid arguments: {exc}"}], is_error=True)
            kwargs = {f: getattr(args, f) for f in args.__struct_fields__}
        else:
            kwargs = dict(call.arguments)
            try:
                inspect.signature(tdef.fn).bind(**kwargs)
            except TypeError as exc:
                return Result(call.id, [{"type": "text", "text": f"Invalid arguments: {exc}"}], is_error=True)
        value = tdef.fn(**kwargs)
        if tdef.is_async:
            import asyncio  # imported by main() when the plugin has an async tool

            value = asyncio.run(value)
        if isinstance(value, api.ToolResult):
            structured = msgspec.to_builtins(value.structured) if value.has_structured else None
            return Result(call.id, _to_content(value.content), structured, value.has_structured, value.is_error)
        if tdef.structured:
            structured = msgspec.to_builtins(value)
            if tdef.wrap_result:
                structured = {"result": structured}
            return Result(call.id, [{"type": "text", "text": _json.encode(structured).decode()}], structured, True)
        return Result(call.id, _to_content(value))
    except api.ToolError as exc:
        return Result(call.id, [{"type": "text", "text": str(exc) or type(exc).__name__}], is_error=True)
    except Exception as exc:  # the plugin's fault: report the message, keep the traceback for the log
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if _out_of_processes(exc):
            message = (f"{message} (a process or thread could not be started: the tool is at its limit of "
                       "processes and threads, limits.max_processes)")
        return Result(
            call.id, [{"type": "text", "text": message}], is_error=True, traceback=traceback.format_exc(limit=20)
        )
    finally:
        api._set_current(None)


def _out_of_processes(exc: BaseException) -> bool:
    """A thread start or (most likely) a fork refused at the worker's process limit (pids.max, NPROC)."""
    if isinstance(exc, RuntimeError) and "can't start new thread" in str(exc):
        return True
    return type(exc) is BlockingIOError and exc.errno == errno.EAGAIN and exc.filename is None


def encode_result(result: Result) -> bytes:
    """Encode a Result frame; one msgpack cannot carry (an integer beyond 64 bits, ...) becomes an error."""
    try:
        return encode_frame(result)
    except (OverflowError, TypeError, ValueError) as exc:
        text = f"The tool's result could not be encoded: {type(exc).__name__}: {exc}"
        return encode_frame(Result(result.id, [{"type": "text", "text": text}], is_error=True))


#: Results of a batch are held back at most this long, so a slow call still answers promptly.
FLUSH_AFTER_S = 0.002


def serve(chan: Channel, tools: dict[str, api.ToolDef], cpu_s: int = 0) -> None:
    """Run calls in arrival order. Frames that arrive while a batch runs are absorbed between
    calls (without blocking), so a ``CancelCall`` for a call not yet started is honoured.

    ``cpu_s``: each call's CPU budget; a call that leaves a thread or a process running ends this
    worker after its result is sent (``sandbox.call_guard``)."""
    guard = CallGuard(cpu_s) if cpu_s else None
    queue: collections.deque[Call] = collections.deque()
    cancelled: set[int] = set()
    out: list[bytes] = []
    first_unsent = 0.0

    def flush() -> None:
        if out:
            chan.sock.sendall(b"".join(out))
            out.clear()

    def absorb(frames: list[bytes]) -> bool:
        for raw in frames:
            msg = to_worker_decoder.decode(raw)
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

    while True:
        if not queue:
            flush()
            try:
                frames = chan.recv_frames()
            except EOFError:
                return
            if not absorb(frames):
                return
            continue
        try:
            more = chan.poll_frames()
        except EOFError:
            return
        if not absorb(more):
            flush()
            return
        if not queue:
            continue
        call = queue.popleft()
        if not out:
            first_unsent = time.monotonic()
        if call.id in cancelled:
            cancelled.discard(call.id)
            out.append(encode_frame(Result(call.id, [{"type": "text", "text": "cancelled"}], is_error=True)))
        elif guard is None:
            out.append(encode_result(run_call(tools, call, send)))
        else:
            guard.before()
            result = run_call(tools, call, send)
            left = guard.after()
            if left is not None:
                # The daemon sends this worker nothing more and requeues what it had sent after this call.
                reason = f"call {call.tool!r} left {left} running"
                out.append(encode_result(msgspec.structs.replace(result, retire=reason)))
                flush()
                os.write(2, f"toolcell worker: {reason}; this worker retires and a fresh one takes its place\n".encode())
                os._exit(LEFTOVER_EXIT)
            out.append(encode_result(result))
        if not queue or time.monotonic() - first_unsent > FLUSH_AFTER_S:
            flush()


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
            from sandbox import isolation
        except Exception:  # noqa: BLE001, S110 (imported again below, where a failure is reported)
            pass
    chan = Channel(fd)
    init = to_worker_decoder.decode(chan.recv_frames()[0])
    if not isinstance(init, Init):
        raise SystemExit("toolcell worker: first frame was not Init")
    if spare:
        _adopt_env(init.env)
    sys.path[:0] = [p for p in init.sys_path if p not in sys.path]
    try:
        from sandbox import isolation

        layers, missing = isolation.apply(init)
    except Exception as exc:
        chan.send(LoadFailed(f"isolation failed: {type(exc).__name__}: {exc}", stage="isolation"))
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
        from sandbox import zygote

        zygote.serve(chan, tools, init)
    else:
        serve(chan, tools, init.limits.cpu_s)


if __name__ == "__main__":
    main()
