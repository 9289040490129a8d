"""A pool's workers without processes: ``FakeWorkers`` is a worker factory (``runtime.execution.pool.
WorkerFactory``) whose workers are records the test drives, on trio's virtual clock, the way httpcore
tests its connection pool against a mock backend.

* ``FakeWorker``: no socket at all. What the pool writes to it is decoded into ``received``; the test
  answers its running call with ``finish`` (the pool's ``result`` event, as the worker's reader would
  tell it) or ends it with ``crash``. ``kill`` records the kill; nothing is ever signalled.
* ``SocketWorker``: a real ``runtime.execution.worker.Worker`` over a socketpair, read by the real reader
  (``read_frames``); the test speaks the worker's frames on the other end. For rules that live in the
  frames (questions, withdrawn calls); its ``kill`` only records and closes the socket.
"""

from __future__ import annotations

import collections
import socket
from pathlib import Path
from typing import Any

import trio

from runtime.execution.child import ChildProcess
from runtime.execution.pool import WorkerPool
from runtime.execution.runner import CallSlot, PluginLoadError
from runtime.execution.worker import Worker, read_frames
from runtime.manifest import Manifest
from runtime.processes import PoolSpec
from runtime.protocol.errors import WorkerFailure
from sandbox import wire

#: Pids of fake workers the pool killed, in order (``fake_kills`` fixture clears it).
KILLED: list[int] = []
#: The socketpairs of socket workers, closed after each test.
SOCKETS: list[socket.socket] = []
#: Fake pids: far above any real pid (never signalled anyway).
_NEXT_PID = [2 ** 22 + 12345]


def _pid() -> int:
    _NEXT_PID[0] += 1
    return _NEXT_PID[0]


class FakeWorker:
    """A worker with no process and no socket (see the module docstring)."""

    def __init__(self) -> None:
        self.pid = _pid()
        self.dead = False
        self.calls = 0
        self.layers: list[str] = []
        self.pending: collections.deque[CallSlot] = collections.deque()
        #: Every frame the pool wrote to this worker, decoded.
        self.received: list[Any] = []
        #: How many writes the pool made (calls batched in one write count once).
        self.writes = 0
        self.hold_socket = False
        #: Frames the worker wrote that the pool had not read when it was killed (``last_words``).
        self.unread = b""

    def wrote_nothing(self) -> bool:
        return self.dead  # a fake's write fails only when it is dead, before taking anything

    def write(self, data: bytes) -> bool:
        if self.dead:
            return False
        self.writes += 1
        self.received += [wire.to_worker_decoder.decode(f) for f in wire.split_frames(bytearray(data))]
        return True

    def kill(self) -> None:
        if not self.dead:
            KILLED.append(self.pid)
        self.dead = True

    async def last_words(self, limit_s: float, max_bytes: int) -> bytes:
        """What the worker wrote that the pool had not read when it was killed (a test sets
        ``unread``: encoded frames, e.g. an answer that was on its way)."""
        return self.unread

    def calls_received(self) -> list[wire.Call]:
        return [m for m in self.received if type(m) is wire.Call]

    def finish(self, pool: WorkerPool, text: str = "ok", retire: str | None = None, run_s: float = 0.0,
               blocked_s: float = 0.0) -> CallSlot:
        """The running call answers ``text`` and returns (``Result``, then ``CallReturned``); its slot.
        ``run_s``/``blocked_s``: how long it says it ran, and was blocked of that."""
        head = self.answer(pool, text, retire, run_s, blocked_s)
        if retire is None:
            pool.returned(self)
        return head

    def answer(self, pool: WorkerPool, text: str = "ok", retire: str | None = None, run_s: float = 0.0,
               blocked_s: float = 0.0) -> CallSlot:
        """The running call answers ``text`` (its code has not returned yet); returns its slot."""
        head = self.pending[0]
        pool.result(self, head, wire.Result(head.call.id, [{"type": "text", "text": text}], retire=retire,
                                            run_ns=int(run_s * 1e9), blocked_ns=int(blocked_s * 1e9)))
        return head

    def crash(self, pool: WorkerPool) -> None:
        """The process died (as its watcher would tell the pool)."""
        pool.fail_worker(self, WorkerFailure("crashed", "the worker process crashed: killed by SIGKILL"))


class FakeProc:
    def __init__(self) -> None:
        self.pid = _pid()
        self.returncode = None
        self.stdout = None


class SocketWorker(Worker):
    """A real ``Worker`` over a socketpair (see the module docstring)."""

    __slots__ = ()

    def kill(self) -> None:
        if not self.dead:
            KILLED.append(self.pid)
        self.dead = True
        self.channel.close()
        try:
            trio.lowlevel.notify_closing(self.raw)
        except (RuntimeError, ValueError, OSError):
            pass
        if not self.hold_socket:
            self.raw.close()


def socket_worker(pool: WorkerPool, tmp_path: Path) -> tuple[SocketWorker, Any]:
    """A ``SocketWorker`` added to ``pool`` with its reader running, and the worker's end of its socket."""
    ours, theirs = socket.socketpair()
    SOCKETS.extend((ours, theirs))
    ours.setblocking(False)
    worker = SocketWorker(ChildProcess(FakeProc(), ours, str(tmp_path)), 1 << 20)  # type: ignore[arg-type]
    pool.workers.add(worker)
    pool.nursery.start_soon(read_frames, pool, worker)
    pool.nursery.start_soon(worker.channel.serve, lambda: pool.fail_worker(worker, WorkerFailure("crashed", "gone")))
    return worker, trio.socket.from_stdlib_socket(theirs)


class FakeWorkers:
    """A worker factory: each ``start`` takes ``start_s`` of (virtual) time, then gives a ``FakeWorker``;
    ``fail_next`` start attempts fail instead."""

    def __init__(self, start_s: float = 0.0, tools: list[wire.ToolSpec] | None = None) -> None:
        self.start_s = start_s
        self.tools = tools if tools is not None else [wire.ToolSpec("t", "", {"type": "object"})]
        self.started: list[FakeWorker] = []
        self.fail_next = 0

    async def start(self, pool: WorkerPool) -> tuple[FakeWorker, wire.Ready]:
        await trio.sleep(self.start_s)
        if self.fail_next:
            self.fail_next -= 1
            raise PluginLoadError("start", "worker failed to start: told to")
        worker = FakeWorker()
        self.started.append(worker)
        return worker, wire.Ready(worker.pid, self.tools)

    def alive(self) -> list[FakeWorker]:
        return [w for w in self.started if not w.dead]


def fake_pool(nursery: trio.Nursery, tmp_path: Path, limits: wire.Limits, factory: Any = None,
              min_workers: int = 1, cores: int = 2) -> WorkerPool:
    """A pool of plugin "fake" with ``limits``, its workers from ``factory`` (default: ``FakeWorkers()``),
    on a machine of ``cores`` cores."""
    manifest = Manifest(name="fake", version="1", entry="fake", limits=limits)
    pool = WorkerPool(PoolSpec(manifest, str(tmp_path), "none", str(tmp_path), min_workers=min_workers), nursery,
                      factory if factory is not None else FakeWorkers())
    pool.cores = pool._cpu_size = cores
    return pool
