"""The load shapes and the bookkeeping every transport's load loop shares.

How a segment runs (one target, one load step, one repeat):

* **warm-up**: load is offered for ``warmup_s``; nothing is recorded;
* **measured window**: for ``duration_s`` (or until ``count`` operations have been started);
  every operation *started* in the window is recorded when it completes (ok, or one of the
  error kinds), and calls/s counts the operations that *completed* ok inside the window;
* **drain**: no new operation starts; the loop waits for those in flight (each has its own
  ``timeout_s``), then what is left is a timeout.

Closed loop keeps ``concurrency`` operations in flight: a new one starts when one completes.
Open loop starts operations on a fixed schedule (``rate`` per second) whatever happens to the
earlier ones; an operation's latency is measured from its *intended* start on that schedule, so
time it spent waiting to be sent (the transport at ``max_inflight``, a stalled connection, a
client that fell behind) is counted, not omitted. The send-to-answer time is kept beside it as
"service time".
"""

from __future__ import annotations

import collections
import resource
import time
from collections.abc import Callable
from typing import Literal

import msgspec

from runtime.bench import stats, wire
from runtime.bench.scenario import CompiledCall, ListSpec, Mix

WARMUP, WINDOW, DRAIN, DONE = 0, 1, 2, 3
PROGRESS_INTERVAL_NS = 500_000_000


class Shape(msgspec.Struct, frozen=True):
    """How load is offered: ``closed`` at ``concurrency``, or ``open`` at ``rate`` per second
    with at most ``max_inflight`` in flight (0: the transport's default)."""

    mode: Literal["closed", "open"] = "closed"
    concurrency: int = 1
    rate: float = 0.0
    max_inflight: int = 0

    def label(self) -> str:
        """``c=16`` or ``rate=200/s``."""
        return f"c={self.concurrency}" if self.mode == "closed" else f"rate={self.rate:g}/s"


class Timing(msgspec.Struct, frozen=True):
    """How long a segment runs."""

    warmup_s: float = 1.0
    duration_s: float = 10.0
    #: > 0: the measured window is this many operations instead of ``duration_s``.
    count: int = 0
    timeout_s: float = 10.0


class ListWalk:
    """A full ``tools/list`` walk: the first page from a template, the next ones per cursor."""

    def __init__(self, spec: ListSpec, modern: bool) -> None:
        self.spec = spec
        self.modern = modern
        self.first = wire.RequestTemplate("tools/list", {} if modern else None, modern)
        self.max_pages = spec.max_pages

    def page(self, request_id: int, cursor: str) -> bytes:
        """The request for the page at ``cursor``."""
        return wire.message("tools/list", {"cursor": cursor}, request_id, self.modern)


Op = CompiledCall | ListWalk


class Flight:
    """One operation on its way: which, when it was meant to start and was sent, its deadline,
    and (list walks) the pages so far."""

    __slots__ = ("cursor", "cursors", "deadline", "expected", "intended", "measured", "op", "pages", "sent",
                 "variables")

    def __init__(self, op: int, intended: int, measured: bool) -> None:
        self.op = op
        self.intended = intended
        self.measured = measured
        self.sent = 0
        self.deadline = 0
        self.expected: str | None = None
        self.variables: wire.Variables | None = None
        self.pages = 0
        #: The cursor of the page to ask for next, and every cursor seen (a loop is an error).
        self.cursor = ""
        self.cursors: set[str] | None = None


class SegmentStats(msgspec.Struct):
    """What one segment's loop measured, besides the recorder's histograms."""

    window_s: float = 0.0
    ok_in_window: int = 0
    answered_in_window: int = 0
    started: int = 0
    client_cpu_s: float = 0.0
    late: int = 0
    unexpected: int = 0
    server_requests: int = 0
    #: Answers from the window's start to the end of the drain, and that span: the span the
    #: server's CPU is measured over (snapshots are taken outside the window, never inside it).
    answered_since_open: int = 0
    span_s: float = 0.0
    #: Why the loop ended early ("the server exited with 1", ...); None when it ran its course.
    ended_by: str | None = None


