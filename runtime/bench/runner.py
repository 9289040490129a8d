"""A whole benchmark run: start every target, prove each works, then measure them interleaved.

Order: every target (and, unless switched off, the trivial server as the client's ceiling for
each transport in use) is started and passes its correctness pass; then for each load step, for
each repeat, each target runs one segment in turn (A B C A B C ...), so the machine's noise lands
on all of them. A target that is broken gets no load; one that dies is reported dead and skipped
from then on. Rates are medians over repeats; latencies come from the repeats' HDR histograms
merged. Ratios divide by the baseline (the first target unless ``baseline`` names another).
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
import time
from typing import Any

import msgspec

from runtime.bench import phases, procs, stats, wire
from runtime.bench.load import ListWalk, Loop, Op, Shape, Timing
from runtime.bench.report import Report, Segment, Summary, TargetReport, environment
from runtime.bench.scenario import CompiledCall, Scenario
from runtime.bench.stdio_client import TargetDown
from runtime.bench.targets import Live, TargetSpec, ceiling_spec, workdir

CLIENT_LIMIT_CPU_PCT = 90.0
CEILING_WARN_SHARE = 0.5


class Plan(msgspec.Struct, frozen=True):
    """What to run."""

    targets: list[TargetSpec]
    scenario: Scenario
    steps: list[Shape]
    timing: Timing = Timing()
    repeat: int = 1
    modern: bool = False
    headers: list[tuple[str, str]] = msgspec.field(default_factory=list)
    insecure: bool = False
    ceiling: bool = True
    phases: bool = True
    baseline: str | None = None
    #: Start a fresh server for every segment (instead of one per target for the whole run).
    fresh: bool = False


class Events:
    """What the runner tells the live display (no-ops by default)."""

    def target_ready(self, live: Live) -> None:
        """A target was started and checked."""

    def segment_start(self, index: int, total: int, target: str, step: str, repeat: int) -> None:
        """A segment begins."""

    def progress(self, loop: Loop, now: int) -> None:
        """Twice a second during a segment."""

    def segment_end(self, segment: Segment) -> None:
        """A segment ended."""


def compile_ops(scenario: Scenario, modern: bool) -> list[Op]:
    """The scenario's operations, ready for the load loops."""
    ops: list[Op] = [CompiledCall(c, modern) for c in scenario.call]
    if scenario.listing is not None:
        ops.append(ListWalk(scenario.listing, modern))
    return ops


class _Target:
    """A target during a run: its spec, the live server, and its operations."""

    def __init__(self, spec: TargetSpec, plan: Plan, work: str) -> None:
        self.spec = spec
        self.plan = plan
        self.work = work
        self.scenario = plan.scenario.without_expectations() if spec.ceiling else plan.scenario
        self.labels = self.scenario.labels()
        self.weights = self.scenario.weights()
        self.ops = compile_ops(self.scenario, plan.modern)
        self.live: Live | None = None
        self.first: Live | None = None
        self.seq = 0
        self.died: str | None = None

    def start(self) -> Live:
        live = Live(self.spec, self.plan.modern, self.plan.headers, self.plan.insecure, self.plan.phases,
                    self.plan.timing.timeout_s, self.work)
        live.start()
        live.check(self.ops, self.labels)
        self.live = live
        if self.first is None:
            self.first = live
            time.sleep(0.3)
            self.rss_idle = procs.memory_snapshot(live.pid) if live.pid and live.problem is None else []
        return live


