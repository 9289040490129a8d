"""Long-lived streams and shutdown, with the daemon in-process: ``list_changed`` on the legacy GET
stream and on modern listen streams (only those that asked), keep-alives, graceful shutdown."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from http_harness import BETA, drop_plugin, make_plugins, open_http, write_plugin
from httpkit import ACCEPT_BOTH, LEGACY, modern_body, modern_headers

# Both HTTP engines run the same app: toolcell's lean HTTP/1.1 loop (the default) and hypercorn.
pytestmark = pytest.mark.parametrize("engine", ["h1", "hypercorn"])

SUB_ID = "io.modelcontextprotocol/subscriptionId"


async def _lines(response: httpx2.Response) -> AsyncGenerator[str, None]:
    """The lines of ``response``'s body as they arrive. Not ``response.aiter_lines()``: closing that
    before the end leaves the ``aiter_text`` and ``aiter_bytes`` generators inside it to the garbage
    collector (a ResourceWarning from trio), while ``aiter_bytes`` closes what it iterates."""
    pending = b""
    async with aclosing(response.aiter_bytes()) as chunks:
        async for chunk in chunks:
            *complete, pending = (pending + chunk).split(b"\n")
            for line in complete:
                yield line.removesuffix(b"\r").decode()
    if pending:
        yield pending.removesuffix(b"\r").decode()


class SSEReader:
    """Reads one SSE response incrementally: JSON-RPC messages, and a count of comment lines.
    An async context manager: leaving it closes its line generator."""

    def __init__(self, response: httpx2.Response) -> None:
        self.lines = _lines(response)
        self.comments = 0

    async def __aenter__(self) -> SSEReader:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.lines.aclose()

    async def next(self, timeout_s: float = 5.0) -> dict[str, Any] | None:
        data: list[str] = []
        with trio.move_on_after(timeout_s):
            async for line in self.lines:
                if line.startswith(":"):
                    self.comments += 1
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line == "" and data:
                    return json.loads("".join(data))
        return None


async def _initialize(client: httpx2.AsyncClient, url: str) -> str:
    r = await client.post(url, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
        headers={"accept": ACCEPT_BOTH})
    sid = r.headers["mcp-session-id"]
    await client.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                      headers={"mcp-session-id": sid, "mcp-protocol-version": LEGACY, "accept": ACCEPT_BOTH})
    return sid


def _listen(notifications: dict[str, bool], id: Any) -> tuple[bytes, dict[str, str]]:
    return (modern_body("subscriptions/listen", {"notifications": notifications}, id=id),
            modern_headers("subscriptions/listen"))


async def test_list_changed_reaches_the_get_stream_and_only_the_listen_streams_that_asked(tmp_path: Path, engine: str) -> None:
    plugins = make_plugins(tmp_path / "plugins")
    async with open_http(plugins, tmp_path / "state", engine=engine, keepalive_s=0.2) as srv:  # noqa: SIM117
        async with httpx2.AsyncClient(timeout=10) as client:
            sid = await _initialize(client, srv.url)
            get_headers = {"accept": "text/event-stream", "mcp-session-id": sid, "mcp-protocol-version": LEGACY}
            tools_body, tools_headers = _listen({"toolsListChanged": True}, "tools-sub")
            prompts_body, prompts_headers = _listen({"promptsListChanged": True}, 77)
            async with client.stream("GET", srv.url, headers=get_headers) as get_stream, \
                    client.stream("POST", srv.url, content=tools_body, headers=tools_headers) as tools_stream, \
                    client.stream("POST", srv.url, content=prompts_body, headers=prompts_headers) as prompts_stream, \
                    SSEReader(get_stream) as get_reader, SSEReader(tools_stream) as tools_reader, \
                    SSEReader(prompts_stream) as prompts_reader:
                ack = await tools_reader.next()
                assert ack is not None and ack["method"] == "notifications/subscriptions/acknowledged"
                assert ack["params"]["_meta"][SUB_ID] == "tools-sub"
                ack2 = await prompts_reader.next()
                assert ack2 is not None and ack2["params"]["_meta"][SUB_ID] == 77
                assert ack2["params"]["notifications"] == {}

                await drop_plugin(srv.daemon, "beta")

                on_get = await get_reader.next()
                assert on_get == {"jsonrpc": "2.0", "method": "notifications/tools/list_changed", "params": {}}
                on_listen = await tools_reader.next()
                assert on_listen is not None and on_listen["method"] == "notifications/tools/list_changed"
                assert on_listen["params"]["_meta"][SUB_ID] == "tools-sub"
                assert await prompts_reader.next(timeout_s=0.6) is None
                assert prompts_reader.comments >= 1  # keep-alive comments while idle
            # The listing no longer has beta's tools.
            r = await client.post(srv.url, content=modern_body("tools/list"), headers=modern_headers("tools/list"))
            assert all(not t["name"].startswith("b_") for t in r.json()["result"]["tools"])


async def test_shutdown_finishes_in_flight_calls_and_ends_listen_streams_with_their_result(tmp_path: Path, engine: str) -> None:
    plugins = make_plugins(tmp_path / "plugins")
    async with open_http(plugins, tmp_path / "state", engine=engine, shutdown_grace_s=5.0) as srv:  # noqa: SIM117
        async with httpx2.AsyncClient(timeout=10) as client:
            body, headers = _listen({"toolsListChanged": True}, "L")
            results: dict[str, Any] = {}

            async def slow_call() -> None:
                r = await client.post(srv.url, content=modern_body(
                    "tools/call", {"name": "a_sleep", "arguments": {"seconds": 0.6}}, id="slow"),
                    headers=modern_headers("tools/call", "a_sleep"))
                results["call"] = r.json()

            async with client.stream("POST", srv.url, content=body, headers=headers) as listen, \
                    SSEReader(listen) as reader:
                assert (await reader.next())["method"] == "notifications/subscriptions/acknowledged"
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(slow_call)
                    await trio.sleep(0.2)
                    srv.shutdown.set()
                    end = await reader.next()
                    assert end == {"jsonrpc": "2.0", "id": "L", "result": {"resultType": "complete",
                                                                          "_meta": {SUB_ID: "L"}}}
            assert results["call"]["result"]["content"][0]["text"] == "slept"
            # No new connections are accepted any more.
            try:
                await client.get(srv.url.replace("/mcp", "/healthz"))
                raise AssertionError("a request was served after shutdown began")
            except httpx2.TransportError:
                pass


async def test_a_draining_daemon_is_alive_but_not_ready(tmp_path: Path, engine: str) -> None:
    plugins = make_plugins(tmp_path / "plugins")
    async with open_http(plugins, tmp_path / "state", engine=engine) as srv, \
            httpx2.AsyncClient(timeout=10) as client:
        base = srv.url.replace("/mcp", "")
        assert (await client.get(base + "/readyz")).status_code == 200
        srv.app.shutting_down = True  # what SIGTERM sets first, before the listeners close
        not_ready = await client.get(base + "/readyz")
        assert (not_ready.status_code, not_ready.json()) == (503, {"ready": False})
        assert (await client.get(base + "/healthz")).json()["status"] == "stopping"
        assert (await client.get(base + "/livez")).status_code == 200


async def test_concurrency_session_and_stream_caps_answer_503(tmp_path: Path, engine: str) -> None:
    plugins = make_plugins(tmp_path / "plugins")
    async with open_http(plugins, tmp_path / "state", engine=engine, max_concurrent_requests=1, max_sessions=1,  # noqa: SIM117
                         max_streams=1) as srv:
        async with httpx2.AsyncClient(timeout=10) as client:
            async def slow() -> None:
                await client.post(srv.url, content=modern_body("tools/call", {"name": "a_sleep",
                                                                                "arguments": {"seconds": 0.5}}),
                                  headers=modern_headers("tools/call", "a_sleep"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(slow)
                await trio.sleep(0.2)
                busy = await client.post(srv.url, content=modern_body("tools/list"), headers=modern_headers("tools/list"))
                assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            old_sid = await _initialize(client, srv.url)
            # The table is full (max_sessions=1) and its only session is the caller's own and idle:
            # it gives way to the new one (a full table evicts the biggest holder's idle sessions).
            sid = await _initialize(client, srv.url)
            assert sid != old_sid
            gone = await client.post(srv.url, content=b'{"jsonrpc":"2.0","id":2,"method":"ping"}',
                                     headers={"accept": ACCEPT_BOTH, "content-type": "application/json",
                                              "mcp-session-id": old_sid, "mcp-protocol-version": LEGACY})
            assert gone.status_code == 404
            body, headers = _listen({"toolsListChanged": True}, "one")
            # The stream stays open while its reader is: a closed line generator closes the stream.
            async with client.stream("POST", srv.url, content=body, headers=headers) as first, \
                    SSEReader(first) as reader:
                assert (await reader.next()) is not None
                get = await client.get(srv.url, headers={"accept": "text/event-stream", "mcp-session-id": sid})
                assert get.status_code == 503


async def test_idle_sessions_are_forgotten(tmp_path: Path, engine: str) -> None:
    plugins = make_plugins(tmp_path / "plugins")
    async with open_http(plugins, tmp_path / "state", engine=engine, session_idle_s=0.3) as srv:  # noqa: SIM117
        async with httpx2.AsyncClient(timeout=10) as client:
            sid = await _initialize(client, srv.url)
            headers = {"mcp-session-id": sid, "accept": ACCEPT_BOTH}
            ok = await client.post(srv.url, json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, headers=headers)
            assert ok.status_code == 200
            await trio.sleep(0.8)
            gone = await client.post(srv.url, json={"jsonrpc": "2.0", "id": 2, "method": "tools/list"}, headers=headers)
            assert gone.status_code == 404


async def _raw_events(response: httpx2.Response, count: int, timeout_s: float = 5.0) -> list[tuple[str | None, dict]]:
    """The next ``count`` SSE events of ``response`` as (id, JSON message) pairs."""
    events: list[tuple[str | None, dict]] = []
    event_id: str | None = None
    data: list[str] = []
    with trio.fail_after(timeout_s):
        async with aclosing(_lines(response)) as lines:
            async for line in lines:
                if line.startswith("id:"):
                    event_id = line[3:].strip()
                elif line.startswith("data:"):
                    data.append(line[5:].strip())
                elif line == "" and data:
                    events.append((event_id, json.loads("".join(data))))
                    event_id, data = None, []
                    if len(events) == count:
                        return events
    return events


async def test_a_reconnecting_get_stream_gets_what_it_missed_by_last_event_id(tmp_path: Path, engine: str) -> None:
    plugins = make_plugins(tmp_path / "plugins")
    write_plugin(plugins, "gamma", BETA, "c_")
    async with open_http(plugins, tmp_path / "state", engine=engine, keepalive_s=0.2) as srv:  # noqa: SIM117
        async with httpx2.AsyncClient(timeout=10) as client:
            sid = await _initialize(client, srv.url)
            get_headers = {"accept": "text/event-stream", "mcp-session-id": sid, "mcp-protocol-version": LEGACY}
            async with client.stream("GET", srv.url, headers=get_headers) as stream:
                await trio.sleep(0.1)
                await drop_plugin(srv.daemon, "beta")
                [(first_id, first)] = await _raw_events(stream, 1)
            assert first_id is not None and first["method"] == "notifications/tools/list_changed"
            await drop_plugin(srv.daemon, "gamma")  # while the client is away
            async with client.stream("GET", srv.url, headers={**get_headers, "last-event-id": first_id}) as again:
                missed = await _raw_events(again, 1)
            assert [m["method"] for _, m in missed] == ["notifications/tools/list_changed"]
            assert missed[0][0] is not None and int(missed[0][0]) > int(first_id)
            # Without Last-Event-ID a new stream starts empty.
            async with client.stream("GET", srv.url, headers=get_headers) as fresh:
                with trio.move_on_after(0.6):
                    assert await _raw_events(fresh, 1, timeout_s=10) == []
