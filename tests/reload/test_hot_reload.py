"""Hot reload seen by a real client: the official MCP SDK client over stdio, and the daemon in-process.

Each step edits plugin files on disk while the client stays connected, waits (bounded) until the
daemon logs that the reload triggered by that edit is done, then checks what the client received:
exactly one ``notifications/tools/list_changed`` per effective change, none otherwise.
"""

from __future__ import annotations

import json
import shutil
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import trio
from mcp import types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from runtime.config import Config
from runtime.daemon import open_daemon
from runtime.protocol.core import ConnState, ToolCall

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 20.0


def write_plugin(root: Path, name: str, tools: dict[str, str], extra: str = "") -> Path:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plugin.toml").write_text(f'name = "{name}"\nversion = "1.0"\nentry = "{name}"\n')
    body = ["from sandbox import tool", ""]
    for tool_name, returns in tools.items():
        body += ["@tool", f"def {tool_name}(x: int = 0) -> str:", f'    """Tool {tool_name}."""', f"    return {returns!r}", ""]
    (folder / f"{name}.py").write_text("\n".join(body) + extra)
    return folder


class LogWatch:
    """Reads the daemon's JSON log lines from its stderr file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == name:
                out.append(rec)
        return out

    async def wait_for(self, name: str, count: int) -> list[dict[str, Any]]:
        with trio.fail_after(WAIT_S):
            while len(self.events(name)) < count:
                await trio.sleep(0.05)
        return self.events(name)


async def test_an_sdk_client_hears_exactly_one_list_changed_per_effective_change(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    write_plugin(plugins, "alpha", {"a1": "one"})
    write_plugin(plugins, "beta", {"b1": "bee"})
    errlog = tmp_path / "stderr.log"
    changes: list[Any] = []

    async def on_message(message: Any) -> None:
        if isinstance(getattr(message, "root", message), types.ToolListChangedNotification):
            changes.append(message)

    params = StdioServerParameters(command=sys.executable, cwd=str(REPO),
                                   args=["-m", "runtime.cli", "serve", "--stdio", "--policy", "none",
                                         "--plugins", str(plugins)])
    logs = LogWatch(errlog)
    with open(errlog, "w") as err:
        async with stdio_client(params, errlog=err) as (read, write):
            async with ClientSession(read, write, message_handler=on_message) as session:
                with trio.fail_after(WAIT_S):
                    init = await session.initialize()
                assert init.capabilities.tools is not None and init.capabilities.tools.list_changed is True

                async def names() -> list[str]:
                    with trio.fail_after(WAIT_S):
                        return [t.name for t in (await session.list_tools()).tools]

                async def step(expect_changes: int) -> None:
                    done = len(logs.events("reload_done"))
                    await logs.wait_for("reload_done", done + 1)
                    with trio.fail_after(WAIT_S):
                        while len(changes) < expect_changes:
                            await trio.sleep(0.02)
                    await trio.sleep(0.3)  # a duplicate notification would arrive by now
                    assert len(changes) == expect_changes

                assert await names() == ["a1", "b1"]

                write_plugin(plugins, "gamma", {"g1": "gee"})  # add
                await step(1)
                assert await names() == ["a1", "b1", "g1"]

                write_plugin(plugins, "alpha", {"a1": "one", "a2": "two"})  # modify
                await step(2)
                assert await names() == ["a1", "a2", "b1", "g1"]

                (plugins / "alpha" / "alpha.py").write_text((plugins / "alpha" / "alpha.py").read_text())  # touch only
                await step(2)

                (plugins / "alpha" / "alpha.py").write_text("this is not python(\n")  # break
                await step(2)
                failed = await logs.wait_for("plugin_reload_failed", 1)
                assert "SyntaxError" in json.dumps(failed[-1]["problems"])
                assert await names() == ["a1", "a2", "b1", "g1"]
                with trio.fail_after(WAIT_S):
                    result = await session.call_tool("a2", {})
                assert not result.is_error and result.content[0].text == "two"  # the last good version serves

                write_plugin(plugins, "alpha", {"a1": "one", "a3": "three"})  # fix (with a change)
                await step(3)
                assert await names() == ["a1", "a3", "b1", "g1"]
                with trio.fail_after(WAIT_S):
                    result = await session.call_tool("a3", {})
                assert result.content[0].text == "three"

                shutil.rmtree(plugins / "gamma")  # remove
                await step(4)
                assert await names() == ["a1", "a3", "b1"]


async def test_calls_running_during_a_reload_finish_on_the_old_workers(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    folder = write_plugin(plugins, "slowpoke", {}, extra=textwrap.dedent('''
        import time

        @tool
        def nap(seconds: float) -> str:
            """Sleep, then say which version answered."""
            time.sleep(seconds)
            return "v1"
    '''))
    async with open_daemon(Config(plugins=[str(plugins)], policy="none", watch=False)) as daemon:
        state = ConnState()
        daemon.core.receive(state, b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{}}}')
        call = daemon.core.receive(state, b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"nap","arguments":{"seconds":0.6}}}')
        assert isinstance(call, ToolCall)
        results: list[bytes] = []

        async def run() -> None:
            results.append(await daemon.execute(call, lambda data: None))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await trio.sleep(0.2)
            (folder / "slowpoke.py").write_text((folder / "slowpoke.py").read_text().replace('"v1"', '"v2"'))
            with trio.fail_after(WAIT_S):
                await daemon.reload()
            again = daemon.core.receive(state, b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"nap","arguments":{"seconds":0}}}')
            with trio.fail_after(WAIT_S):
                fresh = await daemon.execute(again, lambda data: None)
        assert json.loads(results[0])["result"]["content"][0]["text"] == "v1"
        assert json.loads(fresh)["result"]["content"][0]["text"] == "v2"


async def test_a_cursor_from_before_a_reload_continues_after_the_last_name_seen(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    write_plugin(plugins, "many", {f"t{i}": "x" for i in range(6)})
    async with open_daemon(Config(plugins=[str(plugins)], policy="none", watch=False, page_size=2)) as daemon:
        state = ConnState()
        daemon.core.receive(state, b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{}}}')
        first = json.loads(daemon.core.receive(state, b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}').data)["result"]
        assert [t["name"] for t in first["tools"]] == ["t0", "t1"]
        write_plugin(plugins, "many", {"t0": "x", "t1": "x", "t10": "new", "t2": "x", "t3": "x"})
        with trio.fail_after(WAIT_S):
            assert await daemon.reload() is True
        req = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {"cursor": first["nextCursor"]}}
        second = json.loads(daemon.core.receive(state, json.dumps(req).encode()).data)["result"]
        assert [t["name"] for t in second["tools"]] == ["t10", "t2"]  # continues after "t1", in the new order
        bad = {"jsonrpc": "2.0", "id": 3, "method": "tools/list", "params": {"cursor": "garbage!"}}
        assert json.loads(daemon.core.receive(state, json.dumps(bad).encode()).data)["error"]["code"] == -32602
