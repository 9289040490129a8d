"""A lean HTTP/1.1 server on trio for toolcell's ASGI app: llhttp parses, trio does the I/O.

Why not hypercorn on the hot path: measured on these 2-core machines, hypercorn spends about
350 µs of CPU per request before the application runs (a task, a stream object, an idle-timer
task restart and three socket writes per response), which alone is more than the official SDK's
whole stack takes per call. This server keeps the same ASGI contract (``HttpApp`` runs unchanged
on either) and spends ~30 µs: one connection task, requests handled inline in it, responses
written with one ``send`` each. Parsing is never ours: **httptools** (the llhttp parser that
Node.js uses, and uvicorn's default) parses request lines, headers, chunked bodies, pipelining and
keep-alive rules; this module only frames responses it builds from the app's own values.
``[http] engine = "hypercorn"`` selects hypercorn instead (HTTP/2, h2c).

What it enforces, from ``HttpConfig``:

* ``idle_timeout_s``: a keep-alive connection idle this long is closed; a client that has begun a
  request gets the same time to finish its head (slow-loris), else 408 and close.
* ``max_header_bytes``: request line plus headers (and at most 256 header lines), else 431.
* ``max_connections``: connections beyond it get 503 and are closed at once.
* The unauthenticated budget, for an app that vouches for connections (``vouches_for_connections``;
  ``HttpApp`` does, calling the ``authenticated`` of the exchange once a request passed
  authentication): until then a connection is *unauthenticated*. At most
  ``unauthenticated_budget`` of them are open (``max_unauthenticated_per_address`` per client
  address, an IPv6 /64), each gets ``head_timeout_s`` to send a whole request head, and a new
  connection over a budget evicts the oldest unauthenticated one that has no request in the app
  (its own address's oldest first). So however many connections a client with no token opens or
  holds half-open, a token holder's new connection gets in, and its authenticated ones are never
  touched: the attacker only ever competes with itself.
* Out of file descriptors on accept (EMFILE/ENFILE): the oldest unauthenticated connection is
  evicted to make room, else accepting backs off; logged at most once per ``_ACCEPT_LOG_S``.
* ``write_timeout_s``: via ``TCP_USER_TIMEOUT`` set on the listening socket (inherited).
* Body size and body time are enforced by the app, which reads the body through ``receive``.
* Malformed requests get 400 and the connection is closed; nothing reaches the app.
* Graceful stop: listeners close, idle connections close, requests in flight get
  ``shutdown_grace_s`` to finish (responses then carry ``Connection: close``), the rest is cut.
"""

from __future__ import annotations

import email.utils
import errno
import select
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote

import httptools
import trio

from runtime.clock import clock_reader
from runtime.http_config import HttpConfig
from runtime.logs import log
from runtime.transports.asgi import PARAM_PREFIX, WANTED_HEADERS, RequestHeaders

App = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[[dict[str, Any]], Awaitable[None]]],
               Awaitable[None]]

