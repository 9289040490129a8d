"""A pytest hook that keeps the reason of a skip raised inside a trio test.

pytest-trio runs a test in a nursery; a ``pytest.skip("why")`` there leaves the nursery as an
exception group, which pytest-trio turns into a bare ``Skipped()``: pytest then reports the skip as
"Skipped", at a line of its own, with the reason gone. This hook finds the original skip in the group
and reports its reason and place. ``tests/conftest.py`` installs it.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest


def _inner_skip(error: BaseException | None) -> BaseException | None:
    """The first ``pytest.skip`` exception with a message inside ``error``'s exception groups."""
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = _inner_skip(inner)
            if found is not None:
                return found
        return None
    if isinstance(error, pytest.skip.Exception) and error.msg:
        return error
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if not report.skipped or call.excinfo is None or not isinstance(call.excinfo.value, pytest.skip.Exception):
        return
    if call.excinfo.value.msg:
        return
    inner = _inner_skip(call.excinfo.value.__context__)
    if inner is None:
        return
    # Where the test called skip: the last frame of the skip's traceback in the test's own file.
    line = 0
    tb = inner.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(item.path):
            line = tb.tb_lineno
        tb = tb.tb_next
    report.longrepr = (str(item.path), line, f"Skipped: {getattr(inner, 'msg', '')}")
