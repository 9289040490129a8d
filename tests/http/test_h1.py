"""toolcell's HTTP/1.1 engine (``runtime.transports.h1``) on raw sockets, with small ASGI apps.

What a server must get right whatever the app does: keep-alive and pipelining in order, chunked
bodies both ways, ``Expect: 100-continue``, HEAD, HTTP/1.0 and ``Connection: close``, the
header caps (including one header line that never ends), malformed requests never reaching the
app, an app that raises or tries to inject a header, client disconnects reaching the app,
timeouts, the connection cap and a graceful stop.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from runtime.http_config import HttpConfig
from runtime.transports.h1 import H1Server

# -- a small ASGI app ---------------------------------------------------------------------------


class App:
    """Echo the request (method, path, query, body) as the response body; a few special paths."""

    def __init__(self) -> None:
        self.calls = 0
        self.disconnected = trio.Event()
        self.release = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls += 1
        path = scope["path"]
        if path == "/ext":  # the toolcell.* extensions, as HttpApp uses them
            ext = scope["extensions"]
            wanted = ext["toolcell.headers"]
            first = ext["toolcell.take_body"]()
            again = ext["toolcell.take_body"]()
            if first is None:  # not all there yet: the ASGI way
                first = b""
                while True:
                    message = await receive()
                    first += message.get("body", b"")
                    if not message.get("more_body", False):
                        break
                how = b"receive"
            else:
                how = b"take_body"
            out = b"%s|%s|%s|%s|%s" % (how, first, b"again" if again is not None else b"once",
                                      wanted.get(b"mcp-session-id") or b"-", wanted.params.get(b"region") or b"-")
            if wanted.duplicate is not None:
                out += b"|" + wanted.duplicate
            await ext["toolcell.respond"](201, [(b"content-length", b"%d" % len(out)), (b"x-kind", b"ext")], out)
            return
        if path == "/early":  # answers before reading the body, like an auth or media-type rejection
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-length", b"6")]})
            await send({"type": "http.response.body", "body": b"denied"})
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if path == "/boom":
            raise ValueError("app bug")
        if path == "/big":  # a whole response far larger than the socket's buffers
            big = bytes(range(256)) * (32 * 1024)  # 8 MiB
            await scope["extensions"]["toolcell.respond"](200, [(b"content-length", b"%d" % len(big))], big)
            return
        if path == "/ext-inject":
            await scope["extensions"]["toolcell.respond"](200, [(b"x-evil", b"a\nset-cookie: stolen=1")], b"never")
            return
        if path == "/inject":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"x-evil", b"a\r\nset-cookie: stolen=1")]})
            await send({"type": "http.response.body", "body": b"never"})
            return
        if path == "/wait-disconnect":
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected.set()
            return
        if path == "/sse":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await self.release.wait()
            await send({"type": "http.response.body", "body": b"data: late\n\n", "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        if path == "/slow":
            await self.release.wait()
        if path == "/stream":
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
            for part in (b"one,", b"two,", b"three"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        out = b"%s %s ?%s [%s]" % (scope["method"].encode(), scope["raw_path"], scope["query_string"], body)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})


class Server:
    def __init__(self, port: int, app: Any, stop: trio.Event, server: H1Server) -> None:
        self.port = port
        self.app = app
        self.stop = stop
        self.server = server


@asynccontextmanager
async def running(app: Any = None, **cfg: Any) -> AsyncIterator[Server]:
    """A server on a free port serving ``app`` (by default the echo ``App`` above)."""
    config = HttpConfig(**cfg)
    app = App() if app is None else app
    server = H1Server(app, config)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, [sock], stop.wait)
        try:
            yield Server(sock.getsockname()[1], app, stop, server)
        finally:
            stop.set()


class Client:
    """A raw connection that reads whole responses (Content-Length or chunked framing)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = b""

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _fill(self) -> bool:
        chunk = await self.stream.receive_some(65536)
        self.buf += chunk
        return bool(chunk)

    async def response(self, is_head: bool = False, within_s: float = 5.0) -> tuple[int, dict[bytes, bytes], bytes]:
        with trio.fail_after(within_s):
            while b"\r\n\r\n" not in self.buf:
                if not await self._fill():
                    raise EOFError(f"closed before a response head: {self.buf!r}")
            head, _, self.buf = self.buf.partition(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            status = int(lines[0].split(b" ")[1])
            headers: dict[bytes, bytes] = {}
            for line in lines[1:]:
                name, _, value = line.partition(b":")
                assert name.lower() not in headers, f"duplicate header {name!r}"
                headers[name.lower()] = value.strip()
            if status < 200 or is_head:
                return status, headers, b""
            if headers.get(b"transfer-encoding") == b"chunked":
                body = b""
                while True:
                    while b"\r\n" not in self.buf:
                        assert await self._fill(), "closed inside a chunked body"
                    size_line, _, rest = self.buf.partition(b"\r\n")
                    size = int(size_line, 16)
                    while len(rest) < size + 2:
                        assert await self._fill(), "closed inside a chunk"
                        size_line, _, rest = self.buf.partition(b"\r\n")
                    body += rest[:size]
                    self.buf = rest[size + 2:]
                    if size == 0:
                        return status, headers, body
            length = int(headers.get(b"content-length", b"0"))
            while len(self.buf) < length:
                assert await self._fill(), "closed inside a body"
            body, self.buf = self.buf[:length], self.buf[length:]
            return status, headers, body

    async def closed(self, within_s: float = 5.0) -> bool:
        """True when the server closes the connection (EOF) within ``within_s``."""
        with trio.move_on_after(within_s):
            try:
                while await self._fill():
                    pass
            except trio.BrokenResourceError:
                pass
            return True
        return False


@asynccontextmanager
async def client(srv: Server) -> AsyncIterator[Client]:
    stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
    async with stream:
        yield Client(stream)


def post(path: bytes, body: bytes, *extra: bytes) -> bytes:
    head = [b"POST " + path + b" HTTP/1.1", b"Host: localhost", b"Content-Length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


# -- keep-alive, pipelining, bodies -------------------------------------------------------------


async def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    async with running() as srv, client(srv) as c:
        await c.send(post(b"/a?x=1", b"first"))
        status, headers, body = await c.response()
        assert (status, body) == (200, b"POST /a ?x=1 [first]")
        assert b"date" in headers and b"connection" not in headers
        # Three requests in one write: three responses, in order, on the same connection.
        await c.send(post(b"/b", b"2") + post(b"/c", b"3") + b"GET /d HTTP/1.1\r\nHost: x\r\n\r\n")
        assert [(await c.response())[2] for _ in range(3)] == [b"POST /b ? [2]", b"POST /c ? [3]", b"GET /d ? []"]
        assert srv.app.calls == 4


async def test_an_app_winding_down_gets_every_connection_closed_after_its_response() -> None:
    """A draining replica still answers, but keeps no connection for a balancer to reuse: an idle
    kept-alive connection would race a request sent on it at the moment the listener closes."""
    app = App()
    winding = False
    app.winding_down = lambda: winding  # type: ignore[attr-defined]
    async with running(app) as srv, client(srv) as c:
        await c.send(post(b"/a", b"1"))
        status, headers, _ = await c.response()
        assert status == 200 and b"connection" not in headers
        winding = True
        await c.send(post(b"/b", b"2"))
        status, headers, body = await c.response()
        assert (status, body) == (200, b"POST /b ? [2]") and headers[b"connection"] == b"close"
        assert await c.closed()


async def test_chunked_request_body_is_reassembled_and_streamed_responses_are_chunked() -> None:
    async with running() as srv, client(srv) as c:
        await c.send(b"POST /e HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     b"5\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\n\r\n")
        assert (await c.response())[2] == b"POST /e ? [hello world]"
        await c.send(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await c.response()
        assert headers[b"transfer-encoding"] == b"chunked" and b"content-length" not in headers
        assert body == b"one,two,three"
        # The connection is still usable after a streamed response.
        await c.send(post(b"/f", b"ok"))
        assert (await c.response())[2] == b"POST /f ? [ok]"


async def test_a_streamed_response_sends_its_head_before_the_first_event() -> None:
    async with running() as srv, client(srv) as c:
        await c.send(b"GET /sse HTTP/1.1\r\nHost: x\r\n\r\n")
        with trio.fail_after(5):
            while b"\r\n\r\n" not in c.buf:
                assert await c._fill()
        assert c.buf.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding: chunked" in c.buf
        srv.app.release.set()
        status, _, body = await c.response()
        assert (status, body) == (200, b"data: late\n\n")


async def test_a_streamed_response_to_an_http10_client_is_ended_by_closing_not_chunked() -> None:
    """RFC 9112 7.1: a server must not send Transfer-Encoding to an HTTP/1.0 request."""
    async with running() as srv, client(srv) as c:
        await c.send(b"GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        with trio.fail_after(5):
            while await c._fill():
                pass
        head, _, body = bytes(c.buf).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and b"transfer-encoding" not in head.lower()
        assert b"connection: close" in head.lower() and b"content-length" not in head.lower()
        assert body == b"one,two,three"


async def test_expect_100_continue_gets_the_interim_response_before_the_body_is_sent() -> None:
    async with running() as srv, client(srv) as c:
        await c.send(b"POST /g HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        status, _, _ = await c.response()
        assert status == 100
        await c.send(b"body")
        assert (await c.response())[2] == b"POST /g ? [body]"


async def test_head_http10_and_connection_close() -> None:
    async with running() as srv:
        async with client(srv) as c:
            await c.send(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, body = await c.response(is_head=True)
            assert status == 200 and body == b"" and int(headers[b"content-length"]) > 0
            await c.send(post(b"/after-head", b""))
            assert (await c.response())[2] == b"POST /after-head ? []"
        async with client(srv) as c:
            await c.send(b"GET /old HTTP/1.0\r\n\r\n")
            status, headers, body = await c.response()
            assert body == b"GET /old ? []" and headers[b"connection"] == b"close"
            assert await c.closed()
        async with client(srv) as c:
            await c.send(post(b"/bye", b"", b"Connection: close"))
            assert (await c.response())[1][b"connection"] == b"close"
            assert await c.closed()


# -- bad input never reaches the app ------------------------------------------------------------


@pytest.mark.parametrize("request_bytes", [
    b"GARBAGE\r\n\r\n",
    b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
    b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: x\r\nBad Header: \x00\r\n\r\n",
    b"GET /x HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n",
    b"GET http://a:99999999/x HTTP/1.1\r\nHost: x\r\n\r\n",  # llhttp takes it; the URL parser does not
])
async def test_malformed_requests_get_400_and_the_app_never_runs(request_bytes: bytes) -> None:
    async with running() as srv, client(srv) as c:
        await c.send(request_bytes)
        status, headers, _ = await c.response()
        assert status == 400 and headers[b"connection"] == b"close"
        assert await c.closed()
        assert srv.app.calls == 0


async def test_header_caps_answer_431_even_for_a_header_line_that_never_ends() -> None:
    async with running(max_header_bytes=4096) as srv:
        async with client(srv) as c:
            await c.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * 5000 + b"\r\n\r\n")
            assert (await c.response())[0] == 431
        async with client(srv) as c:
            many = b"".join(b"X-%d: 1\r\n" % i for i in range(300))
            await c.send(b"GET / HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n")
            assert (await c.response())[0] == 431
        async with client(srv) as c:
            # One header value growing forever: the server must stop reading and answer, not buffer it.
            await c.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Endless: ")
            status = None
            with trio.move_on_after(10):
                try:
                    for _ in range(400):  # up to 10 MiB
                        await c.send(b"a" * 26214)
                except (trio.BrokenResourceError, OSError):
                    pass
                status = (await c.response())[0]
            assert status == 431
        assert srv.app.calls == 0


async def test_an_app_that_raises_gets_500_and_one_that_injects_a_header_is_refused() -> None:
    async with running() as srv:
        async with client(srv) as c:
            await c.send(post(b"/boom", b""))
            assert (await c.response())[0] == 500
            assert await c.closed()
        async with client(srv) as c:
            await c.send(post(b"/inject", b""))
            status, headers, body = await c.response()
            assert status == 500 and b"set-cookie" not in headers and body != b"never"
        async with client(srv) as c:  # and the server goes on serving
            await c.send(post(b"/fine", b"1"))
            assert (await c.response())[2] == b"POST /fine ? [1]"


async def test_h2c_upgrade_is_answered_over_http11_and_the_connection_closes() -> None:
    async with running() as srv, client(srv) as c:
        await c.send(b"GET /up HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
                     b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n")
        status, headers, body = await c.response()
        assert (status, body) == (200, b"GET /up ? []") and headers[b"connection"] == b"close"
        assert await c.closed()


# -- disconnects, timeouts, caps, stop ----------------------------------------------------------


async def test_a_client_disconnect_reaches_the_app() -> None:
    async with running() as srv:
        async with client(srv) as c:
            await c.send(post(b"/wait-disconnect", b"x"))
            await trio.sleep(0.1)
        with trio.fail_after(5):
            await srv.app.disconnected.wait()


async def test_idle_connections_close_and_a_slow_head_gets_408(autojump_clock: trio.testing.MockClock) -> None:
    # Virtual time: a 75-second keep-alive passes at once (loopback data is there before the clock jumps).
    async with running(idle_timeout_s=75.0) as srv:
        async with client(srv) as c:
            await c.send(post(b"/a", b""))
            await c.response()
            assert await c.closed(within_s=120)  # idle after the response: closed by the keep-alive timeout
        async with client(srv) as c:
            await c.send(b"POST /slow-loris HTTP/1.1\r\nHost: x\r\n")  # and never the rest of the head
            started = trio.current_time()
            status, headers, _ = await c.response(within_s=120)
            assert 75.0 <= trio.current_time() - started < 76.0
            assert status == 408 and headers[b"connection"] == b"close"
        assert srv.app.calls == 1


async def test_connections_over_the_cap_get_503() -> None:
    async with running(max_connections=2) as srv, client(srv) as a, client(srv) as b:
        await a.send(post(b"/1", b""))
        await b.send(post(b"/2", b""))
        await a.response()
        await b.response()
        async with client(srv) as c:
            status, _, body = await c.response()
            assert status == 503 and b"too many connections" in body


async def test_graceful_stop_finishes_the_request_in_flight_and_closes_idle_connections() -> None:
    async with running(shutdown_grace_s=5) as srv, client(srv) as busy, client(srv) as idle:
        await idle.send(post(b"/warm", b""))
        await idle.response()
        await busy.send(post(b"/slow", b"x"))
        await trio.sleep(0.1)
        srv.stop.set()
        assert await idle.closed()
        srv.app.release.set()
        status, headers, body = await busy.response()
        assert (status, body) == (200, b"POST /slow ? [x]") and headers[b"connection"] == b"close"
        assert await busy.closed()
        with pytest.raises(OSError):
            await trio.open_tcp_stream("127.0.0.1", srv.port)


# -- edges found by fault injection ----------------------------------------------------------------


async def test_bare_crlfs_do_not_keep_an_idle_connection_open(autojump_clock: trio.testing.MockClock) -> None:
    async with running(idle_timeout_s=30.0) as srv:
        async with client(srv) as c:
            closed = False
            with trio.move_on_after(180):
                while True:
                    try:
                        await c.send(b"\r\n")
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        closed = True
                        break
                    with trio.move_on_after(0.1):
                        try:
                            if not await c._fill():
                                closed = True
                                break
                        except (trio.BrokenResourceError, trio.ClosedResourceError):
                            closed = True  # reset by the server: closed as well
                            break
            assert closed, "a client sending bare CRLFs was never timed out"


async def test_an_early_rejection_says_connection_close_when_the_body_was_not_read() -> None:
    async with running() as srv:
        async with client(srv) as c:
            await c.send(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"x" * 10)
            status, headers, body = await c.response()
            assert status == 401 and body == b"denied"
            assert headers.get(b"connection") == b"close"
            assert await c.closed()


async def test_an_early_answer_after_the_whole_body_arrived_keeps_the_connection() -> None:
    async with running() as srv:
        async with client(srv) as c:
            await c.send(post(b"/early", b"small") + post(b"/next", b""))
            status, headers, _ = await c.response()
            assert status == 401 and b"connection" not in headers
            status, _, body = await c.response()
            assert status == 200 and body.startswith(b"POST /next")


@pytest.mark.parametrize("framing", [
    b"zz\r\nhello\r\n0\r\n\r\n",                         # not a hex size
    b"-5\r\nhello\r\n0\r\n\r\n",                         # negative size
    b"ffffffffffffffffffffff\r\nhello\r\n0\r\n\r\n",     # overflowing size
    b"5\r\nhelloEXTRA\r\n0\r\n\r\n",                     # data longer than its size
])
async def test_malformed_chunked_framing_gets_400_and_close(framing: bytes) -> None:
    async with running() as srv:
        async with client(srv) as c:
            await c.send(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + framing)
            status, headers, _ = await c.response()
            assert status == 400 and headers[b"connection"] == b"close"
            assert await c.closed()


@pytest.mark.parametrize("head", [
    b"Transfer-Encoding: chunked, gzip",                  # chunked not last
    b"Transfer-Encoding: chunked\r\nContent-Length: 5",  # both framings
])
async def test_ambiguous_body_framing_gets_400(head: bytes) -> None:
    async with running() as srv:
        async with client(srv) as c:
            await c.send(b"POST /a HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n\r\n5\r\nhello\r\n0\r\n\r\n")
            status, headers, _ = await c.response()
            assert status == 400 and headers[b"connection"] == b"close"
        assert srv.app.calls == 0


# -- toolcell's extensions (what HttpApp uses on this server) ------------------------------------


async def test_the_extensions_give_the_gathered_headers_a_body_once_and_a_whole_response_in_one_call() -> None:
    async with running() as srv, client(srv) as c:
        await c.send(post(b"/ext", b"hello", b"Mcp-Session-Id: s1", b"MCP-Param-Region: eu", b"MCP-Param-Region: us"))
        status, headers, body = await c.response()
        # The body came whole from take_body, and only once; a repeated header is joined, and
        # remembered as a duplicate (which HttpApp refuses: test_lockdown).
        assert (status, body) == (201, b"take_body|hello|once|s1|eu,us|mcp-param-region")
        assert headers[b"x-kind"] == b"ext" and headers[b"content-length"] == b"%d" % len(body) and b"date" in headers
        # The connection is reused, and a plain ASGI request after it still reads its body with receive.
        await c.send(post(b"/a", b"plain"))
        assert (await c.response())[2] == b"POST /a ? [plain]"


async def test_a_body_still_on_its_way_is_not_taken_and_comes_through_receive() -> None:
    async with running() as srv, client(srv) as c:
        head = post(b"/ext", b"late body")
        await c.send(head[: -len(b"late body")])  # the head now, the body after the app has started
        await trio.sleep(0.05)
        await c.send(b"late body")
        status, _, body = await c.response()
        assert (status, body) == (201, b"receive|late body|once|-|-")


async def test_a_whole_response_with_a_cr_or_lf_in_a_header_is_refused_with_500() -> None:
    async with running() as srv, client(srv) as c:
        await c.send(post(b"/ext-inject", b""))
        status, headers, body = await c.response()
        assert status == 500 and b"set-cookie" not in headers and b"never" not in body
        assert await c.closed()


async def test_a_response_larger_than_the_socket_buffers_waits_for_a_slow_reader_and_arrives_whole() -> None:
    async with running() as srv, client(srv) as c:
        await c.send(post(b"/big", b""))
        await trio.sleep(0.3)  # the server's send fills the buffers and must wait for room, not spin or drop
        status, headers, body = await c.response(within_s=30)
        assert status == 200 and body == bytes(range(256)) * (32 * 1024)
        await c.send(post(b"/a", b"after"))  # and the connection is still good
        assert (await c.response())[2] == b"POST /a ? [after]"


async def test_a_client_gone_in_the_middle_of_a_large_response_costs_only_its_connection() -> None:
    async with running() as srv:
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        await stream.send_all(post(b"/big", b""))
        await stream.receive_some(1024)  # the response has begun
        await stream.aclose()  # gone, with megabytes still to come
        async with client(srv) as c:  # the server serves on
            await c.send(post(b"/a", b"next"))
            assert (await c.response())[2] == b"POST /a ? [next]"
