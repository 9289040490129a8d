"""stdio transport: newline-delimited JSON-RPC on stdin/stdout; logs go to stderr only.

Reads in large chunks; ``runtime.protocol.framing`` (sans-io) splits the lines (a line longer
than ``max_message_bytes`` is refused with a clear error and skipped to its end). The first line
of a scheduler pass is written the moment it is made; the rest of the pass, and anything a full
pipe holds back, go together in the writer's next write. On stdin EOF it lets in-flight calls finish,
flushes, and returns.
"""

from __future__ import annotations

import os

import trio

from runtime.daemon import Daemon
from runtime.connection import Answered, BatchStarted, Connection, Deferred, LineSink
from runtime.protocol.core import Batch
from runtime.protocol.framing import TOO_LONG, Item, LineSplitter


#: Answers not yet taken by the client, in bytes, past which stdin is no longer read (until the client
#: reads): a client that sends without reading cannot make the daemon hold its answers without end.
MAX_UNREAD_ANSWERS = 32 * 1024 * 1024


class _Writer:
    def __init__(self, stream: trio.abc.SendStream, max_backlog: int | None = None) -> None:
        self.stream = stream
        #: A pipe or file we write ourselves (``_write_fd``); None: through the stream's ``send_all``.
        self.fd = stream.fileno() if isinstance(stream, trio.lowlevel.FdStream) else None
        self.pending: list[bytes] = []
        self.wake = trio.Event()
        self.broken = False
        self.closing = False
        #: The rest of a line ``emit`` could only write in part: it goes out before ``pending``.
        self.partial = b""
        #: ``flush`` is writing a chunk (``emit`` must queue behind it).
        self.writing = False
        #: ``emit`` wrote a line itself since ``run`` last ran (the rest of the pass queues).
        self.wrote_this_pass = False
        #: Bytes emitted and not yet written; over ``max_backlog``, ``room`` waits (the reader).
        self.backlog = 0
        self.max_backlog = MAX_UNREAD_ANSWERS if max_backlog is None else max_backlog
        self._room: trio.Event | None = None

    def close(self) -> None:
        """Finish writing what is queued, then let ``run`` return."""
        self.closing = True
        self.wake.set()

    def emit(self, data: bytes, error_code: int | None = None) -> None:
        """Send a line (``error_code``: an answer's, nothing to do with it on a line: see ``LineSink``).

        The first line of a scheduler pass is written at once if the pipe takes it: the client reads
        it while the daemon goes on (no wait for the end of the pass, nor for the writer's task).
        Lines after it in the same pass queue, and the writer sends them together when it runs (one
        write for many answers under load)."""
        if self.broken:
            return
        if not self.wrote_this_pass and self.fd is not None and not self.pending and not self.partial \
                and not self.writing:
            self.wrote_this_pass = True
            line = data + b"\n"
            try:
                written = os.write(self.fd, line)
            except BlockingIOError:
                written = 0
            except OSError:
                self.broken = True
                return
            if written < len(line):
                # The pipe is full: the rest goes first when ``run`` writes (it waits for room).
                self.partial = line[written:]
                self.backlog += len(self.partial)
        else:
            self.pending.append(data)
            self.backlog += len(data) + 1
        self.wake.set()

    async def room(self) -> None:
        """Wait until the answers the client has not taken are within ``max_backlog`` (or the
        output is broken: nobody will take them)."""
        while self.backlog > self.max_backlog and not self.broken:
            self._room = trio.Event()
            await self._room.wait()

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake = trio.Event()
            self.wrote_this_pass = False
            await self.flush()
            if self.closing and not self.pending and not self.partial:
                return

    async def flush(self) -> None:
        while (self.pending or self.partial) and not self.broken:
            chunk = self.partial + (b"\n".join(self.pending) + b"\n" if self.pending else b"")
            self.partial = b""
            self.pending.clear()
            # While a chunk is being written, ``emit`` queues (a line written past it would land
            # inside it).
            self.writing = True
            try:
                if self.fd is not None:
                    await _write_fd(self.fd, chunk)
                else:
                    await self.stream.send_all(chunk)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                self.broken = True
            finally:
                self.writing = False
                self.backlog -= len(chunk)
                if self._room is not None and (self.backlog <= self.max_backlog or self.broken):
                    self._room.set()
                    self._room = None


