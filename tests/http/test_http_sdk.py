"""Interop with the official MCP Python SDK client (``mcp`` 2.x) over streamable HTTP: a legacy
session (initialize, list, call, progress, log messages, list_changed on the GET stream) and the
modern stateless era (discover, list, call)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio
from http_harness import TOKENS, ServerProcess, drop_plugin, make_plugins, open_http
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

FULL = TOKENS["full"]


async def test_sdk_client_lists_and_calls_tools_in_a_legacy_session_with_progress_and_logs(
        locked_server: ServerProcess) -> None:
    logs: list[Any] = []

    async def on_log(params: Any) -> None:
        logs.append(params)

    http = create_mcp_http_client(headers={"authorization": f"Bearer {FULL}"})
    async with http, streamable_http_client(locked_server.url, http_client=http) as (read, write):  # noqa: SIM117
        async with ClientSession(read, write, logging_callback=on_log) as session:
            with trio.fail_after(30):
                init = await session.initialize()
                assert init.protocol_version == "2025-11-25"
                assert init.server_info.name == "toolcell"
                listed = await session.list_tools()
                names = {t.name for t in listed.tools}
                assert {"a_echo", "a_progress", "b_secret"} <= names
                echoed = await session.call_tool("a_echo", {"text": "hello sdk"})
                assert echoed.content[0].text == "hello sdk" and not echoed.is_error
                seen: list[tuple[float, float | None]] = []

                async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                    seen.append((progress, total))

                done = await session.call_tool("a_progress", {"steps": 3}, progress_callback=on_progress)
                assert done.content[0].text == "done"
                assert seen == [(1, 3), (2, 3), (3, 3)]
                await session.call_tool("a_chatty", {})
                assert any(getattr(entry, "data", None) == "hello from chatty" for entry in logs)
                bad = await session.call_tool("a_sleep", {"seconds": "not a number"})
                assert bad.is_error


async def test_sdk_client_in_the_modern_era_discovers_lists_and_calls(locked_server: ServerProcess) -> None:
    http = create_mcp_http_client(headers={"authorization": f"Bearer {TOKENS['alpha']}"})
    async with http, streamable_http_client(locked_server.url, http_client=http) as (read, write):  # noqa: SIM117
        async with ClientSession(read, write) as session:
            with trio.fail_after(30):
                found = await session.discover()
                assert "2026-07-28" in found.supported_versions
                assert session.protocol_version == "2026-07-28"
                listed = await session.list_tools()
                assert listed.tools and all(t.name.startswith("a_") for t in listed.tools)  # alpha-only scopes
                seen: list[float] = []

                async def on_progress(progress: float, total: float | None, message: str | None) -> None:
                    seen.append(progress)

                done = await session.call_tool("a_progress", {"steps": 2}, progress_callback=on_progress)
                assert done.content[0].text == "done" and seen == [1, 2]
                routed = await session.call_tool("a_routed", {"region": "Zürich", "count": 3})
                assert routed.content[0].text == "Zürich:3:False"


async def test_sdk_client_hears_list_changed_on_its_get_stream(tmp_path: Path) -> None:
    plugins = make_plugins(tmp_path / "plugins")
    changed = trio.Event()

    async def on_message(message: Any) -> None:
        root = getattr(message, "root", message)
        if getattr(root, "method", None) == "notifications/tools/list_changed":
            changed.set()

    async with open_http(plugins, tmp_path / "state") as srv, streamable_http_client(srv.url) as (read, write):  # noqa: SIM117
        async with ClientSession(read, write, message_handler=on_message) as session:
            with trio.fail_after(30):
                await session.initialize()
                before = {t.name for t in (await session.list_tools()).tools}
                assert "b_secret" in before
                await trio.sleep(0.3)  # the SDK opens its GET stream after notifications/initialized
                await drop_plugin(srv.daemon, "beta")
                await changed.wait()
                after = {t.name for t in (await session.list_tools()).tools}
                assert "b_secret" not in after and "a_echo" in after
