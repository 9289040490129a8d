"""Environment capture, per-point summaries (medians over repeats) and text / markdown tables."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata

import msgspec

from targets import REPO_ROOT, fastmcp_python

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))  # the engine (runtime.bench) from this checkout

from runtime.bench.report import cpu_model  # noqa: E402

from runtime.bench.procs import ProcMemory

BASELINE = "sdk"


class LoadResult(msgspec.Struct):
    """One measured run (from a ``toolcell bench`` segment). Latencies in milliseconds, CPU in
    seconds unless named otherwise."""

    concurrency: int
    modern: bool
    duration_s: float
    calls: int
    calls_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    errors: int
    lost: int
    unexpected: int
    error_sample: str | None
    server_cpu_s: float
    server_cpu_us_per_call: float
    server_cpu_pct: float
    client_cpu_pct: float
    ready_s: float
    request_bytes: int
    rss_idle: list[ProcMemory]
    rss_loaded: list[ProcMemory]


class Run(msgspec.Struct):
    """One (server, concurrency, repeat) run: its result, or why it failed."""

    server: str
    concurrency: int
    repeat: int
    result: LoadResult | None = None
    error: str | None = None


class Summary(msgspec.Struct):
    """The median of the successful repeats of one (server, concurrency) point."""

    server: str
    concurrency: int
    runs: int
    failed_runs: int
    calls_per_s: float
    calls_per_s_min: float
    calls_per_s_max: float
    p50_ms: float
    p99_ms: float
    errors: int
    server_cpu_us_per_call: float
    client_cpu_pct: float
    ratio_vs_baseline: float | None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _fastmcp_version() -> str | None:
    py = fastmcp_python()
    if py is None:
        return None
    probe = "import importlib.metadata as m; print(m.version('fastmcp'), m.version('mcp'))"
    try:
        out = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    fastmcp, mcp = out.split()
    return f"{fastmcp} (mcp {mcp})"


def _git_commit() -> str | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
        )
    except OSError:
        return None
    return head.stdout.strip() or None


def environment() -> dict[str, object]:
    """Versions, CPU count and load average: everything to record beside the figures."""
    return {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "versions": {dist: _version(dist) for dist in ("trio", "msgspec", "mcp", "psutil", "toolcell")}
        | {"fastmcp": _fastmcp_version()},
        "git_commit": _git_commit(),
        "loadavg_before": os.getloadavg(),
    }


def summarise(runs: Sequence[Run], servers: Sequence[str], concurrencies: Sequence[int]) -> list[Summary]:
    """Collapse repeats into medians, in the order servers x concurrencies, with the ratio to the SDK."""
    baseline: dict[int, float] = {}
    rows: list[Summary] = []
    for server in servers:
        for c in concurrencies:
            point = [r for r in runs if r.server == server and r.concurrency == c]
            ok = [r.result for r in point if r.result is not None]
            if not ok:
                continue
            rate = statistics.median(r.calls_per_s for r in ok)
            if server == BASELINE:
                baseline[c] = rate
            rows.append(
                Summary(
                    server=server,
                    concurrency=c,
                    runs=len(ok),
                    failed_runs=len(point) - len(ok),
                    calls_per_s=rate,
                    calls_per_s_min=min(r.calls_per_s for r in ok),
                    calls_per_s_max=max(r.calls_per_s for r in ok),
                    p50_ms=statistics.median(r.p50_ms for r in ok),
                    p99_ms=statistics.median(r.p99_ms for r in ok),
                    errors=sum(r.errors for r in ok),
                    server_cpu_us_per_call=statistics.median(r.server_cpu_us_per_call for r in ok),
                    client_cpu_pct=statistics.median(r.client_cpu_pct for r in ok),
                    ratio_vs_baseline=None,
                )
            )
    for row in rows:
        if row.concurrency in baseline and baseline[row.concurrency] > 0:
            row.ratio_vs_baseline = row.calls_per_s / baseline[row.concurrency]
    return rows


HEADERS = ["server", "c", "calls/s", "spread", "p50 ms", "p99 ms", "errors", "CPU µs/call", "client CPU", "× sdk"]


def _cells(row: Summary) -> list[str]:
    spread = (row.calls_per_s_max - row.calls_per_s_min) / row.calls_per_s if row.calls_per_s else 0.0
    ratio = f"{row.ratio_vs_baseline:.2f}" if row.ratio_vs_baseline is not None else "-"
    failed = f" ({row.failed_runs} failed)" if row.failed_runs else ""
    return [
        row.server,
        str(row.concurrency),
        f"{row.calls_per_s:,.0f}",
        f"±{50 * spread:.0f}%",
        f"{row.p50_ms:.3f}",
        f"{row.p99_ms:.2f}",
        f"{row.errors}{failed}",
        f"{row.server_cpu_us_per_call:,.0f}",
        f"{row.client_cpu_pct:.0f}%",
        ratio,
    ]


def text_table(rows: Sequence[Summary]) -> str:
    """An aligned plain-text table for the terminal."""
    table = [HEADERS, *(_cells(r) for r in rows)]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADERS))]
    lines = [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in table
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[Summary]) -> str:
    """A GitHub markdown table for benchmarks/RESULTS.md."""
    out = [
        "| " + " | ".join(HEADERS) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(HEADERS))) + "|",
    ]
    out += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(out)


def memory_lines(runs: Sequence[Run], servers: Sequence[str]) -> list[str]:
    """One line per server: idle RSS of the daemon and of each child, from its last successful run."""
    lines = []
    for server in servers:
        last = next((r.result for r in reversed(runs) if r.server == server and r.result is not None), None)
        if last is None:
            continue
        daemon = [p for p in last.rss_idle if p.role == "daemon"]
        children = [p for p in last.rss_idle if p.role == "child"]
        loaded = sum(p.rss_bytes for p in last.rss_loaded)
        text = f"{server}: daemon {_mb(daemon)} MB idle"
        if children:
            text += f"; {len(children)} children idle: " + ", ".join(f"{_mb([p])} MB ({p.name})" for p in children[:8])
            text += " ..." if len(children) > 8 else ""
        text += f"; whole tree under load (c={last.concurrency}) {loaded / 2**20:.1f} MB"
        lines.append(text)
    return lines


def _mb(procs: Sequence[ProcMemory]) -> str:
    return f"{sum(p.rss_bytes for p in procs) / 2**20:.1f}"


def environment_lines(env: dict[str, object]) -> list[str]:
    """The environment as short 'key: value' lines (for the terminal and the markdown report)."""
    versions = env["versions"]
    assert isinstance(versions, dict)
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    return [
        f"when: {env['when']}  git: {env.get('git_commit')}",
        f"python {env['python']}, {shown}",
        f"cpu: {env['nproc']} usable of {env['cpu_count']} ({env['cpu_model']}); {env['platform']}",
        f"load average before: {_load(env['loadavg_before'])}; after: {_load(env.get('loadavg_after'))}",
    ]


def _load(value: object) -> str:
    return " ".join(f"{x:.2f}" for x in value) if isinstance(value, (tuple, list)) else "?"
