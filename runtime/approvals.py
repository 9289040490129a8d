"""Permissions a person approved: what each plugin may read, write, reach, see and use.

``toolcell add``, ``toolcell import`` and ``toolcell approve NAME`` show a plugin's grants and, once a
person said yes, record them in ``<state_dir>/approvals.json`` (0600, owned by the daemon's user,
written atomically). Only those commands write it; the daemon only reads it. No client request and
no tool reaches it: a worker cannot write the state dir (Landlock, a read-only mount view, another
uid), and nothing in the MCP conversation touches approvals.

Approvals are kept per plugin folder (its real path). Every load of a plugin with a recorded approval
-- at start and at every hot reload -- compares its manifest with the record (``check``). ``FIELDS``
classifies every manifest field: covered by the approval, with the change that widens it (what the
plugin can reach, run, consume, or who shares its state: a path outside the approved ones, a new
network entry, dependency or environment variable, a changed fixed value of one, a higher limit,
another package, command or argument, ``per_principal`` turned off, ``isolation`` from "per_call" to
"pooled", a different name or prefix, ...), or not security-relevant, with why. A change in the
widening direction is refused with the difference; the opposite change loads. On a hot reload the
approved version keeps serving and the difference is reported (``plugin_reload_failed``, ``toolcell
list``) until ``toolcell approve NAME``. A test fails when a manifest field is not in ``FIELDS``.

Fixed environment values (``env.set``) are recorded only as HMAC-SHA256 digests under a random key
kept beside the file (``approvals.key``, 0600): the record never holds a secret in plaintext, and a
changed value is seen without showing either value. A record written before a field was compared
counts as approving that field at its narrowest, so a plugin asking more is approved once more (its
reason says so).

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

Where approvals are kept is a ``Book``: ``StateDirBook`` (the file above, one daemon: the default) or
``runtime.approvals_shared.RedisBook`` (``[approvals] store``, replicas behind one balancer). A daemon
reads its book once per load or reload into a ``Snapshot`` and checks every plugin against that.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
import time
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import msgspec

from runtime.logs import log
from runtime.manifest import Manifest
from runtime.server_spec import ServerSpec
from sandbox.wire import Limits

FILE = "approvals.json"
#: The key under which fixed environment values are recorded (HMAC-SHA256), created by the first approval.
KEY_FILE = "approvals.key"
KEY_BYTES = 32
#: How a held plugin's problem starts (``runtime.plugins.awaiting_approval`` looks for it).
HELD = "needs approval:"


class ApprovalsError(Exception):
    """The approvals file cannot be trusted or read."""


#: What a server asks for when the manifest has none (a plugin of kind "plugin"): the defaults.
_NO_SERVER = ServerSpec()
_LIMITS = Limits()


def grants(manifest: Manifest, secret: bytes = b"") -> dict[str, Any]:
    """What ``manifest`` asks for, as recorded and compared. Fixed environment values are kept only as
    an HMAC under ``secret`` (the state dir's approvals key): the record never holds them in plaintext."""
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
        "env_values": {var: _digest(secret, var, value) for var, value in sorted(manifest.env.set.items())},
        "limits": msgspec.structs.asdict(manifest.limits),
        "runs": runs,
        "bin": s.bin,
        "args": list(s.args),
        "instances": s.instances,
        "per_principal": s.per_principal,
        "max_principals": s.max_principals,
        "cancel_grace_s": s.cancel_grace_s,
        "start_timeout_s": s.start_timeout_s,
        "isolation": manifest.isolation,
        "dependencies": sorted(set(manifest.dependencies)),
        "allow_source_builds": manifest.allow_source_builds,
        # Each secret -> the host its value is sent to (the values are the operator's, never recorded).
        "secrets": {name: spec.host for name, spec in sorted(manifest.secrets.items())},
    }


def _digest(secret: bytes, var: str, value: str) -> str:
    return hmac.new(secret, f"{var}\0{value}".encode(), hashlib.sha256).hexdigest()


# -- what each manifest field means to an approval ------------------------------------------------------
#
# Every field of a manifest is in ``FIELDS``: either covered by an approval, with the change that widens
# it (a person must approve that change; the opposite change loads), or not security-relevant, with why.
# ``exceeds`` runs the comparisons of the covered ones, and nothing else: a field that is not in the
# table is compared by nothing, which is why a test fails when ``Manifest`` has a field the table lacks.

#: How a field an older approval did not record is shown (``check`` then says why it asks again).
UNRECORDED = "(not recorded)"
Compare = Callable[[dict[str, Any], dict[str, Any]], list[str]]


