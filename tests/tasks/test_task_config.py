"""The ``[tasks]`` table and the store URLs it accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config import ConfigError, load_config
from runtime.task_store import Limits, parse_store_url


def test_the_tasks_table_defaults_to_sqlite_in_the_state_dir_with_bounded_limits(tmp_path: Path) -> None:
    cfg = load_config(None, {"state_dir": str(tmp_path)})
    assert cfg.tasks.store is None
    assert parse_store_url(cfg.tasks.store, cfg.state_dir).target == str(tmp_path / "tasks.sqlite3")
    assert cfg.tasks.max_live_per_principal == 100
    assert cfg.tasks.default_ttl_ms <= cfg.tasks.max_ttl_ms
    assert cfg.tasks.store_limits() == Limits(max_payload_bytes=cfg.tasks.max_payload_bytes,
                                              orphan_after_ms=round(cfg.tasks.orphan_after_s * 1000))


def test_the_tasks_table_is_read_from_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "toolcell.toml"
    path.write_text('[tasks]\nstore = "redis://tasks.internal:6379/2"\nmax_live_per_principal = 7\n'
                    'default_ttl_ms = 60000\nmax_ttl_ms = 120000\npoll_interval_ms = 250\nheartbeat_s = 2\n'
                    'orphan_after_s = 10\nmax_payload_bytes = 65536\n')
    tasks = load_config(str(path), {}).tasks
    assert (tasks.store, tasks.max_live_per_principal, tasks.default_ttl_ms, tasks.max_ttl_ms, tasks.poll_interval_ms,
            tasks.heartbeat_s, tasks.orphan_after_s, tasks.max_payload_bytes) == (
        "redis://tasks.internal:6379/2", 7, 60_000, 120_000, 250, 2.0, 10.0, 65_536)


@pytest.mark.parametrize(("table", "complaint"), [
    ({"stroe": "sqlite"}, "tasks.stroe: unknown key (did you mean 'store'"),
    ({"store": "postgres://db/tasks"}, "tasks.store"),
    ({"store": "sqlite://relative/tasks.db"}, "sqlite:///absolute"),
    ({"max_live_per_principal": 0}, "tasks.max_live_per_principal"),
    ({"default_ttl_ms": 7_200_000, "max_ttl_ms": 3_600_000}, "tasks.default_ttl_ms"),
    ({"max_ttl_ms": 999}, "tasks.max_ttl_ms"),
    ({"poll_interval_ms": 5}, "tasks.poll_interval_ms"),
    ({"heartbeat_s": 0}, "tasks.heartbeat_s"),
    ({"heartbeat_s": 10, "orphan_after_s": 15}, "at least twice tasks.heartbeat_s"),
    ({"max_payload_bytes": 100}, "tasks.max_payload_bytes"),
])
def test_a_bad_tasks_table_is_refused_with_the_field_named(table: dict[str, object], complaint: str) -> None:
    with pytest.raises(ConfigError, match=complaint.replace("(", r"\(")):
        load_config(None, {"tasks": table})


@pytest.mark.parametrize(("url", "kind", "target"), [
    (None, "sqlite", "/state/tasks.sqlite3"),
    ("sqlite", "sqlite", "/state/tasks.sqlite3"),
    ("sqlite:///var/lib/toolcell/tasks.db", "sqlite", "/var/lib/toolcell/tasks.db"),
    ("redis://127.0.0.1:6379/0", "redis", "redis://127.0.0.1:6379/0"),
    ("rediss://user:pw@tasks.internal:6380/1", "redis", "rediss://user:pw@tasks.internal:6380/1"),
    ("unix:///run/redis/redis.sock?db=3", "redis", "unix:///run/redis/redis.sock?db=3"),
])
def test_store_urls_name_a_backend_and_a_place(url: str | None, kind: str, target: str) -> None:
    where = parse_store_url(url, "/state")
    assert (where.kind, where.target) == (kind, target)


@pytest.mark.parametrize("url", ["", "sqlite://", "sqlite:///", "unix://relative.sock", "memcached://x", "tasks.db"])
def test_other_store_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="task store"):
        parse_store_url(url, "/state")
