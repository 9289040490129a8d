"""Daemon configuration: one frozen Struct tree decoded strictly from TOML, CLI flags on top.

Example ``toolcell.toml``::

    plugins = ["/srv/toolcell/plugins"]
    policy = "strict"          # strict | compat | none
    page_size = 100
    list_ttl_ms = 60000
    max_message_bytes = 16777216
    log_level = "info"

    egress_ca_file = "/etc/ssl/internal-ca.pem"   # optional: more CAs the egress proxy trusts upstream

    [secrets]                  # values of plugins' secrets (runtime.plugin_secrets); never logged
    GITHUB_TOKEN = { env = "GH_TOKEN" }          # or { file = "/run/secrets/gh" }, { credential = "gh" }

    [tasks]                    # long-running tool calls (MCP tasks): where they are kept, limits
    store = "redis://tasks.internal:6379/0"   # default: SQLite, tasks.sqlite3 in state_dir
    max_live_per_principal = 100
"""

from __future__ import annotations

import os
import re
import stat
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from runtime import audit, config_problems, plugin_files

from runtime.http_config import HttpConfig, check_http_config
from runtime.plugin_secrets import SecretSource, check_sources
from runtime.task_store import Limits, parse_store_url
import importlib.util

def _bundled_plugins() -> Path:
    """The bundled plugins: ``plugins/`` beside ``runtime/`` in a checkout (and an editable install),
    else the copy a wheel or ``pip install .`` put in site-packages as ``toolcell_plugins``."""
    checkout = Path(__file__).resolve().parent.parent / "plugins"
    if checkout.is_dir():
        return checkout
    try:
        spec = importlib.util.find_spec("toolcell_plugins")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    return checkout


BUNDLED_PLUGINS = _bundled_plugins()


def default_state_dir() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return os.path.join(base, f"toolcell-{os.getuid()}")


class TasksConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[tasks]`` table: the durable store of MCP tasks and the limits the daemon puts on them."""

    #: None or "sqlite": ``tasks.sqlite3`` in ``state_dir``; "sqlite:///PATH"; "redis://HOST:PORT/DB",
    #: "rediss://…" or "unix:///PATH/redis.sock" to share tasks between daemons.
    store: str | None = None
    #: Non-terminal tasks one principal may hold at once; more are refused.
    max_live_per_principal: Annotated[int, Meta(ge=1, le=1_000_000)] = 100
    #: A task's lifetime when the client asks for none, and the most it may ask for.
    default_ttl_ms: Annotated[int, Meta(ge=1_000, le=30 * 86_400_000)] = 3_600_000
    max_ttl_ms: Annotated[int, Meta(ge=1_000, le=30 * 86_400_000)] = 86_400_000
    #: The polling interval suggested to clients.
    poll_interval_ms: Annotated[int, Meta(ge=10, le=600_000)] = 1_000
    #: How often a daemon tells the store it is alive, and how long a silent daemon's unfinished
    #: tasks wait before they are failed (``recover_orphans``).
    heartbeat_s: Annotated[float, Meta(ge=0.1, le=300)] = 5.0
    orphan_after_s: Annotated[float, Meta(ge=0.2, le=86_400)] = 30.0
    #: The largest result, error, input-request set or mailbox message the store accepts.
    max_payload_bytes: Annotated[int, Meta(ge=1024, le=256 * 1024 * 1024)] = 8 * 1024 * 1024

    def store_limits(self) -> Limits:
        """The sizes and times the task store enforces, from this table."""
        return Limits(max_payload_bytes=self.max_payload_bytes, orphan_after_ms=round(self.orphan_after_s * 1000))


def check_tasks_config(cfg: TasksConfig, state_dir: str) -> list[str]:
    """What is wrong with a ``[tasks]`` table, one sentence each."""
    problems = []
    try:
        parse_store_url(cfg.store, state_dir)
    except ValueError as exc:
        problems.append(f"tasks.store: {exc}")
    if cfg.default_ttl_ms > cfg.max_ttl_ms:
        problems.append("tasks.default_ttl_ms must not exceed tasks.max_ttl_ms")
    if cfg.orphan_after_s < 2 * cfg.heartbeat_s:
        problems.append("tasks.orphan_after_s must be at least twice tasks.heartbeat_s (one late heartbeat must "
                        "not fail running tasks)")
    return problems


class ApprovalsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The ``[approvals]`` table: where the permissions people approved are kept (``runtime.approvals``)."""

    #: None: ``approvals.json`` and ``approvals.key`` in ``state_dir`` (one daemon). A Redis URL
    #: ("redis://HOST:PORT/DB", "rediss://…", "unix:///PATH/redis.sock"; usually ``tasks.store``'s):
    #: shared by every replica given the same URL and ``key_file`` (``runtime.approvals_shared``).
    store: str | None = None
    #: With a Redis store: the key that signs every approval record and keys recorded fixed
    #: environment values; a file the operator provides (32+ random bytes, 0600, or 0640 owned by
    #: root), the same on every replica and wherever ``toolcell approve`` runs.
    key_file: str | None = None
    #: With a Redis store: how often each replica looks for a new approval.
    poll_s: Annotated[float, Meta(ge=0.1, le=300)] = 2.0


