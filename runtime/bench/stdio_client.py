"""MCP over stdio from the client side: a spawned server, its handshake, and the load loop.

Requests are pipelined on the one pipe (distinct integer ids, many in flight): every refill goes
out in one ``write``, responses are read in 1 MiB chunks and a chunk's complete lines decoded in
one msgspec call (``wire.decode_lines``). A line longer than ``MAX_LINE_BYTES`` ends the target
(a server that never sends a newline would otherwise grow the buffer without end). The loop is
one thread around ``epoll``; its CPU time is reported beside the results so a saturated client
shows.
"""

from __future__ import annotations

import collections
import os
import select
import time
from collections.abc import Callable, Sequence
from typing import Any

from runtime.bench import wire
from runtime.bench.load import Flight, ListWalk, Loop, walk_step
from runtime.bench.procs import Server
from runtime.bench.scenario import CompiledCall

#: One ``read`` of the server's stdout: a pipe holds 64 KiB, and a buffer above glibc's mmap threshold
#: (128 KiB) would be mapped and unmapped on every read (see ``http_client.READ_CHUNK``).
READ_CHUNK = 64 * 1024
#: One message from the server; past it the target is down. A partial line is held as the chunks
#: it came in and joined once, when its newline comes: appending each chunk to one bytes object
#: copied the whole line every read (a server sending no newline took 31 s to reach the limit).
MAX_LINE_BYTES = 64 << 20
MAX_REMEMBERED_TIMEOUTS = 100_000
#: Bytes the server has not read from its stdin, past which its requests to us get no refusal: a
#: server sending requests without reading our answers grew this without end (RSS +45 MB/s).
#: Our own requests are bounded by the load shape and are always sent.
MAX_UNSENT_BYTES = 16 << 20


class LineSplitter:
    """Bytes read from the server, cut at newlines, holding at most ``MAX_LINE_BYTES`` of a
    partial line (as the chunks it came in)."""

    __slots__ = ("held", "held_bytes")

    def __init__(self) -> None:
        self.held: list[bytes] = []
        self.held_bytes = 0

    def feed(self, chunk: bytes) -> bytes | None:
        """The complete lines ``chunk`` ends, newline-separated without the last newline; None when
        it ends none. Raises TargetDown when the partial line grows past ``MAX_LINE_BYTES``."""
        cut = chunk.rfind(b"\n")
        if cut < 0:
            self._hold(chunk)
            return None
        lines = chunk[:cut]
        if self.held:
            lines = b"".join([*self.held, lines])
            self.held.clear()
            self.held_bytes = 0
        if cut + 1 < len(chunk):
            self._hold(chunk[cut + 1:])
        return lines

    def _hold(self, piece: bytes) -> None:
        self.held.append(piece)
        self.held_bytes += len(piece)
        if self.held_bytes > MAX_LINE_BYTES:
            raise TargetDown(f"the server sent a line longer than {MAX_LINE_BYTES} bytes")


class TargetDown(Exception):
    """The server is gone or unusable (exited, closed its pipes, sent an endless line)."""


