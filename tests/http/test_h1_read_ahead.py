"""Read-ahead on a keep-alive connection of ``runtime.transports.h1`` while the app answers a request.

While a call runs, the server reads on to notice a client that goes away (a 2026-07-28 call is
cancelled by its client's disconnect), parsing any pipelined requests behind it. Two things must
hold: what one connection buffers that way is bounded (body bytes across every request parsed
ahead, not per request), and once reading ahead has stopped at that bound a client that closes or
resets its socket is still noticed, without reading (or spinning on) the request bytes it left.
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from runtime.http_config import HttpConfig
from runtime.transports import h1
from runtime.transports.h1 import H1Server


async def _read_body(receive: Any) -> bytes | None:
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk: bytes = message.get("body", b"")
        body += chunk
        if not message.get("more_body", False):
            return body


class App:
    """``/slow`` is a long call that watches for its client's disconnect (as a 2026-07-28 call does);
    ``/echo`` reads its body with ``receive``, ``/take`` with the ``toolcell.take_body`` extension,
    ``/ignore`` answers without reading it. Each answers with the length of the body it read."""

    def __init__(self) -> None:
        self.started = trio.Event()
        self.release = trio.Event()
        self.disconnected = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        path = scope["path"]
        respond = scope["extensions"]["toolcell.respond"]
        if path == "/ignore":
            body: bytes | None = b""
        elif path == "/take":
            body = scope["extensions"]["toolcell.take_body"]()
            if body is None:
                body = await _read_body(receive)
        else:
            body = await _read_body(receive)
        if body is None:
            return
        if path == "/slow":
            self.started.set()
            async with trio.open_nursery() as nursery:
                async def watch() -> None:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        self.disconnected.set()
                        nursery.cancel_scope.cancel()  # the call is cancelled: no response

                nursery.start_soon(watch)
                await self.release.wait()
                nursery.cancel_scope.cancel()
            if self.disconnected.is_set():
                return
        out = b"%d" % len(body)
        await respond(200, [(b"content-length", b"%d" % len(out))], out)


@asynccontextmanager
async def running() -> AsyncIterator[tuple[int, App, H1Server]]:
    app = App()
    server = H1Server(app, HttpConfig())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    stop = trio.Event()
    with sock:  # the server closes it when it stops; this, when a failing test cancels it
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve, [sock], stop.wait)
            try:
                yield sock.getsockname()[1], app, server
            finally:
                stop.set()


def post(path: bytes, body: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (path, len(body), body)


def get(path: bytes) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path


def held_body_bytes(conn: Any) -> int:
    """Body bytes the connection holds for requests not yet handed to the app (ready and parsing)."""
    reqs = list(conn.ready)
    if conn.parsing is not None and all(conn.parsing is not r for r in reqs):
        reqs.append(conn.parsing)
    return sum(r.body_size for r in reqs)


async def paused_connection(server: H1Server, app: App) -> Any:
    """The one connection, once the slow call runs and reading ahead has stopped."""
    with trio.fail_after(20):
        await app.started.wait()
        (conn,) = server.connections
        while conn._can_read_ahead():  # noqa: ASYNC110 - the server's own state; nothing to wait on
            await trio.sleep(0.005)
    return conn


async def read_responses(stream: trio.SocketStream, count: int) -> list[bytes]:
    buf = b""
    bodies: list[bytes] = []
    with trio.fail_after(30):
        while len(bodies) < count:
            head, sep, rest = buf.partition(b"\r\n\r\n")
            if sep:
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                if len(rest) >= length:
                    assert head.startswith(b"HTTP/1.1 200 ")
                    bodies.append(rest[:length])
                    buf = rest[length:]
                    continue
            chunk = await stream.receive_some(65536)
            assert chunk, "closed before all responses arrived"
            buf += chunk
    return bodies


async def test_pipelined_bodies_behind_a_slow_call_are_bounded_per_connection() -> None:
    """19 requests, 18 with 1 MiB bodies, pipelined behind a slow call: the connection stops reading once
    the bodies it holds reach the per-connection bound (it held ~16 MiB when the bound was per
    request); each body taken or dropped is counted off, so afterwards it holds nothing."""
    big = b"b" * h1.MAX_BUFFERED_BODY
    # First a body the app leaves unread (it has all arrived by then: read ahead behind the slow
    # call; one still arriving would close the connection), then big ones it reads both ways.
    requests = [(b"/ignore", b"i" * 100_000)] + [(b"/echo", big), (b"/take", big)] * 9
    async with running() as (port, app, server):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream, trio.open_nursery() as nursery:
            nursery.start_soon(stream.send_all, post(b"/slow", b"s") + b"".join(post(p, b) for p, b in requests))
            conn = await paused_connection(server, app)
            assert held_body_bytes(conn) <= h1.MAX_BUFFERED_BODY + h1.READ_SIZE
            assert conn.buffered == held_body_bytes(conn)
            app.release.set()
            bodies = await read_responses(stream, 1 + len(requests))
            assert bodies == [b"1"] + [b"0" if p == b"/ignore" else b"%d" % len(b) for p, b in requests]
            # Every body was handed over or dropped with its request: the count is back to zero.
            assert conn.buffered == 0 and held_body_bytes(conn) == 0 and not conn.ready
            # And the connection is still good.
            await stream.send_all(post(b"/echo", b"after"))
            assert await read_responses(stream, 1) == [b"5"]


@pytest.mark.parametrize("how", ["close", "reset"])
@pytest.mark.parametrize("paused_by", ["count", "bytes"])
async def test_a_client_gone_after_read_ahead_paused_cancels_the_slow_call(how: str, paused_by: str) -> None:
    """A client pipelines enough to stop the server reading ahead (too many requests, or too many
    body bytes), sends one more request the server leaves unread, and goes away: the slow call's
    ``receive`` still returns ``http.disconnect``, and while waiting the server does not spin."""
    if paused_by == "count":
        pipelined = b"".join(get(b"/echo") for _ in range(h1.MAX_PIPELINED + 4))
    else:
        pipelined = post(b"/echo", b"b" * h1.MAX_BUFFERED_BODY)
    async with running() as (port, app, server):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            with trio.fail_after(20):
                await stream.send_all(post(b"/slow", b"s") + pipelined)
            conn = await paused_connection(server, app)
            await stream.send_all(get(b"/unread"))  # left in the socket: the server is not reading
            # Paused with request bytes waiting in the socket, every task sleeps (no busy loop).
            with trio.fail_after(10):
                await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert not app.disconnected.is_set() and not conn.eof
            if how == "reset":
                stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        with trio.fail_after(10):
            await app.disconnected.wait()
        assert not app.release.is_set()


async def test_one_read_of_thousands_of_tiny_pipelined_requests_is_cut_at_max_parsed() -> None:
    """One read of tiny pipelined requests used to become one request object each (about 3,600 in
    64 KiB, before any app ran). Past ``MAX_PARSED`` parsed and unanswered, the rest of the read is
    refused: the requests already parsed are answered in order, then a 503, then the connection closes."""
    tiny = b"GET /ignore HTTP/1.1\r\nHost: x\r\n\r\n"
    async with running() as (port, _app, server):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(tiny * (60_000 // len(tiny)))
            data = b""
            with trio.fail_after(20):
                while True:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        break
                    data += chunk
                    conns = list(server.connections)
                    if conns:
                        assert len(conns[0].ready) <= h1.MAX_PARSED
        statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]
        assert statuses[-1] == 503 and b"pipelined requests at once" in data
        assert statuses[:-1] == [200] * len(statuses[:-1]) and h1.MAX_PARSED <= len(statuses) - 1 < 3 * h1.MAX_PARSED


async def test_pipelined_requests_up_to_max_parsed_in_one_write_are_all_answered() -> None:
    tiny = b"GET /ignore HTTP/1.1\r\nHost: x\r\n\r\n"
    async with running() as (port, _app, _server):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(tiny * (h1.MAX_PARSED - 1))
            data = b""
            with trio.fail_after(20):
                while data.count(b"HTTP/1.1 200 ") < h1.MAX_PARSED - 1:
                    chunk = await stream.receive_some(65536)
                    assert chunk, "closed before every request was answered"
                    data += chunk
            await stream.send_all(tiny)  # and the connection is still good
            with trio.fail_after(5):
                while data.count(b"HTTP/1.1 200 ") < h1.MAX_PARSED:
                    data += await stream.receive_some(65536)
