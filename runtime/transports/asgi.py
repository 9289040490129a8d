"""Small ASGI helpers for the HTTP transport: request headers, bodies, JSON and SSE responses.

Everything here talks raw ASGI (``scope``/``receive``/``send``); hypercorn does the HTTP parsing.
``send`` to a client that has gone away is swallowed: the caller learns it from ``Responder.gone``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, Protocol

import trio

from runtime.protocol import jsonrpc as rpc

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON = b"application/json"
SSE = b"text/event-stream"
SSE_HEADERS: Headers = [(b"content-type", SSE), (b"cache-control", b"no-cache, no-transform"),
                        (b"x-accel-buffering", b"no")]
#: The request headers the transport reads (``RequestHeaders`` keeps these, and ``Mcp-Param-*``).
WANTED_HEADERS = frozenset({b"host", b"origin", b"authorization", b"accept", b"content-type", b"content-length",
                     b"mcp-session-id", b"mcp-protocol-version", b"mcp-method", b"mcp-name",
                     b"access-control-request-headers", b"last-event-id", b"traceparent", b"tracestate"})
PARAM_PREFIX = b"mcp-param-"
#: Of those, the ones whose value is a list by definition (RFC 9110 ``#`` rules): repeated lines
#: are one list, joined with ``,``. Every other header the transport reads (and every
#: ``Mcp-Param-*``) carries one value that a decision reads: sent twice, the request is refused
#: with 400 (RFC 9112 3.2 for Host), never "first wins" nor "joined" (``RequestHeaders.duplicate``).
LIST_HEADERS = frozenset({b"accept", b"access-control-request-headers"})


class RequestHeaders(dict[bytes, bytes]):
    """The request headers the transport looks at, by lower-case name (a dict: ``get`` is the
    dict's own); repeated ones are joined with ``,``. ``params``: the ``Mcp-Param-*`` headers by
    suffix. ``size``: the bytes the head took, for the header cap. ``duplicate``: the first header
    that must appear once and came more than once (not in ``LIST_HEADERS``), else None: the app
    refuses such a request with 400 before reading anything else.

    Built in one pass over the header lines (``raw``). toolcell's HTTP/1.1 server starts one empty
    and fills it as the parser hands it each header (``h1._Connection.on_header``), then sets ``size``."""

    __slots__ = ("duplicate", "params", "size")

    def __init__(self, raw: Sequence[tuple[bytes, bytes]] = ()) -> None:
        super().__init__()
        params: dict[bytes, bytes] = {}
        self.params = params
        self.size = 0
        self.duplicate: bytes | None = None
        for name, value in raw:
            name = name.lower()
            self.size += len(name) + len(value) + 4
            if name in WANTED_HEADERS:
                if name in self:
                    self.repeated(name)
                    self[name] = self[name] + b"," + value
                else:
                    self[name] = value
            elif name.startswith(PARAM_PREFIX):
                key = name[len(PARAM_PREFIX):]
                if key in params:
                    self.repeated(name)
                    params[key] = params[key] + b"," + value
                else:
                    params[key] = value

    def repeated(self, name: bytes) -> None:
        """``name`` (lower-case) came again: remembered unless it is a list header."""
        if self.duplicate is None and name not in LIST_HEADERS:
            self.duplicate = name


class Exchange(Protocol):
    """One request as a server hands it to an app directly (toolcell's HTTP/1.1 server does, to
    ``HttpApp.serve_exchange``): what the ASGI scope and the ``toolcell.*`` extensions carry, as
    fields, with the ASGI ``receive``/``send`` pair for bodies that stream."""

    method: str
    path: str
    headers: RequestHeaders

    async def receive(self) -> dict[str, Any]: ...

    async def send(self, message: dict[str, Any]) -> None: ...

    async def respond(self, status: int, headers: Headers, body: bytes) -> None: ...

    def respond_json(self, body: bytes) -> Awaitable[None]: ...

    def take_body(self) -> bytes | None: ...

    def authenticated(self) -> None: ...

    @property
    def source(self) -> Hashable | None:
        """The client's address as per-address limits count it (``h1.source_of``; None: a unix socket)."""


def accepts(accept: bytes | None) -> tuple[bool, bool]:
    """(JSON acceptable, SSE acceptable). Lenient: no Accept, or a wildcard, accepts both."""
    if accept is None:
        return True, True
    a = accept.lower()
    if b"*/*" in a:
        return True, True
    return (JSON in a or b"application/*" in a), (SSE in a or b"text/*" in a)


def error_body(id_bytes: bytes | None, code: int, message: str, data: Any = rpc.UNSET) -> bytes:
    return rpc.error_response(id_bytes, code, message, data)


#: A whole response with a length, sent in one call: ``respond(status, headers, body)``.
Respond = Callable[[int, Headers, bytes], Awaitable[None]]


class Responder:
    """Sends one HTTP response: a plain body, or an SSE stream of events.

    ``respond``, when the server offers it (toolcell's HTTP/1.1 server does, as the
    ``toolcell.respond`` scope extension), sends a whole response without the two ASGI messages."""

    __slots__ = ("extra", "gone", "respond", "respond_json", "send", "sse", "started", "status")

    def __init__(self, send: Send, extra: Headers, respond: Respond | None = None,
                 respond_json: Callable[[bytes], Awaitable[None]] | None = None) -> None:
        self.send = send
        self.respond = respond
        #: ``200 OK``, a JSON body and nothing else, sent in one call (toolcell's HTTP/1.1 server).
        self.respond_json = respond_json
        self.extra = extra  # CORS and session headers, added to every response
        self.started = False
        self.gone = False
        self.sse = False
        self.status = 0

    async def _send(self, message: dict[str, Any]) -> None:
        if self.gone:
            return
        try:
            await self.send(message)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError, RuntimeError):
            self.gone = True
        except Exception:  # noqa: BLE001 - hypercorn raises its own errors for a closed stream
            self.gone = True

    async def body(self, status: int, body: bytes = b"", content_type: bytes | None = JSON,
                   headers: Headers | None = None) -> None:
        if (status == 200 and content_type is JSON and body and not headers and not self.extra
                and self.respond_json is not None):
            # The common answer, with nothing of ours to add: its head is made from constants.
            self.started = True
            self.status = status
            if self.gone:
                return
            try:
                await self.respond_json(body)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                self.gone = True
            return
        h: Headers = [(b"content-length", str(len(body)).encode())]
        if content_type is not None and body:
            h.append((b"content-type", content_type))
        if headers:
            h.extend(headers)
        h.extend(self.extra)
        self.started = True
        self.status = status
        if self.respond is not None:
            if self.gone:
                return
            try:
                await self.respond(status, h, body)
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                self.gone = True
            return
        await self._send({"type": "http.response.start", "status": status, "headers": h})
        await self._send({"type": "http.response.body", "body": body})

    async def start_sse(self, status: int = 200, headers: Headers | None = None) -> None:
        h = list(SSE_HEADERS)
        if headers:
            h.extend(headers)
        h.extend(self.extra)
        self.started = True
        self.sse = True
        self.status = status
        await self._send({"type": "http.response.start", "status": status, "headers": h})

    async def events(self, messages: list[bytes]) -> None:
        """Send JSON-RPC messages as SSE ``message`` events (one write for all of them)."""
        chunk = b"".join(b"event: message\ndata: " + m + b"\n\n" for m in messages)
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def events_with_ids(self, events: list[tuple[int, bytes]]) -> None:
        """Send ``(event id, JSON-RPC message)`` pairs as SSE ``message`` events carrying ``id:``, so
        that a client that reconnects can say where it stopped (``Last-Event-ID``)."""
        chunk = b"".join(b"id: %d\nevent: message\ndata: %s\n\n" % (i, m) for i, m in events)
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def comment(self, text: bytes = b"keep-alive") -> None:
        await self._send({"type": "http.response.body", "body": b": " + text + b"\n\n", "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b""})


async def lifespan(receive: Receive, send: Send) -> None:
    """Answer an ASGI ``lifespan`` scope: nothing to set up or tear down beyond acknowledging."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body. Raises ``BodyTooLarge`` or ``ClientGone``; no deadline here."""
    first = await receive()
    if first["type"] != "http.request":
        raise ClientGone
    body: bytes = first.get("body", b"")
    if not first.get("more_body", False):
        if len(body) > limit:
            raise BodyTooLarge
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)