class StdioConnection:
    """One stdio server process, spoken to over newline-delimited JSON."""

    def __init__(self, argv: Sequence[str], cwd: str | None, env: dict[str, str] | None = None) -> None:
        self.server = Server(argv, cwd, stdio=True, env=env)
        proc = self.server.proc
        assert proc.stdin is not None and proc.stdout is not None
        self.write_fd = proc.stdin.fileno()
        self.read_fd = proc.stdout.fileno()
        os.set_blocking(self.write_fd, False)
        os.set_blocking(self.read_fd, False)
        self.lines = LineSplitter()
        #: Complete lines read by the slow path and not yet consumed.
        self.ready: collections.deque[bytes] = collections.deque()
        self.out = b""
        self.unsent = 0
        self.next_id = 1
        self.timed_out: set[int] = set()
        self.down: str | None = None
        self.server_info: dict[str, Any] | None = None

    # -- slow path: handshake, probes --------------------------------------------------------------

    def _why_down(self, what: str) -> str:
        code = None
        try:
            code = self.server.proc.wait(0.5)
        except Exception:  # noqa: BLE001 (still running, or already reaped)
            code = self.server.exited()
        tail = self.server.stderr_tail(600).strip()
        state = f"exited with {code}" if code is not None else "still running"
        return f"{what} (the server {state})" + (f"; its stderr ends: {tail[-600:]}" if tail else "")

    def _write_all(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.write_fd, view):]
            except BlockingIOError:
                self._wait(self.write_fd, select.POLLOUT, deadline)
            except (BrokenPipeError, ConnectionResetError):
                raise TargetDown(self._why_down("the server closed its stdin")) from None

    def _wait(self, fd: int, event: int, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        poller = select.poll()
        poller.register(fd, event)
        if remaining <= 0 or not poller.poll(remaining * 1000):
            raise TimeoutError("no answer in time")

    def _read_line(self, deadline: float) -> bytes:
        while not self.ready:
            self._wait(self.read_fd, select.POLLIN, deadline)
            try:
                chunk = os.read(self.read_fd, READ_CHUNK)
            except BlockingIOError:
                continue
            if not chunk:
                raise TargetDown(self._why_down("the server closed its stdout"))
            lines = self.lines.feed(chunk)
            if lines is not None:
                self.ready.extend(lines.split(b"\n"))
        return self.ready.popleft()

    def roundtrip(self, data_for_id: Callable[[int], bytes], timeout_s: float) -> wire.Envelope | wire.Garbage:
        """Send one request (built for the id we give) and return its answer. Notifications are
        skipped, server-to-client requests refused, lines that are not JSON-RPC skipped (the
        timeout then says what they were); an answer to an id we never asked is returned as
        Garbage, since only one request is out. Raises TimeoutError or TargetDown."""
        request_id = self.next_id
        self.next_id += 1
        deadline = time.monotonic() + timeout_s
        self._write_all(data_for_id(request_id) + b"\n", deadline)
        skipped, first_skipped = 0, ""
        while True:
            try:
                line = self._read_line(deadline)
            except TimeoutError:
                why = f"no answer in {timeout_s:g} s"
                if skipped:
                    why += f"; it sent {skipped} other line(s), the first: {first_skipped}"
                raise TimeoutError(why) from None
            if not line.strip():
                continue
            msg = wire.decode_one(line)
            if isinstance(msg, wire.Garbage):
                if msg.id == request_id:
                    return msg
                skipped += 1
                first_skipped = first_skipped or msg.reason[:200]
                continue
            if msg.method is not None:
                if msg.id is not None:
                    self._write_all(wire.refusal(msg.id) + b"\n", deadline)
                continue
            if type(msg.id) is int and msg.id == request_id:
                return msg
            return wire.Garbage(f"an answer to id {repr(msg.id)[:60]}, which was never asked (the request was id "
                                f"{request_id})")

    def notify(self, method: str) -> None:
        """Send a notification."""
        self._write_all(wire.message(method, None, None, False) + b"\n", time.monotonic() + 10)

    def close(self) -> int | None:
        """Stop the server (and its tree)."""
        return self.server.stop()

    # -- the load loop ---------------------------------------------------------------------------

    def run(self, loop: Loop) -> None:
        """Drive ``loop`` over this pipe until it is over; on the server's death, fail what is in
        flight as ``transport`` and raise TargetDown."""
        pending: dict[int, Flight] = {}
        ep = select.epoll()
        ep.register(self.read_fd, select.EPOLLIN)
        writing = False
        clock = time.monotonic_ns
        concurrency = loop.shape.concurrency
        max_inflight = loop.shape.max_inflight or 100_000
        ops = loop.ops
        timeout_ns = loop.timeout_ns
        open_loop = loop.open
        complete = loop.complete
        out: list[bytes] = [self.out] if self.out else []
        self.out = b""
        if self.ready:  # read after the answer the slow path wanted: nothing asked them
            for msg in wire.decode_lines(b"\n".join(self.ready)):
                self._stray(loop, msg, out)
            self.ready.clear()
        loop.begin(clock())
        try:
            while True:
                now = clock()
                loop.advance(now)
                # Start what is due: refill to C (closed) or drain the schedule's backlog (open).
                if loop.issuing or loop.backlog:
                    if open_loop:
                        loop.due(now)
                        backlog = loop.backlog
                        while backlog and len(pending) < max_inflight:
                            fl = loop.new_flight(backlog.popleft())
                            rid = self.next_id
                            self.next_id = rid + 1
                            fl.sent = now
                            fl.deadline = now + timeout_ns
                            pending[rid] = fl
                            out.append(loop.request(fl, rid) + b"\n")
                    elif loop.issuing:
                        while len(pending) < concurrency and loop.issuing:
                            fl = loop.new_flight(now)
                            rid = self.next_id
                            self.next_id = rid + 1
                            fl.sent = now
                            fl.deadline = now + timeout_ns
                            pending[rid] = fl
                            out.append(loop.request(fl, rid) + b"\n")
                if out:
                    data = b"".join(out)
                    out.clear()
                    try:
                        written = os.write(self.write_fd, data)
                    except BlockingIOError:
                        written = 0
                    except (BrokenPipeError, ConnectionResetError):
                        raise TargetDown(self._why_down("the server closed its stdin")) from None
                    if written < len(data):
                        out.append(data[written:])
                    self.unsent = len(data) - written
                    if bool(out) != writing:
                        writing = bool(out)
                        if writing:
                            ep.register(self.write_fd, select.EPOLLOUT)
                        else:
                            ep.unregister(self.write_fd)
                else:
                    self.unsent = 0
                    if writing:
                        writing = False
                        ep.unregister(self.write_fd)
                # Deadlines: pending is in send order (and every deadline is send + timeout), so
                # the expired ones are a prefix.
                if pending and next(iter(pending.values())).deadline <= now:
                    expired = []
                    for rid, fl in pending.items():
                        if fl.deadline > now:
                            break
                        expired.append(rid)
                    for rid in expired:
                        complete(pending.pop(rid), now, wire.TIMEOUT, f"no answer within {loop.timing.timeout_s:g} s")
                        self._remember_timeout(rid)
                if loop.finished(len(pending)):
                    break
                oldest = next(iter(pending.values())).deadline if pending else 0
                events = ep.poll(loop.next_wake(now, oldest))
                readable = False
                for fd, _ in events:
                    if fd == self.read_fd:
                        readable = True
                if not readable:
                    continue
                try:
                    chunk = os.read(self.read_fd, READ_CHUNK)
                except BlockingIOError:
                    continue
                if not chunk:
                    raise TargetDown(self._why_down("the server closed its stdout"))
                lines = self.lines.feed(chunk)
                if lines is None:
                    continue
                now = clock()
                for msg in wire.decode_lines(lines):
                    rid = msg.id
                    found = pending.pop(rid, None) if type(rid) is int else None
                    if found is None:
                        self._stray(loop, msg, out)
                        continue
                    fl = found
                    if isinstance(msg, wire.Garbage):
                        complete(fl, now, wire.INVALID, msg.reason)
                        continue
                    op = ops[fl.op]
                    if isinstance(op, CompiledCall):
                        if msg.method is not None:
                            complete(fl, now, wire.INVALID, "a request or notification reused our id")
                            continue
                        kind, detail = wire.check_call(msg, op.check, fl.expected)
                        complete(fl, now, kind, detail)
                        continue
                    assert isinstance(op, ListWalk)
                    kind, detail, cursor = walk_step(loop, fl, msg)
                    if cursor is None:
                        complete(fl, now, kind, detail)
                        continue
                    rid = self.next_id
                    self.next_id = rid + 1
                    fl.deadline = now + timeout_ns
                    pending[rid] = fl
                    out.append(op.page(rid, cursor) + b"\n")
        except TargetDown as exc:
            now = clock()
            for fl in pending.values():
                loop.complete(fl, now, wire.TRANSPORT, str(exc)[:300])
            loop.fail_backlog(now, wire.TRANSPORT, str(exc)[:300])
            pending.clear()
            loop.stats.ended_by = str(exc)
            self.down = str(exc)
            loop.end(now)
            raise
        finally:
            ep.close()
        now = clock()
        for rid, fl in pending.items():
            loop.complete(fl, now, wire.TIMEOUT, f"no answer within {loop.timing.timeout_s:g} s")
            self._remember_timeout(rid)
        loop.fail_backlog(now, wire.TIMEOUT, "never sent: the server took nothing more in time")
        self.out = b"".join(out)
        loop.end(now)

    def _remember_timeout(self, rid: int) -> None:
        if len(self.timed_out) >= MAX_REMEMBERED_TIMEOUTS:
            self.timed_out.clear()
        self.timed_out.add(rid)

    def _stray(self, loop: Loop, msg: wire.Envelope | wire.Garbage, out: list[bytes]) -> None:
        """A message that answers nothing in flight: a late answer, a server request, a
        notification, or something unexpected."""
        if isinstance(msg, wire.Garbage):
            loop.stats.unexpected += 1
            return
        if msg.method is not None:
            if msg.id is not None:
                loop.stats.server_requests += 1
                if self.unsent <= MAX_UNSENT_BYTES:
                    refusal = wire.refusal(msg.id) + b"\n"
                    out.append(refusal)
                    self.unsent += len(refusal)
            return
        if type(msg.id) is int and msg.id in self.timed_out:
            self.timed_out.discard(msg.id)
            loop.stats.late += 1
            return
        loop.stats.unexpected += 1

