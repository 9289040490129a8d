"""Hot reload over Streamable HTTP, seen by official MCP SDK clients of a real ``toolcell serve --http``.

Two clients stay connected while plugin files are edited on disk: a legacy session (2025-11-25) that
hears ``list_changed`` on its GET stream, and a modern (2026-07-28) client on a
``subscriptions/listen`` stream that asked for ``toolsListChanged``. Both count every
``notifications/tools/list_changed`` frame their ``message_handler`` sees (the SDK's own listen
iterator deduplicates, so it cannot count).

Exactly one per effective change: each client's notifications arrive in order on one stream, so
when the notification of change k+1 arrives, a duplicate of change k (or one caused by the no-op or
broken edit in between) would already have arrived, and the count would be off by one. The last
step is a sentinel change for that reason. No-op and broken edits also get a bounded quiet wait once
the daemon logged that their reload is done.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx2
import trio
from mcp import types
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import listen
from reload_harness import WAIT_S, Counter, HttpDaemon, metric, start_http_daemon, write_plugin

SUB_ID = "io.modelcontextprotocol/subscriptionId"


@asynccontextmanager
async def session(url: str, counter: Counter) -> AsyncIterator[ClientSession]:
    async with streamable_http_client(url) as (read, write), \
            ClientSession(read, write, message_handler=counter.handler) as s:
        yield s


async def names(s: ClientSession) -> list[str]:
    with trio.fail_after(WAIT_S):
        return [t.name for t in (await s.list_tools()).tools]


async def call(s: ClientSession, tool: str) -> str:
    with trio.fail_after(WAIT_S):
        result = await s.call_tool(tool, {})
    assert not result.is_error, result
    content = result.content[0]
    assert isinstance(content, types.TextContent)
    return content.text


async def scrape(daemon: HttpDaemon) -> str:
    async with httpx2.AsyncClient(timeout=WAIT_S) as client:
        r = await client.get(daemon.metrics_url)
    r.raise_for_status()
    return r.text


async def until(check: Callable[[str], bool], daemon: HttpDaemon) -> str:
    """Scrape the metrics (bounded) until ``check`` holds."""
    with trio.fail_after(WAIT_S):
        while True:
            text = await scrape(daemon)
            if check(text):
                return text
            await trio.sleep(0.05)


async def test_sdk_clients_over_http_hear_exactly_one_list_changed_per_effective_change(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    write_plugin(plugins, "alpha", {"a1": "one"})
    write_plugin(plugins, "beta", {"b1": "bee"})
    daemon = start_http_daemon(tmp_path, plugins)
    logs = daemon.logs
    legacy_seen, modern_seen = Counter(), Counter()
    try:
        async with session(daemon.url, legacy_seen) as legacy, session(daemon.url, modern_seen) as modern:
            with trio.fail_after(WAIT_S):
                init = await legacy.initialize()
                assert init.capabilities.tools is not None and init.capabilities.tools.list_changed is True
                await modern.discover()
            assert modern.protocol_version == "2026-07-28"
            async with listen(modern, tools_list_changed=True) as sub:
                assert sub.honored.tools_list_changed is True
                # The SDK opens the legacy GET stream in the background: wait until the daemon
                # holds both long-lived streams (the GET stream and the listen stream).
                await until(lambda text: (metric(text, "toolcell_http_streams") or 0) >= 2, daemon)

                async def both_list(expected: list[str]) -> None:
                    assert await names(legacy) == expected
                    assert await names(modern) == expected

                async def effective(count: int) -> None:
                    await legacy_seen.reaches(count)
                    await modern_seen.reaches(count)
                    assert len(legacy_seen.seen) == count and len(modern_seen.seen) == count
                    assert (modern_seen.seen[-1].params is not None
                            and (modern_seen.seen[-1].params.meta or {}).get(SUB_ID) == sub.subscription_id)

                async def quiet(count: int) -> None:
                    await legacy_seen.stays_at(count)
                    await modern_seen.stays_at(count)

                await both_list(["a1", "b1"])

                write_plugin(plugins, "gamma", {"g1": "gee"})  # add a plugin
                await effective(1)
                await both_list(["a1", "b1", "g1"])

                write_plugin(plugins, "alpha", {"a1": "one"}, doc="Tool {name}, now documented better.")  # modify
                await effective(2)
                with trio.fail_after(WAIT_S):
                    listed = {t.name: t.description for t in (await legacy.list_tools()).tools}
                assert listed["a1"] == "Tool a1, now documented better."
                await both_list(["a1", "b1", "g1"])

                done = len(logs.events("reload_done"))
                module = plugins / "alpha" / "alpha.py"
                module.write_bytes(module.read_bytes())  # touched, nothing changed
                await logs.wait_for("reload_done", done + 1)
                assert logs.events("reload_done")[-1]["changed"] is False
                await quiet(2)

                failed = len(logs.events("plugin_reload_failed"))
                module.write_text("this is not python(\n")  # break it
                problems = (await logs.wait_for("plugin_reload_failed", failed + 1))[-1]["problems"]
                assert "SyntaxError" in json.dumps(problems)
                await quiet(2)
                await both_list(["a1", "b1", "g1"])
                assert await call(legacy, "a1") == "one"  # the last good version keeps serving
                assert await call(modern, "a1") == "one"
                text = await until(lambda t: metric(t, "toolcell_plugin_reload_failing", plugin="alpha") == 1, daemon)
                assert metric(text, "toolcell_plugin_reload_failing", plugin="beta") == 0

                write_plugin(plugins, "alpha", {"a1": "one", "a3": "three"})  # fix it (with a new tool)
                await effective(3)
                await both_list(["a1", "a3", "b1", "g1"])
                assert await call(legacy, "a3") == "three"
                assert await call(modern, "a3") == "three"
                await until(lambda t: metric(t, "toolcell_plugin_reload_failing", plugin="alpha") == 0, daemon)

                shutil.rmtree(plugins / "gamma")  # remove a plugin
                await effective(4)
                await both_list(["a1", "a3", "b1"])

                write_plugin(plugins, "delta", {"d1": "dee"})  # sentinel: proves nothing more came for the removal
                await effective(5)
                await both_list(["a1", "a3", "b1", "d1"])
    finally:
        daemon.stop()
    assert daemon.proc.returncode == 0, daemon.logs.path.read_text()[-3000:]
