"""A backend that fails raises the store's own error (TaskStoreUnavailable, with the client's error
chained), so a daemon can catch one type; a URL in an error never shows a password."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
import redis
from store_harness import RedisServer, record

from runtime.task_store import TaskStoreUnavailable, redact_store_url, wall_clock_ms
from runtime.task_store_open import connect_task_store


async def test_a_redis_that_goes_away_is_a_store_error_and_one_that_comes_back_serves_again(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    try:
        store = await connect_task_store(server.url(), str(tmp_path))
        rec = record(created_at_ms=wall_clock_ms())
        await store.create(rec, 10)
        server.stop()
        with pytest.raises(TaskStoreUnavailable, match=r"the task store \(unix://.*redis.sock\) failed") as caught:
            await store.get(rec.task_id, "alice")
        assert isinstance(caught.value.__cause__, redis.exceptions.ConnectionError)
        with pytest.raises(TaskStoreUnavailable):
            await store.heartbeat("me", wall_clock_ms())
        server = RedisServer(tmp_path / "redis")  # empty (no persistence), but reachable again
        assert await store.get(rec.task_id, "alice") is None
        await store.create(record(created_at_ms=wall_clock_ms()), 10)
        await store.aclose()
    finally:
        server.stop()


async def test_a_broken_sqlite_connection_is_a_store_error(tmp_path: Path) -> None:
    store = await connect_task_store(f"sqlite:///{tmp_path}/tasks.sqlite3", str(tmp_path))
    try:
        # Stand-in for a damaged file: the connection underneath is gone.
        await store._thread.run((lambda conn: conn.close(), False))  # type: ignore[attr-defined]
        with pytest.raises(TaskStoreUnavailable, match="tasks.sqlite3") as caught:
            await store.get("some-task-id", "alice")
        assert isinstance(caught.value.__cause__, sqlite3.Error)
        with pytest.raises(TaskStoreUnavailable):
            await store.create(record(created_at_ms=wall_clock_ms()), 10)
    finally:
        await store.aclose()


def test_a_store_url_in_a_message_has_no_credentials() -> None:
    assert redact_store_url("redis://user:s3cret@tasks.internal:6379/0") == "redis://tasks.internal:6379/0"
    assert redact_store_url("rediss://:s3cret@tasks.internal/1") == "rediss://tasks.internal/1"
    assert redact_store_url("unix:///run/redis.sock?db=2&password=s3cret") == "unix:///run/redis.sock"
