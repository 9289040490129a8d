"""Fake workers for the pool-side tests of tools that ask: a socketpair in place of a worker process.

The pool holds one end as a ``Worker``; the test speaks the worker's frames on the other. Nothing
is ever signalled (the ``no_kills`` fixture of conftest.py replaces ``kill_tree``), and every
socket is closed after its test (conftest.py's autouse fixture; warnings are errors).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import trio

#: The socketpairs of the fake workers, closed after each test.
SOCKETS: list[socket.socket] = []


class FakeProc:
    def __init__(self) -> None:
        self.pid = 2 ** 22 + 12345  # never signalled: kill_tree is replaced
        self.returncode = None


def fake_worker(pool: Any, tmp_path: Path) -> tuple[Any, Any]:
    """A ``Worker`` added to ``pool``, and the worker's end of its socket (a trio socket)."""
    from runtime.execution.pool import Worker

    ours, theirs = socket.socketpair()
    SOCKETS.extend((ours, theirs))
    ours.setblocking(False)
    worker = Worker(FakeProc(), ours, str(tmp_path), 1 << 20)  # type: ignore[arg-type]
    pool.workers.add(worker)
    return worker, trio.socket.from_stdlib_socket(theirs)