def check_approvals_config(cfg: ApprovalsConfig) -> list[str]:
    """What is wrong with an ``[approvals]`` table, one sentence each."""
    if cfg.store is None:
        return ["approvals.key_file is used only with approvals.store (a Redis URL)"] if cfg.key_file else []
    problems = []
    try:
        redis = parse_store_url(cfg.store, "/").kind == "redis"
    except ValueError:
        redis = False
    if not redis:
        problems.append(f"approvals.store {cfg.store!r}: use redis://HOST:PORT/DB, rediss://… or "
                        "unix:///PATH/redis.sock (leave it out to keep approvals in state_dir)")
    if not cfg.key_file:
        problems.append("approvals.store needs approvals.key_file: the key that signs approvals, the same file on "
                        "every replica (head -c 32 /dev/urandom > approvals.key; chmod 600)")
    return problems


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    plugins: list[str] = msgspec.field(default_factory=lambda: [str(BUNDLED_PLUGINS)])
    policy: Literal["strict", "compat", "none"] = "strict"
    page_size: Annotated[int, Meta(ge=1, le=10_000)] = 100
    list_ttl_ms: Annotated[int, Meta(ge=0)] = 60_000
    max_message_bytes: Annotated[int, Meta(ge=1024, le=1 << 30)] = 16 * 1024 * 1024
    #: Calls running or queued at once across all plugins and clients.
    max_inflight: Annotated[int, Meta(ge=1)] = 4096
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: Log lines on stderr: "auto" (readable text on a terminal, JSON lines otherwise), "json" or "text".
    log_format: Literal["auto", "json", "text"] = "auto"
    state_dir: str = msgspec.field(default_factory=default_state_dir)
    #: Pre-started workers per plugin (each plugin may grow to its max_concurrency).
    min_workers: Annotated[int, Meta(ge=0, le=64)] = 1
    instructions: str | None = None
    #: Hot reload: watch the plugin folders for changes (SIGHUP and `toolcell reload` always work).
    watch: bool = True
    #: Changes closer together than this are one reload (an editor saving several files).
    reload_debounce_ms: Annotated[int, Meta(ge=10, le=60_000)] = 150
    #: The key that seals 2026-07-28 ``requestState`` (created 0600 on first use; default: in
    #: ``state_dir``). Daemons behind one balancer must share it.
    state_key_file: str | None = None
    #: How long a 2026-07-28 ``input_required`` answer's ``requestState`` stays valid.
    request_state_ttl_s: Annotated[float, Meta(ge=1, le=86400)] = 600.0
    #: 2026-07-28 calls held for their client's retry, across all plugins (see ``runtime.mrtr``).
    max_parked_calls: Annotated[int, Meta(ge=0, le=100_000)] = 64
    #: The HTTP transport: listeners, Host/Origin allowlists, tokens, limits (see runtime.http_config).
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    #: MCP tasks: the store and its limits (see ``TasksConfig``).
    tasks: TasksConfig = msgspec.field(default_factory=TasksConfig)
    #: Where approvals are kept: the state dir, or a Redis shared by replicas (see ``ApprovalsConfig``).
    approvals: ApprovalsConfig = msgspec.field(default_factory=ApprovalsConfig)
    #: Where the values of plugins' secrets come from, by name (``runtime.plugin_secrets``).
    secrets: dict[str, SecretSource] = {}
    #: More CAs (a PEM file) the egress proxy trusts, beside the system's, when it checks a host a
    #: secret is bound to (an internal CA).
    egress_ca_file: str | None = None