async def _write_fd(fd: int, data: bytes) -> None:
    """Write all of ``data`` to a non-blocking ``fd``, waiting only when the pipe is full.

    ``FdStream.send_all`` first yields to the scheduler on every call; the writer has just been
    woken by the scheduler (``wake``), so that round trip only costs time (one per write: per
    scheduler pass under load)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(fd)


async def _read_fd(fd: int, max_bytes: int, waited: list[bool]) -> bytes:
    """Read from a non-blocking ``fd`` what is there, or wait for something (b"": EOF).
    ``waited[0]`` says whether it had to wait (then the scheduler ran others meanwhile)."""
    await trio.lowlevel.checkpoint_if_cancelled()
    while True:
        try:
            data = os.read(fd, max_bytes)
        except BlockingIOError:
            waited[0] = True
            await trio.lowlevel.wait_readable(fd)
            continue
        return data


async def _drain_on(shutdown: trio.Event, grace_s: float, session: Connection, read_scope: trio.CancelScope,
                   drain_scope: trio.CancelScope) -> None:
    """Shutdown: refuse new calls at once, give running ones ``grace_s``, then answer what is left
    with "the server is shutting down" and stop reading."""
    with drain_scope:
        await shutdown.wait()
        session.draining = True
        with trio.move_on_after(grace_s):
            await session.wait_idle()
        session.abort("the server is shutting down")
        read_scope.cancel()


async def serve_stdio(daemon: Daemon, stdin: trio.abc.ReceiveStream | None = None,
                      stdout: trio.abc.SendStream | None = None, shutdown: trio.Event | None = None,
                      grace_s: float = 10.0) -> None:
    """Serve one client on stdin/stdout until stdin reaches EOF, or until ``shutdown`` is set and
    the calls in flight have finished (or ``grace_s`` has passed: those left are answered with an
    error saying so). Requests that arrive during the grace are refused, not dropped."""
    if stdin is None:
        stdin = trio.lowlevel.FdStream(os.dup(0))
    if stdout is None:
        stdout = trio.lowlevel.FdStream(os.dup(1))
    max_line = daemon.config.max_message_bytes
    writer = _Writer(stdout)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)
        read_scope = trio.CancelScope()
        drain_scope = trio.CancelScope()
        #: Answers that wait on the task store (a blocking tasks/result may wait for a long task): the
        #: client is gone once its input ends, so they get a moment, then stop.
        deferred_scope = _Deferreds()
        async with trio.open_nursery() as calls:
            session = Connection(daemon, push=writer.emit)
            sink = LineSink(writer.emit)
            if shutdown is not None:
                calls.start_soon(_drain_on, shutdown, grace_s, session, read_scope, drain_scope)
            lines = LineSplitter(max_line)
            # A pipe or file is read directly (``_read_fd``): ``receive_some`` yields to the
            # scheduler before every read, which costs a pass even when the client's next lines
            # are already there. Here the reader yields only after a read that did not have to wait.
            in_fd = stdin.fileno() if isinstance(stdin, trio.lowlevel.FdStream) else None
            waited = [False]
            chunk: bytes | bytearray
            try:
                with read_scope:
                    while True:
                        if writer.backlog > writer.max_backlog:
                            await writer.room()  # the client reads its answers before it sends more
                        try:
                            if in_fd is not None:
                                waited[0] = False
                                chunk = await _read_fd(in_fd, 1 << 16, waited)
                            else:
                                chunk = await stdin.receive_some(1 << 16)
                        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                            chunk = b""
                        if not chunk:
                            break
                        _deliver(session, sink, calls, lines.feed(chunk), max_line, deferred_scope)
                        if in_fd is not None and not waited[0]:
                            await trio.lowlevel.checkpoint()
                    _deliver(session, sink, calls, lines.end(), max_line, deferred_scope)
                    session.stop_asking("the client closed its input; it cannot answer")
                    await session.wait_idle()
            finally:
                drain_scope.cancel()
                session.close()
                deferred_scope.end_after(DEFERRED_GRACE_S)
        writer.close()  # the writer drains what is queued (even a send in progress) and returns


#: What answers still waiting on the task store get after the client's input ended.
DEFERRED_GRACE_S = 1.0


def _deliver(session: Connection, sink: LineSink, nursery: trio.Nursery, items: list[Item], max_line: int,
             deferred_scope: _Deferreds) -> None:
    for item in items:
        if item is TOO_LONG:
            sink.emit(session.core.too_large(session.state, max_line))
            continue
        assert isinstance(item, bytes)
        outcome = session.dispatch(session.receive(item), sink)
        if type(outcome) is Answered:
            if outcome.data is not None:
                sink.emit(outcome.data)
        elif type(outcome) is BatchStarted:
            nursery.start_soon(_answer_batch, session, sink, outcome.batch)
        elif type(outcome) is Deferred:
            nursery.start_soon(_answer_deferred, sink, outcome, deferred_scope)


async def _answer_batch(session: Connection, sink: LineSink, batch: Batch) -> None:
    data = await session.run_batch(batch)
    if data is not None:
        sink.emit(data)


class _Deferreds:
    """The cancel scopes of the answers waiting on the task store, to end them all at once."""

    def __init__(self) -> None:
        self.scopes: set[trio.CancelScope] = set()
        self.deadline = float("inf")

    def end_after(self, seconds: float) -> None:
        self.deadline = trio.current_time() + seconds
        for scope in self.scopes:
            scope.deadline = self.deadline


async def _answer_deferred(sink: LineSink, deferred: Deferred, deferreds: _Deferreds) -> None:
    with trio.CancelScope(deadline=deferreds.deadline) as scope:
        deferreds.scopes.add(scope)
        try:
            data, _code = await deferred.work()
            if data is not None:
                sink.emit(data)
        finally:
            deferreds.scopes.discard(scope)
