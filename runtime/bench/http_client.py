"""MCP over Streamable HTTP from the client side: keep-alive connections, sessions, the load loop.

Each connection carries one request at a time (HTTP/1.1 keep-alive, no pipelining, as real MCP
clients do). Responses are parsed by httptools (llhttp, the parser Node.js uses): a server's
bytes are never framed by code of ours. A JSON body is one message; a ``text/event-stream`` body
is read event by event and the call is complete when the event carrying its response arrives.

Legacy era: one ``initialize`` (and ``notifications/initialized``) opens a session whose
``Mcp-Session-Id`` every request then carries, on every connection. 2026-07-28: no handshake;
every request carries ``params._meta`` and the ``MCP-Protocol-Version``, ``Mcp-Method``,
``Mcp-Name`` and ``Mcp-Param-*`` headers.

Closed loop: C connections, one operation in flight on each. Open loop: a pool that grows up to
``max_inflight`` connections; an operation whose time has come and finds no free connection
waits, and its latency (from the intended start) includes the wait. Every segment opens fresh
connections (so a connection the server closed while idle is never mistaken for a failure).
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import httptools

from runtime.bench import wire
from runtime.bench.load import Flight, ListWalk, Loop, walk_step
from runtime.bench.procs import Server
from runtime.bench.scenario import CompiledCall
from runtime.bench.stdio_client import TargetDown

#: One ``recv``. Below glibc's mmap threshold (128 KiB): a larger buffer is mapped, shrunk and unmapped
#: on every read (three syscalls a response, measured: 30 of the client's 50 µs per call were kernel time),
#: CPU the load generator takes from the server it measures when both share a machine.
READ_CHUNK = 64 * 1024
#: A response body larger than this fails the request (the one in flight, or the handshake).
MAX_BODY_BYTES = 64 << 20
#: A response's status line and headers together: llhttp sets no limit of its own and httptools
#: buffers a header until it ends, so a server sending headers without end grew the bench's memory
#: without end (22 GB in a minute). Node.js allows 16 KiB; a real MCP server's head is far smaller.
MAX_HEAD_BYTES = 1 << 20
TIMEOUT_SCAN_NS = 50_000_000
RETRY_AFTER_NS = 100_000_000


class Endpoint:
    """Where to connect, how (TCP or TLS), and the fixed part of every request's head."""

    def __init__(self, url: str, headers: list[tuple[str, str]], insecure: bool = False,
                 connect_timeout_s: float = 5.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http:// or https:// URL: {url!r}")
        self.url = url
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.connect_timeout_s = connect_timeout_s
        self.context: ssl.SSLContext | None = None
        if self.tls:
            self.context = ssl.create_default_context()
            if insecure:
                self.context.check_hostname = False
                self.context.verify_mode = ssl.CERT_NONE
        host_header = parts.netloc.rsplit("@", 1)[-1]
        lines = [f"POST {self.path} HTTP/1.1", f"Host: {host_header}", "Accept: application/json, text/event-stream",
                 "Content-Type: application/json", "Connection: keep-alive"]
        for name, value in headers:
            if any(c in name + value for c in "\r\n\0"):
                raise ValueError(f"header {name!r} contains a line break")
            lines.append(f"{name}: {value}")
        self.fixed = "\r\n".join(lines) + "\r\n"
        self.session_id: str | None = None

    def head(self, extra: list[str]) -> bytes:
        """The request head up to (not including) ``Content-Length``."""
        session = [f"Mcp-Session-Id: {self.session_id}"] if self.session_id else []
        return (self.fixed + "".join(f"{line}\r\n" for line in session + extra)).encode()

    def connect(self) -> socket.socket:
        """A connected (and, for https, handshaken) non-blocking socket."""
        sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.context is not None:
                sock = self.context.wrap_socket(sock, server_hostname=self.host)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock


class Response:
    """One HTTP response as httptools hands it over (the parser's protocol object)."""

    __slots__ = ("answer", "answer_ns", "body", "body_bytes", "complete", "head_bytes", "headers", "headers_done",
                 "keep_alive", "parser", "sse", "sse_buf", "sse_first_garbage", "sse_garbage", "want_id")

    def __init__(self, want_id: int) -> None:
        self.want_id = want_id
        self.headers: dict[bytes, bytes] = {}
        self.headers_done = False
        self.head_bytes = 0
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.complete = False
        self.sse = False
        self.sse_buf = bytearray()
        #: SSE events whose data was not a JSON-RPC message: how many, and what the first one was.
        self.sse_garbage = 0
        self.sse_first_garbage = ""
        #: The message that answers ``want_id`` (from the body or an SSE event), and when it came.
        self.answer: wire.Envelope | wire.Garbage | None = None
        self.answer_ns = 0
        #: Asked of the parser while the message completes (afterwards llhttp has reset it).
        self.keep_alive = False
        self.parser: Any = None

    @property
    def answered(self) -> bool:
        """Complete, or an SSE stream that carried the answer (a server may keep it open after)."""
        return self.complete or (self.sse and self.answer is not None)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.sse = self.headers.get(b"content-type", b"").lower().startswith(b"text/event-stream")

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > MAX_BODY_BYTES:
            raise ValueError(f"response body over {MAX_BODY_BYTES} bytes")
        if not self.sse:
            self.body.append(body)
            return
        # One bytearray, searched only where it was not searched before: an event without end, re-copied
        # and re-scanned from its start at every read, cost 60 s of CPU to reach MAX_BODY_BYTES.
        buf = self.sse_buf
        if buf.endswith(b"\r") and body.startswith(b"\n"):
            del buf[-1]  # a CRLF cut between two reads
        scanned = max(0, len(buf) - 1)  # a blank line may straddle two reads
        buf += body.replace(b"\r\n", b"\n")
        while self.answer is None:
            end = buf.find(b"\n\n", scanned)
            if end < 0:
                break
            event = bytes(buf[:end])
            del buf[:end + 2]
            scanned = 0
            data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
            if not data:
                continue
            msg = wire.decode_one(data)
            if msg.id == self.want_id and type(msg.id) is int and not (isinstance(msg, wire.Envelope)
                                                                          and msg.method is not None):
                self.answer = msg
                self.answer_ns = time.monotonic_ns()
            elif isinstance(msg, wire.Garbage):
                # Said if the stream ends without the answer (notifications and requests are expected).
                self.sse_garbage += 1
                self.sse_first_garbage = self.sse_first_garbage or msg.reason[:200]

    def on_message_complete(self) -> None:
        self.complete = True
        if self.parser is not None:
            self.keep_alive = bool(self.parser.should_keep_alive())
            self.parser = None  # no reference cycle left behind (the bench runs with gc off)
        if not self.sse and self.answer is None:
            body = b"".join(self.body)
            if body:
                self.answer = wire.decode_one(body)
                self.answer_ns = time.monotonic_ns()


class Conn:
    """One keep-alive connection and what is in flight on it."""

    __slots__ = ("close_after", "fl", "out", "parser", "request_id", "response", "retry_at", "sock")

    def __init__(self, sock: socket.socket | None) -> None:
        self.sock = sock
        self.fl: Flight | None = None
        self.request_id = 0
        self.out = b""
        self.response: Response | None = None
        self.parser: Any = None
        self.close_after = False
        self.retry_at = 0

    def feed(self, chunk: bytes) -> None:
        """Hand received bytes to the parser; raises ValueError past ``MAX_HEAD_BYTES`` of head
        (and, from the body callback, past ``MAX_BODY_BYTES`` of body), or httptools' parse error."""
        resp = self.response
        assert resp is not None
        if not resp.headers_done:
            resp.head_bytes += len(chunk)
            if resp.head_bytes > MAX_HEAD_BYTES:
                raise ValueError(f"response head over {MAX_HEAD_BYTES} bytes")
        self.parser.feed_data(chunk)

    def expect(self, request_id: int) -> None:
        self.request_id = request_id
        self.response = Response(request_id)
        self.parser = httptools.HttpResponseParser(self.response)
        self.response.parser = self.parser

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
            self.sock = None


def classify(resp: Response, status: int, want_id: int, legacy_session: bool) -> tuple[str, str | None, wire.Envelope | None]:
    """(kind, detail, envelope) of a complete response to request ``want_id``; ``ok`` means
    the envelope is to be checked by the operation."""
    msg = resp.answer
    if status == 200:
        if msg is None:
            what = "an SSE stream that ended without the response" if resp.sse else "an empty body"
            if resp.sse_garbage:
                what += f" ({resp.sse_garbage} event(s) that were not JSON-RPC, the first: {resp.sse_first_garbage})"
            return wire.INVALID, f"HTTP 200 with {what}", None
        if isinstance(msg, wire.Garbage):
            return wire.INVALID, msg.reason, None
        if type(msg.id) is not int or msg.id != want_id:
            return wire.INVALID, f"the response's id is {msg.id!r}, not {want_id}", None
        return wire.OK, None, msg
    if isinstance(msg, wire.Envelope) and msg.error is not None:
        return wire.RPC_ERROR, f"HTTP {status}, {msg.error.code}: {msg.error.message[:200]}", None
    if status == 404 and legacy_session:
        return wire.TRANSPORT, "HTTP 404: the session is unknown or ended", None
    body = b"".join(resp.body)[:160]
    return wire.TRANSPORT, f"HTTP {status}: {body!r}", None


class HttpTarget:
    """An MCP endpoint (and the server process behind it, when the bench started it)."""

    def __init__(self, endpoint: Endpoint, modern: bool, server: Server | None = None) -> None:
        self.endpoint = endpoint
        self.modern = modern
        self.server = server
        self.next_id = 1
        self.down: str | None = None
        self.server_info: dict[str, Any] | None = None
        #: Per tool: argument name -> header name, for 2026-07-28 ``Mcp-Param-*`` headers.
        self.param_headers: dict[str, dict[str, str]] = {}

    # -- slow path -------------------------------------------------------------------------------

    def era_headers(self, method: str, name: str | None) -> list[str]:
        """The protocol headers of a request."""
        if not self.modern:
            return [f"MCP-Protocol-Version: {wire.LEGACY_PROTOCOL_VERSION}"]
        out = [f"MCP-Protocol-Version: {wire.MODERN_PROTOCOL_VERSION}", f"Mcp-Method: {method}"]
        if name is not None:
            out.append(f"Mcp-Name: {wire.header_value(name)}")
        return out

    def _why_down(self, what: str) -> str:
        if self.server is not None and self.server.exited() is not None:
            tail = self.server.stderr_tail(600).strip()
            return f"{what} (the server exited with {self.server.exited()})" + (f"; its stderr ends: {tail}" if tail else "")
        return what

    def roundtrip(self, body: bytes, extra: list[str], want_id: int, timeout_s: float) -> tuple[int, dict[bytes, bytes], wire.Envelope | wire.Garbage | None]:
        """One request on a fresh connection: (status, headers, the message answering ``want_id``)."""
        deadline = time.monotonic() + timeout_s
        try:
            sock = self.endpoint.connect()
        except OSError as exc:
            raise TargetDown(self._why_down(f"cannot connect to {self.endpoint.url}: {exc}")) from None
        conn = Conn(sock)
        conn.expect(want_id)
        try:
            data = self.endpoint.head(extra) + b"Content-Length: %d\r\n\r\n" % len(body) + body
            sock.setblocking(True)
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            sock.sendall(data)
            resp = conn.response
            assert resp is not None
            while not resp.answered:
                remaining = deadline - time.monotonic()
                if remaining <= 0:  # a server trickling bytes would otherwise reset every recv's timeout
                    raise TimeoutError
                sock.settimeout(remaining)
                chunk = sock.recv(READ_CHUNK)
                if not chunk:
                    if resp.headers_done and not resp.complete:
                        resp.on_message_complete()
                        break
                    raise TargetDown(self._why_down("the server closed the connection without an answer"))
                conn.feed(chunk)
            return conn.parser.get_status_code(), resp.headers, resp.answer
        except (TimeoutError, socket.timeout):
            raise TimeoutError("no answer in time") from None
        except (httptools.HttpParserError, ValueError) as exc:
            raise TargetDown(f"the server sent a malformed HTTP response: {exc}") from None
        except OSError as exc:
            raise TargetDown(self._why_down(f"connection to {self.endpoint.url} failed: {exc}")) from None
        finally:
            conn.close()

    def request(self, method: str, params: dict[str, Any] | None, timeout_s: float,
                name: str | None = None) -> wire.Envelope | wire.Garbage:
        """One request and its answer; a non-200 answer without a JSON-RPC body raises TargetDown."""
        rid = self.next_id
        self.next_id += 1
        body = wire.message(method, params, rid, self.modern)
        status, _, msg = self.roundtrip(body, self.era_headers(method, name), rid, timeout_s)
        if msg is None:
            raise TargetDown(f"{method} answered HTTP {status} with no JSON-RPC message")
        if status != 200 and not (isinstance(msg, wire.Envelope) and msg.error is not None):
            raise TargetDown(f"{method} answered HTTP {status}")
        return msg

    def open_session(self, timeout_s: float) -> wire.Envelope | wire.Garbage:
        """Legacy: ``initialize`` (keeping the session id) and ``notifications/initialized``."""
        rid = self.next_id
        self.next_id += 1
        body = wire.message("initialize", wire.initialize_params(), rid, False)
        status, headers, msg = self.roundtrip(body, self.era_headers("initialize", None), rid, timeout_s)
        if status != 200 or msg is None:
            raise TargetDown(f"initialize answered HTTP {status}" + (" with no JSON-RPC message" if msg is None else ""))
        session = headers.get(b"mcp-session-id")
        if session:
            text = session.decode("ascii", "replace")
            if not all(0x21 <= ord(c) <= 0x7E for c in text):
                raise TargetDown("the server's Mcp-Session-Id is not visible ASCII")
            self.endpoint.session_id = text
        note = wire.message("notifications/initialized", None, None, False)
        status, _, _ = self.roundtrip(note, self.era_headers("notifications/initialized", None), -1, timeout_s)
        if status not in (200, 202, 204):
            raise TargetDown(f"notifications/initialized answered HTTP {status}")
        return msg

    def close(self) -> int | None:
        """Stop the server we started (if any)."""
        return self.server.stop() if self.server is not None else None

    # -- the load loop ---------------------------------------------------------------------------

    def _op_heads(self, loop: Loop) -> list[bytes]:
        heads = []
        for op in loop.ops:
            if isinstance(op, CompiledCall):
                heads.append(self.endpoint.head(self.era_headers("tools/call", op.spec.tool)))
            else:
                heads.append(self.endpoint.head(self.era_headers("tools/list", None)))
        return heads

    def _param_headers(self, op: CompiledCall, fl: Flight) -> bytes:
        mapping = self.param_headers.get(op.spec.tool)
        if not mapping or not self.modern:
            return b""
        lines = []
        for arg, header in mapping.items():
            if arg not in op.spec.arguments:
                continue
            value = op.spec.arguments[arg]
            if isinstance(value, str) and fl.variables is not None:
                value = wire.render_text(value, fl.variables)
            lines.append(f"Mcp-Param-{header}: {wire.header_value(value)}\r\n")
        return "".join(lines).encode()

    def run(self, loop: Loop) -> None:
        """Drive ``loop`` until it is over. Raises TargetDown when the server we started has
        exited (what was in flight ends as ``transport``)."""
        ep = select.epoll()
        conns: dict[int, Conn] = {}
        idle: list[Conn] = []
        waiting: list[Conn] = []  # closed loop: connections to (re)connect when their retry time comes
        heads = self._op_heads(loop)
        ops = loop.ops
        clock = time.monotonic_ns
        timeout_ns = loop.timeout_ns
        legacy_session = not self.modern and self.endpoint.session_id is not None
        open_loop = loop.open
        target = loop.shape.concurrency if not open_loop else (loop.shape.max_inflight or 256)
        complete = loop.complete
        in_flight = 0
        next_scan = 0

        def connect(conn: Conn) -> bool:
            try:
                conn.sock = self.endpoint.connect()
            except OSError as exc:
                if self.server is not None and self.server.exited() is not None:
                    raise TargetDown(self._why_down("the server is gone")) from None
                conn.retry_at = clock() + RETRY_AFTER_NS
                self._connect_error = str(exc)
                return False
            conns[conn.sock.fileno()] = conn
            ep.register(conn.sock.fileno(), select.EPOLLIN)
            return True

        def drop(conn: Conn) -> None:
            if conn.sock is not None:
                fd = conn.sock.fileno()
                conns.pop(fd, None)
                try:
                    ep.unregister(fd)
                except (OSError, ValueError):
                    pass
            conn.close()

        def send(conn: Conn, fl: Flight, now: int) -> None:
            nonlocal in_flight
            rid = self.next_id
            self.next_id = rid + 1
            op = ops[fl.op]
            if fl.pages and isinstance(op, ListWalk):
                body = op.page(rid, fl.cursor)
            else:
                body = loop.request(fl, rid)
            extra = self._param_headers(op, fl) if isinstance(op, CompiledCall) and self.param_headers else b""
            data = heads[fl.op] + extra + b"Content-Length: %d\r\n\r\n" % len(body) + body
            if conn.fl is None:
                in_flight += 1
            conn.fl = fl
            conn.expect(rid)
            fl.sent = fl.sent or now
            fl.deadline = now + timeout_ns
            assert conn.sock is not None
            try:
                n = conn.sock.send(data)
            except (BlockingIOError, ssl.SSLWantWriteError):
                n = 0
            except OSError as exc:
                fail(conn, now, f"send failed: {exc}")
                return
            if n < len(data):
                conn.out = data[n:]
                ep.modify(conn.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)

        def fail(conn: Conn, now: int, why: str, kind: str = wire.TRANSPORT) -> None:
            nonlocal in_flight
            fl = conn.fl
            conn.fl = None
            drop(conn)
            if fl is not None:
                in_flight -= 1
                complete(fl, now, kind, why)
            conn.retry_at = now if kind == wire.TIMEOUT else now + RETRY_AFTER_NS
            if self.server is not None and self.server.exited() is not None:
                raise TargetDown(self._why_down(why))
            waiting.append(conn)

        def start(conn: Conn, now: int) -> None:
            """Give ``conn`` its next operation (closed loop) or the oldest due one (open loop)."""
            if open_loop:
                if loop.backlog:
                    send(conn, loop.new_flight(loop.backlog.popleft()), now)
                else:
                    idle.append(conn)
            elif loop.issuing:
                send(conn, loop.new_flight(now), now)
            else:
                idle.append(conn)

        def finished_response(conn: Conn, now: int) -> None:
            nonlocal in_flight
            resp = conn.response
            fl = conn.fl
            assert resp is not None and fl is not None
            status = conn.parser.get_status_code()
            kind, detail, env = classify(resp, status, conn.request_id, legacy_session)
            done_ns = resp.answer_ns or now
            keep = resp.complete and not conn.close_after and resp.keep_alive
            op = ops[fl.op]
            cursor = None
            if kind is wire.OK and env is not None:
                if isinstance(op, CompiledCall):
                    kind, detail = wire.check_call(env, op.check, fl.expected)
                else:
                    kind, detail, cursor = walk_step(loop, fl, env)
            if cursor is not None:
                fl.cursor = cursor
                if keep:
                    send(conn, fl, now)
                    return
            else:
                conn.fl = None
                in_flight -= 1
                complete(fl, done_ns, kind, detail)
            if not keep:
                drop(conn)  # a walk's next page goes out on the next connection
                conn.retry_at = now
                waiting.append(conn)
                return
            if cursor is None:
                start(conn, now)

        self._connect_error = ""
        loop.begin(clock())
        try:
            if not open_loop:
                for _ in range(target):
                    conn = Conn(None)
                    if connect(conn):
                        start(conn, clock())
                    else:
                        waiting.append(conn)
            while True:
                now = clock()
                loop.advance(now)
                if open_loop and loop.issuing:
                    loop.due(now)
                if open_loop:
                    while loop.backlog and idle:
                        start(idle.pop(), now)
                    while loop.backlog and len(conns) + len(waiting) < target:
                        conn = Conn(None)
                        if connect(conn):
                            start(conn, now)
                        else:
                            waiting.append(conn)
                            break
                if waiting:
                    ready = [c for c in waiting if c.retry_at <= now]
                    for conn in ready:
                        waiting.remove(conn)
                        fl = conn.fl
                        if fl is None and not (loop.issuing or loop.backlog):
                            continue
                        if not connect(conn):
                            if fl is None and loop.issuing and not open_loop:
                                # An operation that cannot even be sent fails now, as a transport error.
                                lost = loop.new_flight(now)
                                lost.sent = now
                                complete(lost, now, wire.TRANSPORT, f"cannot connect: {self._connect_error}")
                            waiting.append(conn)
                            continue
                        if fl is not None:
                            send(conn, fl, now)
                        else:
                            start(conn, now)
                if now >= next_scan:
                    next_scan = now + TIMEOUT_SCAN_NS
                    for conn in [c for c in conns.values() if c.fl is not None and c.fl.deadline <= now]:
                        fail(conn, now, f"no answer within {loop.timing.timeout_s:g} s", wire.TIMEOUT)
                if loop.finished(in_flight):
                    break
                wake = loop.next_wake(now, 0)
                if waiting:
                    wake = min(wake, max(0.0, (min(c.retry_at for c in waiting) - now) / 1e9))
                wake = min(wake, TIMEOUT_SCAN_NS / 1e9)
                for fd, event in ep.poll(wake):
                    ready_conn = conns.get(fd)
                    if ready_conn is None or ready_conn.sock is None:
                        continue
                    now = clock()
                    if event & select.EPOLLOUT and ready_conn.out:
                        try:
                            n = ready_conn.sock.send(ready_conn.out)
                            ready_conn.out = ready_conn.out[n:]
                        except (BlockingIOError, ssl.SSLWantWriteError):
                            pass
                        except OSError as exc:
                            fail(ready_conn, now, f"send failed: {exc}")
                            continue
                        if not ready_conn.out:
                            ep.modify(fd, select.EPOLLIN)
                    if not event & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                        continue
                    self._read(ready_conn, now, fail, finished_response)
        except TargetDown as exc:
            now = clock()
            for conn in list(conns.values()) + waiting:
                if conn.fl is not None:
                    complete(conn.fl, now, wire.TRANSPORT, str(exc)[:300])
                    conn.fl = None
            loop.fail_backlog(now, wire.TRANSPORT, str(exc)[:300])
            loop.stats.ended_by = str(exc)
            self.down = str(exc)
            loop.end(now)
            raise
        finally:
            for conn in list(conns.values()):
                conn.close()
            ep.close()
        now = clock()
        for conn in list(conns.values()) + waiting:
            if conn.fl is not None:
                complete(conn.fl, now, wire.TIMEOUT, f"no answer within {loop.timing.timeout_s:g} s")
                conn.fl = None
        loop.fail_backlog(now, wire.TIMEOUT, "never sent: no connection was free in time")
        loop.end(now)

    def _read(self, conn: Conn, now: int, fail: Callable[..., None], finished: Callable[[Conn, int], None]) -> None:
        assert conn.sock is not None
        while True:
            try:
                chunk = conn.sock.recv(READ_CHUNK)
            except (BlockingIOError, ssl.SSLWantReadError):
                return
            except OSError as exc:
                fail(conn, now, f"connection failed: {exc}")
                return
            if not chunk:
                resp = conn.response
                if conn.fl is not None and resp is not None and resp.headers_done and not resp.complete \
                        and b"content-length" not in resp.headers and b"transfer-encoding" not in resp.headers:
                    resp.on_message_complete()  # a body delimited by the connection's end
                    conn.close_after = True
                    finished(conn, now)
                    return
                fail(conn, now, "the server closed the connection" + (" mid-response" if conn.fl else ""))
                return
            if conn.fl is None:
                fail(conn, now, "the server sent bytes nobody asked for")
                return
            try:
                conn.feed(chunk)
            except (httptools.HttpParserError, ValueError) as exc:
                fail(conn, now, f"malformed HTTP response: {exc}", wire.INVALID)
                return
            resp = conn.response
            assert resp is not None
            if resp.answered:
                # An SSE stream may stay open after its answer: the call is done, the connection is not reused.
                conn.close_after = conn.close_after or not resp.complete
                finished(conn, now)
                return
            if not isinstance(conn.sock, ssl.SSLSocket):
                return
