"""The bench report, checked on reports generated here: a closed loop over two load steps with
repeats (and the client's ceilings), rendered in a real headless Chromium, and an open loop with
one repeat. What is checked is structure (which charts, which traces, which axis, which cells),
never a timing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hdrh")
pytest.importorskip("plotly")

from runtime.bench import html_report, report, stats  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
QUICK = ["--tool", "echo", "--duration", "0.5", "--warmup", "0.1", "--quiet"]


class Generated:
    """One generated report: its JSON (decoded both ways), the table printed, the HTML page."""

    def __init__(self, data: dict[str, Any], path: Path, stdout: str, html: Path | None) -> None:
        self.data = data
        self.report = report.load(str(path))
        self.stdout = stdout
        self.html = html


def _generate(tmp: Path, name: str, *args: str, html: bool = False) -> Generated:
    out = tmp / f"{name}.json"
    page = tmp / f"{name}.html" if html else None
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", *args, "--json", str(out),
                           *(["--html", str(page)] if page else [])],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Generated(json.loads(out.read_text()), out, proc.stdout, page)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench-report")


@pytest.fixture(scope="module")
def closed(tmp: Path) -> Generated:
    """Two targets (stdio, HTTP), two steps, two repeats, with the client's ceilings."""
    return _generate(tmp, "closed", "trivial", "trivial+http", "-c", "1,2", "--repeat", "2", *QUICK, html=True)


@pytest.fixture(scope="module")
def open_loop(tmp: Path) -> Generated:
    """The same two targets offered a fixed rate, one repeat."""
    return _generate(tmp, "open", "trivial", "trivial+http", "--rate", "200", "--no-ceiling", *QUICK)


