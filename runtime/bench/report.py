"""The report: what a run measured (Structs, written as ``--json``) and the table printed at the
end (``compare.py`` compares two reports, ``gates.py`` checks ``--fail-if``)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import msgspec

from runtime import plugin_files
from runtime.bench.phases import PhaseRow
from runtime.bench.procs import ProcMemory
from runtime.bench.significance import mann_whitney_p, smallest_p
from runtime.bench.stats import Latency, OpResult, TimelinePoint
from runtime.bench.targets import CheckResult

REPORT_FORMAT = 1
#: A report file larger than this is refused unread (a long run of many targets is a few MiB).
MAX_REPORT_BYTES = 256 * 1024 * 1024


class Segment(msgspec.Struct):
    """One target at one load step, one repeat."""

    target: str
    step: str
    step_index: int
    repeat: int
    skipped: str | None = None
    ended_by: str | None = None
    window_s: float = 0.0
    offered_per_s: float | None = None
    calls_per_s: float = 0.0
    answered_per_s: float = 0.0
    started: int = 0
    ok: int = 0
    errors: dict[str, int] = msgspec.field(default_factory=dict)
    error_samples: dict[str, list[str]] = msgspec.field(default_factory=dict)
    latency: Latency = msgspec.field(default_factory=Latency)
    service: Latency | None = None
    failed_latency: Latency = msgspec.field(default_factory=Latency)
    ops: list[OpResult] = msgspec.field(default_factory=list)
    timeline: list[TimelinePoint] = msgspec.field(default_factory=list)
    histogram: str = ""
    client_cpu_pct: float = 0.0
    server_cpu_us_per_call: float | None = None
    server_cpu_pct: float | None = None
    server_cpu_s: float | None = None
    server_rss_bytes: int | None = None
    late: int = 0
    unexpected: int = 0
    server_requests: int = 0
    phases: list[PhaseRow] = msgspec.field(default_factory=list)


class Summary(msgspec.Struct):
    """One target at one load step, over its repeats: medians of rates, merged histograms."""

    target: str
    step: str
    step_index: int
    repeats: int
    calls_per_s: float
    calls_per_s_min: float
    calls_per_s_max: float
    latency: Latency
    service: Latency | None
    errors: dict[str, int]
    error_rate: float
    client_cpu_pct: float
    server_cpu_us_per_call: float | None
    server_rss_mb: float | None
    #: Closed loop: calls/s over the baseline's at the same step (None in an open loop, where
    #: every target is offered the same rate and calls/s tells nothing apart).
    ratio: float | None = None
    p50_ratio: float | None = None
    #: p99 latency over the baseline's at the same step: what an open loop compares.
    p99_ratio: float | None = None
    ceiling_share: float | None = None
    offered_per_s: float | None = None
    curve: list[tuple[float, float]] = msgspec.field(default_factory=list)
    phases: list[PhaseRow] = msgspec.field(default_factory=list)


class TargetReport(msgspec.Struct):
    """A target: what it is, what it says it is, and how it fared."""

    name: str
    spec: str
    transport: str
    local: bool
    ceiling: bool
    status: str
    problem: str | None
    server_info: dict[str, Any] | None
    protocol_version: str | None
    ready_s: float
    checks: list[CheckResult]
    rss_idle: list[ProcMemory]
    knee: str | None = None
    knee_note: str | None = None


class Report(msgspec.Struct):
    """Everything ``toolcell bench`` measured in one run."""

    format: int
    environment: dict[str, Any]
    config: dict[str, Any]
    targets: list[TargetReport]
    segments: list[Segment]
    summary: list[Summary]
    warnings: list[str]
    baseline: str | None = None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), for a report's environment."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _git_commit() -> str | None:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment() -> dict[str, Any]:
    """Versions, cores and load: recorded beside every figure."""
    dists = ("toolcell", "trio", "msgspec", "psutil", "httptools", "hdrhistogram", "plotly", "mcp")
    return {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "versions": {d: v for d in dists if (v := _version(d)) is not None},
        "git_commit": _git_commit(),
        "loadavg_before": list(os.getloadavg()),
    }


def environment_lines(env: dict[str, Any]) -> list[str]:
    """The environment as short lines."""
    versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items())
    load = env.get("loadavg_before") or []
    after = env.get("loadavg_after") or []
    return [
        f"when {env.get('when')}, git {env.get('git_commit') or '-'}; python {env.get('python')}, {versions}",
        f"cores: {env.get('cores')} usable of {env.get('cpu_count')} ({env.get('cpu_model')}); {env.get('platform')}",
        "load average before: " + " ".join(f"{x:.2f}" for x in load) + "; after: " + " ".join(f"{x:.2f}" for x in after),
    ]


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:,.0f}"


HEADERS = ["target", "step", "calls/s", "spread", "p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "max ms", "errors",
           "srv CPU µs/call", "srv RSS MB", "client CPU", "ratio"]
#: An open loop offers every target the same rate: the last column compares latency instead.
OPEN_LOOP_RATIO = "p99 vs base"
#: What a figure that cannot be computed shows (a spread over one repeat, a ratio to nothing).
NONE = "–"


def spread_pct(row: Summary) -> float | None:
    """Half the range of the repeats' calls/s, as a percent of their median; None with one repeat."""
    if row.repeats < 2 or not row.calls_per_s:
        return None
    return (row.calls_per_s_max - row.calls_per_s_min) / row.calls_per_s * 50


