"""Permissions a person approved: what each plugin may read, write, reach, see and use.

``toolcell add``, ``toolcell import`` and ``toolcell approve NAME`` show a plugin's grants and, once a
person said yes, record them in ``<state_dir>/approvals.json`` (0600, owned by the daemon's user,
written atomically). Only those commands write it; the daemon only reads it. No client request and
no tool reaches it: a worker cannot write the state dir (Landlock, a read-only mount view, another
uid), and nothing in the MCP conversation touches approvals.

Approvals are kept per plugin folder (its real path). Every load of a plugin with a recorded approval -- at start and at every hot reload -- compares its
manifest with the record (``check``). A manifest that asks for more (a path outside the approved
ones, a new network entry or environment variable, a variable copied from the daemon's environment
that was approved as a fixed value, a higher limit, a different server package, command, executable
or arguments, more server instances or instances per principal, a new dependency, source builds, a
different name or prefix) is refused with the difference; on a hot reload the approved version keeps
serving and the difference is reported (``plugin_reload_failed``, ``toolcell list``) until
``toolcell approve NAME``.

Paths are compared as the sandbox applies them, resolved (``realpath``); where each approved path
led is recorded with it. A path with ``..`` or a symlink in it is approved only as exactly that
string, and only while it still leads under an approved path: the plugin can make symlinks wherever
it may write.

Plugins with no record -- the bundled ones, and folders an operator placed in a plugins directory by
hand, as before approvals existed -- are served as placed: putting them there is the approval. Run
``toolcell approve NAME`` once to put such a plugin under the same watch.

A file that another user could have written (wrong owner, group- or world-writable, a symlink), or
that is not a well-formed approvals file, is not trusted: every plugin is held until it is fixed
(``approvals_untrusted`` in the log, the reason in ``toolcell list``), and ``toolcell approve``
refuses to write to it.
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
from runtime.server_spec import ServerSpec
from sandbox.wire import Limits

FILE = "approvals.json"
#: How a held plugin's problem starts (``runtime.plugins.awaiting_approval`` looks for it).
HELD = "needs approval:"


class ApprovalsError(Exception):
    """The approvals file cannot be trusted or read."""


#: What a server asks for when the manifest has none (a plugin of kind "plugin"): the defaults.
_NO_SERVER = ServerSpec()


def grants(manifest: Manifest) -> dict[str, Any]:
    """What ``manifest`` asks for, as recorded and compared."""
    p = manifest.permissions
    s = manifest.server or _NO_SERVER
    runs: Any = None
    if manifest.server is not None:
        runs = manifest.server.package or [*manifest.server.command, *manifest.server.args]
    paths = sorted(set(p.read) | set(p.write))
    return {
        "name": manifest.name,
        "prefix": manifest.prefix,
        "read": sorted(set(p.read)),
        "write": sorted(set(p.write)),
        # Where each path led when approved: the sandbox grants the real path (``sandbox.isolation.paths``).
        "real": {path: os.path.realpath(path) for path in paths},
        "network": sorted(set(p.network)),
        # Both kinds together, as recorded before ``env_allow`` and ``env_set`` were kept apart.
        "env": sorted(set(manifest.env.allow) | set(manifest.env.set)),
        "env_allow": sorted(set(manifest.env.allow)),
        "env_set": sorted(set(manifest.env.set)),
        "limits": msgspec.structs.asdict(manifest.limits),
        "runs": runs,
        "bin": s.bin,
        "args": list(s.args),
        "instances": s.instances,
        "per_principal": s.per_principal,
        "max_principals": s.max_principals,
        "dependencies": sorted(set(manifest.dependencies)),
        "allow_source_builds": manifest.allow_source_builds,
    }


def _under(real: str, roots: list[str]) -> bool:
    return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)


def _paths(kind: str, asked: list[str], approved: list[str], real: dict[str, str]) -> list[str]:
    """Requested paths beyond the approved ones, compared as the sandbox applies them: real paths.

    A path with ``..`` or a symlink in it is approved only as exactly that string (where it leads
    may change: the plugin can make symlinks wherever it may write), and only while it still leads
    under an approved path as resolved at approval time."""
    roots = [real.get(a) or os.path.realpath(a) for a in approved]
    more: list[str] = []
    for path in asked:
        resolved = os.path.realpath(path)
        indirect = ".." in path.split("/") or resolved != os.path.normpath(path)
        if (indirect and path not in approved) or not _under(resolved, roots):
            more.append(f"+ {kind} {path}" + (f" (leads to {resolved})" if indirect else ""))
    return more


def _was(approved: dict[str, Any], field: str) -> str:
    return repr(approved[field]) if field in approved else "(not recorded)"


def exceeds(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    """What ``asked`` wants beyond ``approved`` (empty: nothing more), one line per item.

    A field an older approval did not record counts as approved at its least: no dependencies, one
    instance, no source builds, no package arguments; a prefix, a name or a path's target it did not
    record is compared with what the plugin asks for now."""
    more: list[str] = []
    if asked["name"] != approved.get("name"):
        more.append(f"name: {_was(approved, 'name')} -> {asked['name']!r}")
    # Tool names are the prefix + names the plugin's code picks: a longer prefix only narrows them.
    if "prefix" not in approved or not asked["prefix"].startswith(approved["prefix"]):
        more.append(f"prefix: {_was(approved, 'prefix')} -> {asked['prefix']!r}")
    real = dict(approved.get("real", {}))
    ok_write = list(approved.get("write", []))
    more += _paths("read", asked["read"], list(approved.get("read", [])) + ok_write, real)
    more += _paths("write", asked["write"], ok_write, real)
    more += [f"+ network {e}" for e in asked["network"] if e not in approved.get("network", [])]
    ok_allow = list(approved.get("env_allow", []))
    ok_set = list(approved.get("env_set", [])) + ok_allow
    for v in asked["env_allow"]:
        if v in ok_set and v not in ok_allow:
            more.append(f"env {v}: a fixed value -> the daemon's own value (env.allow)")
        elif v not in ok_allow:
            more.append(f"+ env {v}")
    more += [f"+ env {v}" for v in asked["env_set"] if v not in ok_set]
    limits = approved.get("limits", {})
    defaults = msgspec.structs.asdict(Limits())
    for key, value in asked["limits"].items():
        old = limits.get(key, defaults.get(key))
        if isinstance(value, (int, float)) and isinstance(old, (int, float)) and value > old:
            more.append(f"limits.{key}: {old:g} -> {value:g}")
    if asked.get("runs") != approved.get("runs"):
        more.append(f"runs: {approved.get('runs')!r} -> {asked.get('runs')!r}")
    elif isinstance(asked.get("runs"), str):  # a package: its executable and arguments are not in ``runs``
        for field in ("bin", "args"):
            if asked[field] != approved.get(field, getattr(_NO_SERVER, field)):
                more.append(f"server.{field}: {_was(approved, field)} -> {asked[field]!r}")
    if asked["instances"] > approved.get("instances", _NO_SERVER.instances):
        more.append(f"server.instances: {approved.get('instances', _NO_SERVER.instances)} -> {asked['instances']}")
    if asked["per_principal"]:
        if not approved.get("per_principal", False):
            more.append("server.per_principal: false -> true")
        if asked["max_principals"] > approved.get("max_principals", _NO_SERVER.max_principals):
            more.append(f"server.max_principals: {approved.get('max_principals', _NO_SERVER.max_principals)} -> "
                        f"{asked['max_principals']}")
    more += [f"+ dependency {d}" for d in asked["dependencies"] if d not in approved.get("dependencies", [])]
    if asked["allow_source_builds"] and not approved.get("allow_source_builds", False):
        more.append("allow_source_builds: false -> true")
    return more


def describe(manifest: Manifest) -> list[str]:
    """The grants of ``manifest`` in words, for a person to approve."""
    g = grants(manifest)
    lim = manifest.limits

    def paths(kind: str) -> str:
        return ", ".join(p + (f" (-> {g['real'][p]})" if g["real"][p] != p else "") for p in g[kind])

    lines = [f"plugin {manifest.name} {manifest.version} ({manifest.kind}), tools named "
             f"{manifest.prefix + '*' if manifest.prefix else 'without a prefix'}"]
    if g["runs"] is not None:
        runs = g["runs"] if isinstance(g["runs"], str) else " ".join(g["runs"])
        if isinstance(g["runs"], str):
            runs = " ".join([runs + (f" (its {g['bin']})" if g["bin"] else ""), *g["args"]])
        lines.append(f"  runs:     {runs}")
        s = manifest.server or _NO_SERVER
        lines.append(f"  server:   {s.instances} instance(s)"
                     + (f" per principal, up to {s.max_principals} principals" if s.per_principal else ""))
    if g["dependencies"]:
        lines.append(f"  installs: {', '.join(g['dependencies'])}"
                     + (" (may build from source, with network to the package index)" if g["allow_source_builds"]
                        else ""))
    lines.append(f"  read:     {paths('read') or '(nothing beyond its own files)'}")
    lines.append(f"  write:    {paths('write') or '(nothing beyond its private scratch)'}")
    lines.append(f"  network:  {', '.join(g['network']) or '(none)'}")
    env = [f"{v} (the daemon's value)" for v in g["env_allow"]]
    env += [f"{v} (a fixed value)" for v in g["env_set"] if v not in g["env_allow"]]
    lines.append(f"  env:      {', '.join(env) or '(none)'}")
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
    records: dict[str, Any] = {}
    for folder, entry in data["plugins"].items():
        problem = _malformed(entry)
        if problem:  # not skipped: a skipped record would let its plugin load as placed, unwatched
            raise ApprovalsError(f"{path}: the approval of {folder}: {problem}")
        records[folder] = _upgraded(entry)
    return records


#: The type of every recorded grant (a record may lack any of them: it predates that field).
_TYPES: dict[str, type] = {"name": str, "prefix": str, "read": list, "write": list, "real": dict, "network": list,
                           "env": list, "env_allow": list, "env_set": list, "limits": dict, "bin": str, "args": list,
                           "instances": int, "per_principal": bool, "max_principals": int, "dependencies": list,
                           "allow_source_builds": bool}


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _malformed(entry: Any) -> str:
    if not isinstance(entry, dict) or not isinstance(entry.get("grants"), dict):
        return "no grants"
    g = entry["grants"]
    for field, kind in _TYPES.items():
        value: Any = g.get(field, kind())
        if not _is(value, kind):
            return f"{field} is not a {kind.__name__}"
        items: list[Any] = [*value, *value.values()] if isinstance(value, dict) else list(value) if isinstance(
            value, list) else []
        if field == "limits":
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in value.values()):
                return "limits holds something else than numbers"
        elif any(not isinstance(item, str) for item in items):
            return f"{field} holds something else than strings"
    if not isinstance(g.get("runs"), (str, list, type(None))):
        return "runs is not a package, a command or null"
    return ""


def _upgraded(entry: dict[str, Any]) -> dict[str, Any]:
    """A record as this version compares it. Before ``env_allow`` and ``env_set`` were recorded apart,
    ``env`` held both kinds: its names count as approved with fixed values only, so a variable copied
    from the daemon's environment is approved again once (the safe reading: nothing says which names
    a person approved to carry the daemon's values). The plugin's name was recorded beside the grants."""
    g = dict(entry["grants"])
    if "env_allow" not in g and "env_set" not in g:
        g["env_allow"], g["env_set"] = [], list(g.get("env", []))
    if "name" not in g and isinstance(entry.get("name"), str):
        g["name"] = entry["name"]
    return {**entry, "grants": g}


def check(manifest: Manifest, plugin_dir: Any, state_dir: str) -> str | None:
    """None when ``manifest`` may load, else why it is held (asks for more than was approved)."""
    try:
        records = load(state_dir)
    except ApprovalsError as exc:
        # Fail closed: which plugins it holds approvals for, and what they are, is unknown.
        log("approvals_untrusted", level="error", error=str(exc), plugin=manifest.name,
            note="every plugin is held until the file is fixed")
        return f"{HELD} the approvals file cannot be trusted ({exc}); fix it, then `toolcell reload`"
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
        raise ApprovalsError(f"{exc}; fix it before approving (without it, no plugin is watched)") from None
    records[key(plugin_dir)] = {"grants": grants(manifest), "name": manifest.name, "version": manifest.version,
                              "how": how, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    path = _path(state_dir)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"plugins": records}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