class ConfigError(Exception):
    pass


def secure_state_dir(path: str) -> None:
    """Make the state dir (0711), or check the one that is there: a real directory owned by this
    user that nobody else may write. It holds approvals, installed environments, pidfiles and the
    request-state key; under /tmp another local user could have made it first and planted them.
    Raises ``ConfigError`` saying what is wrong."""
    try:
        os.makedirs(path, mode=0o711, exist_ok=True)
        st = os.lstat(path)
    except OSError as exc:
        raise ConfigError(f"state_dir {path}: {exc.strerror or exc}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"state_dir {path} is not a directory (a symlink or a file): remove it or set another")
    if st.st_uid != os.geteuid():
        raise ConfigError(f"state_dir {path} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}): "
                          "someone else may have made it; remove it or set another state_dir")
    if st.st_mode & 0o022:
        raise ConfigError(f"state_dir {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
                          "chmod go-w it, or set another state_dir")


def check_config(cfg: Config) -> list[str]:
    """Problems the field declarations cannot state (bounds and choices are declared on the fields)."""
    problems = (check_http_config(cfg.http) + check_tasks_config(cfg.tasks, cfg.state_dir) + check_sources(cfg.secrets)
                + check_approvals_config(cfg.approvals))
    oauth = cfg.http.oauth
    # Only egress_ca_file must be there now: a command that reads this config without serving (tasks,
    # approve on another box) needs none of the others, and the daemon makes a missing state key.
    named = [("egress_ca_file", cfg.egress_ca_file, True), ("approvals.key_file", cfg.approvals.key_file, False),
             ("state_key_file", cfg.state_key_file, False)]
    if oauth is not None:
        named += [("http.oauth.ca_file", oauth.ca_file, False),
                  ("http.oauth.introspection_client_secret_file", oauth.introspection_client_secret_file, False)]
    problems += [problem for key, path, needed in named if path is not None
                 for problem in [_named_file_problem(key, path, needed)] if problem]
    audit_log = cfg.http.audit_log
    if audit_log and audit_log != "-":
        problem = audit.existing_file_problem(audit_log)
        if problem:
            problems.append(problem)
    return problems


def _named_file_problem(key: str, path: str, needed: bool) -> str | None:
    """What is wrong with a file the config names for the daemon to read: it must be a regular file (a
    FIFO would block the daemon at its first read, a directory or device is a mistake)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return f"{key} {path}: no such file" if needed else None
    except OSError as exc:
        return f"{key} {path}: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return f"{key} {path}: not a regular file (it is {plugin_files.file_kind(st.st_mode)}); name the file itself"
    return None


#: The config file (and ``http.tokens_file``) is refused larger than this: a config is a few KiB,
#: thousands of tokens a few hundred.
MAX_CONFIG_BYTES = 4 * 1024 * 1024
_TOML_AT = re.compile(r"^(.*) \(at line ([0-9]+), column ([0-9]+)\)$", re.DOTALL)


def read_toml(path: str) -> tuple[str, dict[str, Any]] | None:
    """The text and the data of the TOML file ``path`` (None if there is none). Anything else is a
    ``ConfigError`` of one line, ``path:line:column: ...`` where there is a place to point at: not a
    regular file (a FIFO is never opened: it would block), over ``MAX_CONFIG_BYTES``, not UTF-8, not
    TOML (duplicate keys, nesting tomllib cannot follow, an integer of thousands of digits)."""
    try:
        data = plugin_files.read_named(path, MAX_CONFIG_BYTES)
    except plugin_files.PluginFileError as exc:
        raise ConfigError(f"{exc.reason} (give a regular TOML file of at most {MAX_CONFIG_BYTES >> 20} MiB)") from None
    if data is None:
        return None
    try:
        source = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = data[:exc.start].decode("utf-8")
        line, column = before.count("\n") + 1, len(before) - before.rfind("\n")
        raise ConfigError(f"{path}:{line}:{column}: not UTF-8 text (byte 0x{data[exc.start]:02x}); "
                          "save the file as UTF-8") from None
    try:
        return source, tomllib.loads(source)
    except RecursionError:
        raise ConfigError(f"{path}: not valid TOML: nested too deeply") from None
    except tomllib.TOMLDecodeError as exc:
        m = _TOML_AT.match(str(exc))
        if m is None:
            raise ConfigError(f"{path}: not valid TOML: {str(exc)[:300]}") from None
        raise ConfigError(f"{path}:{m.group(2)}:{m.group(3)}: not valid TOML: {m.group(1)[:300]}") from None
    except ValueError as exc:  # a 5,000-digit integer
        raise ConfigError(f"{path}: not valid TOML: {str(exc)[:300]}") from None


def _with_tokens_file(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with the ``[[tokens]]`` of ``http.tokens_file`` appended to ``http.tokens``."""
    http = raw.get("http")
    tokens_file = http.get("tokens_file") if isinstance(http, dict) else None
    if not isinstance(tokens_file, str):
        return raw
    try:
        read = read_toml(tokens_file)
    except ConfigError as exc:
        raise ConfigError(f"http.tokens_file: {exc}") from None
    if read is None:
        raise ConfigError(f"http.tokens_file {tokens_file}: No such file or directory")
    loaded = read[1]
    extra = loaded.pop("tokens", [])
    if loaded or not isinstance(extra, list):
        raise ConfigError(f"http.tokens_file {tokens_file}: expected only [[tokens]] tables")
    assert isinstance(http, dict)
    return {**raw, "http": {**http, "tokens": [*http.get("tokens", []), *extra]}}


def load_config(path: str | None, overrides: dict[str, Any]) -> Config:
    """Read the TOML file (if any), apply CLI overrides, check everything; raise ConfigError naming
    every problem at once, each as ``file:line:column: problem``."""
    raw: dict[str, Any] = {}
    source = ""
    if path:
        read = read_toml(path)
        if read is None:
            raise ConfigError(f"config file not found: {path}")
        source, raw = read
    given = {k: v for k, v in overrides.items() if v is not None}
    raw.update(given)
    raw = _with_tokens_file(raw)
    cfg, found = config_problems.find_all(raw, Config, check_config)
    if found:
        # A problem with a value given on the command line is not in the file: no position for it.
        located = config_problems.locate_all(source, [p for p in found if not _from_flags(p, given)])
        located += [config_problems.Located(None, p if isinstance(p, str) else p.message)
                    for p in found if _from_flags(p, given)]
        where = path or "config"
        lines = [p.render(where) for p in located]
        raise ConfigError(lines[0] if len(lines) == 1 else f"{len(lines)} problems:\n  " + "\n  ".join(lines))
    assert cfg is not None
    return cfg


def _from_flags(problem: config_problems.Problem | str, given: dict[str, Any]) -> bool:
    return isinstance(problem, config_problems.Problem) and bool(problem.keys) and problem.keys[0] in given
