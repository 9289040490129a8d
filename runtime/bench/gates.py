"""``--fail-if 'p99>50ms'``: thresholds a CI job sets on a run (or on the new side of
``bench compare``); any one crossed makes the command exit 1 and says where.

A gate is ``[TARGET:]METRIC OP VALUE[UNIT]``: METRIC one of ``METRICS``, OP one of ``> >= < <=``,
latencies in ``us``/``µs``/``ms``/``s`` (ms when no unit), ``error_rate`` as a percent (``1%``)
or a fraction, RSS in ``MB``/``GB``, CPU in µs per call. Without ``TARGET:`` it applies to every
measured target (never the client's ceiling), at every load step.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Sequence

import msgspec

from runtime.bench.report import Report, Summary


class GateError(ValueError):
    """A ``--fail-if`` that does not parse; the message says what is accepted."""


_LATENCY = {"p50": lambda r: r.latency.p50_ms, "p90": lambda r: r.latency.p90_ms, "p99": lambda r: r.latency.p99_ms,
            "p99.9": lambda r: r.latency.p999_ms, "max": lambda r: r.latency.max_ms, "mean": lambda r: r.latency.mean_ms}
#: metric: (what it reads from a summary row, its unit kind)
METRICS: dict[str, tuple[Callable[[Summary], float | None], str]] = {
    **{name: (pick, "time") for name, pick in _LATENCY.items()},
    "errors": (lambda r: float(sum(r.errors.values())), "count"),
    "error_rate": (lambda r: r.error_rate, "share"),
    "calls/s": (lambda r: r.calls_per_s, "count"),
    "cpu": (lambda r: r.server_cpu_us_per_call, "cpu"),
    "rss": (lambda r: r.server_rss_mb, "memory"),
}
_UNITS = {"time": {"": 1.0, "ms": 1.0, "us": 1e-3, "µs": 1e-3, "s": 1000.0},
          "count": {"": 1.0},
          "share": {"": 1.0, "%": 0.01},
          "cpu": {"": 1.0, "us": 1.0, "µs": 1.0, "ms": 1000.0},
          "memory": {"": 1.0, "mb": 1.0, "gb": 1024.0}}
_SHOWN = {"time": "ms", "count": "", "share": "", "cpu": "µs/call", "memory": "MB"}
_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le, ">": operator.gt,
                                                   "<": operator.lt}
_GATE = re.compile(r"^\s*(?:(?P<target>[^<>=]+):)?(?P<metric>[a-z0-9_./]+)\s*(?P<op>>=|<=|>|<)\s*"
                   r"(?P<value>[0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*(?P<unit>[a-zµ%]*)\s*$", re.IGNORECASE)


class Gate(msgspec.Struct, frozen=True):
    """One threshold: ``value`` in the metric's own unit (ms, a fraction, µs/call, MB)."""

    text: str
    metric: str
    op: str
    value: float
    target: str | None = None


def parse(text: str) -> Gate:
    """``[TARGET:]METRIC OP VALUE[UNIT]`` as a Gate; GateError says what is wrong."""
    m = _GATE.match(text)
    if m is None:
        raise GateError(f"--fail-if {text!r}: expected [TARGET:]METRIC OP VALUE[UNIT], e.g. 'p99>50ms', 'errors>0'")
    metric = m["metric"].lower()
    if metric not in METRICS:
        raise GateError(f"--fail-if {text!r}: unknown metric {metric!r} (one of {', '.join(METRICS)})")
    kind = METRICS[metric][1]
    unit = m["unit"].lower()
    if unit not in _UNITS[kind]:
        units = ", ".join(u for u in _UNITS[kind] if u) or "none"
        raise GateError(f"--fail-if {text!r}: {metric} takes no unit {m['unit']!r} (units: {units})")
    target = m["target"].strip() if m["target"] else None
    return Gate(text.strip(), metric, m["op"], float(m["value"]) * _UNITS[kind][unit], target)


def crossed(report: Report, gates: Sequence[Gate]) -> list[str]:
    """Every (gate, target, step) over its threshold, as a line; a gate naming a target the
    report does not have is crossed too (a typo must not pass a CI job)."""
    ceilings = {t.name for t in report.targets if t.ceiling}
    names = {t.name for t in report.targets}
    out = []
    for gate in gates:
        if gate.target is not None and gate.target not in names:
            out.append(f"fail-if {gate.text}: no target named {gate.target!r} ({', '.join(sorted(names))})")
            continue
        pick, kind = METRICS[gate.metric]
        for row in report.summary:
            if row.target in ceilings or (gate.target is not None and row.target != gate.target):
                continue
            value = pick(row)
            if value is not None and _OPS[gate.op](value, gate.value):
                shown = f"{value:.2%}" if kind == "share" else f"{value:,.3g} {_SHOWN[kind]}".rstrip()
                out.append(f"fail-if {gate.text}: {row.target} {row.step} {gate.metric} is {shown}")
    return out
