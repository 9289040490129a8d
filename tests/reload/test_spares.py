"""The spare worker interpreter (``runtime.spares``): a hot reload starts the new version in it.

A worker that starts from the spare must be indistinguishable from a freshly spawned one: the
plugin's environment (not the spare's), the same isolation layers, its own process. A plugin whose
environment the spare cannot provide gets a fresh process; the spare is replaced once taken and
is gone with the daemon.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from reload_harness import WAIT_S

from runtime.config import Config
from runtime.daemon import Daemon, open_daemon
from runtime.protocol.core import ConnState, ToolCall
from runtime.connection import run_call

ENVY = '''
import os
import time

from sandbox import tool


@tool
def whoami() -> dict:
    """Report this worker's process and environment."""
    return {"pid": os.getpid(), "greeting": os.environ.get("GREETING"), "lang": os.environ.get("LANG"),
            "marker": os.environ.get("TOOLCELL_WORKER"), "tz": os.environ.get("TZ"), "tzname": list(time.tzname),
            "version": VERSION}


VERSION = 1
'''


async def spare_ready(daemon: Daemon) -> int:
    assert daemon.spares is not None
    with trio.fail_after(WAIT_S):
        while daemon.spares.ready_pid is None:
            await trio.sleep(0.02)
    return daemon.spares.ready_pid


async def whoami(daemon: Daemon) -> dict[str, Any]:
    state = ConnState()
    daemon.core.receive(state, b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":{}}}')
    call = daemon.core.receive(state, b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"whoami","arguments":{}}}')
    assert isinstance(call, ToolCall)
    with trio.fail_after(WAIT_S):
        response = json.loads(await run_call(daemon, call))
    return dict(response["result"]["structuredContent"])


def layers(daemon: Daemon) -> list[str]:
    (plugin,) = daemon.plugins.values()
    return plugin.layers


@pytest.mark.parametrize("policy", ["none", "compat"])
async def test_a_reload_starts_the_new_version_in_the_spare_with_the_plugins_environment(
        make_plugin: Callable[..., Path], tmp_path: Path, policy: str) -> None:
    plugins = make_plugin("envy", ENVY, manifest={"env": {"set": {"GREETING": "hello", "TZ": "Asia/Tokyo"}}})
    module = plugins / "envy" / "envy.py"
    config = Config(plugins=[str(plugins)], policy=policy, watch=False, state_dir=str(tmp_path / "state"))
    async with open_daemon(config) as daemon:
        assert daemon.spares is not None
        fresh = await whoami(daemon)
        fresh_layers = layers(daemon)
        spare_pid = await spare_ready(daemon)

        module.write_text(ENVY.replace("VERSION = 1", "VERSION = 2"))
        with trio.fail_after(WAIT_S):
            await daemon.reload()
        assert daemon.spares.taken == 1
        (plugin,) = daemon.plugins.values()
        assert plugin.pool is not None and {w.proc.pid for w in plugin.pool.workers} == {spare_pid}
        assert layers(daemon) == fresh_layers  # isolated exactly like a freshly spawned worker
        reloaded = await whoami(daemon)
        assert reloaded["version"] == 2
        assert reloaded["greeting"] == "hello" and reloaded["lang"] == "C.UTF-8"
        assert reloaded["tz"] == "Asia/Tokyo" and reloaded["tzname"] == fresh["tzname"] == ["JST", "JST"]
        assert reloaded["marker"].startswith("envy:")  # the plugin's marker, not the spare's

        # The next spare is another process, started once the taken one is Ready.
        assert await spare_ready(daemon) != spare_pid
        assert daemon.spares.started == 2
        last_spare = daemon.spares.ready_pid
    assert last_spare is not None and not psutil.pid_exists(last_spare)  # gone with the daemon


async def test_a_plugin_that_sets_the_locale_gets_a_fresh_process_not_the_spare(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    plugins = make_plugin("envy", ENVY, manifest={"env": {"set": {"LANG": "POSIX"}}})
    module = plugins / "envy" / "envy.py"
    config = Config(plugins=[str(plugins)], policy="none", watch=False, state_dir=str(tmp_path / "state"))
    async with open_daemon(config) as daemon:
        assert daemon.spares is not None
        spare_pid = await spare_ready(daemon)
        module.write_text(ENVY.replace("VERSION = 1", "VERSION = 2"))
        with trio.fail_after(WAIT_S):
            await daemon.reload()
        assert daemon.spares.taken == 0 and daemon.spares.ready_pid == spare_pid
        reloaded = await whoami(daemon)
        assert reloaded["version"] == 2 and reloaded["lang"] == "POSIX" and reloaded["pid"] != spare_pid