class Dom:
    """The page after Chromium ran plotly: every plot's rendered SVG, by its ``data-plot`` key."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.plots: dict[str, str] = {}
        for part in re.split(r"(?=<div class=\"plot\" data-plot=)", text)[1:]:
            key = re.match(r"<div class=\"plot\" data-plot=\"([^\"]+)\"", part)
            assert key is not None
            self.plots[key.group(1).replace("&amp;", "&")] = part

    def traces(self, key: str, kind: str = "scatter") -> int:
        return self.plots[key].count(f'class="trace {kind}')

    def legend(self, key: str) -> list[str]:
        return re.findall(r'<text class="legendtext"[^>]*>([^<]*)</text>', self.plots[key])

    def tick_labels(self, key: str, axis: str) -> list[str]:
        return re.findall(rf'<g class="{axis}tick"><text[^>]*>([^<]*)</text>', self.plots[key])


@pytest.fixture(scope="module")
def dom(closed: Generated, tmp: Path) -> Iterator[Dom]:
    if not os.path.exists(CHROMIUM):
        pytest.skip("chromium is installed by tests/system-packages.sh")
    assert closed.html is not None
    page = closed.html.read_text()
    # nothing to fetch: no script or stylesheet from elsewhere
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=\"http", page)
    proc = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                           "--disable-background-networking", "--disable-component-update", "--disable-sync",
                           f"--user-data-dir={tmp / 'chromium-profile'}", "--virtual-time-budget=5000", "--dump-dom",
                           closed.html.as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    yield Dom(proc.stdout)


MEASURED = ["trivial", "trivial+http"]
EVERY = [*MEASURED, "ceiling (http)", "ceiling (stdio)"]


def test_the_html_report_renders_every_plot_in_headless_chromium(dom: Dom) -> None:
    assert list(dom.plots) == ["throughput", "latency c=1", "latency c=2", "errors over time", "server CPU over time",
                               "server RSS over time", *(f"timeline {name}" for name in EVERY)]
    for key, part in dom.plots.items():
        assert 'class="plot-container plotly"' in part and '<svg class="main-svg"' in part, key


def test_every_targets_latency_curve_is_overlaid_in_one_chart_per_load_step(dom: Dom, closed: Generated) -> None:
    for step in ("c=1", "c=2"):
        key = f"latency {step}"
        assert dom.traces(key) == len(EVERY)
        assert sorted(dom.legend(key)) == sorted(EVERY)
        fig = dict(html_report.figures(closed.report))[key]
        for trace in fig.data:
            row = next(r for r in closed.report.summary if r.target == trace.name and r.step == step)
            assert list(trace.y) == [ms for _, ms in row.curve]


def test_throughput_overlays_the_targets_and_draws_the_clients_ceiling_on_its_own_scale(dom: Dom,
                                                                                         closed: Generated) -> None:
    assert dom.traces("throughput", "bars") == len(MEASURED)
    assert dom.traces("throughput", "scatter") == 2  # the two ceilings
    assert dom.tick_labels("throughput", "y2"), "the ceiling's own axis is drawn"
    fig = dict(html_report.figures(closed.report))["throughput"]
    axes = {t.name: t.yaxis or "y" for t in fig.data}
    assert axes == {"trivial": "y", "trivial+http": "y", "ceiling (http)": "y2", "ceiling (stdio)": "y2"}
    assert fig.layout.yaxis2.overlaying == "y" and fig.layout.yaxis2.side == "right"


def test_server_cpu_per_call_rss_and_errors_are_charted_over_time_for_every_target(dom: Dom,
                                                                                    closed: Generated) -> None:
    for key in ("errors over time", "server CPU over time", "server RSS over time"):
        assert dom.traces(key) == len(MEASURED), key
        assert sorted(dom.legend(key)) == sorted(MEASURED), key
    # the figures come from every interval of every measured window
    for seg in closed.report.segments:
        assert seg.timeline and all(p.server_rss_mb and p.server_rss_mb > 1 for p in seg.timeline)
        assert any(p.server_cpu_us_per_call for p in seg.timeline)
    fig = dict(html_report.figures(closed.report))["server RSS over time"]
    trivial = next(t for t in fig.data if t.name == "trivial")
    points = [p for s in closed.report.segments if s.target == "trivial" for p in s.timeline]
    assert [y for y in trivial.y if y is not None] == [p.server_rss_mb for p in points]


def test_no_window_ends_in_a_sliver_of_an_interval(closed: Generated) -> None:
    """The drain's last few completions used to make an interval of a millisecond or two of their
    own: a vertical spike at the end of every window. A short tail is folded into the interval
    before it, and no call is lost on the way."""
    for seg in closed.report.segments:
        times = [0.0] + [p.t_s for p in seg.timeline]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert min(gaps) >= stats.TIMELINE_INTERVAL_S / 2, (seg.target, seg.step, times)
        assert sum(p.ok for p in seg.timeline) == seg.ok


def test_log_axes_carry_few_ticks_each_written_in_full(dom: Dom) -> None:
    """Plotly's own log ticks label every digit between decades ("5 6 7 8 9 0.1 2 3"): unreadable."""
    def number(label: str) -> float:
        label = label.replace("\u2212", "-")
        return float(label[:-1]) * 1000 if label.endswith("k") else float(label)

    for key in dom.plots:
        labels = dom.tick_labels(key, "y")
        assert 2 <= len(labels) <= 9, (key, labels)
        values = [number(x) for x in labels]
        assert values == sorted(values) and len(set(values)) == len(values), (key, labels)


def test_a_spread_over_one_repeat_is_a_dash_not_plus_minus_zero(open_loop: Generated, closed: Generated) -> None:
    assert "±0%" not in open_loop.stdout
    for row in open_loop.report.summary:
        assert report.spread_pct(row) is None
        cells = dict(zip(report.headers([row]), report.table([row], None).splitlines()[2].split(), strict=False))
        assert cells["spread"] == report.NONE
    assert all(report.spread_pct(r) is not None for r in closed.report.summary)


def test_an_open_loop_compares_latency_not_calls_per_second_at_the_offered_rate(open_loop: Generated) -> None:
    base = next(r for r in open_loop.report.summary if r.target == "trivial")
    other = next(r for r in open_loop.report.summary if r.target == "trivial+http")
    assert base.ratio is None and other.ratio is None
    assert other.p99_ratio == pytest.approx(other.latency.p99_ms / base.latency.p99_ms)
    header = next(line for line in open_loop.stdout.splitlines() if line.startswith("target"))
    assert header.endswith(report.OPEN_LOOP_RATIO) and " ratio" not in header.replace(report.OPEN_LOOP_RATIO, "")
    line = next(x for x in open_loop.stdout.splitlines() if x.startswith("trivial+http "))
    assert line.endswith(f"{other.p99_ratio:.2f}x")
