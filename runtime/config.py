"""Daemon configuration: one frozen Struct tree decoded strictly from TOML, CLI flags on top.

Example ``toolcell.toml``::

    plugins = ["/srv/toolcell/plugins"]
    policy = "strict"          # strict | compat | none
    page_size = 100
    list_ttl_ms = 60000
    max_message_bytes = 16777216
    log_level = "info"
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from runtime.http_config import HttpConfig, check_http_config

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