def _ratio_cell(row: Summary, baseline: str | None) -> str:
    if row.offered_per_s is not None:
        value = row.p99_ratio
    else:
        value = row.ratio
    if value is None:
        return NONE
    return "1.00 (base)" if row.target == baseline else f"{value:.2f}x"


def _cells(row: Summary, baseline: str | None) -> list[str]:
    spread = spread_pct(row)
    errors = sum(row.errors.values())
    err = f"{errors}" + (f" ({row.error_rate:.1%})" if errors else "")
    return [row.target, row.step, f"{row.calls_per_s:,.0f}", NONE if spread is None else f"±{spread:.0f}%",
            _ms(row.latency.p50_ms), _ms(row.latency.p90_ms), _ms(row.latency.p99_ms), _ms(row.latency.p999_ms),
            _ms(row.latency.max_ms), err,
            NONE if row.server_cpu_us_per_call is None else f"{row.server_cpu_us_per_call:,.0f}",
            NONE if row.server_rss_mb is None else f"{row.server_rss_mb:.1f}", f"{row.client_cpu_pct:.0f}%",
            _ratio_cell(row, baseline)]


def headers(rows: Sequence[Summary]) -> list[str]:
    """The table's column names (the last depends on the loop)."""
    if any(r.offered_per_s is not None for r in rows):
        return [*HEADERS[:-1], OPEN_LOOP_RATIO]
    return list(HEADERS)


def table_lines(names: Sequence[str], cells: Sequence[Sequence[str]], markdown: bool, left: int = 2) -> list[str]:
    """Aligned text lines (or markdown) of a table whose first ``left`` columns are text."""
    if markdown:
        out = ["| " + " | ".join(names) + " |", "|" + "|".join("---" if i < left else "---:" for i in range(len(names))) + "|"]
        return out + ["| " + " | ".join(c) + " |" for c in cells]
    grid = [list(names), *cells]
    widths = [max(len(line[i]) for line in grid) for i in range(len(names))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=False))).rstrip()
             for line in grid]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return lines


def table(rows: Sequence[Summary], baseline: str | None, markdown: bool = False) -> str:
    """The summary as an aligned text table (or markdown)."""
    return "\n".join(table_lines(headers(rows), [_cells(r, baseline) for r in rows], markdown))


def verdict(report: Report) -> list[str]:
    """The answer first: per load step, which target is faster than the baseline, by how much (the
    ratio of medians, and the range the repeats allow: worst against best pairing), and how sure
    (the Mann-Whitney p-value of the repeats; "–" with too few). Closed loop: calls/s; open loop:
    p99 latency (both runs were offered the same rate)."""
    base = report.baseline or (report.targets[0].name if report.targets else None)
    if base is None:
        return []
    lines = []
    steps = sorted({(s.step_index, s.step) for s in report.summary})
    for _, step in steps:
        rows = {r.target: r for r in report.summary if r.step == step}
        if base not in rows:
            continue
        open_loop = rows[base].offered_per_s is not None

        def samples(target: str, step: str = step, open_loop: bool = open_loop) -> list[float]:
            return [seg.latency.p99_ms if open_loop else seg.calls_per_s for seg in report.segments
                    if seg.target == target and seg.step == step and seg.skipped is None and seg.ok]

        b = samples(base)
        for target, row in rows.items():
            if target == base:
                continue
            t = samples(target)
            if not b or not t or min(b) <= 0 or min(t) <= 0:
                continue
            if open_loop:
                ratio, lo, hi = row.latency.p99_ms / rows[base].latency.p99_ms, min(t) / max(b), max(t) / min(b)
                what = f"p99 {row.latency.p99_ms:.2f} ms is {ratio:.3g}x {base}'s"
                better = ratio < 1
            else:
                ratio, lo, hi = row.calls_per_s / rows[base].calls_per_s, min(t) / max(b), max(t) / min(b)
                what = f"{row.calls_per_s:,.0f} calls/s is {ratio:.3g}x {base}'s"
                better = ratio > 1
            if smallest_p(len(b), len(t)) >= 0.05:
                sure = f"too few repeats to tell noise apart ({len(b)}+{len(t)}; use --repeat 5)"
            else:
                p = mann_whitney_p(b, t)
                sure = (f"{'faster' if better else 'slower'}, p={p:.3f}" if p < 0.05 else
                        f"no significant difference, p={p:.3f}")
            lines.append(f"{step}: {target} {what} (repeats allow {lo:.3g}x-{hi:.3g}x; {sure})")
    return lines


