"""Progress while the command line waits on something slow (installing a package): on a terminal a
spinner with the seconds elapsed, on one line; elsewhere a line at the start, one every
``EVERY_S`` seconds while it lasts, and one at the end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TextIO

import trio

FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
EVERY_S = 10.0
TICK_S = 0.1


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (ValueError, OSError):
        return False


@asynccontextmanager
async def progress(label: str, stream: TextIO) -> AsyncIterator[None]:
    """Show that ``label`` (e.g. "installing npm:pkg@1.2.3") is going on until the block ends."""
    tty = _is_tty(stream)
    start = trio.current_time()

    def write(text: str) -> None:
        try:
            stream.write(text)
            stream.flush()
        except (ValueError, OSError):
            pass

    async def tick() -> None:
        frame = 0
        while True:
            await trio.sleep(TICK_S if tty else EVERY_S)
            elapsed = trio.current_time() - start
            if tty:
                frame += 1
                write(f"\r{FRAMES[frame % len(FRAMES)]} {label} ({elapsed:.0f} s)\x1b[K")
            else:
                write(f"... still {label} ({elapsed:.0f} s)\n")

    write(f"{FRAMES[0]} {label}" if tty else f"{label} ...\n")
    ok = False
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            try:
                yield
            finally:
                nursery.cancel_scope.cancel()
        ok = True
    except BaseExceptionGroup as group:
        # Only the block's own exception is in it (the ticker is cancelled): give it back as it was
        # raised, so that callers catch what they always caught.
        raise (group.exceptions[0] if len(group.exceptions) == 1 else group) from None
    finally:
        took = trio.current_time() - start
        end = f"{label}: done in {took:.1f} s" if ok else f"{label}: stopped after {took:.1f} s"
        write(f"\r{end}\x1b[K\n" if tty else end + "\n")
