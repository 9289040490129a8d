"""``toolcell import`` turns a client's config into working sandboxed plugins; ``toolcell add`` adds one;
approvals hold a plugin that asks for more until a person approves it."""

from __future__ import annotations

import http.server
import json
import os
import pty
import shutil
import socket
import stat
import subprocess
import sys
import threading
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
        code, out, err = await toolcell("reload", "--config", str(config), "--plugins", str(into))
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
        code, out, err = await toolcell("reload", "--config", str(config), "--plugins", str(into))
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


async def test_import_shows_with_its_prompt_which_program_a_configs_command_resolved_to(tmp_path: Path) -> None:
    bin_dir, repo = tmp_path / "bin", tmp_path / "repo"
    bin_dir.mkdir()
    repo.mkdir()
    (bin_dir / "mytool").symlink_to("/bin/true")
    (repo / "mytool").write_text("#!/bin/sh\n")
    (repo / "mytool").chmod(0o755)
    config_file = tmp_path / "mcp.json"
    config_file.write_text(json.dumps({"mcpServers": {"tool": {"command": "mytool"}}}))
    into = tmp_path / "plugins"
    done = await trio.run_process(
        [sys.executable, "-m", "runtime.cli", "import", str(config_file), "--into", str(into), "--config",
         str(write_config(tmp_path, tmp_path / "state")), "--yes"],
        cwd=str(repo), env={**os.environ, "PYTHONPATH": str(REPO), "PATH": f".:{bin_dir}:{os.environ['PATH']}"},
        capture_stdout=True, capture_stderr=True, check=False, stdin=b"")
    out = done.stdout.decode()
    assert done.returncode == 0, out + done.stderr.decode()
    assert f"'mytool' in the config is {bin_dir / 'mytool'} (-> {os.path.realpath('/bin/true')})" in out, out
    assert str(repo / "mytool") not in (into / "tool" / "plugin.toml").read_text()


def _sparse(path: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(64 * 1024 * 1024)


#: A client config that came with a cloned repository, as something other than a JSON file. A FIFO
#: used to hang ``toolcell import`` and a device (/dev/zero's numbers) to be read until memory ran out.
CONFIG_HOSTILE: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (lambda path: os.mkfifo(path), "not a regular file: it is a FIFO"),
    "device": (lambda path: os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(1, 5)), "not a regular file: it is a device"),
    "directory": (lambda path: path.mkdir(), "not a regular file: it is a directory"),
    "link-to-fifo": (lambda path: (os.mkfifo(path.with_suffix(".pipe")), path.symlink_to(path.with_suffix(".pipe"))),
                     "it is a FIFO (" ),
    "huge": (_sparse, "larger than"),
}


@pytest.mark.parametrize("kind", sorted(CONFIG_HOSTILE))
async def test_import_of_a_config_that_is_no_regular_file_refuses_it_without_blocking(
        tmp_path: Path, kind: str) -> None:
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod needs root")
    make, says = CONFIG_HOSTILE[kind]
    config_file = tmp_path / "mcp.json"
    make(config_file)
    with trio.fail_after(30):
        code, out, err = await toolcell("import", str(config_file), "--into", str(tmp_path / "plugins"), "--config",
                                        str(write_config(tmp_path, tmp_path / "state")), "--yes")
    assert code == 2 and says in err, out + err


def _socket(path: Path, secret: Path) -> None:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.close()


#: What ``toolcell add FOLDER`` met in the folder, and what its refusal says. Before, the folder was
#: copied with ``shutil.copytree(symlinks=True)``: a device with /dev/zero's numbers was read without
#: end, a hard link to a file outside was copied in as that file's content, a link out was kept.
ADD_HOSTILE: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "link-out": (lambda path, secret: path.symlink_to(secret), "a symbolic link"),
    "link-in": (lambda path, secret: path.symlink_to("../notes.py"), "a symbolic link"),
    "hard-link-out": (lambda path, secret: os.link(secret, path), "hard link outside the folder"),
    "fifo": (lambda path, secret: os.mkfifo(path), "a FIFO"),
    "socket": (_socket, "a socket"),
    "device": (lambda path, secret: os.mknod(path, 0o644 | stat.S_IFCHR, os.makedev(1, 5)), "a device"),
}


@pytest.mark.parametrize("kind", sorted(ADD_HOSTILE))
async def test_add_of_a_folder_holding_anything_but_files_and_folders_refuses_it_naming_the_path(
        make_plugin: Callable[..., Path], tmp_path: Path, kind: str) -> None:
    if kind == "device" and os.geteuid() != 0:
        pytest.skip("mknod needs root")
    source = make_plugin("notes", "from sandbox import tool\n\n@tool\ndef note() -> str:\n    return 'n'\n",
                         root="src")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET-add-must-not-copy\n")
    secret.chmod(0o600)
    (source / "notes" / "data").mkdir()
    make, says = ADD_HOSTILE[kind]
    make(source / "notes" / "data" / "thing", secret)
    own_state = tmp_path / "state"
    config = write_config(tmp_path, own_state)
    into = tmp_path / "plugins"
    with trio.fail_after(30):
        code, out, err = await toolcell("add", str(source / "notes"), "--into", str(into), "--config", str(config),
                                        "--yes")
    assert code == 1, out + err
    assert "data/thing" in err and says in err, err
    assert not (into / "notes").exists()
    assert approvals.load(str(own_state)) == {}, "an approval is recorded for a folder that was refused"
    assert not list((own_state / "staging").iterdir()), "the partial copy is left behind"


