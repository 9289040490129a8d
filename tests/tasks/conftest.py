"""Task store fixtures: every store test runs on SQLite (a file in tmp_path) and on a real Redis
server this session starts on a unix socket of its own (never one already running)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from store_harness import OpenStore, RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=["sqlite", "redis"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of an empty store of each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/tasks.sqlite3"
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url()


@pytest.fixture
async def open_store(store_url: str, tmp_path: Path) -> AsyncIterator[OpenStore]:
    opener = OpenStore(store_url, str(tmp_path))
    yield opener
    await opener.aclose()
