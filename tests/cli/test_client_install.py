"""``toolcell install CLIENT`` writes the client's own file layout (the files below are shaped like
the real ones: Claude Desktop's ``claude_desktop_config.json``, Claude Code's ``.mcp.json``, Cursor's
``~/.cursor/mcp.json``, VS Code's ``.vscode/mcp.json``), keeps everything else in it, backs it up,
shows a ``--dry-run`` diff, changes nothing the second time, and the stdio entry it writes really
starts toolcell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CLAUDE_DESKTOP = {
    "mcpServers": {
        "filesystem": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/Users/me/Desktop"]},
        "github": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-github"],
                   "env": {"GITHUB_PERSONAL_ACCESS_TOKEN": "ghp_secret"}},
    },
    "globalShortcut": "Ctrl+Space",
}
VSCODE = {
    "inputs": [{"type": "promptString", "id": "perplexity-key", "description": "Perplexity API Key", "password": True}],
    "servers": {
        "Perplexity": {"type": "stdio", "command": "npx", "args": ["-y", "server-perplexity-ask"],
                       "env": {"PERPLEXITY_API_KEY": "${input:perplexity-key}"}},
    },
}


def toolcell(*args: str, home: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], check=False, cwd=str(cwd), capture_output=True,
                          text=True, timeout=60, env=env)


def test_claude_desktop_dry_run_then_write_with_a_backup_then_nothing_to_do(tmp_path: Path) -> None:
    home = tmp_path / "home"
    config = home / ".config" / "Claude" / "claude_desktop_config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(CLAUDE_DESKTOP, indent=2))
    config.chmod(0o600)
    before = config.read_text()
    dry = toolcell("install", "claude-desktop", "--dry-run", home=home, cwd=tmp_path)
    assert dry.returncode == 0, dry.stderr
    assert f"+++ {config} (with toolcell)" in dry.stdout and '+    "toolcell": {' in dry.stdout
    assert config.read_text() == before and list(config.parent.iterdir()) == [config]
    done = toolcell("install", "claude-desktop", home=home, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    written = json.loads(config.read_text())
    assert written["globalShortcut"] == "Ctrl+Space"
    assert written["mcpServers"]["github"] == CLAUDE_DESKTOP["mcpServers"]["github"]
    entry = written["mcpServers"]["toolcell"]
    assert os.path.isabs(entry["command"]) and os.access(entry["command"], os.X_OK)  # no PATH in a GUI app
    assert entry["args"][-2:] == ["serve", "--stdio"] and "type" not in entry
    backups = [p for p in config.parent.iterdir() if p != config]
    assert len(backups) == 1 and backups[0].read_text() == before
    assert (config.stat().st_mode & 0o777) == 0o600 == (backups[0].stat().st_mode & 0o777)  # it holds a token
    again = toolcell("install", "claude-desktop", home=home, cwd=tmp_path)
    assert again.returncode == 0 and "nothing changed" in again.stdout
    assert len(list(config.parent.iterdir())) == 2
    refused = toolcell("install", "claude-desktop", "--http", "http://127.0.0.1:8765/mcp", home=home, cwd=tmp_path)
    assert refused.returncode == 2 and "stdio" in refused.stderr


def test_the_claude_code_entry_it_writes_starts_toolcell_and_answers_mcp(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    settings = tmp_path / "toolcell.toml"
    settings.write_text(f'policy = "none"\nstate_dir = "{tmp_path / "state"}"\nwatch = false\n')
    done = toolcell("install", "claude-code", "--plugins", str(REPO / "plugins" / "mathkit"), "--config",
                    str(settings), home=tmp_path, cwd=project)
    assert done.returncode == 0, done.stderr
    entry = json.loads((project / ".mcp.json").read_text())["mcpServers"]["toolcell"]
    assert entry["type"] == "stdio"
    messages = [
        {"jsonrpc": "2.0", "id": 1, "method": "initialize",
         "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
        {"jsonrpc": "2.0", "method": "notifications/initialized"},
        {"jsonrpc": "2.0", "id": 2, "method": "tools/list"},
    ]
    # As a client starts it: the command and arguments from the file, nothing else.
    server = subprocess.run([entry["command"], *entry["args"]], input="".join(json.dumps(m) + "\n" for m in messages),
                            capture_output=True, text=True, timeout=120, cwd=str(tmp_path),
                            env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})
    replies = {r["id"]: r for r in map(json.loads, server.stdout.splitlines())}
    assert replies[1]["result"]["serverInfo"]["name"], server.stderr
    assert "math_evaluate" in {t["name"] for t in replies[2]["result"]["tools"]}, server.stderr


def test_vscode_and_cursor_get_an_http_entry_with_the_token_and_keep_what_was_there(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    (workspace / ".vscode").mkdir(parents=True)
    (workspace / ".vscode" / "mcp.json").write_text(json.dumps(VSCODE, indent=2))
    url = "http://127.0.0.1:8765/mcp"
    done = toolcell("install", "vscode", "--http", url, "--token", "tc_abc", home=tmp_path, cwd=workspace)
    assert done.returncode == 0, done.stderr
    written = json.loads((workspace / ".vscode" / "mcp.json").read_text())
    assert written["inputs"] == VSCODE["inputs"] and written["servers"]["Perplexity"] == VSCODE["servers"]["Perplexity"]
    assert written["servers"]["toolcell"] == {"type": "http", "url": url, "headers": {"Authorization": "Bearer tc_abc"}}
    cursor = toolcell("install", "cursor", "--http", url, "--token", "tc_abc", home=tmp_path, cwd=workspace)
    assert cursor.returncode == 0, cursor.stderr
    made = tmp_path / ".cursor" / "mcp.json"
    assert json.loads(made.read_text()) == {"mcpServers": {"toolcell": {"url": url,
                                                                        "headers": {"Authorization": "Bearer tc_abc"}}}}
    assert (made.stat().st_mode & 0o777) == 0o600  # a new file with a token in it


def test_a_file_it_cannot_rewrite_faithfully_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / ".vscode").mkdir()
    commented = '{\n  // my servers\n  "servers": {}\n}\n'
    (tmp_path / ".vscode" / "mcp.json").write_text(commented)
    out = toolcell("install", "vscode", home=tmp_path, cwd=tmp_path)
    assert out.returncode == 2 and "not plain JSON" in out.stderr
    assert (tmp_path / ".vscode" / "mcp.json").read_text() == commented


def test_a_hostile_or_odd_client_file_is_refused_unchanged_and_never_hangs(tmp_path: Path) -> None:
    """The file may come with a cloned repository (``.mcp.json``): a FIFO (reading it would block for
    ever), a huge file, or JSON with a key twice (json keeps the last one, so rewriting it would drop
    the others' servers silently) is refused with the reason, and left as it was."""
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    out = toolcell("install", "cursor", "--file", str(fifo), home=tmp_path, cwd=tmp_path)
    assert out.returncode == 2 and "not a regular file" in out.stderr, out.stderr
    huge = tmp_path / "huge.json"
    huge.write_text("{" + " " * (5 << 20) + "}")
    out = toolcell("install", "cursor", "--file", str(huge), home=tmp_path, cwd=tmp_path)
    assert out.returncode == 2 and "larger than" in out.stderr, out.stderr
    twice = '{"mcpServers": {"a": {"command": "a"}}, "mcpServers": {"b": {"command": "b"}}}\n'
    duplicated = tmp_path / "twice.json"
    duplicated.write_text(twice)
    out = toolcell("install", "cursor", "--file", str(duplicated), home=tmp_path, cwd=tmp_path)
    assert out.returncode == 2 and "'mcpServers' appears more than once" in out.stderr, out.stderr
    assert duplicated.read_text() == twice
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.json", "huge.json", "twice.json"]  # no backups


def test_a_token_written_into_a_file_others_can_read_makes_it_private(tmp_path: Path) -> None:
    """A config others may read (editors make them 0644) that now holds a bearer token is the user's
    alone; the backup is no more readable than the file was."""
    (tmp_path / ".cursor").mkdir()
    config = tmp_path / ".cursor" / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {}}))
    config.chmod(0o644)
    done = toolcell("install", "cursor", "--http", "http://127.0.0.1:8765/mcp", "--token", "tc_secret",
                    home=tmp_path, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "tc_secret" in config.read_text()
    assert (config.stat().st_mode & 0o777) == 0o600
    backups = list((tmp_path / ".cursor").glob("mcp.json.*.bak"))
    assert len(backups) == 1 and (backups[0].stat().st_mode & 0o777) == 0o644
    assert json.loads(backups[0].read_text()) == {"mcpServers": {}}


def test_a_client_file_that_is_a_link_is_left_as_it_is_and_the_file_it_leads_to_can_be_named(tmp_path: Path) -> None:
    """A dotfiles manager keeps ``~/.cursor/mcp.json`` as a link into its repository; the new file replaced
    the link with a copy. A ``.mcp.json`` in a cloned repository may be a link leading anywhere."""
    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    real = dotfiles / "cursor-mcp.json"
    real.write_text(json.dumps({"mcpServers": {"mine": {"command": "mine"}}}))
    (tmp_path / ".cursor").mkdir()
    link = tmp_path / ".cursor" / "mcp.json"
    link.symlink_to(real)
    out = toolcell("install", "cursor", home=tmp_path, cwd=tmp_path)
    assert out.returncode == 2 and f"is a link to {real}" in out.stderr and f"--file {real}" in out.stderr, out.stderr
    assert link.is_symlink() and json.loads(real.read_text()) == {"mcpServers": {"mine": {"command": "mine"}}}
    assert sorted(p.name for p in (tmp_path / ".cursor").iterdir()) == ["mcp.json"]  # no backup, no temporary file
    loop = tmp_path / "repo" / ".mcp.json"  # a cloned repository's link to itself
    loop.parent.mkdir()
    loop.symlink_to(loop)
    looped = toolcell("install", "claude-code", home=tmp_path, cwd=loop.parent)
    assert looped.returncode == 2 and "a loop of links" in looped.stderr and "Traceback" not in looped.stderr, \
        looped.stderr
    named = toolcell("install", "cursor", "--file", str(real), home=tmp_path, cwd=tmp_path)
    assert named.returncode == 0, named.stderr
    assert link.is_symlink() and set(json.loads(link.read_text())["mcpServers"]) == {"mine", "toolcell"}
