"""``toolcell bench compare BASE.json NEW.json``: which (target, step) changed, by how much, and
whether the change is more than noise, the way benchstat reports.

The samples are the repeats (``--repeat N``): one value per measured segment, calls/s (closed
loop only: an open loop offers both runs the same rate), p50 and p99. Per metric the medians are
compared and the Mann-Whitney U test says how likely a difference at least this large is
between two sets of repeats of the same build (``significance.py``). A regression is a change
that is both significant (p below ``alpha``) and worse by more than ``threshold_pct``; anything
else within noise is "no significant change". A single repeat per side cannot tell a change from
noise (the smallest p four against four repeats can reach is 0.029): such a metric says so
rather than guessing. Errors are not noise: an error rate that grew by more than
``threshold_pct`` of itself and by at least 0.1 percentage point is a regression at any count.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import msgspec

from runtime.bench.report import Report, Segment, table_lines
from runtime.bench.significance import mann_whitney_p, smallest_p

#: The repeats the README suggests so that a test can tell (5 + 5 reaches p = 0.008).
SUGGESTED_REPEATS = 5


class Metric(msgspec.Struct, frozen=True):
    """A compared figure: its name, unit, and whether more is better."""

    name: str
    unit: str
    higher_is_better: bool


CALLS = Metric("calls/s", "calls/s", True)
P50 = Metric("p50", "ms", False)
P99 = Metric("p99", "ms", False)

_SAMPLE: dict[str, Callable[[Segment], float]] = {
    CALLS.name: lambda s: s.calls_per_s,
    P50.name: lambda s: s.latency.p50_ms,
    P99.name: lambda s: s.latency.p99_ms,
}


class MetricChange(msgspec.Struct):
    """One metric of one (target, step): medians of each side's repeats, the change of the
    median in percent, the test's p-value, and the verdict."""

    metric: str
    unit: str
    base: float
    new: float
    change_pct: float
    p_value: float
    n_base: int
    n_new: int
    #: "better", "worse", "no significant change", or "too few repeats"
    verdict: str
    regression: bool = False


class Change(msgspec.Struct):
    """One (target, step) present in both reports."""

    target: str
    step: str
    metrics: list[MetricChange]
    base_error_rate: float
    new_error_rate: float
    regressions: list[str]


def _samples(report: Report, target: str, step: str, metric: str) -> list[float]:
    pick = _SAMPLE[metric]
    return [pick(s) for s in report.segments
            if s.target == target and s.step == step and s.skipped is None and (s.ok or metric == CALLS.name)]


def _metric(metric: Metric, base: list[float], new: list[float], threshold_pct: float, alpha: float) -> MetricChange:
    b, n = statistics.median(base), statistics.median(new)
    change = (n - b) / b * 100 if b else 0.0
    p = mann_whitney_p(base, new)
    worse = change < 0 if metric.higher_is_better else change > 0
    if smallest_p(len(base), len(new)) >= alpha:
        verdict = "too few repeats"
    elif p >= alpha:
        verdict = "no significant change"
    else:
        verdict = "worse" if worse else "better"
    return MetricChange(metric.name, metric.unit, b, n, change, p, len(base), len(new), verdict,
                        regression=verdict == "worse" and abs(change) > threshold_pct)


def compare(base: Report, new: Report, threshold_pct: float = 10.0, alpha: float = 0.05) -> list[Change]:
    """Every (target, step) measured in both reports, metric by metric (see the module's doc)."""
    old = {(s.target, s.step): s for s in base.summary}
    out = []
    for s in new.summary:
        b = old.get((s.target, s.step))
        if b is None:
            continue
        metrics = [P50, P99] if s.offered_per_s is not None else [CALLS, P50, P99]
        changes = []
        for m in metrics:
            xs, ys = _samples(base, s.target, s.step, m.name), _samples(new, s.target, s.step, m.name)
            if xs and ys:
                changes.append(_metric(m, xs, ys, threshold_pct, alpha))
        regressions = [f"{c.metric} {c.change_pct:+.1f}% (p={c.p_value:.3f})" for c in changes if c.regression]
        if s.error_rate - b.error_rate > max(0.001, b.error_rate * threshold_pct / 100):
            regressions.append(f"error rate {b.error_rate:.2%} -> {s.error_rate:.2%}")
        out.append(Change(s.target, s.step, changes, b.error_rate, s.error_rate, regressions))
    return out


def _value(value: float, unit: str) -> str:
    if unit == "ms":
        return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:,.0f}"
    return f"{value:,.0f}"


HEADERS = ["target", "step", "metric", "base", "new", "change", "p", "n", "verdict"]


def rows(changes: Sequence[Change]) -> list[list[str]]:
    """The comparison's cells, a row per metric (and one per error-rate regression)."""
    out = []
    for c in changes:
        for m in c.metrics:
            verdict = m.verdict
            if m.regression:
                verdict = "REGRESSION"
            elif m.verdict == "worse":
                verdict = "worse, within the threshold"
            out.append([c.target, c.step, f"{m.metric} ({m.unit})" if m.unit != m.metric else m.metric,
                        _value(m.base, m.unit), _value(m.new, m.unit),
                        "~" if m.verdict in ("no significant change", "too few repeats") else f"{m.change_pct:+.1f}%",
                        f"{m.p_value:.3f}", f"{m.n_base}+{m.n_new}", verdict])
        if c.new_error_rate or c.base_error_rate:
            bad = any(r.startswith("error rate") for r in c.regressions)
            out.append([c.target, c.step, "error rate", f"{c.base_error_rate:.2%}", f"{c.new_error_rate:.2%}",
                        f"{(c.new_error_rate - c.base_error_rate) * 100:+.2f} pp", "", "",
                        "REGRESSION" if bad else "ok"])
    return out


def verdict_lines(changes: Sequence[Change], threshold_pct: float, alpha: float) -> list[str]:
    """What the comparison concludes, in a few lines."""
    bad = [(c, r) for c in changes for r in c.regressions]
    out = []
    if bad:
        out.append(f"{len(bad)} regression(s), significant at p < {alpha:g} and beyond {threshold_pct:g}%:")
        out += [f"  {c.target} {c.step}: {r}" for c, r in bad]
    else:
        out.append(f"no significant regression (p < {alpha:g}, beyond {threshold_pct:g}%)")
    few = [m for c in changes for m in c.metrics if m.verdict == "too few repeats"]
    if few:
        n = min(min(m.n_base, m.n_new) for m in few)
        out.append(f"{len(few)} metric(s) cannot be told from noise with {n} repeat(s) on a side: run both with "
                   f"--repeat {SUGGESTED_REPEATS} or more")
    return out


def render(changes: Sequence[Change], threshold_pct: float, alpha: float, markdown: bool = False) -> str:
    """The comparison as a table (or markdown for a pull-request comment), then the verdict."""
    lines = table_lines(HEADERS, rows(changes), markdown, left=3)
    verdict = verdict_lines(changes, threshold_pct, alpha)
    if markdown:
        first, *rest = verdict
        return "\n".join([f"**{first}**", "", *lines, "", *(f"- {x.strip()}" for x in rest)]).rstrip()
    return "\n".join([*lines, "", *verdict])
