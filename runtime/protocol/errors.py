"""The one error table: every way a request or a call can fail, whose fault it is, and how each
looks on the wire. Sans-io. No other module chooses a JSON-RPC error code or an HTTP status for an
error: they raise (or return) one of these types, and ``error_response`` / ``http_status`` turn it
into bytes and a status for the era in force.

Whose fault (``Fault``):

* ``client``: the client sent something wrong (garbage, an unknown method or tool, bad params,
  headers that contradict the body, too much, too often). Its request fails; nothing else notices.
* ``plugin``: the plugin misbehaved (invalid output, garbage on its channel, a crash).
* ``limit``: a limit the plugin's manifest set fired (``LimitKind``: which one).
* ``busy``: the server is at capacity; the client may retry (``retryAfterMs``).
* ``shutdown``: the server is stopping; the request was not run.
* ``server``: our bug. Answered as -32603, logged with a traceback, never fatal to the daemon.

Plugin, limit and worker faults of a *running* call are not JSON-RPC errors: the call's result is
``isError: true`` with a sentence naming what happened (``call_failure_text``).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec

UNSET: Any = msgspec.UNSET

Fault = Literal["client", "plugin", "limit", "busy", "shutdown", "server"]

# -- JSON-RPC codes: the only place they are written -----------------------------------------------
PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
#: What 2025 SDK servers answer for an unknown HTTP session (legacy, implementation-defined band).
SESSION_NOT_FOUND = -32001
# MCP 2026-07-28
HEADER_MISMATCH = -32020
MISSING_CLIENT_CAPABILITY = -32021
UNSUPPORTED_PROTOCOL_VERSION = -32022
# Implementation-defined server errors live outside the spec's reserved -32000..-32099 band in the
# modern era; each is a transient condition the client may retry.
SERVER_BUSY = -31001
#: The server is shutting down: the request was not run (the client may retry elsewhere or later).
SHUTTING_DOWN = -31002
#: The principal or the tool is over its rate limit (``data.retryAfterMs``).
RATE_LIMITED = -31003


class McpError(Exception):
    """An error answered to the client. Subclasses fix the code, the fault and the HTTP status."""

    code: ClassVar[int] = INTERNAL_ERROR
    fault: ClassVar[Fault] = "server"
    #: HTTP status when the error is the whole answer to a POST (modern era, or a transport refusal).
    status: ClassVar[int] = 500
    #: HTTP status in the legacy era, where JSON-RPC errors of a readable request travel in a 200.
    legacy_status: ClassVar[int] = 200

    def __init__(self, message: str, data: Any = UNSET) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


# -- the client's fault ----------------------------------------------------------------------------


class ClientError(McpError):
    code = INVALID_REQUEST
    fault = "client"
    status = 400


class ParseError(ClientError):
    code = PARSE_ERROR
    legacy_status = 400


class InvalidRequest(ClientError):
    code = INVALID_REQUEST
    legacy_status = 400


class MethodNotFound(ClientError):
    code = METHOD_NOT_FOUND
    status = 404


class InvalidParams(ClientError):
    code = INVALID_PARAMS


class HeaderMismatch(ClientError):
    """2026-07-28 HTTP headers that contradict the body."""

    code = HEADER_MISMATCH


class MissingClientCapability(ClientError):
    code = MISSING_CLIENT_CAPABILITY


class UnsupportedProtocolVersion(ClientError):
    code = UNSUPPORTED_PROTOCOL_VERSION


class SessionNotFound(ClientError):
    code = SESSION_NOT_FOUND
    status = legacy_status = 404


class RateLimited(ClientError):
    """Over a rate limit; ``retry_after_s`` is when a retry will be admitted."""

    code = RATE_LIMITED
    status = legacy_status = 429

    def __init__(self, what: str, retry_after_s: float) -> None:
        super().__init__(f"Rate limit exceeded for {what}; retry in {retry_after_s:.2f} s",
                         {"retryAfterMs": max(1, int(retry_after_s * 1000 + 0.999)), "limit": what})
        self.what = what
        self.retry_after_s = retry_after_s


class HttpRefusal(ClientError):
    """A request the HTTP layer refuses before JSON-RPC is read (status only; code -32600)."""

    legacy_status = 400

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status_code = status


# -- capacity and lifecycle ------------------------------------------------------------------------


class ServerBusy(McpError):
    """No room for the request or call now (a full queue, too many in flight, streams, sessions)."""

    code = SERVER_BUSY
    fault = "busy"
    status = legacy_status = 503

    def __init__(self, message: str, retry_after_ms: int | None = 100) -> None:
        super().__init__(message, UNSET if retry_after_ms is None else {"retryAfterMs": retry_after_ms})


class ShuttingDown(McpError):
    code = SHUTTING_DOWN
    fault = "shutdown"
    status = legacy_status = 503

    def __init__(self, message: str = "Server is shutting down; the request was not run") -> None:
        super().__init__(message)


class InternalError(McpError):
    code = INTERNAL_ERROR
    fault = "server"
    status = legacy_status = 500

    def __init__(self, message: str = "Internal error") -> None:
        super().__init__(message)


class PoolBusy(ServerBusy):
    """Every worker of the plugin is busy and its wait queue is full."""

    def __init__(self, message: str) -> None:
        super().__init__(f"Server busy: {message}")


def http_status(error: McpError, modern: bool) -> int:
    """The HTTP status of a POST answered with ``error``."""
    if isinstance(error, HttpRefusal):
        return error.status_code
    return error.status if modern else error.legacy_status


def error_object(error: McpError) -> dict[str, Any]:
    """The JSON-RPC ``error`` member for ``error``, for a message built as a dict (the daemon's
    answers to a hosted server's requests); ``jsonrpc.error_reply`` encodes a whole reply."""
    obj: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.data is not UNSET:
        obj["data"] = error.data
    return obj


_BY_CODE: dict[int, type[McpError]] = {
    cls.code: cls for cls in (ParseError, InvalidRequest, MethodNotFound, InvalidParams, InternalError, HeaderMismatch,
                              MissingClientCapability, UnsupportedProtocolVersion, SessionNotFound, RateLimited,
                              ServerBusy, ShuttingDown)
}


def status_of_code(code: int, modern: bool) -> int:
    """The HTTP status for an already-encoded error reply with ``code`` (400 for an unknown one)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        return 400 if modern else 200
    return cls.status if modern else cls.legacy_status


# -- a running call's failures (answered as isError results, not JSON-RPC errors) -----------------

#: How a call can fail because of its worker (metrics and logs use these names).
FailureKind = Literal["timeout", "cpu", "memory", "processes", "output_cap", "asks", "crashed", "garbage",
                      "cancelled", "unavailable"]
#: The kinds that are a limit firing (``toolcell_limit_kills_total``).
LIMIT_KINDS: frozenset[str] = frozenset({"timeout", "cpu", "memory", "processes", "output_cap", "asks"})


def fault_of_failure(kind: FailureKind) -> Fault:
    if kind in LIMIT_KINDS:
        return "limit"
    if kind == "unavailable":
        return "busy"
    if kind == "cancelled":
        return "client"
    return "plugin"  # crashed, garbage: the plugin's process misbehaved


class WorkerFailure(Exception):
    """A call failed because of its worker; ``kind`` says how (for the client and for metrics)."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message

    @property
    def fault(self) -> Fault:
        return fault_of_failure(self.kind)


class PluginOutputError(Exception):
    """A tool's result breaks its contract (bad content, output schema, size): the plugin's fault."""

    fault: ClassVar[Fault] = "plugin"


def call_failure_text(tool: str, failure: WorkerFailure) -> str:
    """The sentence an ``isError`` result carries for a call its worker could not finish."""
    if failure.kind == "timeout":
        return f"Tool {tool} {failure.message}"
    return f"Tool {tool} failed: {failure.message}"