def run(plan: Plan, events: Events | None = None) -> Report:
    """Run ``plan`` and return its report (servers are always stopped, even on Ctrl-C)."""
    events = events or Events()
    env = environment()
    work = workdir()
    targets = [_Target(spec, plan, work) for spec in plan.targets]
    if plan.ceiling:
        tools = sorted({c.tool for c in plan.scenario.call})
        for transport in sorted({t.spec.transport for t in targets if not t.spec.ceiling}):
            targets.append(_Target(ceiling_spec(transport, tools), plan, work))
    segments: list[Segment] = []
    warnings: list[str] = []
    try:
        for t in targets:
            live = t.start()
            events.target_ready(live)
        total = len(plan.steps) * plan.repeat * len(targets)
        index = 0
        for step_index, shape in enumerate(plan.steps):
            for repeat in range(1, plan.repeat + 1):
                for t in targets:
                    index += 1
                    events.segment_start(index, total, t.spec.name, shape.label(), repeat)
                    seg = _segment(t, shape, step_index, repeat, plan, events)
                    segments.append(seg)
                    events.segment_end(seg)
    finally:
        for t in targets:
            if t.live is not None:
                t.live.stop()
        shutil.rmtree(work, ignore_errors=True)
    env["loadavg_after"] = list(os.getloadavg())
    baseline = plan.baseline or (plan.targets[0].name if plan.targets else None)
    summary = summarise(segments, targets, plan, baseline)
    reports = [_target_report(t, segments, summary, plan) for t in targets]
    warnings += _warnings(segments, summary, targets)
    config = {
        "shape_mode": plan.steps[0].mode if plan.steps else "closed",
        "steps": [s.label() for s in plan.steps],
        "era": "2026-07-28 (stateless)" if plan.modern else "legacy (initialize, 2025-06-18)",
        "repeat": plan.repeat,
        "warmup_s": plan.timing.warmup_s,
        "window": f"{plan.timing.count} ops" if plan.timing.count > 0 else f"{plan.timing.duration_s:g} s",
        "timeout_s": plan.timing.timeout_s,
        "scenario": msgspec.to_builtins(plan.scenario),
        "scenario_text": ", ".join(f"{w}x {label}" for label, w in zip(plan.scenario.labels(), plan.scenario.weights(), strict=False)),
        "ceiling": plan.ceiling,
        "fresh_server_per_segment": plan.fresh,
    }
    return Report(format=1, environment=env, config=config, targets=reports, segments=segments, summary=summary,
                  warnings=warnings, baseline=baseline)


def _segment(t: _Target, shape: Shape, step_index: int, repeat: int, plan: Plan, events: Events) -> Segment:
    seg = Segment(target=t.spec.name, step=shape.label(), step_index=step_index, repeat=repeat,
                  offered_per_s=shape.rate if shape.mode == "open" else None)
    if t.died is not None:
        seg.skipped = f"the server died earlier: {t.died}"[:300]
        return seg
    if plan.fresh and t.live is not None and (step_index, repeat) != (0, 1):
        t.live.stop()
        t.start()
    live = t.live
    if live is None or live.problem is not None:
        seg.skipped = (live.problem if live is not None else "not started") or ""
        return seg
    pid = live.pid
    marks: dict[str, Any] = {}

    def on_window(opening: bool) -> None:
        key = "before" if opening else "after"
        if pid is not None:
            marks[f"cpu_{key}"] = procs.cpu_snapshot(pid)
            if not opening:
                marks["rss"] = sum(p.rss_bytes for p in procs.memory_snapshot(pid))
        if live.metrics_url is not None:
            marks[f"metrics_{key}"] = phases.scrape(live.metrics_url)

    sampler = procs.TreeSampler(pid) if pid is not None else None
    loop = Loop(t.ops, t.labels, t.weights, shape, plan.timing, t.seq, on_window, events.progress, sampler)
    conn = live.conn
    assert conn is not None
    gc.disable()  # a collection in the middle of the window would be the client's pause, not the server's
    try:
        conn.run(loop)
    except TargetDown as exc:
        t.died = str(exc)
        live.problem = f"died: {exc}"
    finally:
        gc.enable()
        if sampler is not None:
            sampler.close()
    t.seq = loop.seq
    rec = loop.recorder
    s = loop.stats
    seg.window_s = s.window_s
    seg.started = s.started
    seg.ended_by = s.ended_by
    seg.calls_per_s = s.ok_in_window / s.window_s if s.window_s else 0.0
    seg.answered_per_s = s.answered_in_window / s.window_s if s.window_s else 0.0
    all_ok = rec.all_ok()
    seg.ok = int(all_ok.get_total_count())
    seg.latency = stats.latency(all_ok)
    seg.histogram = stats.encode(all_ok)
    seg.service = stats.latency(rec.service) if rec.service is not None else None
    seg.failed_latency = stats.latency(rec.failed_hist)
    seg.errors = {k: v for k, v in rec.errors.items() if v}
    seg.error_samples = rec.samples
    seg.ops = rec.op_results() if len(t.ops) > 1 else []
    seg.timeline = rec.timeline
    seg.client_cpu_pct = 100.0 * s.client_cpu_s / s.window_s if s.window_s else 0.0
    seg.late, seg.unexpected, seg.server_requests = s.late, s.unexpected, s.server_requests
    if "cpu_before" in marks and "cpu_after" in marks and s.span_s:
        cpu = procs.cpu_delta_s(marks["cpu_before"], marks["cpu_after"])
        seg.server_cpu_us_per_call = cpu / max(1, s.answered_since_open) * 1e6
        seg.server_cpu_pct = 100.0 * cpu / s.span_s
        seg.server_cpu_s = cpu
        seg.server_rss_bytes = marks.get("rss")
    seg.phases = phases.rows(marks.get("metrics_before"), marks.get("metrics_after"))
    return seg


