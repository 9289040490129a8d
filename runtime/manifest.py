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

    [secrets.GITHUB_TOKEN]       # the worker sees a placeholder; the egress proxy puts the operator's
    host = "api.github.com"      # value into requests to this host only (runtime.plugin_secrets)

    [tools.word_count]           # per tool (its name without the prefix); overrides the decorator
    task_support = "optional"    # forbidden | optional | required: may a call run as a task
    task_after_ms = 500          # 2026-07-28: a task only if not finished after 500 ms
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from runtime import config_problems, plugin_files
from runtime.config_problems import Located
from runtime.egress_rules import Entry, parse_entry
from runtime.plugin_files import excerpt
from runtime.plugin_secrets import SecretSpec, check_bindings
from runtime.server_spec import ServerSpec, check_requirements, check_server
from sandbox.wire import Limits, Permissions

MANIFEST_NAME = "plugin.toml"
#: A manifest larger than this is refused unread (a real one is a few hundred bytes).
MAX_MANIFEST_BYTES = 256 * 1024
_PLUGIN_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_ENTRY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: Variables a manifest can never set or copy in: they change how the interpreter or the C library
#: behaves before the worker has isolated itself (the dynamic loader; locale and character-set
#: modules, which glibc loads as code: GCONV_PATH, LOCPATH; message catalogues; tunables; resolver
#: and host alias files).
_ENV_FORBIDDEN = re.compile(
    r"^(PYTHON.*|LD_.*|GCONV_PATH|LOCPATH|NLSPATH|GLIBC_TUNABLES|MALLOC_.*|HOSTALIASES|RES_OPTIONS|LOCALDOMAIN"
    r"|GETCONF_DIR)$")


#: Bounds of ``limits.max_processes`` (declared on ``Limits``; named here for tests and docs).
MIN_PROCESSES = 8
MAX_PROCESSES = 4096


class EnvSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    allow: list[str] = []
    set: dict[str, str] = {}


class ToolPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """``[tools.NAME]``: what the plugin's operator decides for one tool, over its decorator."""

    #: Whether calls may run as tasks: forbidden, optional or required.
    task_support: Literal["forbidden", "optional", "required"] | None = None
    #: 2026-07-28: become a task only when not finished after this many ms (0: at once).
    task_after_ms: Annotated[int, Meta(ge=0, le=3_600_000)] | None = None


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    version: str
    #: The plugin's module (required for kind "plugin"; a "server" has none).
    entry: str = ""
    description: str = ""
    #: "plugin" (code written for ``sandbox.api``) or "server" (an existing MCP server: ``runtime.execution.hosted``).
    kind: str = "plugin"
    #: Python requirements, installed into a per-plugin environment (``runtime.installer``).
    dependencies: list[str] = []
    #: Dependencies that exist only as source may be built -- inside a sandbox (``runtime.builds``).
    allow_source_builds: bool = False
    server: ServerSpec | None = None
    prefix: str = ""
    isolation: Literal["pooled", "per_call"] = "pooled"
    limits: Limits = Limits()
    env: EnvSpec = EnvSpec()
    permissions: Permissions = Permissions()
    #: Per-tool policy by the tool's name in the plugin (without the prefix).
    tools: dict[str, ToolPolicy] = {}
    #: Secrets by variable name, each bound to the one host it is sent to (``runtime.plugin_secrets``).
    secrets: dict[str, SecretSpec] = {}


class ManifestError(Exception):
    """A manifest that cannot be used; ``problems`` lists every issue found, ``located`` the same
    with where each one is in the file (``located()`` renders them as ``file:line:column: ...``)."""

    def __init__(self, path: Path, problems: list[str], located: list[Located] | None = None) -> None:
        self.path = path
        self.problems = problems
        self._located = located if located is not None else [Located(None, p) for p in problems]
        super().__init__(f"{path}: " + "; ".join(problems))

    def located(self) -> list[str]:
        """Each problem as ``file:line:column: problem`` (``file: problem`` when it is nowhere in particular)."""
        return [p.render(str(self.path)) for p in self._located]