READ_SIZE = 64 * 1024
MAX_HEADER_LINES = 256
#: Pipelined requests parsed ahead of the one being answered before reading stops.
MAX_PIPELINED = 16
#: Requests one connection may have parsed and not yet answered. Reading stops at
#: ``MAX_PIPELINED``, but one read (``READ_SIZE``) of tiny requests holds thousands: past this many
#: the rest of that read is refused (503 after the ones already parsed, then close) instead of
#: becoming thousands of request objects.
MAX_PARSED = 64
#: Request body bytes one connection buffers ahead of the app (across every request parsed and not
#: yet handed over) before reading stops; it may pass this by at most one read (``READ_SIZE``).
MAX_BUFFERED_BODY = 1024 * 1024
#: With reading ahead stopped and no epoll: how often to look whether the client has gone.
_GONE_POLL_S = 0.5
#: Accept failures (out of descriptors, memory) are logged at most this often, with a count.
_ACCEPT_LOG_S = 10.0
#: accept() errors that say "no room for another connection now" (not "this listener is broken").
_NO_ROOM = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_NO_BODY_STATUS = frozenset({204, 304})
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
#: Each known status's line, made once (a response's head starts with one).
_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in _REASONS.items()}
#: The start of a ``respond_json`` head, up to its content-length value.
_JSON_200_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
#: Response headers the server itself frames (the app's are dropped or acted on, never copied).
_FRAMING = frozenset({b"content-length", b"connection", b"transfer-encoding"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_DISCONNECT = {"type": "http.disconnect"}

#: Method names as the app reads them (``str``), for the methods llhttp knows best.
_METHOD_NAMES = {m.encode(): m for m in ("GET", "POST", "DELETE", "OPTIONS", "HEAD", "PUT", "PATCH")}
#: Origin-form request targets with nothing to decode (no query, escape or fragment) and their path.
_PLAIN_PATHS: dict[bytes, str] = {}
_ASGI = {"version": "3.0", "spec_version": "2.3"}


class _Date:
    """The ``Date`` header value, formatted at most once a second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        s = int(time.time())
        if s != cls.second:
            cls.second = s
            cls.value = email.utils.formatdate(s, usegmt=True).encode()
        return cls.value


def source_of(family: int, addr: Any) -> str | bytes | None:
    """The client address a per-address cap counts by: an IPv4 address, an IPv6 /64 (one
    subscriber's usual allocation: per address would be no cap at all), or None (a unix socket)."""
    if family == socket.AF_INET:
        return str(addr[0])
    if family == socket.AF_INET6:
        host = str(addr[0])
        if host.startswith("::ffff:") and "." in host:
            return host[7:]  # an IPv4 client on a dual-stack socket
        try:
            return socket.inet_pton(socket.AF_INET6, host.split("%", 1)[0])[:8]
        except OSError:
            return host
    return None


def _canned(status: int, message: str) -> bytes:
    body = message.encode() + b"\n"
    return (b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\ndate: %s\r\n\r\n%s" % (status, _REASONS.get(status, b""), len(body), _Date.now(), body))


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class _Request:
    """One request as it is parsed. The fields most requests never change are class defaults (set
    on the instance only when they do): one of these is made per request."""

    url = b""
    #: Request line and header bytes so far, and header lines so far (both capped).
    size = 0
    lines = 0
    method = b""
    keep_alive = True
    expect_continue = False
    upgrade = False
    head_done = False
    body_size = 0
    complete = False
    continue_sent = False

    def __init__(self, keep_raw: bool) -> None:
        #: Every header line as (lower-case name, value), for an ASGI app's scope (only then).
        self.headers: list[tuple[bytes, bytes]] | None = [] if keep_raw else None
        #: The headers the app reads (the ``toolcell.headers`` extension), gathered as they are parsed.
        self.wanted = RequestHeaders()
        self.body: deque[bytes] = deque()

    def take_buffered(self) -> bytes:
        """The body bytes parsed so far, in one piece; the buffer is left empty. The caller first
        counts ``body_size`` off its connection's ``buffered``."""
        body = self.body
        data = (body.popleft() if len(body) == 1 else b"".join(body)) if body else b""
        body.clear()
        self.body_size = 0
        return data


class _Connection:
    """One client connection: parse, run the app for each request in turn, write responses."""

    #: False until the app vouches for a request on it (then for good); True from the start when
    #: the app never vouches (``H1Server.vouching``): see the module doc.
    authenticated = True

    def __init__(self, server: H1Server, raw: socket.socket, client: Any, local: Any,
                 source: str | bytes | None = None) -> None:
        self.server = server
        #: The client address its per-address cap counts by (``source_of``).
        self.source = source
        #: The stdlib socket, non-blocking; trio's ``wait_readable``/``wait_writable`` do the waiting.
        self.raw = raw
        self.client = client
        self.local = local
        self.max_header = server.cfg.max_header_bytes
        self.parser = httptools.HttpRequestParser(self)
        #: Keep every header line for the app's ASGI scope: not for an app that takes the exchange.
        self.keep_raw = server.direct is None
        self.parsing: _Request | None = None  # the request whose bytes the parser is reading
        self.ready: deque[_Request] = deque()  # requests whose head is complete, oldest first
        self.error: BadRequest | None = None
        self.head_bytes = 0
        #: Body bytes parsed and not yet handed to the app, over ``ready`` and ``parsing``: the sum
        #: of their ``body_size``. Added in ``on_body``; counted off when the app takes a body and
        #: when a request is done with (``_serve``). What bounds reading ahead.
        self.buffered = 0
        self.eof = False
        self.reading = False
        self.closed = False
        #: True while waiting for the next request; ``idle_since`` is when that began.
        self.idle = True
        self.idle_since = server.now()
        #: Wraps the whole connection; the server's sweeper cancels it only while ``idle``.
        self.scope = trio.CancelScope()

    # -- parser callbacks (llhttp calls these from feed_data) ---------------------------------

    def on_message_begin(self) -> None:
        if len(self.ready) >= MAX_PARSED:
            # llhttp wraps a callback's exception in its own error; remember ours first.
            self.error = BadRequest(503, f"Service Unavailable: more than {MAX_PARSED} pipelined requests at once")
            raise self.error
        self.parsing = _Request(self.keep_raw)

    def on_url(self, url: bytes) -> None:
        req = self.parsing
        assert req is not None
        req.url += url
        req.size += len(url)
        if req.size > self.max_header:
            self._too_large()

    def _too_large(self) -> None:
        # llhttp wraps a callback's exception in its own error; remember ours first.
        self.error = BadRequest(431, "Request Header Fields Too Large")
        raise self.error

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self.parsing
        assert req is not None
        req.size += len(name) + len(value) + 4
        req.lines += 1
        if req.size > self.max_header or req.lines > MAX_HEADER_LINES:
            self._too_large()
        name = name.lower()
        if req.headers is not None:
            req.headers.append((name, value))
        # ``RequestHeaders``' one pass, done here as each header arrives (not in a second loop).
        if name in WANTED_HEADERS:
            wanted = req.wanted
            if name in wanted:
                wanted.repeated(name)
                wanted[name] = wanted[name] + b"," + value
            else:
                wanted[name] = value
        elif name.startswith(PARAM_PREFIX):
            wanted = req.wanted
            params = wanted.params
            key = name[len(PARAM_PREFIX):]
            if key in params:
                wanted.repeated(name)
                params[key] = params[key] + b"," + value
            else:
                params[key] = value
        elif name == b"expect" and value.strip().lower() == b"100-continue":
            req.expect_continue = True

    def on_headers_complete(self) -> None:
        req = self.parsing
        assert req is not None
        p = self.parser
        req.method = p.get_method()
        req.keep_alive = p.should_keep_alive()
        req.upgrade = p.should_upgrade()
        req.wanted.size = req.size
        req.head_done = True
        self.head_bytes = 0
        self.ready.append(req)

    def on_body(self, body: bytes) -> None:
        req = self.parsing
        assert req is not None
        req.body.append(body)
        n = len(body)
        req.body_size += n
        self.buffered += n

    def on_message_complete(self) -> None:
        req = self.parsing
        assert req is not None
        req.complete = True
        self.parsing = None

    # -- reading ------------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except BadRequest as exc:
            self.error = exc
            return
        except httptools.HttpParserUpgrade:
            # An upgrade (h2c, websocket) is not offered: the request is answered over HTTP/1.1
            # and the connection closes after it (the bytes after the head are not HTTP/1.1).
            if self.ready:
                self.ready[-1].keep_alive = False
            self.eof = True
        except httptools.HttpParserError as exc:
            if self.error is None:
                self.error = BadRequest(400, f"Bad Request: {exc}")
            return
        parsing = self.parsing
        if parsing is not None and not parsing.head_done:
            # The parser holds a header line until it ends: bound what a head in progress may
            # buffer (an over-estimate by at most one read when a chunk also ended a request).
            self.head_bytes += len(data)
            if self.head_bytes > self.max_header + READ_SIZE:
                self.error = BadRequest(431, "Request Header Fields Too Large")

    async def _read_once(self) -> None:
        """Read what the socket has and feed it to the parser; EOF and errors are recorded."""
        if self.reading:
            raise RuntimeError("two readers on one connection")
        self.reading = True
        raw = self.raw
        try:
            while True:
                # Wait first: between requests a keep-alive client has usually not written yet,
                # so a try-first recv would mostly fail (a syscall and an exception for nothing).
                await trio.lowlevel.wait_readable(raw)
                try:
                    data = raw.recv(READ_SIZE)
                    break
                except (BlockingIOError, InterruptedError):
                    continue
        except (OSError, ValueError, trio.ClosedResourceError):  # reset, or closed under us
            data = b""
        finally:
            self.reading = False
        if not data:
            self.eof = True  # a request cut short is not answered: nobody is left to read it
            return
        self._feed(data)

    def _can_read_ahead(self) -> bool:
        # The bound is per connection: the bodies of finished pipelined requests count as well as
        # the one being parsed (a per-request bound let one connection hold ~17 of them).
        return (not self.eof and self.error is None and len(self.ready) <= MAX_PIPELINED
                and self.buffered < MAX_BUFFERED_BODY)

    async def _wait_gone(self) -> None:
        """With reading ahead stopped: wait until the client closes or resets the connection (then
        ``eof`` is set), reading none of the request bytes it may have left in the socket.

        Waiting for the socket to be readable does not do: a socket with unread bytes is readable
        at once, forever (a busy loop), and a peek (``MSG_PEEK``) there returns those bytes, never
        the end of stream queued behind them, which is exactly the case of a client that pipelined
        past the bound and left. The kernel knows: a FIN received sets ``EPOLLRDHUP`` (and a reset
        ``EPOLLERR``/``EPOLLHUP``) whatever data is still queued. So a private epoll set watches
        the socket for those alone (not ``EPOLLIN``: new data does not wake it), and trio waits
        for that epoll fd to become readable: no reads, no polling, no timer. One fd, made only
        while paused (a rare state), closed when the wait ends or is cancelled.
        """
        if self.reading:
            raise RuntimeError("two readers on one connection")
        self.reading = True
        raw = self.raw
        ep = None
        if hasattr(select, "epoll"):
            try:
                ep = select.epoll(1)
            except OSError:  # out of file descriptors: peek instead
                pass
        try:
            if ep is not None:
                with ep:
                    ep.register(raw.fileno(), select.EPOLLRDHUP)  # EPOLLERR, EPOLLHUP: always
                    await trio.lowlevel.wait_readable(ep)
            else:
                # Without epoll: peek; while bytes are queued, look again every ``_GONE_POLL_S``
                # (a reset is seen then, a FIN behind the queued bytes is not: the fallback).
                while True:
                    await trio.lowlevel.wait_readable(raw)
                    try:
                        if not raw.recv(1, socket.MSG_PEEK):
                            break
                    except (BlockingIOError, InterruptedError):
                        continue
                    await trio.sleep(_GONE_POLL_S)
        except (OSError, ValueError, trio.ClosedResourceError):  # reset, or closed under us
            pass
        finally:
            self.reading = False
        self.eof = True

    async def next_request(self) -> _Request | None:
        """The next request whose head is complete, or None when the connection is done. An
        unauthenticated connection gets ``head_timeout_s`` for it, idle time included."""
        if self.authenticated or self.ready:
            return await self._next_request()
        with trio.move_on_after(self.server.cfg.head_timeout_s) as waited:
            return await self._next_request()
        if waited.cancelled_caught:
            self.error = BadRequest(408, "Request Timeout: no whole request head within head_timeout_s "
                                         "(the limit before authentication)")
        return None

    async def _next_request(self) -> _Request | None:
        cfg = self.server.cfg
        deadline: float | None = None
        idle_started = False
        while not self.ready:
            if self.error is not None or self.eof:
                return None
            if self.parsing is None and deadline is None:
                # Idle between requests. The keep-alive timeout and a graceful stop come from the
                # server's sweeper cancelling ``self.scope`` (no cancel scope per request). Bytes
                # that start no request (bare CRLFs, which llhttp skips) do not restart the clock.
                if self.server.stopping:
                    return None
                self.idle = True
                if not idle_started:
                    idle_started = True
                    self.idle_since = self.server.now()
                try:
                    await self._read_once()
                finally:
                    self.idle = False
                continue
            if deadline is None:
                deadline = trio.current_time() + cfg.idle_timeout_s
            with trio.move_on_at(deadline) as scope:
                await self._read_once()
            if scope.cancelled_caught:
                self.error = BadRequest(408, "Request Timeout: the request head took too long")
                return None
        return self.ready[0]

    # -- writing ------------------------------------------------------------------------------

    async def write(self, data: bytes) -> None:
        if self.closed:
            raise BrokenPipeError("connection closed")
        raw = self.raw
        try:
            # Try the send at once: a response nearly always fits the socket buffer, and then no
            # trip through the scheduler is needed. Only a full buffer waits for room.
            try:
                sent = raw.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            if sent == len(data):
                return
            view = memoryview(data)[sent:]
            while view:
                await trio.lowlevel.wait_writable(raw)
                try:
                    sent = raw.send(view)
                except (BlockingIOError, InterruptedError):
                    continue
                view = view[sent:]
        except (OSError, trio.ClosedResourceError):
            self.closed = True
            raise BrokenPipeError("connection closed") from None

    def close(self) -> None:
        self.closed = True
        if self.raw.fileno() != -1:
            trio.lowlevel.notify_closing(self.raw)  # wakes a task parked on it (ClosedResourceError)
            self.raw.close()

    # -- one connection -----------------------------------------------------------------------

    async def _serve(self, app: App) -> None:
        direct = self.server.direct
        try:
            with self.scope:  # the server's sweeper cancels it (keep-alive timeout, stop)
                while True:
                    req = await self.next_request()
                    if req is None:
                        if self.error is not None and not self.closed:
                            with trio.move_on_after(1):
                                try:
                                    await self.write(_canned(self.error.status, self.error.message))
                                except OSError:
                                    pass
                        return
                    exchange = _Exchange(self, req)
                    # ``_Exchange.run``, written out here: a request's awaits pass one frame fewer.
                    scope: dict[str, Any] | None = None
                    try:
                        if direct is None:
                            scope = exchange.scope()
                        else:
                            exchange.target()
                        ok = True
                    except BadRequest as exc:
                        exchange.keep_alive = False
                        await exchange._try_write(_canned(exc.status, exc.message))
                        exchange.finished = True
                        ok = False
                    if ok:
                        try:
                            if direct is not None:
                                await direct(exchange)
                            else:
                                assert scope is not None
                                await app(scope, exchange.receive, exchange.send)
                        except Exception as exc:  # noqa: BLE001 - the app's bug must not take the server down
                            await exchange.failed(exc)
                        if not exchange.finished or self.server.stopping:
                            exchange.keep_alive = False  # a response cut short: the client must not reuse it
                    self.ready.popleft()
                    self.buffered -= req.body_size  # a body the app did not take goes with its request
                    if not exchange.reusable():
                        return
        finally:
            self.close()
            self.server._left(self)


class _Exchange:
    """One request and its response: the ASGI ``receive``/``send`` pair for the app. The fields a
    response usually leaves as they are are class defaults (one exchange is made per request)."""

    delivered = False  # the whole body was handed to the app
    head_sent = False
    finished = False
    chunked = False
    status = 0
    reply_headers: list[tuple[bytes, bytes]] | tuple[()] = ()
    #: The request as an app that takes the exchange itself reads it (``serve_exchange``): the
    #: method and the decoded path (both set by ``target``), and the headers it looks at.
    method = ""
    path = ""

    def __init__(self, conn: _Connection, req: _Request) -> None:
        self.conn = conn
        self.req = req
        self.no_body = req.method == b"HEAD"
        self.keep_alive = req.keep_alive and not req.upgrade
        self.headers = req.wanted

    @property
    def source(self) -> str | bytes | None:
        """The client address its connection counts by (``source_of``)."""
        return self.conn.source

    def authenticated(self) -> None:
        """The app's word that this request passed authentication: its connection leaves the
        unauthenticated budget for good (see the module doc)."""
        conn = self.conn
        if not conn.authenticated:
            conn.server.vouched(conn)

    def target(self) -> tuple[bytes, bytes]:
        """Read the request target: sets ``method`` and ``path``; returns the raw path and the query.
        Raises ``BadRequest`` for a target that is not one."""
        req = self.req
        url = req.url
        method = req.method
        self.method = _METHOD_NAMES.get(method) or method.decode("latin-1")
        path = _PLAIN_PATHS.get(url)
        if path is not None:
            self.path = path
            return url, b""
        if url[:1] == b"/" and b"?" not in url and b"%" not in url and b"#" not in url:
            self.path = url.decode("latin-1")  # the usual origin-form target
            if len(_PLAIN_PATHS) < 64:  # the few a server sees, each decoded once
                _PLAIN_PATHS[url] = self.path
            return url, b""
        try:
            parsed = httptools.parse_url(url)
            raw_path = parsed.path or b"/"
            query = parsed.query or b""
        except httptools.HttpParserInvalidURLError:
            raise BadRequest(400, "Bad Request: invalid request target") from None
        if parsed.host:
            # An absolute-form target (``POST http://host/mcp``): RFC 9112 3.2.2 has an origin server
            # use its authority and ignore the Host header, so the app's Host check reads that.
            host = b"[" + parsed.host + b"]" if b":" in parsed.host else parsed.host
            req.wanted[b"host"] = host if parsed.port is None else b"%s:%d" % (host, parsed.port)
        self.path = unquote(raw_path.decode("latin-1"))
        return raw_path, query

    def scope(self) -> dict[str, Any]:
        """The ASGI scope, for an app that is only an ASGI app."""
        raw_path, query = self.target()
        req = self.req
        conn = self.conn
        # toolcell's own extensions (an ASGI app that does not know them ignores them): the headers
        # it reads, already gathered; the whole body if it has arrived; a response in one call.
        extensions = {"toolcell.headers": req.wanted, "toolcell.respond": self.respond,
                      "toolcell.take_body": self.take_body, "toolcell.authenticated": self.authenticated}
        return {"type": "http", "asgi": _ASGI, "http_version": "1.1", "method": self.method,
                "scheme": "http", "path": self.path, "raw_path": raw_path, "query_string": query, "root_path": "",
                "headers": req.headers or [], "client": conn.client, "server": conn.local, "extensions": extensions}

    async def failed(self, exc: Exception) -> None:
        """The app raised: log it, answer 500 if nothing was sent yet, and close after."""
        log("http_app_error", level="error", error=f"{type(exc).__name__}: {exc}")
        self.keep_alive = False
        if not self.head_sent:
            await self._try_write(_canned(500, "Internal Server Error"))
            self.finished = True

    async def _try_write(self, data: bytes) -> None:
        try:
            with trio.move_on_after(5):
                await self.conn.write(data)
        except OSError:
            pass

    def reusable(self) -> bool:
        return self.keep_alive and self.finished and self.req.complete and not self.conn.closed

    async def receive(self) -> dict[str, Any]:
        req = self.req
        conn = self.conn
        while True:
            if self.finished or conn.closed:
                return _DISCONNECT
            if not self.delivered:
                if req.body:
                    conn.buffered -= req.body_size
                    chunk = req.take_buffered()
                    more = not req.complete
                    self.delivered = not more
                    return {"type": "http.request", "body": chunk, "more_body": more}
                if req.complete:
                    self.delivered = True
                    return {"type": "http.request", "body": b"", "more_body": False}
                if conn.error is not None:
                    # Malformed body framing (chunk sizes, data longer than its chunk): 400 and close
                    # (RFC 9112 6.3), never a silent close.
                    if not self.head_sent:
                        self.keep_alive = False
                        await self._try_write(_canned(conn.error.status, conn.error.message))
                        self.finished = True
                    return _DISCONNECT
                if conn.eof:
                    return _DISCONNECT
                if req.expect_continue and not req.continue_sent and not self.head_sent:
                    req.continue_sent = True
                    try:
                        await conn.write(_CONTINUE)
                    except OSError:
                        return _DISCONNECT
                await conn._read_once()
                continue
            # The body is delivered: what is left is waiting for the client to go away.
            if conn.eof:
                return _DISCONNECT
            if conn._can_read_ahead():
                await conn._read_once()
            else:
                # Nothing more is parsed until this request is answered, but its client may still
                # leave (which cancels a 2026-07-28 call): watch for that without reading.
                await conn._wait_gone()

    def take_body(self) -> bytes | None:
        """The whole request body if it has all arrived (then ``receive`` has no body left to
        give), else None: read it through ``receive``."""
        req = self.req
        if self.delivered or not req.complete:
            return None
        self.delivered = True
        self.conn.buffered -= req.body_size
        return req.take_buffered()

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """A whole response (``headers`` carry its content-length) in one write: what an
        ``http.response.start`` and a final ``http.response.body`` do, without the messages."""
        if self.head_sent or self.status:
            raise RuntimeError("response already started")
        self.status = status
        self.reply_headers = headers
        await self.conn.write(self._head(body, more=False))

    def respond_json(self, body: bytes) -> Awaitable[None]:
        """``200 OK`` with a JSON body and no other header of the app's: what most answers are, its
        head made from constants (``_head``'s rules, with no header of the app's to check)."""
        if self.head_sent or self.status:
            raise RuntimeError("response already started")
        self.status = 200
        if self.no_body:  # HEAD: the general path leaves the body out
            self.reply_headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
            return self.conn.write(self._head(body, more=False))
        closing = b"connection: close\r\n" if self._closes() else b""
        self.head_sent = True
        self.finished = True
        return self.conn.write(b"%s%d\r\n%sdate: %s\r\n\r\n%s" % (_JSON_200_HEAD, len(body), closing, _Date.now(), body))

    def _closes(self) -> bool:
        """Whether this response ends the connection (then it says ``Connection: close``)."""
        # Answered before its body arrived (an early 401/413/415 ...): the rest of the body is never
        # read, so the connection cannot carry another request. A stop closes every connection.
        server = self.conn.server
        if not self.req.complete or server.stopping or not self.keep_alive or server.winding_down():
            self.keep_alive = False
            return True
        return False

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if self.head_sent or self.status:
                raise RuntimeError("response already started")
            self.status = int(message["status"])
            self.reply_headers = message.get("headers") or []
            if not any(name.lower() == b"content-length" for name, _ in self.reply_headers):
                # A streamed response (SSE): the client must see the head now, not with the
                # first event. With a length, the head waits to go out in one write with the body.
                await self.conn.write(self._head(b"", more=True))
            return
        if kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind!r}")
        if self.finished:
            if self.conn.error is not None:
                return  # already answered 400 for the request's broken framing
            raise RuntimeError("response already finished")
        if not self.status:
            raise RuntimeError("http.response.body before http.response.start")
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if not self.head_sent:
            return await self.conn.write(self._head(body, more))
        if self.no_body:
            if not more:
                self.finished = True
            return
        if self.chunked:
            data = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n")
        else:
            data = body
        if not more:
            self.finished = True
        if data:
            await self.conn.write(data)

    def _head(self, body: bytes, more: bool) -> bytes:
        """The status line and headers, with ``body`` (the first or only part) behind them: what to write."""
        conn = self.conn
        status = self.status
        no_body = self.no_body or status in _NO_BODY_STATUS or status < 200
        has_length = False
        lines = [_STATUS_LINES.get(status) or b"HTTP/1.1 %d \r\n" % status]
        # The head's pieces; ``ends`` counts the CRLFs put in on purpose (checked below).
        ends = 1
        for name, value in self.reply_headers:
            lname = name.lower()
            if lname in _FRAMING:
                if lname == b"content-length":
                    has_length = True
                elif lname == b"transfer-encoding":
                    continue  # ours to say (chunked or not)
                elif value.strip().lower() == b"close":  # connection: close
                    self.keep_alive = False
                    continue
            elif b":" in name:
                raise RuntimeError("response header name contains ':'")
            lines += (name, b": ", value, b"\r\n")
            ends += 1
        if not has_length and not no_body:
            if more and conn.parser.get_http_version() == "1.0":
                # RFC 9112 7.1: no Transfer-Encoding to an HTTP/1.0 client; closing ends the body. Read
                # here, for a streamed response only (a call per request cost 0.2 µs): the parser still
                # holds this request's version (an HTTP/1.0 client does not pipeline).
                self.keep_alive = False
            elif more:
                self.chunked = True
                lines.append(b"transfer-encoding: chunked\r\n")
                ends += 1
            else:
                lines.append(b"content-length: %d\r\n" % len(body))
                ends += 1
        if self._closes():
            lines.append(b"connection: close\r\n")
            ends += 1
        lines += (b"date: ", _Date.now(), b"\r\n\r\n")
        ends += 2
        head = b"".join(lines)
        # Every line ends in CRLF and the head in one more: any other CR or LF came from a header
        # name or value (response splitting). One count over the head instead of a test per header.
        if head.count(b"\n") != ends or head.count(b"\r") != ends:
            raise RuntimeError("response header contains CR or LF")
        self.head_sent = True
        self.no_body = no_body
        if no_body:
            data = head
        elif self.chunked:
            data = head + (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + (b"" if more else b"0\r\n\r\n")
        else:
            data = head + body
        if not more:
            self.finished = True
        return data


def _never() -> bool:
    return False


class H1Server:
    """Accepts on the given listening sockets and serves ``app`` on each connection."""

    def __init__(self, app: App, cfg: HttpConfig) -> None:
        self.app = app
        #: An app that takes the exchange itself (``HttpApp.serve_exchange``) gets it with no ASGI
        #: scope built for it (nor raw header lines kept); any other app gets plain ASGI.
        self.direct: Callable[[_Exchange], Awaitable[None]] | None = getattr(app, "serve_exchange", None)
        self.cfg = cfg
        self.connections: set[_Connection] = set()
        #: The app calls the exchange's ``authenticated`` for requests that pass authentication: only
        #: then is there an unauthenticated budget to keep (an app that never vouches trusts all).
        self.vouching = bool(getattr(app, "vouches_for_connections", False))
        #: Unauthenticated connections, oldest first (a dict keeps insertion order), and the same
        #: by client address (``source_of``; unix-socket clients are not counted by address).
        self.unauthenticated: dict[_Connection, None] = {}
        self.unauthenticated_by_source: dict[str | bytes, dict[_Connection, None]] = {}
        self.evicted = 0
        self._accept_failures = 0
        self._accept_logged_at = -_ACCEPT_LOG_S
        #: Set when the last connection closes (shutdown waits on it, within its grace).
        self._all_closed = trio.Event()
        self.stopping = False
        #: Whether the app is winding down (a draining replica: still serving, but a balancer should
        #: not keep connections to it): then every response closes its connection, so none is left
        #: idle to race a request the balancer sends on it at the moment the listener closes.
        self.winding_down: Callable[[], bool] = getattr(app, "winding_down", _never)
        #: trio's clock, read in one call (``runtime.clock``).
        self.now = clock_reader()

    async def _accept_loop(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        tcp = listener.family in (socket.AF_INET, socket.AF_INET6)
        local = listener.getsockname() if tcp else None
        while True:
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                await trio.lowlevel.wait_readable(listener)
                continue
            except OSError as exc:
                # EMFILE and friends: make room by evicting the oldest unauthenticated connection
                # (its descriptor is free at once), else back off instead of spinning; the listener
                # keeps its queue meanwhile, and the log says so once in a while, not per attempt.
                self._accept_failed(exc)
                if exc.errno in _NO_ROOM and self.evict_oldest(self.unauthenticated):
                    continue
                await trio.sleep(0.1)
                continue
            sock.setblocking(False)
            if tcp:
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                except OSError:
                    pass
            conn = _Connection(self, sock, addr if tcp else None, local,
                               source_of(listener.family, addr) if tcp else None)
            if not self._admit(conn):
                nursery.start_soon(self._refuse, sock)
                continue
            self.connections.add(conn)
            nursery.start_soon(self._serve_connection, conn)

    def _admit(self, conn: _Connection) -> bool:
        """Make room for ``conn`` (evicting unauthenticated connections, oldest first, as the
        budgets say) and count it in; False: there is no room (it is refused with 503)."""
        cfg = self.cfg
        if self.vouching:
            source = conn.source
            mine = self.unauthenticated_by_source.get(source) if source is not None else None
            if mine is not None and len(mine) >= cfg.max_unauthenticated_per_address and not self.evict_oldest(mine):
                return False
            if len(self.unauthenticated) >= cfg.unauthenticated_budget and not self.evict_oldest(self.unauthenticated):
                return False
        if len(self.connections) >= cfg.max_connections and not self.evict_oldest(self.unauthenticated):
            return False
        if self.vouching:
            conn.authenticated = False
            self.unauthenticated[conn] = None
            if conn.source is not None:
                self.unauthenticated_by_source.setdefault(conn.source, {})[conn] = None
        return True

    def evict_oldest(self, among: dict[_Connection, None]) -> bool:
        """Close the oldest of ``among`` (unauthenticated connections) that has no request in the
        app; False if every one has."""
        victim = next((c for c in among if not c.ready), None)
        if victim is None:
            return False
        self._forget_unauthenticated(victim)
        self.connections.discard(victim)
        self.evicted += 1
        try:  # a word for a client that was only slow, if its socket takes it now; no waiting
            victim.raw.send(_canned(503, "Service Unavailable: too many unauthenticated connections; "
                                         "authenticate sooner or retry"))
        except OSError:
            pass
        victim.close()
        victim.scope.cancel()
        return True

    def vouched(self, conn: _Connection) -> None:
        conn.authenticated = True
        self._forget_unauthenticated(conn)

    def _forget_unauthenticated(self, conn: _Connection) -> None:
        if self.unauthenticated.pop(conn, 0) is None and conn.source is not None:
            mine = self.unauthenticated_by_source[conn.source]
            del mine[conn]
            if not mine:
                del self.unauthenticated_by_source[conn.source]

    def _accept_failed(self, exc: OSError) -> None:
        self._accept_failures += 1
        now = self.now()
        if now - self._accept_logged_at >= _ACCEPT_LOG_S:
            log("http_accept_failed", level="warning", error=str(exc), failures=self._accept_failures)
            self._accept_logged_at = now
            self._accept_failures = 0

    async def _sweep_idle(self) -> None:
        """Close connections idle for ``idle_timeout_s`` (checked a few times per timeout)."""
        timeout = self.cfg.idle_timeout_s
        period = min(1.0, max(0.01, timeout / 4))
        while True:
            await trio.sleep(period)
            limit = trio.current_time() - timeout
            for conn in self.connections:
                if conn.idle and conn.idle_since <= limit:
                    conn.scope.cancel()

    async def _refuse(self, sock: socket.socket) -> None:
        with trio.socket.from_stdlib_socket(sock) as tsock, trio.move_on_after(1):
            try:
                await tsock.send(_canned(503, "Service Unavailable: too many connections"))
            except OSError:
                pass

    def _serve_connection(self, conn: _Connection) -> Awaitable[None]:
        # The connection's own coroutine is the task (one frame fewer per wake); it leaves the
        # server's set itself (``_Connection._left``).
        return conn._serve(self.app)

    def _left(self, conn: _Connection) -> None:
        if not conn.authenticated:
            self._forget_unauthenticated(conn)
        self.connections.discard(conn)
        if not self.connections:
            self._all_closed.set()

    async def serve(self, sockets: list[socket.socket], shutdown_trigger: Callable[[], Awaitable[None]],
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``shutdown_trigger`` returns, then stop gracefully (see the module doc)."""
        listeners = []
        for s in sockets:
            s.listen(1024)
            s.setblocking(False)
            listeners.append(s)
        async with trio.open_nursery() as conns:
            async with trio.open_nursery() as accepting:
                accepting.start_soon(self._sweep_idle)
                for listener in listeners:
                    accepting.start_soon(self._accept_loop, listener, conns)
                task_status.started()
                await shutdown_trigger()
                self.stopping = True
                accepting.cancel_scope.cancel()
            for listener in listeners:
                trio.lowlevel.notify_closing(listener)
                listener.close()
            for conn in list(self.connections):
                if conn.idle:
                    conn.scope.cancel()
            with trio.move_on_after(self.cfg.shutdown_grace_s):
                while self.connections:
                    self._all_closed = trio.Event()
                    await self._all_closed.wait()
            if self.connections:
                log("http_shutdown_cut", level="warning", connections=len(self.connections))
            conns.cancel_scope.cancel()

