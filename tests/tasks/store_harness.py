"""Helpers of the task store tests: a private redis-server, a hand-moved clock, records."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
import secrets
from collections.abc import Callable
from typing import Any

import pytest
import redis

from runtime.task_store import Limits, TaskRecord, TaskStore, new_task_id, wall_clock_ms
from runtime.task_store_open import connect_task_store



def _redis_server_binary() -> str:
    found = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None)
    if found is None:
        pytest.fail("redis-server is not installed; `sh tests/system-packages.sh` installs it (the README's test command)")
    return found


class RedisServer:
    """A redis-server child on a unix socket in a temporary folder (no TCP port, no persistence)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.socket = folder / "redis.sock"
        self.log = folder / "redis.log"
        self.proc = subprocess.Popen(
            [_redis_server_binary(), "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "no", "--dir", str(folder), "--logfile", str(self.log),
             "--daemonize", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(unix_socket_path=str(self.socket), socket_timeout=2).ping()
                break
            except (redis.exceptions.ConnectionError, FileNotFoundError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    log = self.log.read_text() if self.log.exists() else ""
                    pytest.fail(f"redis-server did not start: {log[-2000:]}")
                time.sleep(0.05)

    def url(self, db: int = 0) -> str:
        return f"unix://{self.socket}?db={db}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class FakeClock:
    """A wall clock the test moves by hand; starts at the real time (Redis keys expire in real time)."""

    def __init__(self) -> None:
        self.now_ms = wall_clock_ms()

    def __call__(self) -> int:
        return self.now_ms


def record(*, principal: str = "alice", created_at_ms: int, ttl_ms: int | None = 60_000, owner: str = "daemon-a",
           tool: str = "slow_tool", **fields: Any) -> TaskRecord:
    return TaskRecord(task_id=fields.pop("task_id", new_task_id()), principal=principal, tool=tool,
                      era=fields.pop("era", "2026-07-28"), status=fields.pop("status", "working"),
                      created_at_ms=created_at_ms, updated_at_ms=created_at_ms, ttl_ms=ttl_ms, owner=owner,
                      **fields)


class OpenStore:
    """``await open_store(clock_ms=..., limits=...)``: one more daemon's handle on the test's store
    (its own connection and thread); every handle is closed at the end of the test."""

    def __init__(self, url: str, state_dir: str) -> None:
        self.url = url
        self.state_dir = state_dir
        #: Tests share the session's Redis, never its keys.
        self.namespace = f"test-{secrets.token_hex(6)}"
        self.opened: list[TaskStore] = []

    async def __call__(self, clock_ms: Callable[[], int] = wall_clock_ms, limits: Limits | None = None) -> TaskStore:
        store = await connect_task_store(self.url, self.state_dir, limits=limits, clock_ms=clock_ms,
                                         namespace=self.namespace)
        self.opened.append(store)
        return store

    async def aclose(self) -> None:
        for store in self.opened:
            await store.aclose()
