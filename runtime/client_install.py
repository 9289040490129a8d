"""``toolcell install CLIENT``: put toolcell into an MCP client's configuration, the reverse of
``toolcell import``.

Each client keeps its MCP servers in a JSON file of its own layout (``/work/shared/ECOSYSTEM.md``):

* Claude Desktop: ``claude_desktop_config.json`` (``~/.config/Claude`` on Linux, ``~/Library/Application
  Support/Claude`` on macOS), ``mcpServers``, ``{command, args, env}``; stdio only. A GUI app does not
  inherit the login shell's ``PATH``, so the command is an absolute path.
* Claude Code: ``.mcp.json`` in the project (``--file ~/.claude.json`` for the user's), ``mcpServers``
  with ``type`` (``stdio``, or ``http`` with ``url`` and ``headers``).
* Cursor: ``~/.cursor/mcp.json``, ``mcpServers``; ``{command, args}`` or ``{url, headers}``.
* VS Code: ``.vscode/mcp.json`` in the workspace, ``servers`` with ``type``; its ``inputs`` are kept.

The entry runs ``toolcell serve --stdio`` with this configuration (``--plugins``, ``--config``), or
points at a running daemon (``--http URL``, ``--token`` as a bearer header). Everything else in the
file is kept as it was. The command is idempotent (an entry already as wanted changes nothing),
``--dry-run`` prints the change as a unified diff, and a file it changes is copied aside first.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import plugin_files


@dataclass(frozen=True)
class Client:
    title: str
    #: The top-level key that holds the servers.
    key: str
    #: Whether entries carry ``"type": "stdio" | "http"``.
    typed: bool
    #: Whether the client can reach a server over HTTP from this file.
    http: bool


CLIENTS = {
    "claude-desktop": Client("Claude Desktop", "mcpServers", typed=False, http=False),
    "claude-code": Client("Claude Code", "mcpServers", typed=True, http=True),
    "cursor": Client("Cursor", "mcpServers", typed=False, http=True),
    "vscode": Client("VS Code", "servers", typed=True, http=True),
}


class InstallProblem(Exception):
    """Why the client's configuration cannot be changed; the message says what to do."""


def default_file(client: str, home: Path, cwd: Path, platform: str = sys.platform) -> Path:
    """Where ``client`` keeps its MCP servers by default."""
    if client == "claude-desktop":
        if platform == "darwin":
            return home / "Library" / "Application Support" / "Claude" / "claude_desktop_config.json"
        config_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        return config_home / "Claude" / "claude_desktop_config.json"
    if client == "claude-code":
        return cwd / ".mcp.json"
    if client == "cursor":
        return home / ".cursor" / "mcp.json"
    return cwd / ".vscode" / "mcp.json"


def toolcell_command() -> list[str]:
    """An absolute command that runs this toolcell (GUI clients have no shell ``PATH``)."""
    beside = Path(sys.executable).parent / "toolcell"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside)]
    found = shutil.which("toolcell")
    if found:
        return [os.path.abspath(found)]
    return [os.path.abspath(sys.executable), "-m", "runtime.cli"]


def entry_for(client: Client, args: argparse.Namespace) -> dict[str, Any]:
    """The server entry toolcell needs in ``client``'s file."""
    if args.http:
        if not client.http:
            raise InstallProblem(f"{client.title} starts its servers itself (stdio) from this file: leave out --http")
        if not args.http.startswith(("http://", "https://")):
            raise InstallProblem(f"--http {args.http!r}: give the daemon's URL, e.g. http://127.0.0.1:8765/mcp")
        entry: dict[str, Any] = {"type": "http"} if client.typed else {}
        entry["url"] = args.http
        if args.token:
            entry["headers"] = {"Authorization": f"Bearer {args.token}"}
        return entry
    if args.token:
        raise InstallProblem("--token goes with --http (a stdio server needs none)")
    command = toolcell_command()
    serve = ["serve", "--stdio"]
    for folder in args.plugins or []:
        serve += ["--plugins", os.path.abspath(folder)]
    if args.config:
        serve += ["--config", os.path.abspath(args.config)]
    entry = {"type": "stdio"} if client.typed else {}
    entry.update({"command": command[0], "args": command[1:] + serve})
    return entry


#: A client's configuration file is a few kilobytes; a larger one is refused unread.
MAX_CONFIG_BYTES = 4 * 1024 * 1024


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    twice = next((k for k in keys if keys.count(k) > 1), None)
    if twice is not None:
        # json keeps the last one: rewriting the file would silently drop the others.
        raise ValueError(f"the key {twice!r} appears more than once in one object")
    return dict(pairs)


