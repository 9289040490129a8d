"""Fixtures for the bundled plugins' tests (helpers live in ``plugin_harness``)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from plugin_harness import LoadedPlugin, import_plugin

_cache: dict[str, LoadedPlugin] = {}


@pytest.fixture(scope="session")
def load_plugin() -> Callable[[str], LoadedPlugin]:
    """Import a bundled plugin once per session (by its folder name) and return it."""

    def load(name: str) -> LoadedPlugin:
        if name not in _cache:
            _cache[name] = import_plugin(name)
        return _cache[name]

    return load
