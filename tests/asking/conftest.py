"""Fixtures for the tests of tools that ask: the harnesses of tests/runtime and tests/http are reused."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for folder in (TESTS / "asking", TESTS / "runtime", TESTS / "http"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
