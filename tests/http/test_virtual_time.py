"""Timeouts, expiry and rate limits of the HTTP app on trio's virtual clock (``autojump_clock``).

No socket and no process: the ASGI app is called in memory, and an hour of session idleness or a
30-second body deadline passes in microseconds of real time. The clock is what is under test here,
not the network (the socket-level tests are in test_h1.py and test_lockdown.py).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing

from runtime.config import Config
from runtime.daemon import Daemon
from runtime.http_config import HttpConfig, RateLimit
from runtime.transports.http import HttpApp

JSON_HEADERS = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                (b"accept", b"application/json, text/event-stream")]
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
LIST = {"jsonrpc": "2.0", "id": 2, "method": "tools/list"}


@asynccontextmanager
async def app_with(tmp_path: Any, **http: Any) -> AsyncIterator[HttpApp]:
    """An HttpApp over a daemon with no plugins (nothing to start), its housekeeping running."""
    config = Config(plugins=[str(tmp_path)], policy="none", watch=False, state_dir=str(tmp_path / "state"))
    async with trio.open_nursery() as nursery:
        daemon = Daemon(config, nursery)
        daemon.publish()
        daemon.ready = True
        app = HttpApp(daemon, HttpConfig(**http))
        nursery.start_soon(app.housekeeping)
        try:
            yield app
        finally:
            app.close()
            nursery.cancel_scope.cancel()


async def post(app: HttpApp, message: Any, headers: list[tuple[bytes, bytes]] | None = None,
               body_arrives: bool = True) -> tuple[int, dict[bytes, bytes], Any]:
    """One POST through the ASGI app, in memory. ``body_arrives=False``: the body never comes."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered and body_arrives:
            delivered = True
            return {"type": "http.request", "body": json.dumps(message).encode(), "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(event: dict[str, Any]) -> None:
        sent.append(event)

    scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": JSON_HEADERS + (headers or []),
             "query_string": b"", "http_version": "1.1"}
    await app(scope, receive, send)
    start = next(e for e in sent if e["type"] == "http.response.start")
    body = b"".join(e.get("body", b"") for e in sent if e["type"] == "http.response.body")
    return start["status"], dict(start["headers"]), json.loads(body) if body else None


