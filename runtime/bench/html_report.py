"""``--html FILE``: one self-contained HTML report (plotly.js inlined: it opens with no network).

For every target: latency over time (p50 and p99 of each 0.25 s interval, every segment on one
time axis), the latency distribution (percentile curves from the merged HDR histograms, one per
load step), throughput per load step side by side (with the ceiling), and the tables of the text
report. Plotly renders the plots as SVG in the browser.
"""

from __future__ import annotations

import html
from typing import Any

from runtime.bench.report import Report, environment_lines, table

_STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1200px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; }
pre { background: #f6f6f6; padding: 10px; overflow-x: auto; font-size: 12px; }
.bad { color: #b00020; font-weight: 600; } .ok { color: #08660b; font-weight: 600; }
table.targets td, table.targets th { padding: 3px 10px; text-align: left; border-bottom: 1px solid #ddd; }
"""


def _x_percentile(p: float) -> float:
    """HDR-style x axis: 1 / (1 - p), so 90, 99, 99.9 ... are evenly spaced."""
    return 1.0 / max(1e-6, 1.0 - p / 100.0)


def figures(report: Report) -> list[tuple[str, Any]]:
    """The plots, as (title, plotly figure)."""
    import plotly.graph_objects as go

    out: list[tuple[str, Any]] = []
    steps = report.config.get("steps", [])
    names = [t.name for t in report.targets]

    bars = go.Figure()
    for name in names:
        rows = {r.step: r for r in report.summary if r.target == name}
        bars.add_trace(go.Bar(name=name, x=steps, y=[rows[s].calls_per_s if s in rows else 0 for s in steps],
                              hovertemplate="%{x}: %{y:,.0f} calls/s"))
    bars.update_layout(barmode="group", title="Throughput per load step (median over repeats)",
                       yaxis_title="calls/s", xaxis_title="load step", height=420)
    out.append(("throughput", bars))

    for name in names:
        segs = [s for s in report.segments if s.target == name and s.skipped is None and s.timeline]
        if not segs:
            continue
        fig = go.Figure()
        offset = 0.0
        for s in segs:
            xs = [offset + p.t_s for p in s.timeline]
            label = f"{s.step} #{s.repeat}"
            # an interval with no completed call has no latency: a gap, not a zero
            fig.add_trace(go.Scatter(x=xs, y=[p.p50_ms if p.ok else None for p in s.timeline], mode="lines",
                                     name=f"p50 {label}", legendgroup=label))
            fig.add_trace(go.Scatter(x=xs, y=[p.p99_ms if p.ok else None for p in s.timeline], mode="lines",
                                     name=f"p99 {label}", line={"dash": "dot"}, legendgroup=label))
            errors = [p for p in s.timeline if p.errors]
            if errors:
                fig.add_trace(go.Scatter(x=[offset + p.t_s for p in errors], y=[p.p99_ms for p in errors],
                                         mode="markers", marker={"color": "red", "symbol": "x"},
                                         name=f"errors {label}", text=[f"{p.errors} errors" for p in errors]))
            offset = xs[-1] if xs else offset
        fig.update_layout(title=f"{name}: latency over time (each measured window, one after the other)",
                          xaxis_title="seconds of measurement", yaxis_title="ms", yaxis_type="log", height=420)
        out.append((f"timeline {name}", fig))

        curves = [r for r in report.summary if r.target == name and r.curve]
        if curves:
            dist = go.Figure()
            for r in curves:
                dist.add_trace(go.Scatter(x=[_x_percentile(p) for p, _ in r.curve], y=[ms for _, ms in r.curve],
                                          mode="lines+markers", name=r.step,
                                          text=[f"p{p:g}" for p, _ in r.curve],
                                          hovertemplate="%{text}: %{y:.3f} ms"))
            ticks = [0, 50, 90, 99, 99.9, 99.99]
            dist.update_layout(title=f"{name}: latency distribution (HDR percentiles)", yaxis_title="ms",
                               yaxis_type="log", xaxis={"type": "log", "tickvals": [_x_percentile(p) for p in ticks],
                                                        "ticktext": [f"p{p:g}" for p in ticks],
                                                        "title": "percentile"}, height=420)
            out.append((f"distribution {name}", dist))
    return out


def render(report: Report) -> str:
    """The whole page."""
    import plotly.io as pio

    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>toolcell bench report</title>",
             f"<style>{_STYLE}</style></head><body>", "<h1>toolcell bench</h1>"]
    cfg = report.config
    parts.append(f"<p>{html.escape(str(cfg.get('shape_mode')))} loop, {html.escape(str(cfg.get('era')))}; "
                 f"{cfg.get('repeat')} × {html.escape(str(cfg.get('window')))} after {cfg.get('warmup_s')} s warm-up; "
                 f"scenario: {html.escape(str(cfg.get('scenario_text')))}</p>")
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
