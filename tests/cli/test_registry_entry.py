"""``toolcell add ./server.json``: entries of the official MCP Registry (saved in ``registry/``) become
hosted plugins through the same approval flow.

``context7`` and ``playwright-mcp`` are the ``server.json`` files those projects publish to the
registry; the ``*-2025-07-09`` files are the registry's own examples in the format's first
(snake_case) spelling; ``filesystem-pinned`` is the registry's filesystem entry in the current
spelling with its package pinned to the version ``tests/hosted`` installs, so that the end-to-end
test below installs what the other tests already rely on."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from runtime.registry_entry import RegistryProblem, read_server_json

REPO = Path(__file__).resolve().parents[2]
SAVED = Path(__file__).resolve().parent / "registry"


def no_one_asked(question: str, default: str) -> str:
    return default


def test_a_published_npm_entry_keeps_its_secret_out_of_the_plugin_folder() -> None:
    entry = read_server_json(SAVED / "context7.server.json", [], no_one_asked)
    assert entry.name == "io.github.upstash/context7"
    assert entry.server == {"package": "npm:@upstash/context7-mcp@1.0.26", "args": []}
    assert entry.env_allow == ["CONTEXT7_API_KEY"] and entry.env_set == {}  # isSecret: from the daemon's env
    assert any("CONTEXT7_API_KEY" in note and "never written" in note for note in entry.notes)
    minimal = read_server_json(SAVED / "playwright-mcp.server.json", [], no_one_asked)
    assert minimal.server == {"package": "npm:@playwright/mcp@0.1.0", "args": []}


def test_the_first_spelling_a_default_argument_and_a_plain_default_variable() -> None:
    entry = read_server_json(SAVED / "filesystem-2025-07-09.server.json", [], no_one_asked)
    # The npm package of the two (the other is an OCI image); its open argument takes its default.
    assert entry.server == {"package": "npm:@modelcontextprotocol/server-filesystem@1.0.2",
                            "args": ["/Users/username/Desktop"]}
    assert entry.env_set == {"LOG_LEVEL": "info"} and entry.env_allow == []
    assert any("2 packages" in note for note in entry.notes)
    given = read_server_json(SAVED / "filesystem-2025-07-09.server.json", ["/srv/shared"], no_one_asked)
    assert given.server["args"] == ["/srv/shared"]
    weather = read_server_json(SAVED / "weather-2025-07-09.server.json", [], no_one_asked)
    assert weather.server == {"package": "pypi:weather-mcp-server==0.5.0", "args": []}
    assert weather.env_allow == ["WEATHER_API_KEY"] and weather.env_set == {"WEATHER_UNITS": "celsius"}


def test_what_toolcell_cannot_host_is_refused_with_the_reason() -> None:
    with pytest.raises(RegistryProblem, match="no npm or PyPI package.*remote"):
        read_server_json(SAVED / "remote-2025-07-09.server.json", [], no_one_asked)
    with pytest.raises(RegistryProblem, match="'target_dir' .*is required: give it with --arg VALUE"):
        read_server_json(SAVED / "filesystem-pinned.server.json", [], no_one_asked)


def test_add_of_a_registry_entry_installs_approves_and_serves_it(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    for folder in (tmp_path, shared):
        folder.chmod(0o777 if folder == shared else 0o755)
    config = tmp_path / "toolcell.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    into = tmp_path / "plugins"

    def toolcell(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runtime.cli", *args, "--config", str(config)], check=False,
                              cwd=str(REPO), capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)

    added = toolcell("add", str(SAVED / "filesystem-pinned.server.json"), "--into", str(into), "--arg", str(shared),
                     "--write", f"filesystem={shared}", "--yes")
    assert added.returncode == 0, added.stdout + added.stderr
    assert "installing npm:@modelcontextprotocol/server-filesystem@2026.8.31" in added.stderr
    manifest = tomllib.loads((into / "filesystem" / "plugin.toml").read_text())
    assert manifest["server"] == {"package": "npm:@modelcontextprotocol/server-filesystem@2026.8.31",
                                  "args": [str(shared)]}
    assert (into / "filesystem" / "package-lock.json").is_file()
    called = toolcell("call", "filesystem_list_allowed_directories", "{}", "--plugins", str(into))
    assert called.returncode == 0, called.stderr
    assert str(shared) in called.stdout


def test_a_server_json_that_is_a_fifo_a_device_or_huge_is_refused_without_hanging(tmp_path: Path) -> None:
    """A server.json may come with a cloned repository: it is read as a plugin's files are."""
    import os

    fifo = tmp_path / "fifo.server.json"
    os.mkfifo(fifo)
    device = tmp_path / "zero.server.json"
    device.symlink_to("/dev/zero")
    huge = tmp_path / "huge.server.json"
    with open(huge, "wb") as f:
        f.truncate(64 * 1024 * 1024)
    for path, fragment in ((fifo, "FIFO"), (device, "device"), (huge, "larger")):
        with pytest.raises(RegistryProblem) as info:
            read_server_json(path, [], no_one_asked)
        assert fragment.lower() in info.value.args[0].lower(), info.value.args[0]


@pytest.mark.parametrize("entry, why", [
    # Not the shapes the format has: each is a RegistryProblem, never a traceback.
    ({"name": "x", "packages": [{"registryType": "npm", "identifier": "x", "transport": "stdio"}]}, None),
    ({"name": "x", "packages": [{"registryType": "npm", "identifier": "x",
                                 "packageArguments": [{"type": "named", "value": "1"}]}]}, "argument name"),
    ({"name": "x", "packages": [{"registryType": ["npm"], "identifier": "x"}]}, "toolcell hosts npm and PyPI"),
    # Escape sequences would reach the person's terminal (questions, notes): refused, or shown escaped.
    ({"name": "x\x1b]52;c;cm0gLXJmIH4=\x07", "packages": []}, "without control characters"),
    ({"name": "x", "packages": [{"registryType": "npm", "identifier": "x\x1b[2J"}]}, "without control characters"),
    ({"name": "x", "packages": [{"registryType": "npm", "identifier": "x", "packageArguments": [
        {"type": "positional", "value": "a\u202eb"}]}]}, "without control characters"),
])
def test_a_hostile_server_json_is_refused_with_a_reason(tmp_path: Path, entry: dict[str, object], why: str | None) -> None:
    import json

    path = tmp_path / "server.json"
    path.write_text(json.dumps(entry))
    if why is None:
        assert read_server_json(path, [], no_one_asked).server["package"] == "npm:x"
        return
    with pytest.raises(RegistryProblem, match=why):
        read_server_json(path, [], no_one_asked)


def test_what_a_server_json_says_is_shown_to_the_person_with_its_control_characters_escaped(tmp_path: Path) -> None:
    import json

    asked: list[str] = []

    def person(question: str, default: str) -> str:
        asked.append(question + default)
        return "/srv"

    path = tmp_path / "server.json"
    path.write_text(json.dumps({"name": "x", "packages": [{"registryType": "npm", "identifier": "x", "packageArguments": [
        {"type": "positional", "valueHint": "dir\x1b[8m", "description": "hidden\x1b[2K\rok", "default": "/tmp"}]}]}))
    assert read_server_json(path, [], person).server["args"] == ["/srv"]
    assert asked and not any(c in asked[0] for c in "\x1b\r"), asked
