"""Which daemons a command means: those of *this* configuration and plugin set, its scope.

Daemons of one user share the per-user default state dir (pidfiles, the task store): a test suite's,
another project's. ``toolcell reload`` and ``toolcell tasks`` act by default only on the daemons of the
command's own scope -- the config file (resolved) and the plugin folders (resolved, sorted) -- and say
which they reached; ``--all`` widens them to every daemon of the state dir.

A config file names its daemons (whose plugin folders ``serve --plugins`` may have set); plugin folders
given to the command narrow that, and without a config file the plugin set is what tells daemons
apart (``means``). A serving daemon writes its scope into its pidfile (``runtime.reload``), and appends
its task-store owner id with its scope to ``<state_dir>/scopes/owners.jsonl``, so that the tasks its
scope ran can be told apart after it has stopped. Both files are in the private state dir; they are
still read defensively.
"""

from __future__ import annotations

import os
from pathlib import Path
import msgspec

#: Owner ids kept per scope (one per daemon start); older ones are dropped.
MAX_OWNERS = 2000


class Scope(msgspec.Struct, frozen=True):
    """A daemon's configuration file (None: no ``--config``) and plugin folders, both resolved."""

    config: str | None
    plugins: tuple[str, ...]

    def describe(self) -> str:
        """For people: ``config /x/toolcell.toml, plugins /a, /b``."""
        config = f"config {self.config}" if self.config else "no config file"
        return f"{config}; plugins {', '.join(self.plugins) or '(none)'}"


def scope_of(config_path: str | None, plugins: list[str]) -> Scope:
    """The scope of a command or daemon given its ``--config`` and its configured plugin folders."""
    config = str(Path(config_path).resolve()) if config_path else None
    return Scope(config, tuple(sorted({str(Path(p).resolve()) for p in plugins})))


def encode(scope: Scope) -> str:
    return msgspec.json.encode(scope).decode()


def decode(text: str) -> Scope | None:
    """A scope read back from a pidfile; None for anything else (an older daemon wrote none)."""
    try:
        return msgspec.json.decode(text, type=Scope)
    except (msgspec.DecodeError, ValueError):
        return None


def means(command: Scope, daemon: Scope | None, plugins_given: bool) -> bool:
    """Whether a command of scope ``command`` means a daemon of scope ``daemon``: the same config file
    and, when the command names plugin folders or has no config file, the same plugin folders (a config
    file names its daemons, whose plugins ``serve --plugins`` may have set; without one, the plugin set
    is all that tells daemons apart)."""
    if daemon is None or daemon.config != command.config:
        return False
    return daemon.plugins == command.plugins if plugins_given or command.config is None else True


def _owners_file(state_dir: str) -> str:
    return os.path.join(state_dir, "scopes", "owners.jsonl")


def record_owner(state_dir: str, scope: Scope, owner: str) -> None:
    """Remember that ``owner`` (a daemon's task-store owner id) served ``scope``."""
    path = _owners_file(state_dir)
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    line = msgspec.json.encode({"owner": owner, "scope": scope}).decode()
    lines = (_read_lines(path) + [line])[-MAX_OWNERS:]
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)


class _Owned(msgspec.Struct):
    owner: str
    scope: Scope


def owners_of(state_dir: str, scope: Scope, plugins_given: bool = True) -> set[str]:
    """The owner ids of every daemon that a command of ``scope`` means (``means``) and that served from
    this state dir."""
    found = set()
    for line in _read_lines(_owners_file(state_dir)):
        try:
            owned = msgspec.json.decode(line, type=_Owned)
        except (msgspec.DecodeError, ValueError):
            continue
        if means(scope, owned.scope, plugins_given):
            found.add(owned.owner)
    return found


def _read_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.strip() for line in f.read(4 * 1024 * 1024).splitlines() if line.strip()]
    except OSError:
        return []