def _read(path: Path, client: Client) -> tuple[str, dict[str, Any]]:
    # Followed to where it leads, then read as a plugin's files are: a regular file only (a FIFO would
    # block, a device never end), capped (``plugin_files.read_named``).
    try:
        text = plugin_files.read_named_text(str(path), MAX_CONFIG_BYTES)
    except plugin_files.PluginFileError as exc:
        raise InstallProblem(f"cannot read it: {exc.reason}") from None
    if text is None:
        return "", {}
    if not text.strip():
        return text, {}
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as exc:
        raise InstallProblem(f"{path}: not plain JSON ({exc}); comments or trailing commas are kept only by hand: "
                             "add the entry --dry-run shows yourself") from None
    if not isinstance(data, dict):
        raise InstallProblem(f"{path}: not a {client.title} configuration (a JSON object)")
    if client.key in data and not isinstance(data[client.key], dict):
        raise InstallProblem(f"{path}: its {client.key!r} is not an object")
    return text, data


def _private_copy(data: bytes, dest: Path, mode: int) -> None:
    """Write ``data`` to the new file ``dest`` (never through a link or over a file there), readable by
    others only once it is chmodded to ``mode``: a config can hold tokens."""
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        os.fchmod(f.fileno(), mode)


def _render(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, ensure_ascii=False) + "\n"


def run_install(args: argparse.Namespace) -> int:
    client = CLIENTS[args.client]
    path = Path(args.file) if args.file else default_file(args.client, Path.home(), Path.cwd())
    if path.is_symlink():
        # The new file would replace the link (a dotfiles manager's link silently becoming a copy), and
        # writing where it leads is not asked for: a `.mcp.json` comes with a cloned repository, and its
        # link may lead anywhere. Named, the file it leads to is written as any other.
        target = os.path.realpath(path)  # never raises (Path.resolve does, on a loop)
        if os.path.islink(target):
            print(f"toolcell install: {path} is a link to {os.readlink(path)}, a loop of links that leads to no "
                  "file: it is left as it is", file=sys.stderr)
            return 2
        print(f"toolcell install: {path} is a link to {os.readlink(path)}: it is left as it is; to change the "
              f"file it leads to, give it: --file {target}", file=sys.stderr)
        return 2
    try:
        old_text, data = _read(path, client)
        entry = entry_for(client, args)
    except InstallProblem as exc:
        print(f"toolcell install: {exc}", file=sys.stderr)
        return 2
    servers = dict(data.get(client.key, {}))
    if servers.get(args.name) == entry:
        print(f"toolcell install: {path} already has {args.name!r} as wanted; nothing changed")
        return 0
    servers[args.name] = entry
    new_text = _render({**data, client.key: servers})
    diff = "".join(difflib.unified_diff(old_text.splitlines(keepends=True), new_text.splitlines(keepends=True),
                                        fromfile=f"{path} (now)", tofile=f"{path} (with toolcell)"))
    if args.dry_run:
        sys.stdout.write(diff)
        print(f"toolcell install: --dry-run: {path} not changed")
        return 0
    backup = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        mode = 0o600  # a new file: the user's alone
        if old_text or path.exists():
            mode = stat.S_IMODE(os.stat(path).st_mode)
            backup = path.with_name(f"{path.name}.{time.strftime('%Y%m%d-%H%M%S')}.bak")
            _private_copy(old_text.encode("utf-8"), backup, mode)  # no more readable than the file was
        if args.token:
            mode &= 0o700  # it holds a token now: the user's alone, whoever could read it before
        tmp = path.with_name(f".{path.name}.toolcell-{os.getpid()}")
        _private_copy(new_text.encode("utf-8"), tmp, mode)
        os.replace(tmp, path)
    except OSError as exc:
        print(f"toolcell install: cannot write {path}: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(diff)
    print(f"toolcell install: {args.name!r} written to {path}" + (f" (the old file: {backup})" if backup else "")
          + f"; restart {client.title} (or reload its MCP servers) to use it")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``toolcell install``."""
    p.add_argument("client", choices=sorted(CLIENTS), help="the MCP client whose configuration to write")
    p.add_argument("--file", metavar="PATH", help="its configuration file (default: where the client keeps it)")
    p.add_argument("--name", default="toolcell", help="the server's name in the client (default: toolcell)")
    p.add_argument("--http", metavar="URL", help="point at a running daemon (toolcell serve --http) instead of "
                                                 "starting toolcell over stdio")
    p.add_argument("--token", help="with --http: the bearer token (toolcell token) the client sends")
    p.add_argument("--dry-run", action="store_true", help="print the change as a diff, change nothing")
    p.add_argument("--config", help="the TOML config the stdio server runs with")
    p.add_argument("--plugins", action="append", metavar="DIR", help="plugin folder the stdio server serves "
                                                                     "(repeatable; default: the bundled plugins)")
