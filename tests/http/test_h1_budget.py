"""The unauthenticated connection budget of ``runtime.transports.h1`` (issue 23, finding 4).

A client with no token must not lock token holders out by holding connections: before a request on
it passes authentication, a connection counts against a budget of its own (a share of
``max_connections``, a cap per client address), gets ``head_timeout_s`` for a whole head, and is
the first to go (oldest first) when a newcomer needs room. Each test measures a token holder being
served while an attacker holds, or keeps taking, every unauthenticated slot; small limits, and
virtual time for the timeouts. The attacker connects from 127.0.0.2 (all of 127/8 is loopback on
Linux), the token holder from 127.0.0.1, so the per-address cap sees two clients.
"""

from __future__ import annotations

import errno
import socket
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio
import trio.testing
from test_h1 import Client, Server, running

from runtime.transports import h1

GOOD = b"Bearer good"
ATTACKER = "127.0.0.2"


class VouchingApp:
    """Answers 200 to ``Authorization: Bearer good`` (and vouches for its connection), else 401:
    what ``HttpApp`` does, in small."""

    vouches_for_connections = True

    def __init__(self) -> None:
        self.served = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        ext = scope["extensions"]
        if ext["toolcell.headers"].get(b"authorization") != GOOD:
            await ext["toolcell.respond"](401, [(b"content-length", b"6")], b"denied")
            return
        ext["toolcell.authenticated"]()
        self.served += 1
        await ext["toolcell.respond"](200, [(b"content-length", b"2")], b"ok")


def request(token: bytes = GOOD) -> bytes:
    return b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nAuthorization: " + token + b"\r\nContent-Length: 0\r\n\r\n"


@asynccontextmanager
async def budget_server(**cfg: Any) -> AsyncIterator[Server]:
    async with running(VouchingApp(), **cfg) as srv:
        yield srv


async def connect(srv: Server, source: str = "127.0.0.1") -> Client:
    return Client(await trio.open_tcp_stream("127.0.0.1", srv.port, local_address=source))


async def served(srv: Server) -> bool:
    """A token holder's new connection: one request, answered 200."""
    c = await connect(srv)
    async with c.stream:
        await c.send(request())
        status, _, body = await c.response()
        return (status, body) == (200, b"ok")


async def settle() -> None:
    """Let the server accept and register what was connected (loopback: a few scheduler turns)."""
    await trio.sleep(0.05)


async def test_a_token_holder_is_served_while_an_attacker_holds_every_unauthenticated_slot() -> None:
    async with budget_server(max_connections=8, max_unauthenticated_connections=4,
                             max_unauthenticated_per_address=4) as srv, AsyncExitStack() as held:
        # Authenticated before the flood: its keep-alive connection is never touched.
        early = await connect(srv)
        held.push_async_callback(early.stream.aclose)
        await early.send(request())
        assert (await early.response())[0] == 200
        for round_ in range(3):
            # The attacker fills (and refills) every unauthenticated slot with heads begun, never ended,
            # and more than the budget, as an attacker would.
            for _ in range(6):
                c = await connect(srv, ATTACKER)
                held.push_async_callback(c.stream.aclose)
                await c.send(b"POST /mcp HTTP/1.1\r\nHost: localhost\r\n")
            await settle()
            assert len(srv.server.unauthenticated) == 4
            assert all(c.source == ATTACKER for c in srv.server.unauthenticated)
            assert await served(srv), f"round {round_}: a new token holder was not served"
            await early.send(request())
            assert (await early.response())[0] == 200, f"round {round_}: the authenticated connection was cut"
        assert srv.app.served == 7
        assert len(srv.server.connections) <= 8


async def test_connections_refused_401_and_left_idle_stay_in_the_unauthenticated_budget() -> None:
    """After an authentication attempt that failed, a connection is still unauthenticated: holding
    many such (each asked once, then idle) locks nobody out either."""
    async with budget_server(max_connections=6, max_unauthenticated_connections=3,
                             max_unauthenticated_per_address=3) as srv, AsyncExitStack() as held:
        for _ in range(5):
            c = await connect(srv, ATTACKER)
            held.push_async_callback(c.stream.aclose)
            await c.send(request(b"Bearer wrong"))
            status, headers, _ = await c.response()
            assert status == 401 and b"connection" not in headers  # kept alive, as HTTP allows
        await settle()
        assert len(srv.server.unauthenticated) == 3
        for _ in range(3):
            assert await served(srv)
        assert not srv.server.unauthenticated_by_source.get("127.0.0.1")  # the token holder's left


async def test_the_attackers_extra_connections_evict_its_own_oldest_not_another_clients() -> None:
    async with budget_server(max_connections=16, max_unauthenticated_connections=8,
                             max_unauthenticated_per_address=2) as srv, AsyncExitStack() as held:
        # A slow but honest client has a connection open and has not sent its head yet.
        slow = await connect(srv, "127.0.0.3")
        held.push_async_callback(slow.stream.aclose)
        attackers = []
        for _ in range(5):
            c = await connect(srv, ATTACKER)
            held.push_async_callback(c.stream.aclose)
            attackers.append(c)
        await settle()
        by_source = {k: len(v) for k, v in srv.server.unauthenticated_by_source.items()}
        assert by_source == {"127.0.0.3": 1, ATTACKER: 2}
        assert await attackers[0].closed(within_s=1)  # evicted, oldest first
        await slow.send(request())
        assert (await slow.response())[0] == 200


