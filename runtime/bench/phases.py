"""Where a toolcell call's time goes, per plugin, read from the daemon's own Prometheus metrics.

A toolcell target is started with ``http.metrics_listen`` set; the bench scrapes ``/metrics`` at
the start and the end of each measured window and divides the growth of the per-plugin phase
counters (``toolcell_call_phase_seconds_total{plugin, phase}``, ``toolcell_call_phase_calls_total``)
by the calls completed in between:

* ``queue``: from admission to the worker starting the call (waiting in the pool's queue, or
  batched behind another call on a worker);
* ``channel``: the daemon ⇄ worker round trip of the call's frames (IPC, wake-ups, encoding),
  i.e. the worker's turn as the daemon saw it minus the tool's own run time;
* ``worker``: the call inside the worker, as the worker timed it (arguments in, tool, result out).

What is left of the latency a client sees is the transport and the daemon's protocol work.
"""

from __future__ import annotations

import urllib.request

import msgspec
from prometheus_client.parser import text_string_to_metric_families

PHASES = ("queue", "channel", "worker")


class PhaseRow(msgspec.Struct):
    """Mean µs per call of each phase, for one plugin over one window."""

    plugin: str
    calls: int
    queue_us: float
    channel_us: float
    worker_us: float


Sample = dict[tuple[str, str, str], float]


def scrape(url: str, timeout_s: float = 2.0) -> Sample | None:
    """The phase counters now: {(metric, plugin, phase): value}; None if unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (our own loopback listener)
            text = response.read().decode()
    except (OSError, ValueError):
        return None
    out: Sample = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("toolcell_call_phase"):
            continue
        for sample in family.samples:
            if not sample.name.endswith("_total"):
                continue
            out[(sample.name, sample.labels.get("plugin", ""), sample.labels.get("phase", ""))] = sample.value
    return out


def rows(before: Sample | None, after: Sample | None) -> list[PhaseRow]:
    """Per-plugin means over the window between two scrapes."""
    if not before or not after:
        return []
    plugins = sorted({key[1] for key in after if key[0] == "toolcell_call_phase_calls_total"})
    out = []
    for plugin in plugins:
        key = ("toolcell_call_phase_calls_total", plugin, "")
        calls = int(after.get(key, 0) - before.get(key, 0))
        if calls <= 0:
            continue
        means = []
        for phase in PHASES:
            k = ("toolcell_call_phase_seconds_total", plugin, phase)
            means.append((after.get(k, 0.0) - before.get(k, 0.0)) / calls * 1e6)
        out.append(PhaseRow(plugin, calls, *means))
    return out


def merge(groups: list[list[PhaseRow]]) -> list[PhaseRow]:
    """Call-weighted means over several windows."""
    totals: dict[str, list[float]] = {}
    for group in groups:
        for row in group:
            t = totals.setdefault(row.plugin, [0.0, 0.0, 0.0, 0.0])
            t[0] += row.calls
            t[1] += row.queue_us * row.calls
            t[2] += row.channel_us * row.calls
            t[3] += row.worker_us * row.calls
    return [PhaseRow(p, int(t[0]), t[1] / t[0], t[2] / t[0], t[3] / t[0]) for p, t in sorted(totals.items()) if t[0]]