async def test_an_idle_legacy_session_expires_after_session_idle_s_and_not_before(
        tmp_path: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with app_with(tmp_path, session_idle_s=3600.0) as app:
        status, headers, _ = await post(app, INIT)
        assert status == 200
        sid = headers[b"mcp-session-id"]
        await trio.sleep(1800)  # half an hour of virtual time: still there, and this use resets the clock
        status, _, body = await post(app, LIST, [(b"mcp-session-id", sid)])
        assert status == 200 and body["result"]["tools"] == []
        await trio.sleep(3000)
        assert (await post(app, LIST, [(b"mcp-session-id", sid)]))[0] == 200
        await trio.sleep(3600 + 3600 / 4 + 1)  # idle for longer than session_idle_s (plus one sweep)
        status, _, body = await post(app, LIST, [(b"mcp-session-id", sid)])
        assert status == 404 and body["error"]["code"] == -32001
        assert len(app.sessions) == 0


async def test_a_principal_over_its_rate_limit_waits_exactly_until_its_next_token(
        tmp_path: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with app_with(tmp_path, principal_rate=RateLimit(per_s=0.5, burst=2)) as app:
        assert (await post(app, INIT))[0] == 200
        assert (await post(app, INIT))[0] == 200
        status, headers, body = await post(app, INIT)
        assert status == 429 and headers[b"retry-after"] == b"2"
        assert body["error"]["code"] == -31003 and body["error"]["data"]["retryAfterMs"] == 2000
        await trio.sleep(1.9)
        assert (await post(app, INIT))[0] == 429
        await trio.sleep(0.2)  # 2 s after the burst was spent: one token
        assert (await post(app, INIT))[0] == 200
        assert app.rate_limited["principal"] == 2


async def test_a_body_that_never_arrives_gets_408_at_body_timeout_s(
        tmp_path: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with app_with(tmp_path, body_timeout_s=30.0) as app:
        start = trio.current_time()
        status, headers, _ = await post(app, INIT, body_arrives=False)
        assert status == 408 and headers[b"connection"] == b"close"
        assert 30.0 <= trio.current_time() - start < 30.1


async def test_a_parked_handler_wakes_on_news_on_its_timer_or_on_cancellation_and_a_wake_with_nobody_parked_is_not_kept(
        autojump_clock: trio.testing.MockClock) -> None:
    from runtime.transports.http_sessions import CallBox

    box = CallBox(stream=False)
    box.wake()  # nobody parked: nothing is kept (the handler checks for work before it parks)
    assert box.task is None and box.woken
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_done_after, box, 3.0)
        started = trio.current_time()
        await box.park()
        assert box.final == b"answer" and trio.current_time() - started == 3.0 and box.task is None
        box.unpark()  # a timer that fires after the news: no effect
    timer = CallBox(stream=False)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_unpark_after, timer, 0.05)
        await timer.park()
        assert timer.final is None and not timer.woken  # the timer ended the wait, without news
    with trio.move_on_after(1.0) as scope:
        await CallBox(stream=False).park()
    assert scope.cancelled_caught  # cancellation ends a park cleanly


async def _done_after(box: Any, delay: float) -> None:
    await trio.sleep(delay)
    box.done(b"answer")
    box.wake()  # a second wake: the task is already rescheduled, nothing happens twice


async def _unpark_after(box: Any, delay: float) -> None:
    await trio.sleep(delay)
    box.unpark()


async def test_allowed_host_values_are_remembered_but_a_foreign_one_is_still_refused_and_the_memory_is_bounded(
        tmp_path: Any) -> None:
    async def with_host(app: HttpApp, host: bytes) -> int:
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": json.dumps(INIT).encode(), "more_body": False}

        async def send(event: dict[str, Any]) -> None:
            sent.append(event)

        headers = [(b"host", host), *JSON_HEADERS[1:]]
        await app({"type": "http", "method": "POST", "path": "/mcp", "headers": headers, "query_string": b""},
                  receive, send)
        return int(next(e for e in sent if e["type"] == "http.response.start")["status"])

    async with app_with(tmp_path) as app:
        assert await with_host(app, b"127.0.0.1:8000") == 200
        assert await with_host(app, b"127.0.0.1:8000") == 200  # served from memory
        # Only allowed values are kept: a foreign one is refused every time, and never remembered.
        for _ in range(2):
            assert await with_host(app, b"evil.example.com") == 403
        assert b"evil.example.com" not in app._hosts_seen
        # Every port of an allowed name is a different value: the memory stops growing at 256.
        for port in range(300):
            assert await with_host(app, b"localhost:%d" % port) == 200
        assert len(app._hosts_seen) == 256
        assert await with_host(app, b"localhost:65000") == 200  # beyond it: checked, not kept
        assert await with_host(app, b"evil.example.com:80") == 403


async def test_a_whole_body_over_the_cap_handed_over_by_the_server_gets_413_without_a_content_length(
        tmp_path: Any) -> None:
    # A chunked body has no Content-Length to refuse it early: the whole body taken from the server
    # (the toolcell.take_body extension) is measured before anything reads it.
    async with app_with(tmp_path, max_body_bytes=1024) as app:
        sent: list[dict[str, Any]] = []
        big = json.dumps({**LIST, "params": {"pad": "x" * 4096}}).encode()

        async def receive() -> dict[str, Any]:
            raise AssertionError("the body was handed over whole; receive is not for it")

        async def send(event: dict[str, Any]) -> None:
            sent.append(event)

        scope = {"type": "http", "method": "POST", "path": "/mcp", "headers": JSON_HEADERS, "query_string": b"",
                 "extensions": {"toolcell.take_body": lambda: big}}
        await app(scope, receive, send)
        start = next(e for e in sent if e["type"] == "http.response.start")
        assert start["status"] == 413 and (b"connection", b"close") in start["headers"]


async def test_a_batch_costs_one_token_per_message_and_one_larger_than_the_burst_is_refused(
        tmp_path: Any, autojump_clock: trio.testing.MockClock) -> None:
    """A 2025-03-26 batch is not a way round the principal's rate limit: it takes a token per message
    (all or none), and a batch that could never fit the burst is refused with a reason, not a retry."""
    init = {**INIT, "params": {**INIT["params"], "protocolVersion": "2025-03-26"}}
    async with app_with(tmp_path, principal_rate=RateLimit(per_s=0.5, burst=3)) as app:
        status, headers, _ = await post(app, init)  # 1 token; 2 left
        assert status == 200
        session = [(b"mcp-session-id", headers[b"mcp-session-id"]), (b"mcp-protocol-version", b"2025-03-26")]

        def batch(n: int) -> list[dict[str, Any]]:
            return [{**LIST, "id": 10 + i} for i in range(n)]

        status, headers, body = await post(app, batch(3), session)
        assert status == 429 and body["error"]["data"]["retryAfterMs"] == 2000  # one token short
        status, _, body = await post(app, batch(4), session)
        assert status == 400 and "more than principal" in body["error"]["message"]
        await trio.sleep(2)  # 3 tokens
        status, _, body = await post(app, batch(3), session)
        assert status == 200 and sorted(m["id"] for m in body) == [10, 11, 12]
        assert (await post(app, LIST, session))[0] == 429  # the batch spent them all


async def test_one_principal_cannot_take_every_stream_or_request_slot(
        tmp_path: Any, autojump_clock: trio.testing.MockClock) -> None:
    """Each principal gets a share of the global caps: alice at her stream share is refused another
    listen while bob still opens one, and her open listens do not count as requests in progress."""
    import hashlib

    from runtime.http_config import Token

    def token(name: str) -> Token:
        return Token(principal=name, sha256=hashlib.sha256(name.encode()).hexdigest())

    def as_(name: str) -> list[tuple[bytes, bytes]]:
        return [(b"authorization", b"Bearer " + name.encode()), (b"mcp-protocol-version", b"2026-07-28"),
                (b"mcp-method", b"subscriptions/listen")]

    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}
    listen = {"jsonrpc": "2.0", "id": 1, "method": "subscriptions/listen",
              "params": {"notifications": {"toolsListChanged": True}, "_meta": meta}}
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {"_meta": meta}}
    async with app_with(tmp_path, tokens=[token("alice"), token("bob")], max_streams=10, max_streams_per_principal=2,
                        max_concurrent_requests=10, max_requests_per_principal=1) as app:
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(post, app, listen, as_("alice"))
            await trio.sleep(1)
            assert app.streams == 2 and app.active == 0  # streams, not requests in progress
            status, headers, body = await post(app, listen, as_("alice"))
            assert status == 503 and "principal alice has 2 streams open" in body["error"]["message"]
            assert headers[b"retry-after"] == b"5"
            nursery.start_soon(post, app, listen, as_("bob"))
            await trio.sleep(1)
            assert app.streams == 3 and app.streams_by == {"alice": 2, "bob": 1}
            list_headers = [(b"authorization", b"Bearer alice"), (b"mcp-protocol-version", b"2026-07-28"),
                            (b"mcp-method", b"tools/list")]
            assert (await post(app, listing, list_headers))[0] == 200  # her listens hold no request slot
            nursery.cancel_scope.cancel()
    assert app.streams == 0 and app.streams_by == {} and app.active == 0 and app.active_by == {}


