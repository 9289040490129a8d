"""Latencies in HDR histograms (HdrHistogram_py, the reference implementation's Python port), a
timeline of the measured window, and the result Structs the report is made of.

Latencies are recorded in microseconds, 1 µs to 100 s at 3 significant digits (values beyond
are clamped to 100 s). Each operation records into a histogram of the current interval (one
``record_value`` per call, the only per-call cost here); every ``TIMELINE_INTERVAL_S`` the
interval is summarised for the timeline and added (in C) to the operation's totals. Histograms
travel in the JSON report in HdrHistogram's compressed base64 form, so a report can be merged,
compared and re-plotted without losing the distribution.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec
from hdrh.histogram import HdrHistogram

LOWEST_US = 1
HIGHEST_US = 100_000_000
SIGNIFICANT_DIGITS = 3
TIMELINE_INTERVAL_S = 0.25
PERCENTILES = (50.0, 90.0, 99.0, 99.9, 100.0)
#: The points of the percentile curve drawn in the HTML report.
CURVE_PERCENTILES = (0.0, 10.0, 25.0, 50.0, 75.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99, 100.0)


def histogram() -> Any:
    """An empty latency histogram (µs)."""
    return HdrHistogram(LOWEST_US, HIGHEST_US, SIGNIFICANT_DIGITS)


def encode(hist: Any) -> str:
    """The compressed base64 form of ``hist`` (empty string when it holds nothing)."""
    return str(hist.encode().decode()) if hist.get_total_count() else ""


def decode(text: str) -> Any:
    """A histogram from ``encode``'s form; an empty histogram for ""."""
    return HdrHistogram.decode(text.encode()) if text else histogram()


def merge(texts: list[str]) -> Any:
    """One histogram holding every encoded histogram's values."""
    out = histogram()
    for text in texts:
        if text:
            out.add(decode(text))
    return out


class Latency(msgspec.Struct):
    """Percentiles of one histogram, in milliseconds."""

    count: int = 0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0
    p999_ms: float = 0.0
    max_ms: float = 0.0
    mean_ms: float = 0.0


def latency(hist: Any) -> Latency:
    """``hist``'s percentiles (one pass over its counts, up to its largest value)."""
    count = int(hist.get_total_count())
    if not count:
        return Latency()
    values = hist.get_percentile_to_value_dict(list(PERCENTILES[:-1]))
    return Latency(count=count, p50_ms=values[50.0] / 1000, p90_ms=values[90.0] / 1000,
                   p99_ms=values[99.0] / 1000, p999_ms=values[99.9] / 1000,
                   max_ms=hist.get_max_value() / 1000, mean_ms=_mean_us(hist) / 1000)


def _mean_us(hist: Any) -> float:
    """The mean, from the counts up to the largest value (hdrh's own mean walks an iterator
    object per bucket, ~100x slower)."""
    top = int(hist._counts_index_for(hist.get_max_value()))
    counts = hist.counts[:top + 1]
    total = 0.0
    for index, n in enumerate(counts):
        if n:
            total += n * hist._hdr_median_equiv_value(hist.get_value_from_index(index))
    return total / float(hist.get_total_count())


def quick(hist: Any) -> tuple[int, float, float, float]:
    """(count, p50 ms, p99 ms, max ms): the timeline's and the live display's cheap summary."""
    count = int(hist.get_total_count())
    if not count:
        return 0, 0.0, 0.0, 0.0
    values = hist.get_percentile_to_value_dict([50.0, 99.0])
    return count, values[50.0] / 1000, values[99.0] / 1000, hist.get_max_value() / 1000


def curve(hist: Any) -> list[tuple[float, float]]:
    """(percentile, ms) points for the latency distribution plot."""
    if not hist.get_total_count():
        return []
    values = hist.get_percentile_to_value_dict(list(CURVE_PERCENTILES))
    return [(p, values[p] / 1000) for p in CURVE_PERCENTILES]


class TimelinePoint(msgspec.Struct, array_like=True):
    """One interval of the measured window: its end (s from the window's start), ok calls and
    errors completed in it, the latency of the ok ones (ms), and (targets the bench started) the
    server tree's CPU µs per answered call in the interval and its RSS (MB) at the interval's end."""

    t_s: float
    ok: int
    errors: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    server_cpu_us_per_call: float | None = None
    server_rss_mb: float | None = None


class ServerSampler(Protocol):
    """The server's CPU seconds so far and RSS bytes now (``procs.TreeSampler``)."""

    def sample(self) -> tuple[float, int] | None:
        """(CPU s, RSS bytes) of the server's processes, or None when they are gone."""


class OpResult(msgspec.Struct):
    """One operation of the mix in one segment."""

    label: str
    latency: Latency
    errors: dict[str, int]
    histogram: str = ""


