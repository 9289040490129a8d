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

from fake_pool import KILLED, SOCKETS  # noqa: E402 (needs the path above)


@pytest.fixture(autouse=True)
def _close_fake_worker_sockets() -> Iterator[None]:
    yield
    while SOCKETS:
        SOCKETS.pop().close()


@pytest.fixture
def no_kills() -> Iterator[list[int]]:
    """The pids of the fake workers the pool killed (a fake's kill only records it)."""
    KILLED.clear()
    yield KILLED
    KILLED.clear()
