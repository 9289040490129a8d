"""Plugin manifests: ``plugin.toml`` in a plugin folder, decoded strictly (typos fail early).

Example::

    name = "textkit"
    version = "1.2.0"
    description = "Text statistics and regex search"
    entry = "textkit"            # module (textkit.py or textkit/) inside the plugin folder
    prefix = "text_"             # optional, prepended to every tool name
    isolation = "pooled"         # or "per_call": a fresh forked process for every call

    [limits]
    timeout_s = 10
    memory_mb = 256
    cpu_s = 10
    max_concurrency = 4
    max_output_bytes = 1048576
    max_processes = 64           # processes + threads of a worker, itself included (8..4096)
    max_notifications = 1000     # progress + log notifications relayed per call (more are dropped)
    max_notification_bytes = 65536  # one notification; a larger one is truncated

    [env]
    allow = ["TZ"]               # variables copied from the daemon's environment
    set = { LANG = "C.UTF-8" }   # fixed values

    [permissions]
    network = ["api.example.com:443"]   # only through the daemon's egress proxy (runtime.egress_rules)
    read = ["/usr/share/zoneinfo"]
    write = []
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import msgspec

from runtime.egress_rules import parse_entry
from runtime.server_spec import ServerSpec, check_requirements, check_server
from sandbox.wire import Limits, Permissions

MANIFEST_NAME = "plugin.toml"
_PLUGIN_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Variables a manifest can never copy in: they change how the interpreter itself behaves.
_ENV_FORBIDDEN = re.compile(r"^(PYTHON.*|LD_.*)$")


#: Bounds of ``limits.max_processes``.
MIN_PROCESSES = 8
MAX_PROCESSES = 4096


class EnvSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    allow: list[str] = []
    set: dict[str, str] = {}


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    version: str
    #: The plugin's module (required for kind "plugin"; a "server" has none).
    entry: str = ""
    description: str = ""
    #: "plugin" (code written for ``sandbox.api``) or "server" (an existing MCP server: ``runtime.hosted``).
    kind: str = "plugin"
    #: Python requirements, installed into a per-plugin environment (``runtime.installer``).
    dependencies: list[str] = []
    #: Dependencies that exist only as source may be built -- inside a sandbox (``runtime.builds``).
    allow_source_builds: bool = False
    server: ServerSpec | None = None
    prefix: str = ""
    isolation: str = "pooled"
    limits: Limits = Limits()
    env: EnvSpec = EnvSpec()
    permissions: Permissions = Permissions()


class ManifestError(Exception):
    """A manifest that cannot be used; ``problems`` lists every issue found."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        super().__init__(f"{path}: " + "; ".join(problems))


def check_manifest(m: Manifest, plugin_dir: Path) -> list[str]:
    """Every semantic problem with a decoded manifest (empty when it is fine)."""
    problems: list[str] = []
    if not _PLUGIN_NAME.match(m.name):
        problems.append(f"name {m.name!r}: use 1-64 chars of lowercase letters, digits, '_', '.', '-'")
    if m.kind not in ("plugin", "server"):
        problems.append(f"kind {m.kind!r}: must be 'plugin' or 'server'")
    elif m.kind == "server":
        problems.extend(check_server(m.server))
        if m.entry or m.dependencies or m.isolation != "pooled":
            problems.append("a server has no entry, dependencies or isolation (its package brings its own)")
    elif m.server is not None:
        problems.append("a [server] table needs kind = \"server\"")
    problems.extend(check_requirements(m.dependencies))
    if m.kind != "plugin":
        pass
    elif not _ENTRY.match(m.entry):
        problems.append(f"entry {m.entry!r} is not a module name")
    else:
        top = m.entry.split(".")[0]
        if not ((plugin_dir / f"{top}.py").is_file() or (plugin_dir / top).is_dir()):
            problems.append(f"entry module {m.entry!r} not found in {plugin_dir}")
    if m.prefix and not re.match(r"^[A-Za-z0-9_.-]{1,32}$", m.prefix):
        problems.append(f"prefix {m.prefix!r}: use 1-32 chars of [A-Za-z0-9_.-]")
    if m.isolation not in ("pooled", "per_call"):
        problems.append(f"isolation {m.isolation!r}: must be 'pooled' or 'per_call'")
    lim = m.limits
    for field, value, low, high in (
        ("timeout_s", lim.timeout_s, 0.001, 86400),
        ("memory_mb", lim.memory_mb, 16, 1 << 20),
        ("cpu_s", lim.cpu_s, 1, 86400),
        ("max_concurrency", lim.max_concurrency, 1, 1024),
        ("max_output_bytes", lim.max_output_bytes, 1024, 256 << 20),
        ("max_open_files", lim.max_open_files, 16, 65536),
        ("max_file_size_mb", lim.max_file_size_mb, 1, 1 << 20),
        ("max_queue", lim.max_queue, 0, 1 << 20),
        # a worker is two processes (its reaper outside the pid namespace, and pid 1) before any fork;
        # a per_call zygote keeps a relay and a warm call process besides the running one
        ("max_processes", lim.max_processes, MIN_PROCESSES, MAX_PROCESSES),
        ("max_notifications", lim.max_notifications, 0, 1_000_000),
        ("max_notification_bytes", lim.max_notification_bytes, 256, 16 << 20),
    ):
        if not (low <= value <= high):
            problems.append(f"limits.{field} = {value}: must be between {low} and {high}")
    for var in list(m.env.allow) + list(m.env.set):
        if not _ENV_NAME.match(var):
            problems.append(f"env: {var!r} is not a variable name")
        elif _ENV_FORBIDDEN.match(var):
            problems.append(f"env: {var!r} may not be passed to a plugin")
    for entry in m.permissions.network:
        try:
            parse_entry(entry)
        except ValueError as exc:
            problems.append(f"permissions.network: {exc} (use host:port, *.domain:port, an IP or [IPv6]:port)")
    for kind, paths in (("read", m.permissions.read), ("write", m.permissions.write)):
        for p in paths:
            if not p.startswith("/"):
                problems.append(f"permissions.{kind} {p!r}: must be an absolute path")
    return problems


def load_manifest(plugin_dir: Path) -> Manifest:
    """Read and check ``plugin.toml``; raises ``ManifestError`` listing every problem."""
    path = plugin_dir / MANIFEST_NAME
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(path, [f"no {MANIFEST_NAME} in {plugin_dir}"]) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(path, [f"not valid TOML: {exc}"]) from None
    try:
        manifest = msgspec.convert(raw, Manifest)
    except msgspec.ValidationError as exc:
        raise ManifestError(path, [str(exc)]) from None
    problems = check_manifest(manifest, plugin_dir)
    if problems:
        raise ManifestError(path, problems)
    return manifest
