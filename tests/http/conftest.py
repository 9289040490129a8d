"""Fixtures for the HTTP transport tests (the harness itself is in ``http_harness``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from http_harness import LOCKED_CONFIG, ServerProcess, start_server, stop_server


@pytest.fixture(scope="session")
def locked_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_server(tmp_path_factory.mktemp("locked"), LOCKED_CONFIG)
    try:
        yield server
    finally:
        stop_server(server)
