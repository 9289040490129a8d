"""Instances of a hosted server: several share the calls; with ``per_principal`` no two principals ever
share one. Driven in-process through the daemon's call dispatcher, which is where a principal (a
bearer token's, over HTTP) reaches the runner."""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
from conftest import HOSTILE, PYTHON, public

from runtime import approvals

from runtime.config import Config
from runtime.daemon import Daemon, open_daemon
from runtime.manifest import load_manifest
from runtime.protocol.core import Completed, ConnState, ToolCall


def hostile(make_server: Callable[..., Path], **server: Any) -> Path:
    plugins = make_server("hostile", {"command": [PYTHON, "hostile_server.py"], **server},
                          limits={"max_concurrency": 1, "timeout_s": 20})
    shutil.copy(HOSTILE, plugins / "hostile" / "hostile_server.py")
    (plugins / "hostile" / "hostile_server.py").chmod(0o644)
    return plugins


@asynccontextmanager
async def daemon_for(plugins: Path, state_dir: Path) -> AsyncIterator[Daemon]:
    cfg = Config(plugins=[str(plugins)], policy="strict", state_dir=str(state_dir), watch=False)
    with trio.fail_after(60):
        async with open_daemon(cfg) as daemon:
            yield daemon


async def call(daemon: Daemon, name: str, arguments: dict[str, Any], principal: str | None = None) -> str:
    state = ConnState()
    daemon.core.receive(state, json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}).encode())
    action = daemon.core.receive(state, json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                                                    "params": {"name": name, "arguments": arguments}}).encode())
    assert isinstance(action, ToolCall), action
    with trio.fail_after(30):
        outcome = await daemon.calls.execute(action, principal)
    assert isinstance(outcome, Completed), outcome
    assert not outcome.result.is_error, outcome.result
    return str(outcome.result.content[0]["text"])


async def test_one_instance_per_principal_keeps_clients_apart(
        make_server: Callable[..., Path], state_dir: Path) -> None:
    async with daemon_for(hostile(make_server, per_principal=True), state_dir) as daemon:
        alice = [json.loads(await call(daemon, "whoami", {}, "alice"))["instance"] for _ in range(3)]
        bob = [json.loads(await call(daemon, "whoami", {}, "bob"))["instance"] for _ in range(3)]
        assert len(set(alice)) == 1 and len(set(bob)) == 1
        assert alice[0] != bob[0]


async def test_after_approval_an_edit_that_lets_principals_share_a_server_waits_for_a_person(
        make_server: Callable[..., Path], tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o711)
    public(state)
    plugins = hostile(make_server, per_principal=True)
    folder = plugins / "hostile"
    approvals.record(str(state), load_manifest(folder), str(folder), "test")
    async with daemon_for(plugins, state) as daemon:
        alice = json.loads(await call(daemon, "whoami", {}, "alice"))["instance"]
        assert json.loads(await call(daemon, "whoami", {}, "bob"))["instance"] != alice
        # Whoever can write the folder turns per_principal off: bob would be served by alice's server, and
        # read what it keeps of hers.
        manifest = folder / "plugin.toml"
        manifest.write_text(manifest.read_text().replace("per_principal = true", "per_principal = false"))
        await daemon.reload()
        held = daemon.plugins[str(folder.resolve())].reload_error
        assert any("server.per_principal: true -> false" in p and "toolcell approve hostile" in p for p in held), held
        assert json.loads(await call(daemon, "whoami", {}, "bob"))["instance"] != alice
        assert json.loads(await call(daemon, "whoami", {}, "alice"))["instance"] == alice


async def test_several_instances_share_concurrent_calls(make_server: Callable[..., Path], state_dir: Path) -> None:
    async with daemon_for(hostile(make_server, instances=2), state_dir) as daemon:
        runner = next(iter(daemon.plugins.values())).pool
        with trio.fail_after(30):
            while len(runner.workers) < 2 or not all(i.ready for i in runner.workers):
                await trio.sleep(0.05)
        answers: list[str] = []

        async def slow() -> None:
            answers.append(await call(daemon, "sleepy", {"seconds": 1}))

        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(slow)
        assert len(set(answers)) == 2, answers


async def test_a_principals_instance_listing_other_tools_leaves_everyones_catalog_alone(
        make_server: Callable[..., Path], state_dir: Path) -> None:
    """Alice's own server lists a new tool (``list_changed``): the catalog everyone sees is the shared
    instance's listing, so bob (and anyone) is not shown alice's tool."""
    async with daemon_for(hostile(make_server, per_principal=True), state_dir) as daemon:
        plugin = next(iter(daemon.plugins.values()))
        runner = plugin.pool
        assert await call(daemon, "add_tool", {"name": "alice_only"}, "alice") == "added"
        mine = next(i for i in runner.workers if i.group.key == "alice")
        with trio.move_on_after(2):  # the relist comes 50 ms after list_changed
            while True:
                assert "alice_only" not in {t.name for t in runner.tools}
                assert "alice_only" not in {e.name for e in plugin.entries}
                await trio.sleep(0.05)
        assert "alice_only" in {t.name for t in mine.tools}  # alice's instance did list it
        assert json.loads(await call(daemon, "whoami", {}, "bob"))["instance"]