async def test_an_unauthenticated_head_gets_head_timeout_s_and_an_authenticated_one_idle_timeout_s(
        autojump_clock: trio.testing.MockClock) -> None:
    async with budget_server(head_timeout_s=5.0, idle_timeout_s=60.0) as srv:
        # Never a whole head, and never any byte: both are cut after head_timeout_s.
        for first_bytes in (b"POST /mcp HTTP/1.1\r\nHost: x\r\n", b""):
            c = await connect(srv, ATTACKER)
            async with c.stream:
                if first_bytes:
                    await c.send(first_bytes)
                started = trio.current_time()
                status, _, body = await c.response(within_s=30)
                assert 5.0 <= trio.current_time() - started < 6.0
                assert status == 408 and b"head_timeout_s" in body
        # Authenticated: keep-alive idle and a slow next head get idle_timeout_s, as before.
        c = await connect(srv)
        async with c.stream:
            await c.send(request())
            assert (await c.response())[0] == 200
            await trio.sleep(30)
            await c.send(b"POST /mcp HTTP/1.1\r\nHost: x\r\n")
            started = trio.current_time()
            status, _, _ = await c.response(within_s=120)
            assert 60.0 <= trio.current_time() - started < 61.0 and status == 408
        await settle()
        assert not srv.server.connections and not srv.server.unauthenticated
        assert not srv.server.unauthenticated_by_source


async def test_an_app_that_never_vouches_keeps_the_old_rules() -> None:
    """An ASGI app that knows nothing of authentication is not put under the budget (it would
    never leave it): every connection counts as vouched for, and only ``max_connections`` holds."""
    async with running(max_connections=4) as srv, AsyncExitStack() as held:
        for _ in range(3):
            c = await connect(srv, ATTACKER)
            held.push_async_callback(c.stream.aclose)
        await settle()
        assert not srv.server.unauthenticated and len(srv.server.connections) == 3


class NoRoomListener(socket.socket):
    """A listening socket whose accept fails with EMFILE while ``fail`` is set."""

    fail = False
    failures = 0

    def accept(self) -> tuple[socket.socket, Any]:
        if self.fail:
            self.failures += 1
            raise OSError(errno.EMFILE, "Too many open files")
        return super().accept()


async def test_out_of_descriptors_on_accept_evicts_the_oldest_unauthenticated_connection() -> None:
    app = VouchingApp()
    server = h1.H1Server(app, h1.HttpConfig(max_unauthenticated_per_address=8))
    base = socket.socket()
    base.bind(("127.0.0.1", 0))
    listener = NoRoomListener(fileno=base.detach())
    port = listener.getsockname()[1]
    stop = trio.Event()
    async with trio.open_nursery() as nursery, AsyncExitStack() as held:
        await nursery.start(server.serve, [listener], stop.wait)
        srv = Server(port, app, stop, server)
        idle = []
        for _ in range(3):
            c = await connect(srv, ATTACKER)
            held.push_async_callback(c.stream.aclose)
            idle.append(c)
        await settle()
        assert len(server.unauthenticated) == 3
        listener.fail = True
        # A token holder's connection waits in the listen queue; each failed accept makes room by
        # closing the oldest unauthenticated connection, and retries at once.
        pending = await connect(srv)
        held.push_async_callback(pending.stream.aclose)
        await pending.send(request())
        with trio.fail_after(5):
            while server.unauthenticated:
                await trio.sleep(0.01)
        assert server.evicted == 3
        assert await idle[0].closed(within_s=1)
        # With nothing left to evict, accept backs off (no spin) until there is room again.
        before = listener.failures
        await trio.sleep(0.35)
        assert 1 <= listener.failures - before <= 5
        listener.fail = False
        status, _, body = await pending.response()
        assert (status, body) == (200, b"ok")
        stop.set()


async def test_after_a_hostile_round_with_every_connection_closed_no_connection_is_still_tracked() -> None:
    """Issue 23 finding 10: what a hostile run leaves behind. Malformed requests, connections
    held idle (some evicted), slow heads, requests cut by a reset, 401s: once every client has gone,
    the server's tables (connections, the unauthenticated budget, by address) are empty again."""
    async with budget_server(max_connections=64, max_unauthenticated_connections=16,
                             max_unauthenticated_per_address=4) as srv:
        async with AsyncExitStack() as held:
            for i in range(40):
                c = await connect(srv, f"127.0.0.{2 + i % 8}")
                held.push_async_callback(c.stream.aclose)
                kind = i % 5
                if kind == 0:
                    await c.send(b"GARBAGE\r\n\r\n")
                elif kind == 1:
                    await c.send(b"POST /mcp HTTP/1.1\r\nHost: x\r\n")  # never ends
                elif kind == 2:
                    await c.send(request(b"Bearer wrong"))
                elif kind == 3:
                    await c.send(request())
                    await c.response()  # authenticated, then idle
                else:
                    await c.send(request() + request())
                    c.stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            await settle()
            assert srv.server.evicted > 0 and srv.server.connections
        with trio.fail_after(5):
            while srv.server.connections:
                await trio.sleep(0.01)
        assert not srv.server.unauthenticated and not srv.server.unauthenticated_by_source
