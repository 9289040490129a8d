"""Permissions a person approved: what each plugin may read, write, reach, see and use.

``toolcell add``, ``toolcell import`` and ``toolcell approve NAME`` show a plugin's grants and, once a
person said yes, record them in ``<state_dir>/approvals.json`` (0600, owned by the daemon's user,
written atomically). Only those commands write it; the daemon only reads it. No client request and
no tool reaches it: a worker cannot write the state dir (Landlock, a read-only mount view, another
uid), and nothing in the MCP conversation touches approvals.

Approvals are kept per plugin folder (its real path). Every load of a plugin with a recorded approval -- at start and at every hot reload -- compares its
manifest with the record (``check``). A manifest that asks for more (a path outside the approved
ones, a new network entry or environment variable, a higher limit, a different server package or
command) is refused with the difference; on a hot reload the approved version keeps serving and the
difference is reported (``plugin_reload_failed``, ``toolcell list``) until ``toolcell approve NAME``.

Plugins with no record -- the bundled ones, and folders an operator placed in a plugins directory by
hand, as before approvals existed -- are served as placed: putting them there is the approval. Run
``toolcell approve NAME`` once to put such a plugin under the same watch.

A file that another user could have written (wrong owner, group- or world-writable, a symlink) is
not trusted: it is ignored, loudly (``approvals_untrusted`` in the log, and ``toolcell approve`` refuses
to write to it until it is fixed).
"""

from __future__ import annotations

import json
import os
import stat
import time
from typing import Any

import msgspec

from runtime.logs import log
from runtime.manifest import Manifest
from sandbox.wire import Limits

FILE = "approvals.json"
#: How a held plugin's problem starts (``runtime.plugins.awaiting_approval`` looks for it).
HELD = "needs approval:"


class ApprovalsError(Exception):
    """The approvals file cannot be trusted or read."""


def grants(manifest: Manifest) -> dict[str, Any]:
    """What ``manifest`` asks for, as recorded and compared."""
    p = manifest.permissions
    runs: Any = None
    if manifest.server is not None:
        runs = manifest.server.package or [*manifest.server.command, *manifest.server.args]
    return {
        "read": sorted(set(p.read)),
        "write": sorted(set(p.write)),
        "network": sorted(set(p.network)),
        "env": sorted(set(manifest.env.allow) | set(manifest.env.set)),
        "limits": msgspec.structs.asdict(manifest.limits),
        "runs": runs,
    }


def _under(path: str, roots: list[str]) -> bool:
    path = os.path.normpath(path)
    return any(path == os.path.normpath(r) or path.startswith(os.path.normpath(r).rstrip("/") + "/") for r in roots)


def exceeds(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    """What ``asked`` wants beyond ``approved`` (empty: nothing more), one line per item."""
    more: list[str] = []
    ok_read = list(approved.get("read", [])) + list(approved.get("write", []))
    more += [f"+ read {p}" for p in asked["read"] if not _under(p, ok_read)]
    more += [f"+ write {p}" for p in asked["write"] if not _under(p, list(approved.get("write", [])))]
    more += [f"+ network {e}" for e in asked["network"] if e not in approved.get("network", [])]
    more += [f"+ env {v}" for v in asked["env"] if v not in approved.get("env", [])]
    limits = approved.get("limits", {})
    defaults = msgspec.structs.asdict(Limits())
    for key, value in asked["limits"].items():
        old = limits.get(key, defaults.get(key))
        if isinstance(value, (int, float)) and isinstance(old, (int, float)) and value > old:
            more.append(f"limits.{key}: {old:g} -> {value:g}")
    if asked.get("runs") != approved.get("runs"):
        more.append(f"runs: {approved.get('runs')!r} -> {asked.get('runs')!r}")
    return more


def describe(manifest: Manifest) -> list[str]:
    """The grants of ``manifest`` in words, for a person to approve."""
    g = grants(manifest)
    lim = manifest.limits
    lines = [f"plugin {manifest.name} {manifest.version} ({manifest.kind})"]
    if g["runs"] is not None:
        lines.append(f"  runs:     {g['runs'] if isinstance(g['runs'], str) else ' '.join(g['runs'])}")
    lines.append(f"  read:     {', '.join(g['read']) or '(nothing beyond its own files)'}")
    lines.append(f"  write:    {', '.join(g['write']) or '(nothing beyond its private scratch)'}")
    lines.append(f"  network:  {', '.join(g['network']) or '(none)'}")
    lines.append(f"  env:      {', '.join(g['env']) or '(none)'}")
    lines.append(f"  limits:   timeout {lim.timeout_s:g} s, memory {lim.memory_mb} MB, cpu {lim.cpu_s} s, "
                 f"processes {lim.max_processes}, concurrency {lim.max_concurrency}")
    return lines


def _path(state_dir: str) -> str:
    return os.path.join(state_dir, FILE)


def key(plugin_dir: Any) -> str:
    """Approvals are kept per plugin folder: the approval of one folder says nothing about another."""
    return os.path.realpath(str(plugin_dir))


def load(state_dir: str) -> dict[str, Any]:
    """Every recorded approval by plugin folder ({} when none). Raises ``ApprovalsError`` for a file
    that cannot be trusted."""
    path = _path(state_dir)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ApprovalsError(f"{path}: {exc}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) or not stat.S_ISREG(st.st_mode):
            raise ApprovalsError(f"{path} is not a regular file owned by uid {os.geteuid()} and writable only by it")
        dst = os.stat(state_dir)
        if dst.st_uid != os.geteuid() or dst.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ApprovalsError(f"{state_dir} is writable by others than uid {os.geteuid()}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = json.loads(f.read(16 << 20))
    except ValueError as exc:
        raise ApprovalsError(f"{path}: not valid JSON: {exc}") from None
    finally:
        os.close(fd)
    if not isinstance(data, dict) or not isinstance(data.get("plugins"), dict):
        raise ApprovalsError(f"{path}: not an approvals file")
    return {k: v for k, v in data["plugins"].items() if isinstance(v, dict) and isinstance(v.get("grants"), dict)}


def check(manifest: Manifest, plugin_dir: Any, state_dir: str) -> str | None:
    """None when ``manifest`` may load, else why it is held (asks for more than was approved)."""
    try:
        records = load(state_dir)
    except ApprovalsError as exc:
        log("approvals_untrusted", level="error", error=str(exc), note="every approval in it is ignored")
        return None
    record = records.get(key(plugin_dir))
    if record is None:
        return None
    more = exceeds(grants(manifest), record["grants"])
    if not more:
        return None
    return (f"{HELD} asks for more than was approved ({'; '.join(more)}); "
            f"run `toolcell approve {manifest.name}`")


def record(state_dir: str, manifest: Manifest, plugin_dir: str, how: str) -> None:
    """Record that a person approved what ``manifest`` asks for (replacing an earlier approval)."""
    os.makedirs(state_dir, mode=0o711, exist_ok=True)
    try:
        records = load(state_dir)
    except ApprovalsError as exc:
        raise ApprovalsError(f"{exc}; fix or remove it before approving") from None
    records[key(plugin_dir)] = {"grants": grants(manifest), "name": manifest.name, "version": manifest.version,
                              "how": how, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = _path(state_dir)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"plugins": records}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
