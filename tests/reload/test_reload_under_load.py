"""Reload under load, file watching only: calls at concurrency 32 while a plugins folder is edited,
broken, fixed, removed and restored twenty times. No call is lost (each answered exactly once),
and the client hears exactly one ``list_changed`` per effective change and none for a broken edit."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import trio
from reload_harness import LogWatch, write_plugin

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from stdio_peer import open_toolcell  # noqa: E402

CYCLES = 20
CONCURRENCY = 32


async def test_twenty_edit_break_fix_remove_restore_cycles_under_load(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    write_plugin(plugins, "steady", {"steady_echo": "steady"})
    write_plugin(plugins, "flux", {"flux_tool": "flux"}, doc="Flux v0.")
    errlog = tmp_path / "daemon.log"
    logs = LogWatch(errlog)
    async with open_toolcell(plugins, watch=True, stderr_path=errlog) as peer:
        await peer.initialize("2025-11-25")
        sent: list[object] = []
        stop = trio.Event()
        send_lock = trio.Lock()

        async def caller(n: int) -> None:
            i = 0
            while not stop.is_set():
                tool = "steady_echo" if i % 2 else "flux_tool"
                async with send_lock:
                    request_id = await peer.start_call(tool, {"x": i}, id=f"c{n}-{i}")
                sent.append(request_id)
                response = await peer.response(request_id, timeout=30)
                # A result, or (for the flux tool while it is removed or broken) a clear error.
                assert "result" in response or response["error"]["code"] == -32602, response
                i += 1

        def changes() -> int:
            return len(peer.notifications("notifications/tools/list_changed"))

        async def effective(expected: int) -> None:
            with trio.fail_after(20):
                while changes() < expected:
                    await trio.sleep(0.02)

        async with trio.open_nursery() as nursery:
            for n in range(CONCURRENCY):
                nursery.start_soon(caller, n)
            expected = 0
            for cycle in range(CYCLES):
                write_plugin(plugins, "flux", {"flux_tool": "flux"}, doc=f"Flux v{cycle} edited.")  # edit
                expected += 1
                await effective(expected)
                failures = len(logs.events("plugin_reload_failed"))
                (plugins / "flux" / "flux.py").write_text("def broken(:\n")  # break
                await logs.wait_for("plugin_reload_failed", failures + 1)
                write_plugin(plugins, "flux", {"flux_tool": "flux"}, doc=f"Flux v{cycle} fixed.")  # fix
                expected += 1
                await effective(expected)
                shutil.rmtree(plugins / "flux")  # remove
                expected += 1
                await effective(expected)
                write_plugin(plugins, "flux", {"flux_tool": "flux"}, doc=f"Flux v{cycle} restored.")  # restore
                expected += 1
                await effective(expected)
            await trio.sleep(1.0)  # a duplicate notification would arrive in this time
            stop.set()
        assert changes() == expected == 4 * CYCLES
        answered: dict[object, int] = {}
        for message in peer.messages:
            if "method" not in message and "id" in message:
                answered[message["id"]] = answered.get(message["id"], 0) + 1
        assert len(sent) > 100
        assert all(answered.get(request_id) == 1 for request_id in sent), "a call was lost or answered twice"
        assert not logs.events("internal_error")
