"""``toolcell import`` and ``add`` do not leave a server that fails at once: a folder its arguments
name without a grant is said, with the command that grants it, and (without a terminal) the server
is not created."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def toolcell(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], check=False, cwd=str(REPO), capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_import_yes_does_not_create_a_server_without_the_folder_its_arguments_name(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    client = tmp_path / ".mcp.json"
    client.write_text(json.dumps({"mcpServers": {"files": {"command": "/bin/cat", "args": [str(shared)]}}}))
    config = tmp_path / "toolcell.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    into = tmp_path / "plugins"
    out = toolcell("import", str(client), "--into", str(into), "--config", str(config), "--yes")
    assert out.returncode == 1
    assert f"files: its arguments name {shared}, which it is granted neither to read nor to write" in out.stderr
    assert f"toolcell import {client} --only files --write files={shared} --replace" in out.stderr, out.stderr
    assert not (into / "files").exists()
    granted = toolcell("import", str(client), "--into", str(into), "--config", str(config), "--yes",
                       "--only", "files", "--write", f"files={shared}", "--replace")
    assert granted.returncode == 0, granted.stderr
    assert (into / "files" / "plugin.toml").is_file() and "granted neither" not in granted.stderr


def test_a_read_grant_of_a_parent_folder_covers_the_folder_an_argument_names(tmp_path: Path) -> None:
    shared = tmp_path / "shared" / "deeper"
    shared.mkdir(parents=True)
    client = tmp_path / ".mcp.json"
    client.write_text(json.dumps({"mcpServers": {"files": {"command": "/bin/cat", "args": [str(shared)]}}}))
    config = tmp_path / "toolcell.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    out = toolcell("import", str(client), "--into", str(tmp_path / "plugins"), "--config", str(config), "--yes",
                   "--read", f"files={tmp_path / 'shared'}")
    assert out.returncode == 0, out.stderr