def check_manifest(m: Manifest, plugin_dir: Path) -> list[str]:
    """Every semantic problem with a decoded manifest (empty when it is fine)."""
    problems: list[str] = []
    if not _PLUGIN_NAME.match(m.name):
        problems.append(f"name {excerpt(m.name)}: use 1-64 chars of lowercase letters, digits, '_', '.', '-'")
    if m.kind not in ("plugin", "server"):
        problems.append(f"kind {excerpt(m.kind)}: must be 'plugin' or 'server'")
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
        problems.append(f"entry {excerpt(m.entry)} is not a module name")
    else:
        problems.extend(_entry_problems(m.entry, plugin_dir))
    if m.prefix and not re.match(r"^[A-Za-z0-9_.-]{1,32}$", m.prefix):
        problems.append(f"prefix {excerpt(m.prefix)}: use 1-32 chars of [A-Za-z0-9_.-]")
    for var in list(m.env.allow) + list(m.env.set):
        if not _ENV_NAME.match(var):
            problems.append(f"env: {excerpt(var)} is not a variable name")
        elif _ENV_FORBIDDEN.match(var):
            problems.append(f"env: {excerpt(var)} may not be passed to a plugin")
    entries: list[Entry] = []
    for entry in m.permissions.network:
        try:
            entries.append(parse_entry(entry))
        except ValueError as exc:
            problems.append(f"permissions.network: {exc} (use host:port, *.domain:port, an IP or [IPv6]:port)")
    problems.extend(check_bindings(m.secrets, entries, [*m.env.allow, *m.env.set]))
    for kind, paths in (("read", m.permissions.read), ("write", m.permissions.write)):
        for p in paths:
            if not p.startswith("/"):
                problems.append(f"permissions.{kind} {excerpt(p)}: must be an absolute path")
            elif ".." in p.split("/"):
                problems.append(f"permissions.{kind} {excerpt(p)}: must not contain '..' (name the folder itself)")
    return problems


def _entry_problems(entry: str, plugin_dir: Path) -> list[str]:
    """The entry module must be ``TOP.py`` (a regular file) or ``TOP/`` (a folder) of the plugin folder,
    seen by ``lstat``: a link is not followed (``runtime.plugin_files``), so a plugin cannot make the
    daemon probe for files outside its folder."""
    top = entry.split(".")[0]
    for name, fits in ((f"{top}.py", stat.S_ISREG), (top, stat.S_ISDIR)):
        try:
            mode = os.lstat(plugin_dir / name).st_mode
        except OSError:
            continue
        if fits(mode):
            return []
        if stat.S_ISLNK(mode):
            return [f"entry module {excerpt(entry)}: {name} is a symbolic link (links in a plugin folder are not "
                    f"followed)"]
    return [f"entry module {excerpt(entry)} not found in {plugin_dir}"]


def load_manifest(plugin_dir: Path) -> Manifest:
    """Read and check ``plugin.toml``; raises ``ManifestError`` listing every problem.

    The file is the plugin author's: whatever it holds (any size, nesting, number, type) refuses this
    plugin with a reason, never more."""
    path = plugin_dir / MANIFEST_NAME
    try:
        data = plugin_files.read_bytes(str(plugin_dir), MANIFEST_NAME, MAX_MANIFEST_BYTES)
        if data is None:
            raise ManifestError(path, [f"no {MANIFEST_NAME} in {plugin_dir}"])
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ManifestError(path, [f"{MANIFEST_NAME} is not UTF-8 text (byte {exc.start})"]) from None
        raw = tomllib.loads(text)
    except plugin_files.PluginFileError as exc:
        raise ManifestError(path, [exc.reason]) from None
    except RecursionError:
        raise ManifestError(path, ["not valid TOML: nested too deeply"]) from None
    except (tomllib.TOMLDecodeError, ValueError) as exc:  # ValueError: a 5,000-digit integer
        raise ManifestError(path, [f"not valid TOML: {str(exc)[:300]}"]) from None
    # Every decoding problem first (bounds, unknown keys, types); the rest is decoded without the
    # offending values, so that the semantic checks report theirs in the same go.
    try:
        manifest, found = config_problems.find_all(raw, Manifest, lambda m: check_manifest(m, plugin_dir))
        located = config_problems.locate_all(text, found)
    except (RecursionError, ValueError, TypeError, OverflowError) as exc:
        raise ManifestError(path, [f"cannot be read as a manifest: {type(exc).__name__}: {str(exc)[:200]}"]) from None
    if located:
        raise ManifestError(path, [p.message for p in located], located)
    assert manifest is not None
    return manifest
