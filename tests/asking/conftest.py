"""Fixtures for the tests of tools that ask: the harnesses of tests/runtime and tests/http are reused."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS / "asking", TESTS / "runtime", TESTS / "http"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from fake_workers import SOCKETS  # noqa: E402 (needs the path above)


@pytest.fixture(autouse=True)
def _close_fake_worker_sockets() -> Iterator[None]:
    yield
    while SOCKETS:
        SOCKETS.pop().close()


@pytest.fixture
def no_kills(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``kill_tree`` records instead of killing (a fake worker's pid is nobody's); the pids it got."""
    import runtime.execution.pool as workers

    killed: list[int] = []
    monkeypatch.setattr(workers, "kill_tree", killed.append)
    monkeypatch.setattr(workers, "sweep_orphans", lambda: None)
    return killed
