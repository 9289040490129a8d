"""trio's clock, read in one call.

``trio.current_time()`` passes three Python frames (the generated wrapper, the runner, the clock);
the hot path reads the clock a few times per request, so the objects that live inside one
``trio.run`` (the HTTP server and app, a worker pool) keep the clock's own ``current_time``.
Virtual time in tests is unaffected: it is the run's clock, whichever it is."""

from __future__ import annotations

from typing import Callable

import trio


def clock_reader() -> Callable[[], float]:
    """The current run's ``current_time``; outside a run, ``trio.current_time`` (read when called)."""
    try:
        return trio.lowlevel.current_clock().current_time
    except RuntimeError:
        return trio.current_time
