"""Running one call inside the worker: arguments converted for the tool, the tool run, its value
turned into a ``Result`` frame. Shared by the pooled worker (``sandbox.worker``) and the per-call
processes (``sandbox.zygote``). Never imports trio.
"""

from __future__ import annotations

import errno
import inspect
import resource
import time
import traceback
from typing import Any, Union

import msgspec
import msgspec.structs

from sandbox import api, asking, errors
from sandbox.wire import Call, Result, ResultReturned, encode_frame

_json = msgspec.json.Encoder()


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


#: The calling thread's own counts where the system has them (a worker's helper threads block all the time).
_RUSAGE = getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)


def run_call(tools: dict[str, api.ToolDef], call: Call, send: Any, exchange: Any = None,
             returned: bool = False) -> Result:
    """Run one call and build its result, timed (``Result.run_ns``). Never raises.
    ``exchange(call_id, requests) -> responses`` sends an ``Ask`` round for the call and blocks for its
    ``Answer`` (None: this call cannot ask). ``returned``: the runtime of a pooled worker, which sends
    it once the call's code has returned, as a ``ResultReturned`` (``sandbox.wire``)."""
    before = resource.getrusage(_RUSAGE)
    started = time.perf_counter_ns()
    content, structured, has_structured, is_error, tb, missing_capability, request_error = _run_call(
        tools, call, send, exchange)
    run_ns = time.perf_counter_ns() - started
    return (ResultReturned if returned else Result)(
        call.id, content, structured, has_structured, is_error, tb, None, False, missing_capability, request_error,
        run_ns, blocked_ns(before, run_ns))


def blocked_ns(before: resource.struct_rusage, run_ns: int) -> int:
    """Of ``run_ns`` just spent on a call, how long it was blocked: the time it was off the CPU when it
    gave the CPU up itself at least once (a sleep, I/O, a question to its client); 0 when it only ever
    lost the CPU to others (waiting for a core is not being blocked: more workers would not help)."""
    after = resource.getrusage(_RUSAGE)
    if after.ru_nvcsw == before.ru_nvcsw:
        return 0
    cpu_ns = int((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1e9)
    return max(0, run_ns - cpu_ns)


#: What ``_run_call`` found, in ``Result``'s field order: content, structured, has_structured, is_error,
#: traceback, missing_capability, request_error. A tuple: ``run_call`` builds the one ``Result`` frame of
#: the call from it, with the timing, instead of a second copy.
_Outcome = tuple[list[dict[str, Any]], Any, bool, bool, Union[str, None], Union[str, None], Union[str, None]]


def _failed(message: str, traceback_: str | None = None, missing_capability: str | None = None,
            request_error: str | None = None) -> _Outcome:
    return [{"type": "text", "text": message}], None, False, True, traceback_, missing_capability, request_error


def _run_call(tools: dict[str, api.ToolDef], call: Call, send: Any, exchange: Any) -> _Outcome:
    tdef = tools.get(call.tool)
    if tdef is None:
        return _failed(f"Unknown tool: {call.tool}")
    api._begin_call(call, send, exchange)
    try:
        if tdef.args_type is not None:
            try:
                args = msgspec.convert(call.arguments, tdef.args_type, strict=False)
            except msgspec.ValidationError as exc:
                return _failed(f"Invalid arguments: {exc}")
            kwargs = msgspec.structs.asdict(args)
        else:
            kwargs = dict(call.arguments)
            try:
                inspect.signature(tdef.fn).bind(**kwargs)
            except TypeError as exc:
                return _failed(f"Invalid arguments: {exc}")
        value = tdef.fn(**kwargs)
        if tdef.is_async:
            # Lazy: asyncio costs ~40 ms of worker start-up and only async tools need it (the worker's
            # main() imports it before serving when the plugin has one, so this is a lookup).
            import asyncio

            value = asyncio.run(value)
        if isinstance(value, api.ToolResult):
            structured = msgspec.to_builtins(value.structured) if value.has_structured else None
            return _to_content(value.content), structured, value.has_structured, value.is_error, None, None, None
        if tdef.structured:
            structured = msgspec.to_builtins(value)
            if tdef.wrap_result:
                structured = {"result": structured}
            return [{"type": "text", "text": _json.encode(structured).decode()}], structured, True, False, None, None, None
        return _to_content(value), None, False, False, None, None, None
    except errors.RequestError as exc:
        message = str(exc) or "the request is invalid"
        return _failed(message, request_error=message)
    except asking.CapabilityMissing as exc:
        return _failed(str(exc) or type(exc).__name__, missing_capability=exc.capability or None)
    except api.ToolError as exc:
        return _failed(str(exc) or type(exc).__name__)
    except Exception as exc:  # the plugin's fault: report the message, keep the traceback for the log
        message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if _out_of_processes(exc):
            message = (f"{message} (a process or thread could not be started: the tool is at its limit of "
                       "processes and threads, limits.max_processes)")
        return _failed(message, traceback.format_exc(limit=20))
    finally:
        api._end_call()


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
        # Of the same kind: a ResultReturned still says that the call's code returned.
        return encode_frame(type(result)(result.id, [{"type": "text", "text": text}], is_error=True))
