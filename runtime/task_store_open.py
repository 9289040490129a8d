"""Opening the task store a ``tasks.store`` URL names (SQLite, the default, or Redis), and its upkeep.

Apart from ``runtime.task_store`` so that the interface never imports its backends (they import it).
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from runtime.logs import log
from runtime.task_store import (
    Limits,
    OwnerVerdict,
    TaskStore,
    local_owner_verdict,
    parse_store_url,
    wall_clock_ms,
)


async def connect_task_store(url: str | None, state_dir: str, *, limits: Limits | None = None,
                             clock_ms: Callable[[], int] = wall_clock_ms, namespace: str = "toolcell") -> TaskStore:
    """Open the store a ``tasks.store`` URL names (see ``parse_store_url``); the caller ``aclose``s it.

    ``namespace`` prefixes every Redis key (daemons that should share tasks use the same one).
    """
    where = parse_store_url(url, state_dir)
    limits = limits or Limits()
    if where.kind == "sqlite":
        # Lazy: only the backend the URL names is loaded (~8 ms; this module loads with every CLI command).
        from runtime.task_store_sqlite import SqliteTaskStore

        return await SqliteTaskStore.open(where.target, limits=limits, clock_ms=clock_ms)
    # Lazy: only the backend the URL names is loaded (~140 ms with redis-py).
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


async def serve_task_store_upkeep(store: TaskStore, owner: str, *, heartbeat_s: float, expire_every_s: float = 60.0,
                                  owner_alive: OwnerVerdict | None = None, clock_ms: Callable[[], int] = wall_clock_ms,
                                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """What a daemon does for the store while it runs, until cancelled: every ``heartbeat_s``, a
    heartbeat as ``owner`` and ``recover_orphans`` (the first pass, at start-up, fails what a crashed
    daemon left running); every ``expire_every_s``, ``expire``. ``owner_alive`` defaults to
    ``local_owner_verdict(owner)``. A store that cannot be reached is logged and tried again at the
    next beat, never fatal. Reports started after the first pass."""
    verdict = owner_alive if owner_alive is not None else local_owner_verdict(owner)
    next_expiry = trio.current_time()
    started = False
    while True:
        now_ms = clock_ms()
        try:
            await store.heartbeat(owner, now_ms)
            noticed = datetime.datetime.fromtimestamp(now_ms / 1000, tz=datetime.UTC)
            failed = await store.recover_orphans(verdict, now_ms,
                                                 f"noticed at {noticed.isoformat(timespec='seconds')}")
            if failed:
                log("task_orphans_failed", level="warning", tasks=failed)
            if trio.current_time() >= next_expiry:
                next_expiry = trio.current_time() + expire_every_s
                removed = await store.expire(now_ms)
                if removed:
                    log("tasks_expired", level="debug", tasks=removed)
        except Exception as exc:  # Redis away, a locked file: the tasks wait in the store; try again
            log("task_store_upkeep_failed", level="error", error=f"{type(exc).__name__}: {exc}")
        if not started:
            started = True
            task_status.started()
        await trio.sleep(heartbeat_s)