class Recorder:
    """Everything one segment records. The load loops call ``ok``/``failed`` per completed
    operation started inside the measured window, and ``tick`` as time passes."""

    def __init__(self, labels: list[str], service: bool, sampler: ServerSampler | None = None) -> None:
        self.labels = labels
        #: Read at every interval's end (a few /proc reads, ~0.1 ms per 0.25 s interval).
        self.sampler = sampler
        self.last_cpu_s: float | None = None
        #: The last whole interval's histogram and error count: a final, partial interval
        #: shorter than half an interval is folded into it (alone, its handful of stragglers
        #: drew a vertical spike at the end of every window).
        self.last_merged: Any = None
        self.last_errors = 0
        self.last_spent_us: float | None = None
        self.totals = [histogram() for _ in labels]
        #: The current interval's latencies per operation, as {µs: count}: a dict increment is
        #: ~10x cheaper than ``record_value``; the interval goes into HDR histograms at its end.
        self.interval: list[dict[int, int]] = [{} for _ in labels]
        self.failed_hist = histogram()
        #: Open loop: latency from the actual send, beside the latency from the intended send.
        self.service = histogram() if service else None
        self.service_counts: dict[int, int] = {}
        self.errors = {kind: 0 for kind in ("rpc_error", "tool_error", "invalid", "timeout", "transport")}
        self.op_errors: list[dict[str, int]] = [{} for _ in labels]
        self.samples: dict[str, list[str]] = {}
        self.timeline: list[TimelinePoint] = []
        self.start_ns = 0
        self.next_tick_ns = 0
        self.interval_errors = 0
        #: Completions inside the window (what calls/s counts), ok ones and all.
        self.window_ok = 0
        self.window_answered = 0

    def start(self, now_ns: int) -> None:
        """The measured window starts now."""
        self.start_ns = now_ns
        self.next_tick_ns = now_ns + int(TIMELINE_INTERVAL_S * 1e9)
        if self.sampler is not None:
            first = self.sampler.sample()
            self.last_cpu_s = first[0] if first is not None else None

    def ok(self, op: int, latency_ns: int, service_ns: int) -> None:
        """An operation succeeded after ``latency_ns`` (from its intended send)."""
        us = latency_ns // 1000
        counts = self.interval[op]
        counts[us] = counts.get(us, 0) + 1
        if self.service is not None:
            us = service_ns // 1000
            self.service_counts[us] = self.service_counts.get(us, 0) + 1

    def failed(self, op: int, latency_ns: int, kind: str, detail: str | None) -> None:
        """An operation failed (``kind`` is one of ``wire.ERROR_KINDS``)."""
        self.errors[kind] += 1
        errors = self.op_errors[op]
        errors[kind] = errors.get(kind, 0) + 1
        self.interval_errors += 1
        us = latency_ns // 1000
        self.failed_hist.record_value(min(max(us, 0), HIGHEST_US))
        samples = self.samples.setdefault(kind, [])
        if len(samples) < 3 and detail:
            samples.append(f"{self.labels[op]}: {detail}"[:400])

    def tick(self, now_ns: int, final: bool = False) -> None:
        """Close the intervals that ended by ``now_ns``; ``final`` closes the last, partial one."""
        while self.next_tick_ns <= now_ns:
            self._close(self.next_tick_ns)
            self.next_tick_ns += int(TIMELINE_INTERVAL_S * 1e9)
        if final:
            self._close(now_ns, final=True)

    def _close(self, end_ns: int, final: bool = False) -> None:
        merged = histogram()
        for i, counts in enumerate(self.interval):
            if counts:
                h = histogram()
                for us, n in counts.items():
                    h.record_value(us if us < HIGHEST_US else HIGHEST_US, n)
                merged.add(h)
                self.totals[i].add(h)
                self.interval[i] = {}
        if self.service is not None:
            for us, n in self.service_counts.items():
                self.service.record_value(us if us < HIGHEST_US else HIGHEST_US, n)
            self.service_counts = {}
        errors = self.interval_errors
        self.interval_errors = 0
        spent_us, rss_mb = self._sample()
        t_s = round((end_ns - self.start_ns) / 1e9, 3)
        if final and self.timeline and t_s - self.timeline[-1].t_s < TIMELINE_INTERVAL_S / 2:
            self.timeline.pop()
            if self.last_merged is not None:
                merged.add(self.last_merged)
            errors += self.last_errors
            if spent_us is not None and self.last_spent_us is not None:
                spent_us += self.last_spent_us
        count, p50, p99, top = quick(merged)
        answered = count + errors
        cpu = spent_us / answered if spent_us is not None and answered else None
        self.timeline.append(TimelinePoint(t_s, count, errors, p50, p99, top, cpu, rss_mb))
        self.last_merged, self.last_errors, self.last_spent_us = merged, errors, spent_us

    def _sample(self) -> tuple[float | None, float | None]:
        """(server CPU µs since the last sample, RSS MB now), each None when unknown."""
        now = self.sampler.sample() if self.sampler is not None else None
        if now is None:
            return None, None
        cpu_s, rss = now
        spent = max(0.0, cpu_s - self.last_cpu_s) * 1e6 if self.last_cpu_s is not None else None
        self.last_cpu_s = cpu_s
        return spent, rss / 2**20

    def snapshot(self) -> tuple[int, int, float, float]:
        """(ok so far, errors so far, p50 ms, p99 ms) for the live display."""
        merged = histogram()
        for h in self.totals:
            merged.add(h)
        for counts in self.interval:
            for us, n in counts.items():
                merged.record_value(us if us < HIGHEST_US else HIGHEST_US, n)
        count, p50, p99, _ = quick(merged)
        return count, sum(self.errors.values()), p50, p99

    def all_ok(self) -> Any:
        """One histogram of every successful operation."""
        merged = histogram()
        for h in self.totals:
            merged.add(h)
        return merged

    def op_results(self) -> list[OpResult]:
        """Per-operation results (after the final ``tick``)."""
        return [OpResult(label, latency(h), {k: v for k, v in errs.items() if v}, encode(h))
                for label, h, errs in zip(self.labels, self.totals, self.op_errors, strict=False)]