@dataclass(frozen=True)
class Covered:
    """Approved: a change in the direction ``widens`` holds the plugin until a person approves it."""

    widens: str
    compare: Compare


@dataclass(frozen=True)
class NotCovered:
    """Not security-relevant: it changes neither what the plugin can reach nor who shares its state."""

    why: str


def _was(approved: dict[str, Any], field: str) -> str:
    return repr(approved[field]) if field in approved else UNRECORDED


def _name(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    return [] if asked["name"] == approved.get("name") else [f"name: {_was(approved, 'name')} -> {asked['name']!r}"]


def _prefix(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    # Tool names are the prefix + names the plugin's code picks: a longer prefix only narrows them.
    if "prefix" in approved and asked["prefix"].startswith(approved["prefix"]):
        return []
    return [f"prefix: {_was(approved, 'prefix')} -> {asked['prefix']!r}"]


def _under(real: str, roots: list[str]) -> bool:
    return any(real == r or real.startswith(r.rstrip("/") + "/") for r in roots)


def _beyond(kind: str, asked: list[str], approved: list[str], real: dict[str, str]) -> list[str]:
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


def _read(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    ok = list(approved.get("read", [])) + list(approved.get("write", []))
    return _beyond("read", asked["read"], ok, dict(approved.get("real", {})))


def _write(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    return _beyond("write", asked["write"], list(approved.get("write", [])), dict(approved.get("real", {})))


def _added(field: str, words: str) -> Compare:
    def compare(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
        return [f"+ {words} {item}" for item in asked[field] if item not in approved.get(field, [])]
    return compare


def _env(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    more: list[str] = []
    ok_allow = list(approved.get("env_allow", []))
    ok_set = list(approved.get("env_set", [])) + ok_allow
    for v in asked["env_allow"]:
        if v in ok_set and v not in ok_allow:
            more.append(f"env {v}: a fixed value -> the daemon's own value (env.allow)")
        elif v not in ok_allow:
            more.append(f"+ env {v}")
    values = approved.get("env_values")
    for v in asked["env_set"]:
        if v not in ok_set:
            more.append(f"+ env {v}")
        elif v in ok_allow:
            continue  # the daemon's own value was approved; a fixed one carries less
        elif values is None:
            more.append(f"env {v}: its fixed value {UNRECORDED}")
        elif values.get(v) != asked["env_values"][v]:
            more.append(f"env {v}: a different fixed value")  # values are secrets: never shown
    return more


def _secrets(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    ok = approved.get("secrets", {})
    return [f"+ secret {name} sent to {host}" if name not in ok else f"secret {name}: sent to {ok[name]} -> {host}"
            for name, host in asked["secrets"].items() if ok.get(name) != host]


def _runs(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    if asked.get("runs") != approved.get("runs"):
        return [f"runs: {approved.get('runs')!r} -> {asked.get('runs')!r}"]
    more: list[str] = []
    if isinstance(asked.get("runs"), str):  # a package: its executable and arguments are not in ``runs``
        for field in ("bin", "args"):
            if asked[field] != approved.get(field, getattr(_NO_SERVER, field)):
                more.append(f"server.{field}: {_was(approved, field)} -> {asked[field]!r}")
    return more


def _higher(path: str, unrecorded: float, words: str = "") -> Compare:
    """A number whose higher value widens; ``path`` is ``field`` or ``table.field`` in the record."""
    table, _, field = path.rpartition(".")

    def compare(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
        value = asked[table][field] if table else asked[field]
        recorded = approved.get(table, {}) if table else approved
        old = recorded.get(field, unrecorded)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= old:
            return []
        return [f"{words or path}: {old:g} -> {value:g}"]
    return compare


def _per_principal(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    old = approved.get("per_principal", _NO_SERVER.per_principal)
    if asked["per_principal"] == old:
        return []
    why = ("every principal shares one server's state" if old else
           f"up to {asked['max_principals']} principals start servers of their own")
    return [f"server.per_principal: {str(old).lower()} -> {str(asked['per_principal']).lower()} ({why})"]


_max_principals = _higher("max_principals", _NO_SERVER.max_principals, "server.max_principals")


def _principals(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    return _max_principals(asked, approved) if asked["per_principal"] else []


#: From the narrowest to the widest: a pooled worker's module state is shared by every caller it serves.
_ISOLATION = ("per_call", "pooled")


def _isolation(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    if asked.get("runs") is not None:
        return []  # a server brings its own processes (``runtime.execution.hosted``): isolation is always "pooled"
    # Not recorded: approved before it was compared, so only the narrowest counts as approved.
    old = approved.get("isolation")
    least = old if old in _ISOLATION else _ISOLATION[0]
    if _ISOLATION.index(asked["isolation"]) <= _ISOLATION.index(least):
        return []
    return [f"isolation: {old!r} -> {asked['isolation']!r} (callers share the module state of one process)"
            if old is not None else f"isolation: {UNRECORDED} -> {asked['isolation']!r}"]


def _source_builds(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    if asked["allow_source_builds"] and not approved.get("allow_source_builds", False):
        return ["allow_source_builds: false -> true"]
    return []


def _limit(field: str) -> Covered:
    return Covered("higher", _higher(f"limits.{field}", getattr(_LIMITS, field)))


_WHAT_RUNS = Covered("any change", _runs)
_ENV = Covered("an added name, a name moved from env.set to env.allow, a changed fixed value", _env)
_TOOL_POLICY = NotCovered("whether and when a call may run as a task: the same code with the same grants, for the "
                          "same caller")

#: Every manifest field (``table.field``; ``tools.*.field`` for each tool's table): covered by an approval,
#: and which change widens it, or not security-relevant, and why. Compared in this order.
FIELDS: dict[str, Covered | NotCovered] = {
    "name": Covered("any change", _name),
    "prefix": Covered("any change but a longer prefix that starts with the approved one", _prefix),
    "permissions.read": Covered("a path not under an approved read or write path", _read),
    "permissions.write": Covered("a path not under an approved write path", _write),
    "permissions.network": Covered("an added entry", _added("network", "network")),
    "env.allow": _ENV,
    "env.set": _ENV,
    "limits.timeout_s": _limit("timeout_s"),
    "limits.memory_mb": _limit("memory_mb"),
    "limits.cpu_s": _limit("cpu_s"),
    "limits.max_concurrency": _limit("max_concurrency"),
    "limits.max_output_bytes": _limit("max_output_bytes"),
    "limits.max_open_files": _limit("max_open_files"),
    "limits.max_file_size_mb": _limit("max_file_size_mb"),
    "limits.max_queue": _limit("max_queue"),
    "limits.max_processes": _limit("max_processes"),
    "limits.max_notifications": _limit("max_notifications"),
    "limits.max_notification_bytes": _limit("max_notification_bytes"),
    "limits.ask_timeout_s": _limit("ask_timeout_s"),
    "limits.max_asks": _limit("max_asks"),
    "limits.max_parked": _limit("max_parked"),
    "kind": _WHAT_RUNS,
    "server.command": _WHAT_RUNS,
    "server.package": _WHAT_RUNS,
    "server.bin": _WHAT_RUNS,
    "server.args": _WHAT_RUNS,
    "server.instances": Covered("higher", _higher("instances", _NO_SERVER.instances, "server.instances")),
    "server.per_principal": Covered("any change: to false, principals share one server's state; to true, up to "
                                    "max_principals times the servers run", _per_principal),
    "server.max_principals": Covered("higher, with per_principal", _principals),
    "server.cancel_grace_s": Covered("higher", _higher("cancel_grace_s", _NO_SERVER.cancel_grace_s,
                                                       "server.cancel_grace_s")),
    "server.start_timeout_s": Covered("higher", _higher("start_timeout_s", _NO_SERVER.start_timeout_s,
                                                        "server.start_timeout_s")),
    "isolation": Covered('"per_call" -> "pooled": one process, and its module state, serves every caller', _isolation),
    "dependencies": Covered("an added requirement", _added("dependencies", "dependency")),
    "allow_source_builds": Covered("false -> true", _source_builds),
    "secrets.*.host": Covered("a new secret -> host binding, or a binding's host changed: the operator's value "
                              "goes where the manifest says", _secrets),
    "version": NotCovered("a label: the folder's code may change under any version, and is not what is approved"),
    "entry": NotCovered("which module of the folder's own code runs: that code is not what is approved (any file "
                        "of the folder may change), the grants it runs with are"),
    "description": NotCovered("words for people"),
    "tools.*.task_support": _TOOL_POLICY,
    "tools.*.task_after_ms": _TOOL_POLICY,
}


def exceeds(asked: dict[str, Any], approved: dict[str, Any]) -> list[str]:
    """What ``asked`` wants beyond ``approved`` (empty: nothing more), one line per item: the comparison
    of every covered field of ``FIELDS``.

    A field an older approval did not record counts as approved at its least: no dependencies, one
    instance, no source builds, no package arguments, isolation per call, no fixed value; a prefix, a
    name or a path's target it did not record is compared with what the plugin asks for now."""
    more: list[str] = []
    done: set[int] = set()
    for rule in FIELDS.values():
        if isinstance(rule, Covered) and id(rule.compare) not in done:
            done.add(id(rule.compare))
            more += rule.compare(asked, approved)
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
                     + (f" per principal, up to {s.max_principals} principals" if s.per_principal
                        else ", shared by every principal (their calls reach the same server state)"))
    else:
        lines.append("  calls:    " + ("each in a fresh process" if manifest.isolation == "per_call" else
                                       "pooled: one process serves many callers, who share its module state"))
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
    if g["secrets"]:
        lines.append("  secrets:  " + ", ".join(f"{name} -> {host}" for name, host in g["secrets"].items())
                     + " (the operator's values, put into requests to these hosts only)")
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
_TYPES: dict[str, type | tuple[type, ...]] = {
    "name": str, "prefix": str, "read": list, "write": list, "real": dict, "network": list, "env": list,
    "env_allow": list, "env_set": list, "env_values": dict, "limits": dict, "bin": str, "args": list, "instances": int,
    "per_principal": bool, "max_principals": int, "cancel_grace_s": (int, float), "start_timeout_s": (int, float),
    "isolation": str, "dependencies": list, "allow_source_builds": bool, "secrets": dict}


def _is(value: Any, kind: type | tuple[type, ...]) -> bool:
    return isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))


def _malformed(entry: Any) -> str:
    if not isinstance(entry, dict) or not isinstance(entry.get("grants"), dict):
        return "no grants"
    g = entry["grants"]
    for field, kind in _TYPES.items():
        if field not in g:
            continue
        value: Any = g[field]
        if not _is(value, kind):
            return f"{field} is not a {'number' if isinstance(kind, tuple) else kind.__name__}"
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


@dataclass(frozen=True)
class Snapshot:
    """What a book of approvals held when it was read: what every plugin is checked against."""

    #: Every trusted record, by plugin folder (``key``), as ``_upgraded`` returns it.
    records: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Folders whose record is there but not trusted (``RedisBook``: each record is checked alone), and why.
    untrusted: dict[str, str] = dataclasses.field(default_factory=dict)
    #: Not empty: the book as a whole cannot be read or trusted, so every plugin is held.
    problem: str = ""
    #: The key fixed environment values are recorded under (None: there is none).
    secret: bytes | None = None
    #: Not empty: the key is there but cannot be trusted (only plugins with fixed values need it).
    secret_problem: str = ""
    #: Where the key is, for a person (``differences`` says it is gone).
    secret_where: str = ""


class Book(Protocol):
    """Where approvals are kept: read by daemons, written by ``toolcell approve``, ``add`` and ``import``."""

    #: Where it is, for a person.
    where: str

    def read(self) -> Snapshot:
        """Everything recorded; never raises (what cannot be trusted is in the snapshot). Blocking."""
        ...

    def write(self, manifest: Manifest, plugin_dir: str, how: str) -> None:
        """Record that a person approved what ``manifest`` asks for. Raises ``ApprovalsError``. Blocking."""
        ...

    def version(self) -> str | None:
        """Changes whenever an approval is written (None: not watched; ``toolcell reload`` picks changes
        up). Raises ``ApprovalsError`` when it cannot be read. Blocking."""
        ...


class StateDirBook:
    """``approvals.json`` and ``approvals.key`` in one daemon's state dir (the default)."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.where = _path(state_dir)

    def read(self) -> Snapshot:
        try:
            records = load(self.state_dir)
        except ApprovalsError as exc:
            return Snapshot(problem=str(exc))
        secret, secret_problem = None, ""
        try:
            secret = _secret(self.state_dir, create=False)
        except ApprovalsError as exc:
            secret_problem = str(exc)
        return Snapshot(records, secret=secret, secret_problem=secret_problem,
                        secret_where=os.path.join(self.state_dir, KEY_FILE))

    def write(self, manifest: Manifest, plugin_dir: str, how: str) -> None:
        record(self.state_dir, manifest, plugin_dir, how)

    def version(self) -> str | None:
        return None


def new_record(manifest: Manifest, secret: bytes, how: str) -> dict[str, Any]:
    """The record of a person approving what ``manifest`` asks for (fixed values keyed by ``secret``)."""
    return {"grants": grants(manifest, secret), "name": manifest.name, "version": manifest.version, "how": how,
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def checked_record(entry: Any) -> dict[str, Any]:
    """``entry`` as this version compares it; raises ``ApprovalsError`` saying what is wrong with it."""
    problem = _malformed(entry)
    if problem:
        raise ApprovalsError(problem)
    return _upgraded(entry)


def differences_in(snapshot: Snapshot, manifest: Manifest, plugin_dir: Any) -> list[str] | None:
    """What ``manifest`` asks for beyond the approval of ``plugin_dir`` in ``snapshot`` (None: no approval
    is recorded). Raises ``ApprovalsError`` when the book, that record or the key cannot be trusted."""
    if snapshot.problem:
        raise ApprovalsError(snapshot.problem)
    folder = key(plugin_dir)
    if folder in snapshot.untrusted:
        raise ApprovalsError(snapshot.untrusted[folder])
    record_ = snapshot.records.get(folder)
    if record_ is None:
        return None
    approved = record_["grants"]
    secret = b""
    if manifest.env.set and approved.get("env_values"):
        if snapshot.secret_problem:
            raise ApprovalsError(snapshot.secret_problem)
        secret = snapshot.secret or b""
        if not secret:
            return [f"env: the approvals key {snapshot.secret_where} is gone, so its fixed values cannot be compared"]
    return exceeds(grants(manifest, secret), approved)


def differences(manifest: Manifest, plugin_dir: Any, state_dir: str) -> list[str] | None:
    """``differences_in`` the state dir's approvals file."""
    return differences_in(StateDirBook(state_dir).read(), manifest, plugin_dir)


def check_in(snapshot: Snapshot, manifest: Manifest, plugin_dir: Any) -> str | None:
    """None when ``manifest`` may load, else why it is held (asks for more than was approved, or what it
    is checked against cannot be trusted)."""
    try:
        more = differences_in(snapshot, manifest, plugin_dir)
    except ApprovalsError as exc:
        if key(plugin_dir) in snapshot.untrusted and not snapshot.problem:
            # One record: only its plugin is held, and approving it again writes a good one.
            log("approval_untrusted", level="error", error=str(exc), plugin=manifest.name)
            return f"{HELD} {exc}; run `toolcell approve {manifest.name}`"
        # Fail closed: which plugins it holds approvals for, and what they are, is unknown.
        log("approvals_untrusted", level="error", error=str(exc), plugin=manifest.name,
            note="every plugin is held until it is fixed")
        return f"{HELD} the approvals cannot be trusted ({exc}); fix it, then `toolcell reload`"
    if not more:
        return None
    older = (" (its approval was recorded by an older toolcell, which did not compare every field: approve it "
             "once more)" if any(UNRECORDED in line for line in more) else "")
    return (f"{HELD} asks for more than was approved ({'; '.join(more)}){older}; "
            f"run `toolcell approve {manifest.name}`")


def check(manifest: Manifest, plugin_dir: Any, state_dir: str) -> str | None:
    """``check_in`` the state dir's approvals file."""
    return check_in(StateDirBook(state_dir).read(), manifest, plugin_dir)


def _secret(state_dir: str, create: bool) -> bytes | None:
    """The state dir's approvals key (fixed environment values are recorded as HMACs under it): None when
    there is none and ``create`` is false. Raises ``ApprovalsError`` for a key that could have been read
    or replaced by another user."""
    path = os.path.join(state_dir, KEY_FILE)
    if create:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            pass
        except OSError as exc:
            raise ApprovalsError(f"{path}: {exc}") from None
        else:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ApprovalsError(f"{path}: {exc}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077 or not stat.S_ISREG(st.st_mode):
            raise ApprovalsError(f"{path} is not a regular file owned by uid {os.geteuid()} and private to it")
        data = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) != KEY_BYTES:
        raise ApprovalsError(f"{path} is not an approvals key ({KEY_BYTES} bytes)")
    return data


def record(state_dir: str, manifest: Manifest, plugin_dir: str, how: str) -> None:
    """Record that a person approved what ``manifest`` asks for (replacing an earlier approval)."""
    os.makedirs(state_dir, mode=0o711, exist_ok=True)
    try:
        records = load(state_dir)
        secret = _secret(state_dir, create=True)
    except ApprovalsError as exc:
        raise ApprovalsError(f"{exc}; fix it before approving (without it, no plugin is watched)") from None
    assert secret is not None
    records[key(plugin_dir)] = new_record(manifest, secret, how)
    path = _path(state_dir)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"plugins": records}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
