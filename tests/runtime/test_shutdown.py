"""SIGTERM tells clients: during the grace new calls are refused with a clear error, calls that finish
in time are answered as usual, and calls still running at its end are answered with an error saying
the server is shutting down (nothing is left with only an EOF)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import probe_plugins
import trio
from stdio_peer import open_toolcell, text_of


async def test_sigterm_answers_every_stdio_call_before_the_daemon_exits(make_plugin: Callable[..., Path],
                                                                       tmp_path: Path) -> None:
    plugins = make_plugin("probe", probe_plugins.PROBE, limits={"timeout_s": 60, "max_concurrency": 4})
    config = tmp_path / "toolcell.toml"
    config.write_text("[http]\nshutdown_grace_s = 1.5\n")
    async with open_toolcell(plugins, extra=("--config", str(config)), stderr_path=tmp_path / "d.log") as peer:
        await peer.initialize("2025-11-25")
        quick = await peer.start_call("slow", {"seconds": 0.5})
        stuck = await peer.start_call("slow", {"seconds": 30})
        await trio.sleep(0.3)
        peer.proc.send_signal(signal.SIGTERM)
        await trio.sleep(0.2)
        late = await peer.start_call("echo", {"text": "too late"})
        assert text_of(await peer.response(quick, timeout=10)) == "slept 0.5"
        refused = await peer.response(late, timeout=10)
        assert refused["error"]["code"] == -31002 and "shutting down" in refused["error"]["message"]
        stopped = await peer.response(stuck, timeout=10)
        assert stopped["result"]["isError"] is True and "shutting down" in text_of(stopped)
        with trio.fail_after(15):
            await peer.proc.wait()
        for request_id in (quick, stuck, late):
            assert len(peer.responses_to(request_id)) == 1
