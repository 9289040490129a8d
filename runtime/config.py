"""Daemon configuration: one frozen Struct tree decoded strictly from TOML, CLI flags on top.

Example ``toolcell.toml``::

    plugins = ["/srv/toolcell/plugins"]
    policy = "strict"          # strict | compat | none
    page_size = 100
    list_ttl_ms = 60000
    max_message_bytes = 16777216
    log_level = "info"

    [tasks]                    # long-running tool calls (MCP tasks): where they are kept, limits
    store = "redis://tasks.internal:6379/0"   # default: SQLite, tasks.sqlite3 in state_dir
    max_live_per_principal = 100
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from runtime.http_config import HttpConfig, check_http_config
from runtime.task_store import Limits, parse_store_url

def _bundled_plugins() -> Path:
    """The bundled plugins: ``plugins/`` beside ``runtime/`` in a checkout (and an editable install),
    else the copy a wheel or ``pip install .`` put in site-packages as ``toolcell_plugins``."""
    checkout = Path(__file__).resolve().parent.parent / "plugins"
    if checkout.is_dir():
        return checkout
    try:
        import importlib.util

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
    max_live_per_principal: int = 100
    #: A task's lifetime when the client asks for none, and the most it may ask for.
    default_ttl_ms: int = 3_600_000
    max_ttl_ms: int = 86_400_000
    #: The polling interval suggested to clients.
    poll_interval_ms: int = 1_000
    #: How often a daemon tells the store it is alive, and how long a silent daemon's unfinished
    #: tasks wait before they are failed (``recover_orphans``).
    heartbeat_s: float = 5.0
    orphan_after_s: float = 30.0
    #: The largest result, error, input-request set or mailbox message the store accepts.
    max_payload_bytes: int = 8 * 1024 * 1024

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
    if not 1 <= cfg.max_live_per_principal <= 1_000_000:
        problems.append("tasks.max_live_per_principal must be between 1 and 1000000")
    if not 1_000 <= cfg.max_ttl_ms <= 30 * 86_400_000:
        problems.append("tasks.max_ttl_ms must be between 1000 (1 s) and 2592000000 (30 days)")
    if not 1_000 <= cfg.default_ttl_ms <= cfg.max_ttl_ms:
        problems.append("tasks.default_ttl_ms must be between 1000 and tasks.max_ttl_ms")
    if not 10 <= cfg.poll_interval_ms <= 600_000:
        problems.append("tasks.poll_interval_ms must be between 10 and 600000")
    if not 0.1 <= cfg.heartbeat_s <= 300:
        problems.append("tasks.heartbeat_s must be between 0.1 and 300")
    if not 2 * cfg.heartbeat_s <= cfg.orphan_after_s <= 86_400:
        problems.append("tasks.orphan_after_s must be at least twice tasks.heartbeat_s (one late heartbeat must "
                        "not fail running tasks) and at most 86400")
    if not 1024 <= cfg.max_payload_bytes <= 256 * 1024 * 1024:
        problems.append("tasks.max_payload_bytes must be between 1 KiB and 256 MiB")
    return problems


class Config(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    plugins: list[str] = msgspec.field(default_factory=lambda: [str(BUNDLED_PLUGINS)])
    policy: str = "strict"
    page_size: int = 100
    list_ttl_ms: int = 60_000
    max_message_bytes: int = 16 * 1024 * 1024
    #: Calls running or queued at once across all plugins and clients.
    max_inflight: int = 4096
    log_level: str = "info"
    state_dir: str = msgspec.field(default_factory=default_state_dir)
    #: Pre-started workers per plugin (each plugin may grow to its max_concurrency).
    min_workers: int = 1
    instructions: str | None = None
    #: Hot reload: watch the plugin folders for changes (SIGHUP and `toolcell reload` always work).
    watch: bool = True
    #: Changes closer together than this are one reload (an editor saving several files).
    reload_debounce_ms: int = 150
    #: The HTTP transport: listeners, Host/Origin allowlists, tokens, limits (see runtime.http_config).
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    #: MCP tasks: the store and its limits (see ``TasksConfig``).
    tasks: TasksConfig = msgspec.field(default_factory=TasksConfig)


class ConfigError(Exception):
    pass


def check_config(cfg: Config) -> list[str]:
    problems = []
    if cfg.policy not in ("strict", "compat", "none"):
        problems.append(f"policy {cfg.policy!r}: use strict, compat or none")
    if not 1 <= cfg.page_size <= 10_000:
        problems.append("page_size must be between 1 and 10000")
    if cfg.list_ttl_ms < 0:
        problems.append("list_ttl_ms must be >= 0")
    if not 1024 <= cfg.max_message_bytes <= 1 << 30:
        problems.append("max_message_bytes must be between 1 KiB and 1 GiB")
    if cfg.log_level not in ("debug", "info", "warning", "error"):
        problems.append("log_level must be debug, info, warning or error")
    if not 0 <= cfg.min_workers <= 64:
        problems.append("min_workers must be between 0 and 64")
    if cfg.max_inflight < 1:
        problems.append("max_inflight must be >= 1")
    if not 10 <= cfg.reload_debounce_ms <= 60_000:
        problems.append("reload_debounce_ms must be between 10 and 60000")
    problems.extend(check_http_config(cfg.http))
    problems.extend(check_tasks_config(cfg.tasks, cfg.state_dir))
    return problems


def load_config(path: str | None, overrides: dict[str, Any]) -> Config:
    """Read the TOML file (if any), apply CLI overrides, check everything; raise ConfigError."""
    raw: dict[str, Any] = {}
    if path:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        cfg = msgspec.convert(raw, Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from None
    problems = check_config(cfg)
    if problems:
        raise ConfigError(f"{path or 'config'}: " + "; ".join(problems))
    return cfg
