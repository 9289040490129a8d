"""``--html FILE``: one self-contained HTML report (plotly.js inlined: it opens with no network).

It answers "which is faster, by how much" first, with every target on the same chart:

* throughput per load step, the targets side by side, and the client's ceiling (the trivial
  server) as a line on its own right-hand scale, so that a ceiling ten times higher does not
  flatten the targets' bars; an open loop draws the offered rate beside what was achieved;
* per load step, every target's latency percentile curve (merged HDR histograms), overlaid;
* over the measured time (every segment's window one after the other, the same for every
  target): errors, the server's CPU µs per call and its RSS, every target overlaid;
* per target, latency over time (p50 and p99 of each 0.25 s interval);

then the tables of the text report. Only ``--html`` imports this module (``runtime.bench.cli`` checks
for plotly first). Plotly renders the plots as SVG in the browser. Log axes
carry explicit 1-2-5 ticks written out in full (plotly's own label every digit between decades
as "2 3 4 ... 9").
"""

from __future__ import annotations

import html
import math
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio

from runtime.bench.report import Report, Segment, environment_lines, table, verdict

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; }
pre { background: #f6f6f6; padding: 10px; overflow-x: auto; font-size: 12px; }
.bad { color: #b00020; font-weight: 600; } .ok { color: #08660b; font-weight: 600; }
table.targets td, table.targets th { padding: 3px 10px; text-align: left; border-bottom: 1px solid #ddd; }
"""
_HEIGHT = 420
_CEILING_LINE = {"dash": "dot"}


def _x_percentile(p: float) -> float:
    """HDR-style x axis: 1 / (1 - p), so 90, 99, 99.9 ... are evenly spaced."""
    return 1.0 / max(1e-6, 1.0 - p / 100.0)


def _tick_text(value: float) -> str:
    return f"{value / 1000:g}k" if value >= 1000 else f"{value:g}"


def log_axis(values: list[float], title: str) -> dict[str, Any]:
    """A log axis over ``values`` with at most 8 ticks, 1-2-5 (or one per decade, or per two
    decades, as the span needs), each labelled in full; the range is widened to the ticks
    around the data, so that even a narrow span has a labelled tick at both ends."""
    positive = [v for v in values if v is not None and v > 0]
    if not positive:
        return {"type": "log", "title": title}
    lo, hi = min(positive), max(positive)
    decades = math.log10(hi) - math.log10(lo)
    mantissas, step = ((1.0, 2.0, 5.0), 1) if decades <= 2 else ((1.0,), 1) if decades <= 6 else ((1.0,), 2)
    first, last = math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1
    grid = sorted(m * 10.0 ** e for e in range(first, last + 1, step) for m in mantissas)
    below = max((v for v in grid if v <= lo * (1 + 1e-9)), default=grid[0])
    above = min((v for v in grid if v >= hi * (1 - 1e-9)), default=grid[-1])
    ticks = [v for v in grid if below <= v <= above]
    if above == below:
        above = next((v for v in grid if v > below), below * 10)
        ticks.append(above)
    return {"type": "log", "title": title, "tickvals": ticks, "ticktext": [_tick_text(v) for v in ticks],
            "range": [math.log10(below), math.log10(above)]}


def _timelines(report: Report, name: str) -> list[tuple[Segment, float]]:
    """``name``'s measured segments, each with its offset on the shared time axis: windows one
    after the other, in the order they ran."""
    out, offset = [], 0.0
    for s in report.segments:
        if s.target == name and s.skipped is None and s.timeline:
            out.append((s, offset))
            offset += s.timeline[-1].t_s
    return out


def _throughput(report: Report) -> Any:
    steps = report.config.get("steps", [])
    ceilings = {t.name for t in report.targets if t.ceiling}
    fig = go.Figure()
    for t in report.targets:
        rows = {r.step: r for r in report.summary if r.target == t.name}
        ys = [rows[s].calls_per_s if s in rows else None for s in steps]
        if t.name in ceilings:
            fig.add_trace(go.Scatter(name=t.name, x=steps, y=ys, mode="lines+markers", yaxis="y2", line=_CEILING_LINE,
                                     hovertemplate="%{x}: %{y:,.0f} calls/s (client ceiling)"))
        else:
            fig.add_trace(go.Bar(name=t.name, x=steps, y=ys, hovertemplate="%{x}: %{y:,.0f} calls/s"))
    offered = [r.offered_per_s for r in report.summary if r.offered_per_s is not None]
    if offered:
        rates = {r.step: r.offered_per_s for r in report.summary}
        fig.add_trace(go.Scatter(name="offered", x=steps, y=[rates.get(s) for s in steps], mode="lines+markers",
                                 line={"color": "#444"}, hovertemplate="%{x}: %{y:,.0f} calls/s offered"))
    layout: dict[str, Any] = {"barmode": "group", "title": "Throughput per load step (median over repeats)",
                              "yaxis": {"title": "calls/s", "rangemode": "tozero"}, "xaxis_title": "load step",
                              "height": _HEIGHT, "legend": {"orientation": "h", "y": -0.2}}
    if ceilings:
        layout["yaxis2"] = {"title": "client ceiling, calls/s (own scale)", "overlaying": "y", "side": "right",
                            "rangemode": "tozero", "showgrid": False, "tickmode": "auto"}
    fig.update_layout(**layout)
    return fig


def _latency_per_step(report: Report, step: str) -> Any:
    ceilings = {t.name for t in report.targets if t.ceiling}
    rows = [r for r in report.summary if r.step == step and r.curve]
    if not rows:
        return None
    fig = go.Figure()
    for r in rows:
        fig.add_trace(go.Scatter(x=[_x_percentile(p) for p, _ in r.curve], y=[ms for _, ms in r.curve],
                                 mode="lines+markers", name=r.target, text=[f"p{p:g}" for p, _ in r.curve],
                                 line=_CEILING_LINE if r.target in ceilings else None,
                                 hovertemplate=f"{r.target} %{{text}}: %{{y:.3f}} ms"))
    ticks = [0, 50, 90, 99, 99.9, 99.99]
    fig.update_layout(title=f"{step}: latency distribution, every target (HDR percentiles)",
                      yaxis=log_axis([ms for r in rows for _, ms in r.curve], "ms"),
                      xaxis={"type": "log", "tickvals": [_x_percentile(p) for p in ticks],
                             "ticktext": [f"p{p:g}" for p in ticks], "title": "percentile"}, height=_HEIGHT)
    return fig


def _over_time(report: Report, names: list[str], key: str, title: str, unit: str, log: bool) -> Any:
    """One chart of a per-interval figure, every target overlaid; None when nothing has it."""
    fig = go.Figure()
    every: list[float] = []
    for name in names:
        xs: list[float] = []
        ys: list[float | None] = []
        for s, offset in _timelines(report, name):
            for p in s.timeline:
                xs.append(offset + p.t_s)
                value = p.errors if key == "errors" else getattr(p, key)
                ys.append(value)
            xs.append(offset + s.timeline[-1].t_s)
            ys.append(None)  # a gap between windows: no line across the pause between them
        if any(y is not None for y in ys):
            every += [y for y in ys if y is not None]
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=name, connectgaps=False,
                                     hovertemplate=f"{name} %{{x:.2f}} s: %{{y:,.3g}} {unit}"))
    if not fig.data:
        return None
    yaxis = log_axis(every, unit) if log else {"title": unit, "rangemode": "tozero"}
    fig.update_layout(title=title, xaxis_title="seconds of measurement (every window, one after the other)",
                      yaxis=yaxis, height=_HEIGHT)
    return fig


def _timeline(report: Report, name: str) -> Any:
    segs = _timelines(report, name)
    if not segs:
        return None
    fig = go.Figure()
    every: list[float] = []
    for s, offset in segs:
        xs = [offset + p.t_s for p in s.timeline]
        label = f"{s.step} #{s.repeat}"
        # an interval with no completed call has no latency: a gap, not a zero
        p50 = [p.p50_ms if p.ok else None for p in s.timeline]
        p99 = [p.p99_ms if p.ok else None for p in s.timeline]
        every += [v for v in p50 + p99 if v]
        fig.add_trace(go.Scatter(x=xs, y=p50, mode="lines", name=f"p50 {label}", legendgroup=label))
        fig.add_trace(go.Scatter(x=xs, y=p99, mode="lines", name=f"p99 {label}", line={"dash": "dot"},
                                 legendgroup=label))
        errors = [p for p in s.timeline if p.errors]
        if errors:
            fig.add_trace(go.Scatter(x=[offset + p.t_s for p in errors], y=[p.p99_ms or None for p in errors],
                                     mode="markers", marker={"color": "red", "symbol": "x"},
                                     name=f"errors {label}", text=[f"{p.errors} errors" for p in errors]))
    fig.update_layout(title=f"{name}: latency over time (each measured window, one after the other)",
                      xaxis_title="seconds of measurement", yaxis=log_axis(every, "ms"), height=_HEIGHT)
    return fig


def figures(report: Report) -> list[tuple[str, Any]]:
    """The plots, as (key, plotly figure); the key is the page's ``data-plot``."""
    out: list[tuple[str, Any]] = [("throughput", _throughput(report))]
    for step in report.config.get("steps", []):
        fig = _latency_per_step(report, step)
        if fig is not None:
            out.append((f"latency {step}", fig))
    measured = [t.name for t in report.targets if not t.ceiling]
    for key, figure_key, title, unit, log in (
            ("errors", "errors over time", "Errors per 0.25 s interval", "errors", False),
            ("server_cpu_us_per_call", "server CPU over time", "Server CPU per call, per 0.25 s interval",
             "µs/call", True),
            ("server_rss_mb", "server RSS over time", "Server RSS (whole process tree)", "MB", False)):
        fig = _over_time(report, measured, key, title, unit, log)
        if fig is not None:
            out.append((figure_key, fig))
    for t in report.targets:
        fig = _timeline(report, t.name)
        if fig is not None:
            out.append((f"timeline {t.name}", fig))
    return out


def render(report: Report) -> str:
    """The whole page."""
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>toolcell bench report</title>",
             f"<style>{_STYLE}</style></head><body>", "<h1>toolcell bench</h1>"]
    cfg = report.config
    parts.append(f"<p>{html.escape(str(cfg.get('shape_mode')))} loop, {html.escape(str(cfg.get('era')))}; "
                 f"{cfg.get('repeat')} × {html.escape(str(cfg.get('window')))} after {cfg.get('warmup_s')} s warm-up; "
                 f"scenario: {html.escape(str(cfg.get('scenario_text')))}</p>")
    answers = verdict(report)
    if answers:
        parts.append("<h2>Verdict</h2><ul class='verdict'>" + "".join(f"<li>{html.escape(a)}</li>" for a in answers)
                     + "</ul>")
    parts.append("<table class='targets'><tr><th>target</th><th>what</th><th>server</th><th>status</th><th>knee</th></tr>")
    for t in report.targets:
        info = t.server_info or {}
        who = f"{info.get('name', '?')} {info.get('version', '')}" if info else "-"
        css = "ok" if t.status == "ok" else "bad"
        status = t.status + (f": {t.problem}" if t.problem else "")
        knee = f"{t.knee} ({t.knee_note})" if t.knee else "-"
        parts.append(f"<tr><td>{html.escape(t.name)}</td><td>{html.escape(t.spec)} [{t.transport}]</td>"
                     f"<td>{html.escape(who)}</td><td class='{css}'>{html.escape(status[:300])}</td>"
                     f"<td>{html.escape(knee)}</td></tr>")
    parts.append("</table>")
    parts.append(f"<h2>Summary</h2><pre>{html.escape(table(report.summary, report.baseline))}</pre>")
    if report.warnings:
        parts.append("<h2>Warnings</h2><ul>" + "".join(f"<li>{html.escape(w)}</li>" for w in report.warnings) + "</ul>")
    first = True
    for title, fig in figures(report):
        parts.append(f"<div class='plot' data-plot='{html.escape(title)}'>")
        parts.append(pio.to_html(fig, include_plotlyjs=True if first else False, full_html=False,
                                 config={"displaylogo": False}))
        parts.append("</div>")
        first = False
    phases = [(r.target, r.step, p) for r in report.summary for p in r.phases]
    if phases:
        lines = [f"{t} {s} plugin {p.plugin}: queue {p.queue_us:,.0f} µs, channel {p.channel_us:,.0f} µs, "
                 f"worker {p.worker_us:,.0f} µs ({p.calls:,} calls)" for t, s, p in phases]
        parts.append("<h2>Where a toolcell call's time goes (daemon metrics)</h2><pre>" + html.escape("\n".join(lines))
                     + "</pre>")
    parts.append("<h2>Environment</h2><pre>" + html.escape("\n".join(environment_lines(report.environment))) + "</pre>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write(report: Report, path: str) -> None:
    """Write the page to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render(report))
