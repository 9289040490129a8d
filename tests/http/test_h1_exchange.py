"""``runtime.transports.h1`` with an app that takes the exchange itself (``serve_exchange``), as
``HttpApp`` does: no ASGI scope is built for it, and ``respond_json`` writes the common answer
(``200``, a JSON body) from a head made of constants.

What must hold on that path exactly as on the ASGI one: the request the app reads (method, decoded
path, the gathered headers, the body once), the keep-alive rules of the response head (a request
whose body was not read, HTTP/1.0, ``Connection: close``, a graceful stop all close), HEAD leaving
the body out, a bad target or an app's exception never taking the server down.
"""

from __future__ import annotations

import json
from typing import Any

import trio
from test_h1 import client, post, running

from runtime.transports import h1
from runtime.transports.asgi import Exchange


class DirectApp:
    """Answers with what it read of the request, as JSON, through ``respond_json``. ``/raise``
    raises; ``/slow`` waits for ``release``; ``/early`` answers without taking the body."""

    def __init__(self) -> None:
        self.seen: list[Any] = []
        self.release = trio.Event()
        self.started = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise AssertionError("an app with serve_exchange is never called with an ASGI scope")

    async def serve_exchange(self, x: Exchange) -> None:
        self.seen.append(x)
        if x.path == "/raise":
            raise ValueError("app bug")
        if x.path == "/slow":
            self.started.set()
            await self.release.wait()
        body = None if x.path == "/early" else x.take_body()
        again = x.take_body()
        out = {"method": x.method, "path": x.path, "body": None if body is None else body.decode(),
               "again": again is not None, "session": (x.headers.get(b"mcp-session-id") or b"").decode(),
               "region": (x.headers.params.get(b"region") or b"").decode(), "size": x.headers.size,
               "host": (x.headers.get(b"host") or b"").decode()}
        await x.respond_json(json.dumps(out).encode())


async def test_the_exchange_carries_the_request_and_respond_json_keeps_the_connection() -> None:
    async with running(DirectApp()) as srv, client(srv) as c:
        app = srv.app
        await c.send(post(b"/mcp", b'{"a":1}', b"Mcp-Session-Id: s1", b"MCP-Param-Region: eu",
                          b"Mcp-Param-Region: us", b"X-Other: 1"))
        status, headers, body = await c.response()
        assert status == 200
        assert headers[b"content-type"] == b"application/json" and int(headers[b"content-length"]) == len(body)
        assert b"date" in headers and b"connection" not in headers
        seen = json.loads(body)
        assert seen["method"] == "POST" and seen["path"] == "/mcp" and seen["body"] == '{"a":1}'
        assert seen["again"] is False  # the body is given once
        assert seen["session"] == "s1" and seen["region"] == "eu,us"  # repeated headers are joined
        assert seen["size"] > 0
        # The raw header lines are not kept for an app that never sees a scope.
        assert app.seen[0].req.headers is None
        # Same connection, a target with escapes and a query: the path is decoded, the query dropped.
        await c.send(b"PATCH /a%20b?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        status, headers, body = await c.response()
        assert status == 200 and json.loads(body)["path"] == "/a b" and json.loads(body)["method"] == "PATCH"
        # A method llhttp knows that is not in the small table of names still reads as itself.
        await c.send(b"PROPFIND /p HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        assert json.loads((await c.response())[2])["method"] == "PROPFIND"


async def test_respond_json_closes_when_the_client_asked_or_the_body_was_not_read() -> None:
    async with running(DirectApp()) as srv:
        async with client(srv) as c:
            await c.send(post(b"/mcp", b"{}", b"Connection: close"))
            status, headers, _ = await c.response()
            assert status == 200 and headers[b"connection"] == b"close"
            assert await c.closed()
        async with client(srv) as c:
            await c.send(b"POST /mcp HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}")
            status, headers, _ = await c.response()
            assert status == 200 and headers[b"connection"] == b"close"
            assert await c.closed()
        async with client(srv) as c:
            # Answered before its body arrived: the rest of it is never read, so the connection ends.
            await c.send(b"POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\nxx")
            status, headers, body = await c.response()
            assert status == 200 and json.loads(body)["body"] is None and headers[b"connection"] == b"close"
            assert await c.closed()


async def test_respond_json_to_head_sends_the_head_only() -> None:
    async with running(DirectApp()) as srv, client(srv) as c:
        await c.send(b"HEAD /mcp HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = await c.response(is_head=True)
        assert status == 200 and body == b"" and int(headers[b"content-length"]) > 0
        assert headers[b"content-type"] == b"application/json"
        # Nothing of the body was written: the next response follows the head directly.
        await c.send(post(b"/next", b""))
        status, _, body = await c.response()
        assert status == 200 and json.loads(body)["path"] == "/next"


async def test_respond_json_during_a_graceful_stop_says_close() -> None:
    async with running(DirectApp(), shutdown_grace_s=5) as srv, client(srv) as c:
        app, stop = srv.app, srv.stop
        await c.send(post(b"/slow", b"{}"))
        with trio.fail_after(5):
            await app.started.wait()
        stop.set()
        await trio.sleep(0.05)
        app.release.set()
        status, headers, _ = await c.response()
        assert status == 200 and headers[b"connection"] == b"close"
        assert await c.closed()


async def test_a_bad_target_and_an_app_that_raises_fail_only_their_request() -> None:
    async with running(DirectApp()) as srv:
        app = srv.app
        async with client(srv) as c:
            await c.send(b"GET http://[::1 HTTP/1.1\r\nHost: x\r\n\r\n")
            status, headers, _ = await c.response()
            assert status == 400 and headers[b"connection"] == b"close"
        assert app.seen == []  # the app never saw it
        async with client(srv) as c:
            await c.send(post(b"/raise", b""))
            status, headers, _ = await c.response()
            assert status == 500 and headers[b"connection"] == b"close"
        async with client(srv) as c:  # and the server goes on
            await c.send(post(b"/mcp", b"{}"))
            assert (await c.response())[0] == 200


def test_a_response_already_started_cannot_be_answered_again() -> None:
    class _Conn:
        pass

    req = h1._Request(keep_raw=False)
    exchange = h1._Exchange(_Conn(), req)  # type: ignore[arg-type]
    exchange.status = 200
    try:
        exchange.respond_json(b"{}")
    except RuntimeError as exc:
        assert "already started" in str(exc)
    else:
        raise AssertionError("a second answer was accepted")


async def test_an_absolute_form_target_s_authority_is_the_host_the_app_checks() -> None:
    """RFC 9112 3.2.2: with ``POST http://authority/path`` an origin server uses that authority and
    ignores the Host header; the app's Host check (DNS rebinding) must read the same."""
    async with running(DirectApp()) as srv, client(srv) as c:
        await c.send(b"POST http://evil.example:8080/mcp?x=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
        seen = json.loads((await c.response())[2])
        assert seen["host"] == "evil.example:8080" and seen["path"] == "/mcp"
        await c.send(b"GET http://[::1]:9/x HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert json.loads((await c.response())[2])["host"] == "[::1]:9"
        await c.send(b"GET /origin-form HTTP/1.1\r\nHost: 127.0.0.1:5\r\n\r\n")
        assert json.loads((await c.response())[2])["host"] == "127.0.0.1:5"
