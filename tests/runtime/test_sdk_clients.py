"""End to end with the official MCP Python SDK client (``mcp``) over stdio, for a legacy and a modern client.

The SDK spawns ``python -m runtime.cli serve --stdio`` itself (``stdio_client``). ``legacy`` uses the
initialize handshake (it negotiates 2025-11-25); ``2026-07-28`` is a modern client with no
handshake; ``auto`` probes ``server/discover`` first.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import tomllib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import probe_plugins
import pytest
import trio
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.shared.exceptions import MCPError
from stdio_peer import BUNDLED, CONFORMANCE, REPO, open_log, wait_gone

MODES = ["legacy", "2026-07-28"]
WAIT_S = 20.0

pytestmark = pytest.mark.filterwarnings("ignore:The logging capability is deprecated")


@pytest.fixture
def plugins(make_plugin: Callable[..., Path]) -> Path:
    make_plugin("probe", probe_plugins.PROBE, limits={"timeout_s": 10, "max_concurrency": 3})
    return make_plugin("deadline", probe_plugins.DEADLINE, limits={"timeout_s": 0.5})


def server(*plugin_dirs: Path, policy: str | None = "none", extra: tuple[str, ...] = ("--no-watch",)
           ) -> StdioServerParameters:
    args = ["-m", "runtime.cli", "serve", "--stdio", *extra]
    for d in plugin_dirs:
        args += ["--plugins", str(d)]
    if policy is not None:
        args += ["--policy", policy]
    return StdioServerParameters(command=sys.executable, args=args, cwd=str(REPO))


@asynccontextmanager
async def connect(params: StdioServerParameters, mode: str, errlog: Path, **kwargs: Any) -> AsyncIterator[Client]:
    with open_log(errlog, "w") as err, trio.fail_after(WAIT_S):
        async with Client(stdio_client(params, errlog=err), mode=mode, **kwargs) as client:
            yield client


def text(result: Any) -> str:
    return " ".join(c.text for c in result.content if c.type == "text")


async def all_tool_names(client: Client) -> tuple[list[str], int]:
    names: list[str] = []
    cursor = None
    pages = 0
    while True:
        page = await client.list_tools(cursor=cursor, cache_mode="refresh")
        pages += 1
        names += [t.name for t in page.tools]
        cursor = page.next_cursor
        if cursor is None:
            return names, pages
        assert pages < 100


PROBE_TOOLS = {"echo", "pid", "crash", "garbage", "big", "slow", "chatty", "fail", "noisy", "add", "deep"}
DEADLINE_TOOLS = {"sleepy", "escape", "escape_quietly", "quick", "flood_channel"}
def _conformance_tool_names() -> set[str]:
    """The bundled conformance plugin's tools, as its own module registers them (imported here, in
    the test process: it is our fixture, not untrusted code)."""
    import importlib.util

    from sandbox import api

    before = len(api.TOOLS)
    spec = importlib.util.spec_from_file_location("_conformance_fixture", CONFORMANCE / "conformance.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    names = {t.name for t in api.TOOLS[before:]}
    del api.TOOLS[before:]
    return names


CONFORMANCE_TOOLS = _conformance_tool_names()
assert {"test_simple_text", "test_error_handling", "json_schema_2020_12_tool", "test_sampling"} <= CONFORMANCE_TOOLS


@pytest.mark.parametrize("mode", MODES)
async def test_the_sdk_client_lists_every_tool_across_pages_of_two(mode: str, plugins: Path, tmp_path: Path) -> None:
    params = server(plugins, CONFORMANCE, extra=("--no-watch", "--page-size", "2"))
    async with connect(params, mode, tmp_path / "daemon.log") as client:
        assert client.protocol_version == ("2025-11-25" if mode == "legacy" else "2026-07-28")
        names, pages = await all_tool_names(client)
        first = await client.list_tools(cache_mode="refresh")
        again = await client.list_tools(cursor=first.next_cursor, cache_mode="refresh")
        again_2 = await client.list_tools(cursor=first.next_cursor, cache_mode="refresh")
    expected = PROBE_TOOLS | DEADLINE_TOOLS | CONFORMANCE_TOOLS
    assert names == sorted(expected)
    assert pages == math.ceil(len(expected) / 2)
    assert len(first.tools) == 2
    assert [t.name for t in again.tools] == [t.name for t in again_2.tools] == names[2:4]


@pytest.mark.parametrize("mode", MODES)
async def test_the_sdk_client_calls_tools_and_receives_progress_and_log_notifications(
        mode: str, plugins: Path, tmp_path: Path) -> None:
    logs: list[Any] = []
    progress: list[tuple[float, float | None, str | None]] = []

    async def on_log(params: Any) -> None:
        logs.append(params)

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, total, message))

    modern_opt_in = {} if mode == "legacy" else {"log_level": "info"}
    async with connect(server(plugins, CONFORMANCE), mode, tmp_path / "daemon.log", logging_callback=on_log,
                       **modern_opt_in) as client:
        await all_tool_names(client)  # lets the SDK validate structured results against outputSchema
        echoed = await client.call_tool("echo", {"text": "hello through a worker"})
        assert text(echoed) == "hello through a worker" and not echoed.is_error
        added = await client.call_tool("add", {"a": 20, "b": 22})
        assert added.structured_content == {"result": 42}
        assert json.loads(text(added)) == {"result": 42}
        simple = await client.call_tool("test_simple_text", {})
        assert text(simple) == "This is a simple text response for testing."

        with_progress = await client.call_tool("test_tool_with_progress", {}, progress_callback=on_progress)
        assert text(with_progress) == "Tool with progress executed successfully"
        assert [(p, t) for p, t, _ in progress] == [(0, 100), (50, 100), (100, 100)]
        assert progress[-1][2] == "Completed step 100 of 100"

        if mode == "legacy":
            await client.set_logging_level("info")
        logged = await client.call_tool("test_tool_with_logging", {})
        assert text(logged) == "Tool with logging executed successfully"
        assert [entry.data for entry in logs] == ["Tool execution started", "Tool processing data",
                                                  "Tool execution completed"]
        assert all(entry.level == "info" for entry in logs)

        if mode == "legacy":
            await client.set_logging_level("error")
        else:
            logs.clear()
        before = len(logs)
        await client.call_tool("test_tool_with_logging", {}, meta={"io.modelcontextprotocol/logLevel": "error"}
                               if mode != "legacy" else None)
        assert len(logs) == before  # below the level: nothing more arrives


async def test_a_modern_client_that_does_not_opt_in_gets_no_log_messages(plugins: Path, tmp_path: Path) -> None:
    logs: list[Any] = []

    async def on_log(params: Any) -> None:
        logs.append(params)

    async with connect(server(CONFORMANCE), "2026-07-28", tmp_path / "daemon.log", logging_callback=on_log) as client:
        result = await client.call_tool("test_tool_with_logging", {})
        assert not result.is_error
    assert logs == []


@pytest.mark.parametrize("mode", MODES)
async def test_the_sdk_client_gets_error_results_for_bad_arguments_timeouts_and_raising_tools(
        mode: str, plugins: Path, tmp_path: Path) -> None:
    async with connect(server(plugins, CONFORMANCE), mode, tmp_path / "daemon.log") as client:
        invalid = await client.call_tool("echo", {"text": 5})
        assert invalid.is_error and "text" in text(invalid)
        missing = await client.call_tool("echo", {})
        assert missing.is_error and "text" in text(missing)

        late = await client.call_tool("sleepy", {"seconds": 30})
        assert late.is_error and "timed out" in text(late)

        raised = await client.call_tool("fail", {"message": "no such widget"})
        assert raised.is_error
        assert "no such widget" in text(raised) and "Traceback" not in text(raised)

        fixture = await client.call_tool("test_error_handling", {})
        assert fixture.is_error and text(fixture) == "This tool intentionally returns an error for testing"

        with pytest.raises(MCPError) as excinfo:
            await client.call_tool("no_such_tool", {})
        assert excinfo.value.error.code == -32602

        assert text(await client.call_tool("quick", {})) == "quick"


@pytest.mark.parametrize("mode", MODES)
async def test_the_sdk_client_cancels_a_slow_call_and_its_worker_is_killed(
        mode: str, plugins: Path, tmp_path: Path) -> None:
    reported = trio.Event()
    box: dict[str, Any] = {}

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        match = re.fullmatch(r"pid=(\d+)", message or "")
        if match:
            box["pid"] = int(match.group(1))
            reported.set()

    async with connect(server(plugins), mode, tmp_path / "daemon.log") as client:
        scope = trio.CancelScope()

        async def slow_call() -> None:
            with scope:
                box["result"] = await client.call_tool("slow", {"seconds": 60}, progress_callback=on_progress)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(slow_call)
            with trio.fail_after(WAIT_S):
                await reported.wait()
            scope.cancel()
        assert "result" not in box
        await wait_gone(box["pid"])  # the courtesy notifications/cancelled stopped the worker
        after = await client.call_tool("pid", {})
        assert int(text(after)) != box["pid"]
        assert text(await client.call_tool("echo", {"text": "next"})) == "next"


async def test_an_auto_mode_client_discovers_the_modern_era(plugins: Path, tmp_path: Path) -> None:
    async with connect(server(CONFORMANCE), "auto", tmp_path / "daemon.log") as client:
        assert client.protocol_version == "2026-07-28"
        assert client.server_info is not None and client.server_info.name == "toolcell"
        assert client.server_capabilities.tools is not None
        assert text(await client.call_tool("test_simple_text", {})) == "This is a simple text response for testing."


async def test_the_default_strict_policy_serves_the_bundled_plugins(tmp_path: Path) -> None:
    # No --policy: the default (strict) isolation must work with the bundled plugins.
    log = tmp_path / "daemon.log"
    async with connect(server(policy=None), "legacy", log) as client:
        names, _ = await all_tool_names(client)
        assert CONFORMANCE_TOOLS <= set(names)
        digest = await client.call_tool("codec_hash", {"data": "abc"})
        assert not digest.is_error, text(digest)
        assert hashlib.sha256(b"abc").hexdigest() in text(digest)
        assert text(await client.call_tool("test_simple_text", {})) == "This is a simple text response for testing."
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    serving = next(r for r in records if r.get("event") == "serving")
    assert serving["policy"] == "strict"
    assert serving["refused"] == 0
    assert not any(r.get("event") == "isolation_disabled" for r in records)


async def test_an_sdk_client_that_disconnects_leaves_the_daemon_to_exit_by_itself(tmp_path: Path) -> None:
    """The SDK closes stdin, waits 2 s, then sends SIGTERM: the daemon must be gone before that."""
    log = tmp_path / "daemon.log"
    async with connect(server(CONFORMANCE, extra=()), "legacy", log) as client:
        await client.list_tools()
    events = [json.loads(line).get("event") for line in log.read_text().splitlines() if line.startswith("{")]
    assert "shutdown_started" not in events and "shutdown_forced" not in events
    assert events[-1] == "stopped"


async def test_every_bundled_plugin_is_loaded_by_the_time_the_first_answer_arrives(tmp_path: Path) -> None:
    log = tmp_path / "daemon.log"
    async with connect(server(BUNDLED), "legacy", log) as client:
        names, _ = await all_tool_names(client)  # the first listing, right after the handshake
    bundled = sorted(p.name for p in BUNDLED.iterdir() if (p / "plugin.toml").is_file())
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    loaded = sorted(r["plugin"] for r in records if r.get("event") == "plugin_loaded")
    assert loaded == bundled
    serving = next(r for r in records if r.get("event") == "serving")
    assert serving["refused"] == 0 and serving["plugins"] == len(bundled)
    assert len(names) == serving["tools"]
    for plugin in bundled:
        prefix = _manifest_prefix(BUNDLED / plugin)
        if prefix:
            assert any(n.startswith(prefix) for n in names), (plugin, prefix)
    assert CONFORMANCE_TOOLS <= set(names)


def _manifest_prefix(folder: Path) -> str:
    return str(tomllib.loads((folder / "plugin.toml").read_text()).get("prefix", ""))