def render_text(report: Report, markdown: bool = False) -> str:
    """Everything a person reads at the end of a run."""
    out = []
    cfg = report.config
    out.append(f"{cfg.get('shape_mode')} loop, {cfg.get('era')} era; {cfg.get('repeat')} x "
               f"{cfg.get('window')} after {cfg.get('warmup_s')} s warm-up; scenario: {cfg.get('scenario_text')}")
    out.append("")
    answers = verdict(report)
    if answers:
        out.append("**Verdict**" if markdown else "verdict:")
        out.extend(("- " if markdown else "  ") + line for line in answers)
        out.append("")
    for t in report.targets:
        info = t.server_info or {}
        who = f"{info.get('name', '?')} {info.get('version', '')}".strip() if info else "-"
        line = f"{t.name}: {t.spec} [{t.transport}] server {who}, status {t.status.upper()}"
        if t.problem:
            line += f" — {t.problem[:300]}"
        if t.knee:
            line += f"; knee at {t.knee} ({t.knee_note})"
        out.append(("- " if markdown else "") + line)
    out.append("")
    rows = [r for r in report.summary]
    if rows:
        out.append(table(rows, report.baseline, markdown))
    phases = [(r.target, r.step, p) for r in report.summary for p in r.phases]
    if phases:
        out.append("")
        out.append("where a toolcell call's time goes (daemon metrics, mean µs per call):")
        for target, step, p in phases:
            out.append(f"  {target} {step} plugin {p.plugin}: queue {p.queue_us:,.0f}, channel {p.channel_us:,.0f}, "
                       f"worker {p.worker_us:,.0f} ({p.calls:,} calls)")
    samples = [(s.target, s.step, k, v[0]) for s in report.segments for k, v in s.error_samples.items() if v]
    if samples:
        out.append("")
        out.append("first errors:")
        seen = set()
        for target, step, kind, text in samples:
            if (target, kind) in seen:
                continue
            seen.add((target, kind))
            out.append(f"  {target} {step} {kind}: {text[:240]}")
    if report.warnings:
        out.append("")
        out.extend(f"warning: {w}" for w in report.warnings)
    out.append("")
    out.extend(("- " if markdown else "") + line for line in environment_lines(report.environment))
    return "\n".join(out)


# -- JSON ------------------------------------------------------------------------------------------


def to_json(report: Report) -> bytes:
    """The report as indented JSON."""
    return msgspec.json.format(msgspec.json.encode(report), indent=1)


def load_side(spec: str) -> tuple[Report, str | None]:
    """One side of ``toolcell bench compare``: ``REPORT.json`` or ``REPORT.json:TARGET`` (one target of
    a report, so that two targets of one run can be compared). ValueError if it is not usable."""
    if not os.path.exists(spec) and ":" in spec:
        path, target = spec.rsplit(":", 1)
        report = load(path)
        names = [t.name for t in report.targets]
        if target not in names:
            raise ValueError(f"{path} has no target {target!r} (it has: {', '.join(names)})")
        return only_target(report, target, target), target
    return load(spec), None


def only_target(report: Report, target: str, renamed: str) -> Report:
    """``report`` with only ``target``'s segments and summary, under the name ``renamed``."""
    return msgspec.structs.replace(
        report,
        targets=[msgspec.structs.replace(t, name=renamed) for t in report.targets if t.name == target],
        segments=[msgspec.structs.replace(s, target=renamed) for s in report.segments if s.target == target],
        summary=[msgspec.structs.replace(s, target=renamed) for s in report.summary if s.target == target],
        baseline=None)


def load(path: str) -> Report:
    """A report written by ``--json``; ValueError if it is not one."""
    try:
        # A regular file only (a FIFO would block this command for good), capped.
        data = plugin_files.read_named(path, MAX_REPORT_BYTES)
    except plugin_files.PluginFileError as exc:
        raise ValueError(f"cannot read the report: {exc.reason}") from None
    if data is None:
        raise ValueError(f"cannot read {path}: No such file or directory")
    try:
        report = msgspec.json.decode(data, type=Report)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"{path} is not a toolcell bench report: {exc}") from None
    if report.format != REPORT_FORMAT:
        raise ValueError(f"{path}: report format {report.format}, this version reads {REPORT_FORMAT}")
    return report
