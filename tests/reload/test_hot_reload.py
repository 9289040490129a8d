"""Hot reload seen by a real client: the official MCP SDK client over stdio, and the daemon in-process.

Each step edits plugin files on disk while the client stays connected and checks what the client
received: exactly one ``notifications/tools/list_changed`` per effective change (proven by the next
one, as notifications arrive in order; the last step is a sentinel change), none for a touch or a
broken edit (a bounded quiet wait after the daemon logged that their reload is done).
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
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from reload_harness import REPO, WAIT_S, Counter, LogWatch, write_plugin

import runtime.daemon
from runtime.config import Config
from runtime.daemon import open_daemon
from runtime.protocol.core import ConnState, ToolCall
from runtime.connection import run_call


async def test_an_sdk_client_hears_exactly_one_list_changed_per_effective_change(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    write_plugin(plugins, "alpha", {"a1": "one"})
    write_plugin(plugins, "beta", {"b1": "bee"})
    errlog = tmp_path / "stderr.log"
    seen = Counter()
    params = StdioServerParameters(command=sys.executable, cwd=str(REPO),
                                   args=["-m", "runtime.cli", "serve", "--stdio", "--policy", "none",
                                         "--plugins", str(plugins)])
    logs = LogWatch(errlog)
    with open(errlog, "w") as err:  # noqa: ASYNC230 (a local file, before anything runs)
        async with stdio_client(params, errlog=err) as (read, write), \
                ClientSession(read, write, message_handler=seen.handler) as session:
            with trio.fail_after(WAIT_S):
                init = await session.initialize()
            assert init.capabilities.tools is not None and init.capabilities.tools.list_changed is True

            async def names() -> list[str]:
                with trio.fail_after(WAIT_S):
                    return [t.name for t in (await session.list_tools()).tools]

            async def effective(count: int) -> None:
                # Notifications arrive in order: a duplicate of an earlier step would already be here.
                await seen.reaches(count)
                assert len(seen.seen) == count

            assert await names() == ["a1", "b1"]

            write_plugin(plugins, "gamma", {"g1": "gee"})  # add
            await effective(1)
            assert await names() == ["a1", "b1", "g1"]

            write_plugin(plugins, "alpha", {"a1": "one", "a2": "two"})  # modify
            await effective(2)
            assert await names() == ["a1", "a2", "b1", "g1"]

            done = len(logs.events("reload_done"))
            module = plugins / "alpha" / "alpha.py"
            module.write_text(module.read_text())  # touch only
            await logs.wait_for("reload_done", done + 1)
            assert logs.events("reload_done")[-1]["changed"] is False
            await seen.stays_at(2)

            failed = len(logs.events("plugin_reload_failed"))
            module.write_text("this is not python(\n")  # break
            problems = (await logs.wait_for("plugin_reload_failed", failed + 1))[-1]["problems"]
            assert "SyntaxError" in json.dumps(problems)
            await seen.stays_at(2)
            assert await names() == ["a1", "a2", "b1", "g1"]
            with trio.fail_after(WAIT_S):
                result = await session.call_tool("a2", {})
            assert not result.is_error and result.content[0].text == "two"  # the last good version serves

            write_plugin(plugins, "alpha", {"a1": "one", "a3": "three"})  # fix (with a change)
            await effective(3)
            assert await names() == ["a1", "a3", "b1", "g1"]
            with trio.fail_after(WAIT_S):
                result = await session.call_tool("a3", {})
            assert result.content[0].text == "three"

            shutil.rmtree(plugins / "gamma")  # remove
            await effective(4)
            assert await names() == ["a1", "a3", "b1"]

            write_plugin(plugins, "delta", {"d1": "dee"})  # sentinel: nothing more came for the removal
            await effective(5)
            assert await names() == ["a1", "a3", "b1", "d1"]


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
            results.append(await run_call(daemon, call))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await trio.sleep(0.2)
            (folder / "slowpoke.py").write_text((folder / "slowpoke.py").read_text().replace('"v1"', '"v2"'))
            with trio.fail_after(WAIT_S):
                await daemon.reload()
            again = daemon.core.receive(state, b'{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"nap","arguments":{"seconds":0}}}')
            with trio.fail_after(WAIT_S):
                fresh = await run_call(daemon, again)
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


async def test_an_edit_landing_while_the_previous_version_loads_is_picked_up_by_the_next_reload(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = tmp_path / "plugins"
    write_plugin(plugins, "racy", {"r1": "one"})
    original_load = runtime.daemon.load_plugin

    async def load_then_edit(path: Path, *args: Any) -> Any:
        plugin = await original_load(path, *args)
        if edits:
            write_plugin(plugins, "racy", edits.pop())  # the next save lands before this load is done
        return plugin

    edits: list[dict[str, str]] = []
    monkeypatch.setattr(runtime.daemon, "load_plugin", load_then_edit)
    config = Config(plugins=[str(plugins)], policy="none", watch=False, state_dir=str(tmp_path / "state"))
    async with open_daemon(config) as daemon:
        edits.append({"r1": "one", "r3": "three"})
        write_plugin(plugins, "racy", {"r1": "one", "r2": "two"})
        with trio.fail_after(WAIT_S):
            assert await daemon.reload() is True
        assert sorted(daemon.catalog.by_name) == ["r1", "r2"]  # what was on disk when the load began
        with trio.fail_after(WAIT_S):
            assert await daemon.reload() is True  # the watcher's reload for the second save
        assert sorted(daemon.catalog.by_name) == ["r1", "r3"]


async def test_a_change_made_before_the_watcher_was_watching_is_still_picked_up(tmp_path: Path) -> None:
    """The file watcher sets its watches when it first runs: a plugin edited after the daemon loaded
    it but before then raises no event. The watcher looks once more after starting, so the edit is
    served without any later change to the folder."""
    from runtime.reload import serve_watcher

    plugins = tmp_path / "plugins"
    write_plugin(plugins, "alpha", {"a1": "one"})
    async with open_daemon(Config(plugins=[str(plugins)], policy="none", watch=False,
                                  state_dir=str(tmp_path / "state"))) as daemon:
        assert [e.name for e in daemon.catalog.entries] == ["a1"]
        write_plugin(plugins, "alpha", {"a1": "one", "a2": "two"})  # before any watch exists
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_watcher, daemon, 50)
            with trio.fail_after(WAIT_S):
                while [e.name for e in daemon.catalog.entries] != ["a1", "a2"]:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()


async def test_a_missing_folder_that_appears_before_the_watcher_was_watching_is_watched_from_then_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plugin folder missing at start is watched for through its nearest existing ancestor; if it
    appears after the watcher made its plan and before that watch is set, no event comes. The
    watcher's second look finds it: it is served, and watched, so a plugin added to it later is
    served too (it used to be served by the second look and then never watched)."""
    import runtime.reload
    from runtime.reload import serve_watcher

    plugins = tmp_path / "later" / "plugins"
    plan = runtime.reload._watch_plan
    appeared: list[bool] = []

    def plan_then_appear(folders: list[str]) -> tuple[list[str], list[str]]:
        made = plan(folders)
        if not appeared:  # the race: right after the first plan, before any watch is set
            appeared.append(True)
            write_plugin(plugins, "alpha", {"a1": "one"})
        return made

    monkeypatch.setattr(runtime.reload, "_watch_plan", plan_then_appear)
    async with open_daemon(Config(plugins=[str(plugins)], policy="none", watch=False,
                                  state_dir=str(tmp_path / "state"))) as daemon:
        assert not daemon.catalog.entries
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_watcher, daemon, 50)
            with trio.fail_after(WAIT_S):
                while [e.name for e in daemon.catalog.entries] != ["a1"]:
                    await trio.sleep(0.02)
            await trio.sleep(1.0)  # past the second look of the re-armed watcher
            write_plugin(plugins, "beta", {"b1": "bee"})
            with trio.fail_after(WAIT_S):
                while sorted(e.name for e in daemon.catalog.entries) != ["a1", "b1"]:
                    await trio.sleep(0.02)
            nursery.cancel_scope.cancel()
