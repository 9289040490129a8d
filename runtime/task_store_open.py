"""Opening the task store a ``tasks.store`` URL names: SQLite (the default) or Redis.

Apart from ``runtime.task_store`` so that the interface never imports its backends (they import it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from runtime.task_store import Limits, TaskStore, parse_store_url, wall_clock_ms


async def connect_task_store(url: str | None, state_dir: str, *, limits: Limits | None = None,
                             clock_ms: Callable[[], int] = wall_clock_ms, namespace: str = "toolcell") -> TaskStore:
    """Open the store a ``tasks.store`` URL names (see ``parse_store_url``); the caller ``aclose``s it.

    ``namespace`` prefixes every Redis key (daemons that should share tasks use the same one).
    """
    where = parse_store_url(url, state_dir)
    limits = limits or Limits()
    if where.kind == "sqlite":
        from runtime.task_store_sqlite import SqliteTaskStore

        return await SqliteTaskStore.open(where.target, limits=limits, clock_ms=clock_ms)
    from runtime.task_store_redis import RedisTaskStore

    return await RedisTaskStore.open(where.target, limits=limits, clock_ms=clock_ms, namespace=namespace)


@asynccontextmanager
async def open_task_store(url: str | None, state_dir: str, *, limits: Limits | None = None,
                          clock_ms: Callable[[], int] = wall_clock_ms,
                          namespace: str = "toolcell") -> AsyncIterator[TaskStore]:
    """``connect_task_store`` as an async context manager that closes the store on the way out."""
    store = await connect_task_store(url, state_dir, limits=limits, clock_ms=clock_ms, namespace=namespace)
    try:
        yield store
    finally:
        await store.aclose()