def client_cpu_s() -> float:
    """CPU seconds this process has used."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Loop:
    """Phases, schedule and recording of one segment; the transports subclass it for the I/O."""

    def __init__(self, ops: list[Op], labels: list[str], weights: list[int], shape: Shape, timing: Timing,
                 seq_start: int, on_window: Callable[[bool], None] | None,
                 progress: Callable[[Loop, int], None] | None, sampler: stats.ServerSampler | None = None) -> None:
        self.ops = ops
        #: Per operation: the call (None for a list walk) and the first request's template.
        self.calls = [op if isinstance(op, CompiledCall) else None for op in ops]
        self.templates = [op.template if isinstance(op, CompiledCall) else op.first for op in ops]
        self.mix = Mix(weights)
        self.shape = shape
        self.timing = timing
        self.open = shape.mode == "open"
        self.recorder = stats.Recorder(labels, service=self.open, sampler=sampler)
        self.stats = SegmentStats()
        self.seq = seq_start
        self.on_window = on_window
        self.progress = progress
        self.timeout_ns = int(timing.timeout_s * 1e9)
        self.phase = WARMUP
        self.t0 = self.t_window = self.t_end = self.t_drain = 0
        self.window_started = 0
        self.measured_outstanding = 0
        self.last_measured_done = 0
        self.next_progress = 0
        #: Open loop: the next intended start, the interval between starts, and operations
        #: whose time has come but that could not be sent yet (their intended starts).
        self.next_intended = 0
        self.interval_ns = int(1e9 / shape.rate) if self.open and shape.rate > 0 else 0
        self.backlog: collections.deque[int] = collections.deque()
        self.cpu0 = 0.0

    # -- phases ------------------------------------------------------------------------------

    def begin(self, now: int) -> None:
        """The segment starts (warm-up first, if any)."""
        self.t0 = now
        self.t_window = now + int(self.timing.warmup_s * 1e9)
        self.next_intended = now
        self.next_progress = now + PROGRESS_INTERVAL_NS
        if self.t_window <= now:
            self._open_window(now)

    def _open_window(self, now: int) -> None:
        self.phase = WINDOW
        self.t_window = now
        if self.on_window is not None:
            self.on_window(True)
            now = time.monotonic_ns()
            self.t_window = now
        self.recorder.start(now)
        self.cpu0 = client_cpu_s()
        self.t_end = now + int(self.timing.duration_s * 1e9) if self.timing.count <= 0 else 0

    def _close_window(self, now: int) -> None:
        self.phase = DRAIN
        if self.t_end == 0 or now < self.t_end:
            self.t_end = now
        self.t_drain = now + self.timeout_ns + 1_000_000_000

    def advance(self, now: int) -> None:
        """Move through the phases as time passes; report progress."""
        if self.phase == WARMUP and now >= self.t_window:
            self._open_window(now)
        elif self.phase == WINDOW and self.t_end and now >= self.t_end:
            self._close_window(now)
        if self.phase >= WINDOW:
            self.recorder.tick(now)
        if self.progress is not None and now >= self.next_progress:
            self.next_progress = now + PROGRESS_INTERVAL_NS
            self.progress(self, now)

    @property
    def issuing(self) -> bool:
        """Whether new operations may start."""
        return self.phase <= WINDOW

    def finished(self, inflight: int) -> bool:
        """The segment is over: drained, or out of drain time."""
        if self.phase != DRAIN:
            return False
        return (inflight == 0 and not self.backlog) or time.monotonic_ns() >= self.t_drain

    def end(self, now: int) -> None:
        """Close the books (after the transport has failed what was left as timeouts)."""
        if self.phase == WINDOW:
            self._close_window(now)
        if self.timing.count > 0 and self.last_measured_done:
            self.t_end = max(self.t_window, self.last_measured_done)
        self.phase = DONE
        self.recorder.tick(max(now, self.recorder.start_ns), final=True)
        s = self.stats
        s.window_s = max(1e-9, (self.t_end - self.t_window) / 1e9) if self.t_end else 0.0
        s.client_cpu_s = client_cpu_s() - self.cpu0 if self.cpu0 else 0.0
        s.span_s = max(1e-9, (now - self.t_window) / 1e9) if self.t_window else 0.0
        s.ok_in_window = self.recorder.window_ok
        s.answered_in_window = self.recorder.window_answered
        if self.on_window is not None:
            self.on_window(False)

    # -- operations ----------------------------------------------------------------------------

    def new_flight(self, intended: int) -> Flight:
        """Start the next operation of the mix (its request is the transport's business)."""
        op_index = self.mix.next()
        measured = (self.phase != WARMUP and intended >= self.t_window and (not self.t_end or intended < self.t_end))
        if measured:
            self.measured_outstanding += 1
            self.window_started += 1
            if self.timing.count > 0 and self.window_started >= self.timing.count:
                self._close_window(time.monotonic_ns())
        fl = Flight(op_index, intended, measured)
        self.seq += 1
        op = self.calls[op_index]
        if op is not None:
            if op.used:
                fl.variables = variables = wire.Variables(self.seq, op.used)
                if op.text_template is not None:
                    fl.expected = wire.render_text(op.text_template, variables)
            else:
                fl.expected = op.static_text
        self.stats.started += 1
        return fl

    def request(self, fl: Flight, request_id: int) -> bytes:
        """The bytes of ``fl``'s (first) request."""
        return self.templates[fl.op].render(request_id, fl.variables)

    def fail_backlog(self, now: int, kind: str, detail: str) -> None:
        """Open loop: operations due but never sent end as ``kind``."""
        while self.backlog:
            fl = self.new_flight(self.backlog.popleft())
            fl.sent = now
            self.complete(fl, now, kind, detail)

    def due(self, now: int) -> int:
        """Open loop: how many intended starts have come (they go to the backlog)."""
        if not self.issuing:
            return 0
        n = 0
        limit = self.t_end if self.phase == WINDOW and self.t_end else 0
        while self.next_intended <= now:
            if limit and self.next_intended >= limit:
                break
            self.backlog.append(self.next_intended)
            self.next_intended += self.interval_ns
            n += 1
            if self.timing.count > 0 and self.phase == WINDOW and self.window_started + len(self.backlog) >= self.timing.count:
                break
        return n

    def complete(self, fl: Flight, now: int, kind: str, detail: str | None) -> None:
        """``fl`` ended: record it (if it was started in the window) and count it for calls/s."""
        phase = self.phase
        if phase == WARMUP:
            return
        self.stats.answered_since_open += 1
        rec = self.recorder
        if fl.measured:
            if kind is wire.OK:
                rec.ok(fl.op, now - fl.intended, now - fl.sent)
            else:
                rec.failed(fl.op, now - fl.intended, kind, detail)
            self.measured_outstanding -= 1
            self.last_measured_done = now
        if phase == WINDOW or (phase == DRAIN and fl.measured and self.timing.count > 0):
            rec.window_answered += 1
            if kind is wire.OK:
                rec.window_ok += 1

    def next_wake(self, now: int, oldest_deadline: int) -> float:
        """Seconds until something is due (a phase change, an intended start, a deadline)."""
        wake = now + 200_000_000
        if self.phase == WARMUP:
            wake = min(wake, self.t_window)
        elif self.phase == WINDOW and self.t_end:
            wake = min(wake, self.t_end)
        elif self.phase == DRAIN:
            wake = min(wake, self.t_drain)
        if self.open and self.issuing:
            wake = min(wake, self.next_intended)
        if oldest_deadline:
            wake = min(wake, oldest_deadline)
        return max(0.0, (wake - now) / 1e9)


def walk_step(loop: Loop, fl: Flight, env: wire.Envelope) -> tuple[str, str | None, str | None]:
    """One ``tools/list`` page arrived for ``fl``: (kind, detail, next cursor). ``ok`` with a
    cursor means the walk goes on."""
    kind, detail, page = wire.check_list_page(env)
    if kind is not wire.OK or page is None:
        return kind, detail, None
    fl.pages += 1
    cursor = page.nextCursor
    if not cursor:
        return wire.OK, None, None
    op = loop.ops[fl.op]
    assert isinstance(op, ListWalk)
    if fl.pages >= op.max_pages:
        return wire.INVALID, f"pagination did not end after {op.max_pages} pages", None
    if fl.cursors is None:
        fl.cursors = set()
    if cursor in fl.cursors:
        return wire.INVALID, f"pagination loops: cursor {cursor[:60]!r} came back", None
    fl.cursors.add(cursor)
    return wire.OK, None, cursor


def progress_line(loop: Loop, now: int) -> tuple[float, int, int, float, float]:
    """(elapsed s in the window, ok so far, errors so far, p50 ms, p99 ms) for the live display."""
    ok, errors, p50, p99 = loop.recorder.snapshot()
    elapsed = max(0.0, (now - loop.t_window) / 1e9) if loop.phase >= WINDOW else 0.0
    return elapsed, ok, errors, p50, p99