def summarise(segments: list[Segment], targets: list[_Target], plan: Plan, baseline: str | None) -> list[Summary]:
    """Per (target, step): medians over repeats, merged histograms, ratios to the baseline."""
    rows: list[Summary] = []
    for t in targets:
        for step_index, shape in enumerate(plan.steps):
            done = [s for s in segments if s.target == t.spec.name and s.step_index == step_index and s.skipped is None]
            if not done:
                continue
            rates = [s.calls_per_s for s in done]
            merged = stats.merge([s.histogram for s in done])
            errors: dict[str, int] = {}
            for s in done:
                for k, v in s.errors.items():
                    errors[k] = errors.get(k, 0) + v
            measured = sum(s.ok for s in done) + sum(errors.values())
            service = None
            if shape.mode == "open":
                service_counts = [s.service for s in done if s.service is not None]
                service = service_counts[len(service_counts) // 2] if service_counts else None
            cpu = [s.server_cpu_us_per_call for s in done if s.server_cpu_us_per_call is not None]
            rss = [s.server_rss_bytes for s in done if s.server_rss_bytes is not None]
            rows.append(Summary(
                target=t.spec.name, step=shape.label(), step_index=step_index, repeats=len(done),
                calls_per_s=statistics.median(rates), calls_per_s_min=min(rates), calls_per_s_max=max(rates),
                latency=stats.latency(merged), service=service, errors=errors,
                error_rate=sum(errors.values()) / measured if measured else 0.0,
                client_cpu_pct=statistics.median(s.client_cpu_pct for s in done),
                server_cpu_us_per_call=statistics.median(cpu) if cpu else None,
                server_rss_mb=max(rss) / 2**20 if rss else None,
                offered_per_s=shape.rate if shape.mode == "open" else None,
                curve=stats.curve(merged), phases=phases.merge([s.phases for s in done])))
    base = {r.step_index: r for r in rows if r.target == baseline}
    ceilings = {(t.spec.transport, r.step_index): r.calls_per_s for t in targets if t.spec.ceiling
                for r in rows if r.target == t.spec.name}
    transports = {t.spec.name: t.spec.transport for t in targets}
    ceiling_names = {t.spec.name for t in targets if t.spec.ceiling}
    for r in rows:
        b = base.get(r.step_index)
        if b is not None and r.target not in ceiling_names:
            if r.offered_per_s is None:
                r.ratio = r.calls_per_s / b.calls_per_s if b.calls_per_s else None
            r.p99_ratio = r.latency.p99_ms / b.latency.p99_ms if b.latency.p99_ms else None
            r.p50_ratio = r.latency.p50_ms / b.latency.p50_ms if b.latency.p50_ms else None
        top = ceilings.get((transports[r.target], r.step_index))
        if top and r.target not in ceiling_names:
            r.ceiling_share = r.calls_per_s / top
    return rows


def knee(rows: list[Summary], mode: str) -> tuple[str | None, str | None]:
    """Where more load stops paying. Closed loop: the lowest concurrency reaching 90 % of the best
    calls/s (beyond it, more in flight mostly adds latency). Open loop: the highest rate still
    sustained (at least 95 % of it achieved, under 1 % errors)."""
    if len(rows) < 2:
        return None, None
    if mode == "closed":
        best = max(r.calls_per_s for r in rows)
        if best <= 0:
            return None, None
        for r in rows:
            if r.calls_per_s >= 0.9 * best:
                return r.step, f"{r.calls_per_s:,.0f} calls/s, 90% of the best {best:,.0f}; p99 {r.latency.p99_ms:.2f} ms"
        return None, None
    sustained = [r for r in rows if r.offered_per_s and r.calls_per_s >= 0.95 * r.offered_per_s
                 and r.error_rate < 0.01]
    if not sustained:
        return f"below {rows[0].step}", "no rate tried was sustained"
    top = sustained[-1]
    return top.step, f"highest rate sustained (p99 {top.latency.p99_ms:.2f} ms)"


def _status(t: _Target, segments: list[Segment]) -> str:
    live = t.live
    problem = live.problem if live is not None else "not started"
    mine = [s for s in segments if s.target == t.spec.name and s.skipped is None]
    if t.died is not None:
        return "died"
    if problem is not None:
        return problem.split(":", 1)[0]
    timeouts = sum(s.errors.get(wire.TIMEOUT, 0) for s in mine)
    if timeouts and any(s.ok == 0 and s.errors.get(wire.TIMEOUT) for s in mine):
        return "stalled"
    if timeouts:
        return "timeouts"
    if any(s.errors for s in mine):
        return "errors"
    return "ok"


def _target_report(t: _Target, segments: list[Segment], summary: list[Summary], plan: Plan) -> TargetReport:
    live = t.first or t.live
    mine = [r for r in summary if r.target == t.spec.name]
    point, note = knee(mine, plan.steps[0].mode if plan.steps else "closed")
    problem = t.live.problem if t.live is not None else "not started"
    return TargetReport(
        name=t.spec.name, spec=t.spec.spec, transport=t.spec.transport, local=t.spec.local, ceiling=t.spec.ceiling,
        status=_status(t, segments), problem=problem,
        server_info=live.server_info if live else None, protocol_version=live.protocol_version if live else None,
        ready_s=live.ready_s if live else 0.0, checks=live.checks if live else [],
        rss_idle=getattr(t, "rss_idle", []), knee=point, knee_note=note)


def _warnings(segments: list[Segment], summary: list[Summary], targets: list[_Target]) -> list[str]:
    out = []
    for s in segments:
        if s.skipped is None and s.client_cpu_pct >= CLIENT_LIMIT_CPU_PCT:
            out.append(f"{s.target} {s.step} repeat {s.repeat}: the client used {s.client_cpu_pct:.0f}% of a core: "
                       "the client, not the server, may have been the limit")
    for r in summary:
        if r.ceiling_share is not None and r.ceiling_share >= CEILING_WARN_SHARE:
            out.append(f"{r.target} {r.step}: {r.calls_per_s:,.0f} calls/s is {r.ceiling_share:.0%} of what the client "
                       "drives against the trivial server: the client may be the limit")
    if not any(t.spec.ceiling for t in targets):
        out.append("the client's ceiling was not measured (--no-ceiling)")
    return out
