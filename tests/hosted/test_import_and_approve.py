"""``toolcell import`` turns a client's config into working sandboxed plugins; ``toolcell add`` adds one;
approvals hold a plugin that asks for more until a person approves it."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from mcp.shared.exceptions import MCPError
from conftest import HOSTILE, PYTHON, TIME_PACKAGE, connect, public, text, write_config

from runtime import approvals
from runtime.plugins import discover

pytestmark = pytest.mark.filterwarnings("ignore:The logging capability is deprecated")
REPO = Path(__file__).resolve().parents[2]


async def toolcell(*args: str) -> tuple[int, str, str]:
    done = await trio.run_process([sys.executable, "-m", "runtime.cli", *args], cwd=str(REPO), capture_stdout=True,
                                  capture_stderr=True, check=False, stdin=b"")
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def test_import_of_a_claude_desktop_config_with_three_servers_yields_three_working_sandboxed_plugins(
        state_dir: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    public(shared)
    shared.chmod(0o777)
    (shared / "note.txt").write_text("a note")
    version = TIME_PACKAGE.split("==")[1]
    sample = {"mcpServers": {
        "filesystem": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem@2026.8.31", str(shared)]},
        "everything": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-everything@2026.8.31"],
                       "env": {"DEMO_SETTING": "on"}},
        "time": {"command": "uvx", "args": [f"mcp-server-time=={version}", "--local-timezone=UTC"]},
    }}
    config_file = tmp_path / "claude_desktop_config.json"
    config_file.write_text(json.dumps(sample))
    into = tmp_path / "imported"
    config = write_config(tmp_path, state_dir)
    code, out, err = await toolcell("import", str(config_file), "--into", str(into), "--config", str(config),
                                    "--write", f"filesystem={shared}", "--yes")
    assert code == 0, out + err
    assert "3 plugin(s) created" in out
    assert sorted(p.name for p in into.iterdir()) == ["everything", "filesystem", "time"]
    assert (into / "filesystem" / "package-lock.json").is_file() and (into / "time" / "requirements.lock").is_file()
    recorded = approvals.load(str(state_dir))
    assert recorded[os.path.realpath(into / "filesystem")]["grants"]["write"] == [str(shared)]
    public(into)
    async with connect(into, config, tmp_path / "d.log") as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert {"filesystem_read_text_file", "everything_echo", "time_get_current_time"} <= names
        note = await client.call_tool("filesystem_read_text_file", {"path": str(shared / "note.txt")})
        assert text(note) == "a note", text(note)
        assert text(await client.call_tool("everything_echo", {"message": "hi"})) == "Echo: hi"
        env = text(await client.call_tool("everything_get-env", {}))
        assert "DEMO_SETTING" in env
        now = await client.call_tool("time_get_current_time", {"timezone": "UTC"})
        assert not now.is_error, text(now)
    log = (tmp_path / "d.log").read_text()
    assert log.count('"layers":["hygiene","rlimits","identity","cgroup","namespaces","landlock","seccomp"]') >= 3


async def test_a_plugin_asking_for_more_than_approved_is_held_until_approved(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    own_state = tmp_path / "state"
    own_state.mkdir(mode=0o711)
    public(own_state)
    config = write_config(tmp_path, own_state)
    # `toolcell add pypi:...` writes, installs, shows and records the approval.
    into = tmp_path / "plugins"
    code, out, err = await toolcell("add", TIME_PACKAGE, "--into", str(into), "--name", "clock", "--config",
                                    str(config), "--yes", "--arg=--local-timezone=UTC")
    assert code == 0, out + err
    assert "network:  (none)" in out and "approved" in out
    public(into)
    manifest = into / "clock" / "plugin.toml"
    original = manifest.read_text()
    async with connect(into, config, tmp_path / "d.log") as client:
        assert "clock_get_current_time" in {t.name for t in (await client.list_tools()).tools}
        # A new version asks for the network and renames its tools: held, the approved one keeps serving.
        manifest.write_text(original.replace('prefix = "clock_"', 'prefix = "tick_"')
                            .replace("network = []", 'network = ["example.com:443"]'))
        code, out, err = await toolcell("reload", "--config", str(config))
        assert code == 0, err
        with trio.fail_after(30):
            while "plugin_reload_failed" not in (tmp_path / "d.log").read_text():
                await trio.sleep(0.1)
        names = {t.name for t in (await client.list_tools(cache_mode="refresh")).tools}
        assert "clock_get_current_time" in names and "tick_get_current_time" not in names
        assert "+ network example.com:443" in (tmp_path / "d.log").read_text()
        code, out, err = await toolcell("list", "--json", "--plugins", str(into), "--config", str(config))
        problems = json.loads(out)["plugins"][0]["problems"]
        assert any("needs approval" in p and "toolcell approve clock" in p for p in problems), problems
        # Without a person (no terminal, no --yes) nothing is approved.
        code, out, err = await toolcell("approve", "clock", "--plugins", str(into), "--config", str(config))
        assert code == 1 and "+ network example.com:443" in out
        code, out, err = await toolcell("approve", "clock", "--plugins", str(into), "--config", str(config), "--yes")
        assert code == 0, out + err
        code, out, err = await toolcell("reload", "--config", str(config))
        with trio.fail_after(30):
            while True:
                names = {t.name for t in (await client.list_tools(cache_mode="refresh")).tools}
                if "tick_get_current_time" in names:
                    break
                await trio.sleep(0.2)
    assert os.stat(own_state / "approvals.json").st_mode & 0o777 == 0o600


async def test_import_refuses_what_it_cannot_host_and_names_that_cannot_be_folders(
        state_dir: Path, tmp_path: Path) -> None:
    sample = {"mcpServers": {
        "../escape": {"command": "npx", "args": ["-y", "--registry=http://evil", "@scope/pkg;rm -rf /"]},
        "container": {"command": "docker", "args": ["run", "-i", "--rm", "mcp/fetch"]},
        "remote": {"type": "http", "url": "https://example.com/mcp"},
    }}
    config_file = tmp_path / "mcp.json"
    config_file.write_text(json.dumps(sample))
    into = tmp_path / "imported"
    code, out, err = await toolcell("import", str(config_file), "--into", str(into), "--config",
                                    str(write_config(tmp_path, state_dir)), "--yes")
    assert code == 1
    assert "is not an npm package name" in err and "container" in err and "remote" in err, err
    assert list(into.iterdir()) == []


async def test_add_of_a_plugin_folder_copies_it_in_and_records_its_approval(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    source = make_plugin("notes", "from sandbox import tool\n\n@tool\ndef note() -> str:\n    return 'n'\n",
                         root="src")
    own_state = tmp_path / "state"
    config = write_config(tmp_path, own_state)
    into = tmp_path / "plugins"
    code, out, err = await toolcell("add", str(source / "notes"), "--into", str(into), "--config", str(config))
    assert code == 1 and not (into / "notes").exists(), out + err  # no terminal and no --yes: nothing added
    code, out, err = await toolcell("add", str(source / "notes"), "--into", str(into), "--config", str(config),
                                    "--yes")
    assert code == 0, out + err
    assert (into / "notes" / "notes.py").is_file()
    assert approvals.load(str(own_state))[os.path.realpath(into / "notes")]["name"] == "notes"


async def test_an_import_waiting_for_its_approval_is_not_served_by_a_daemon_watching_the_folder(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    own_state = tmp_path / "state"
    own_state.mkdir(mode=0o711)
    public(own_state)
    config = write_config(tmp_path, own_state)
    into = make_plugin("placed", "from sandbox import tool\n\n@tool\ndef here() -> str:\n    return 'here'\n")
    public(into)
    srv, shared = tmp_path / "srv", tmp_path / "shared"
    for folder in (srv, shared):
        folder.mkdir()
        folder.chmod(0o777)
    shutil.copy(HOSTILE, srv / "hostile_server.py")
    (srv / "hostile_server.py").chmod(0o644)
    config_file = tmp_path / "mcp.json"
    config_file.write_text(json.dumps({"mcpServers": {"hostile": {"command": PYTHON,
                                                                  "args": [str(srv / "hostile_server.py")]}}}))
    log = tmp_path / "d.log"
    async with connect(into, config, log) as client:
        assert {t.name for t in (await client.list_tools()).tools} == {"here"}
        # A person at a terminal, asked to approve a write grant and not answering yet.
        person, terminal = pty.openpty()
        importer = await trio.lowlevel.open_process(
            [sys.executable, "-m", "runtime.cli", "import", str(config_file), "--into", str(into), "--config",
             str(config), "--read", f"hostile={srv}", "--write", f"hostile={shared}"],
            cwd=str(REPO), stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        os.close(terminal)
        try:
            os.write(person, b"\n\n\n")  # the offered paths and hosts, as given by the flags
            shown = b""
            assert importer.stdout is not None
            with trio.fail_after(30):
                while b"[y/N]" not in shown:
                    chunk = await importer.stdout.receive_some(4096)
                    assert chunk, shown.decode()
                    shown += chunk
            assert f"write:    {shared}".encode() in shown
            # The daemon reloads (as its watcher would, on whatever the import wrote) while the question is open.
            reloads = log.read_text().count('"reload_done"')
            code, _out, err = await toolcell("reload", "--config", str(config))
            assert code == 0, err
            with trio.fail_after(30):
                while log.read_text().count('"reload_done"') == reloads:
                    await trio.sleep(0.05)
            names = {t.name for t in (await client.list_tools(cache_mode="refresh")).tools}
            assert names == {"here"}, "a plugin awaiting its approval is served"
            with pytest.raises(MCPError, match="Unknown tool"):
                await client.call_tool("hostile_write_file", {"path": str(shared / "x")})
            assert not (shared / "x").exists()
            assert not [p.name for p in into.iterdir() if p.name != "placed"], "the import stages in the plugins folder"
            os.write(person, b"n\n")
            with trio.fail_after(30):
                assert await importer.wait() == 1
        finally:
            if importer.returncode is None:
                importer.kill()
                await importer.wait()
            os.close(person)
    assert sorted(p.name for p in into.iterdir()) == ["placed"]
    assert not [p for p in own_state.rglob("*hostile*")], "the staged folder is left behind"


def test_a_dot_folder_in_a_plugins_folder_is_never_discovered(tmp_path: Path) -> None:
    for name in ("finished", ".finished.toolcell-new", ".hidden"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "plugin.toml").write_text('name = "x"\n')
    assert discover([str(tmp_path)]) == [tmp_path.resolve() / "finished"]