async def test_add_of_a_folder_copies_its_files_and_folders_and_hard_links_within_it(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    source = make_plugin("notes", "from sandbox import tool\n\n@tool\ndef note() -> str:\n    return 'n'\n",
                         root="src")
    folder = source / "notes"
    (folder / "lib" / "deep").mkdir(parents=True)
    (folder / "lib" / "deep" / "run.sh").write_text("#!/bin/sh\n")
    (folder / "lib" / "deep" / "run.sh").chmod(0o4755)
    os.link(folder / "notes.py", folder / "lib" / "same.py")
    (folder / ".git").mkdir()
    (tmp_path / "origin-object").write_bytes(b"x")
    os.link(tmp_path / "origin-object", folder / ".git" / "object")  # a local clone hard-links its history
    into = tmp_path / "plugins"
    code, out, err = await toolcell("add", str(folder), "--into", str(into), "--config",
                                    str(write_config(tmp_path, tmp_path / "state")), "--yes")
    assert code == 0, out + err
    copied = into / "notes"
    assert (copied / "lib" / "same.py").read_text() == (folder / "notes.py").read_text()
    assert stat.S_IMODE((copied / "lib" / "deep" / "run.sh").stat().st_mode) == 0o755  # never setuid
    assert not (copied / ".git").exists()


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


# -- the caller's directory configures no installer (issue 23, finding 9) ------------------------------


class _Registry:
    """A loopback HTTP server that answers every GET with an npm packument whose latest is ``version``
    and counts the connections it saw."""

    def __init__(self, version: str) -> None:
        seen = self.paths = []  # type: list[str]
        body = json.dumps({"name": "toolcell-probe", "dist-tags": {"latest": version},
                           "versions": {version: {"name": "toolcell-probe", "version": version}}}).encode()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                seen.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


async def test_the_version_add_and_import_pin_comes_from_the_users_npm_config_never_the_cwds_npmrc(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``toolcell import`` run inside a cloned repository used to let its ``.npmrc`` choose the registry
    that decided the version to pin. Here the clone's ``.npmrc`` (and ``uv.toml``, ``pip.conf``) name a
    registry that answers 6.6.6; the user's own ``~/.npmrc`` names one that answers 1.2.3."""
    from runtime import installer

    evil, good = _Registry("6.6.6"), _Registry("1.2.3")
    try:
        clone = tmp_path / "cloned-repo"
        clone.mkdir()
        (clone / ".npmrc").write_text(f"registry={evil.url}\n")
        (clone / "package.json").write_text('{"name": "cloned", "version": "1.0.0"}\n')
        (clone / "uv.toml").write_text(f'index-url = "{evil.url}simple"\n')
        (clone / "pip.conf").write_text(f"[global]\nindex-url = {evil.url}simple\n")
        user_rc = tmp_path / "home" / ".npmrc"
        user_rc.parent.mkdir()
        user_rc.write_text(f"registry={good.url}\n")
        for var in list(os.environ):
            if var.lower().startswith("npm_config_"):
                monkeypatch.delenv(var)
        monkeypatch.setenv("NPM_CONFIG_USERCONFIG", str(user_rc))
        monkeypatch.chdir(clone)
        with trio.fail_after(120):
            version = await installer.resolve_version("npm", "toolcell-probe")
        assert version == "1.2.3"
        assert good.paths and not evil.paths
    finally:
        evil.close()
        good.close()


async def test_uv_reads_no_config_file_of_the_callers_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``uv.toml``/``pyproject.toml``/``pip.conf`` in the directory ``toolcell add pypi:...`` runs from
    name a registry that must see nothing; the daemon user's ``UV_INDEX_URL`` is the one asked."""
    from runtime import installer

    evil, good = _Registry("6.6.6"), _Registry("1.2.3")
    try:
        clone = tmp_path / "cloned-repo"
        clone.mkdir()
        (clone / "uv.toml").write_text(f'index-url = "{evil.url}simple"\n')
        (clone / "pyproject.toml").write_text(f'[project]\nname = "x"\nversion = "1"\n[tool.uv]\nindex-url = "{evil.url}simple"\n')
        (clone / "pip.conf").write_text(f"[global]\nindex-url = {evil.url}simple\n")
        monkeypatch.setenv("UV_INDEX_URL", f"{good.url}simple")
        monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
        monkeypatch.setenv("PIP_CONFIG_FILE", str(clone / "pip.conf"))
        monkeypatch.chdir(clone)
        with trio.fail_after(120), pytest.raises(installer.InstallError):
            await installer.resolve_version("pypi", "toolcell-probe")  # the fake index has no such project
        assert good.paths and not evil.paths
    finally:
        evil.close()
        good.close()