async def test_a_principal_at_its_share_of_requests_in_progress_is_refused_and_others_are_served(
        tmp_path: Any, autojump_clock: trio.testing.MockClock) -> None:
    import hashlib

    from runtime.http_config import Token

    tokens = [Token(principal=n, sha256=hashlib.sha256(n.encode()).hexdigest()) for n in ("alice", "bob")]
    async with app_with(tmp_path, tokens=tokens, max_concurrent_requests=10, max_requests_per_principal=2,
                        body_timeout_s=30.0) as app:
        async with trio.open_nursery() as nursery:
            for _ in range(2):  # requests whose bodies never come: each holds a slot until body_timeout_s
                nursery.start_soon(partial_post, app, [(b"authorization", b"Bearer alice")])
            await trio.sleep(1)
            assert app.active_by == {"alice": 2}
            status, headers, body = await post(app, INIT, [(b"authorization", b"Bearer alice")])
            assert status == 503 and "for principal alice" in body["error"]["message"]
            assert headers[b"retry-after"] == b"1"
            assert (await post(app, INIT, [(b"authorization", b"Bearer bob")]))[0] == 200
        assert app.active == 0 and app.active_by == {}  # the two timed out (408) and gave their slots back


async def partial_post(app: HttpApp, headers: list[tuple[bytes, bytes]]) -> None:
    assert (await post(app, INIT, headers, body_arrives=False))[0] == 408


async def test_a_duplicate_host_through_plain_asgi_gets_400_as_on_the_h1_server(tmp_path: Any) -> None:
    """The ASGI path (hypercorn) builds the headers from the scope: the same rule holds there."""
    async with app_with(tmp_path) as app:
        status, _, body = await post(app, INIT, [(b"host", b"evil.example")])
        assert status == 400 and "Host header appears more than once" in body["error"]["message"]
        status, _, _ = await post(app, INIT)
        assert status == 200
