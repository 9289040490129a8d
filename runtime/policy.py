"""Isolation policy profiles and the daemon-side check of what a worker says it applied.

``strict`` (default) refuses a worker that lacks any required layer; ``compat`` accepts what the
machine has and says loudly what is missing; ``none`` must be named explicitly and is logged as
unsafe on every worker start. Never a silent fallback.
"""

from __future__ import annotations

from runtime.logs import log

PROFILES = ("strict", "compat", "none")
#: Layers a ``strict`` worker must report before it may run plugin code.
STRICT_LAYERS = ("hygiene", "rlimits", "identity", "cgroup", "namespaces", "landlock", "seccomp")
#: Also required under ``strict`` from a worker whose plugin holds a network grant (its own network
#: namespace, its proxy socket handed to the daemon: see ``runtime.egress``).
EGRESS_LAYER = "egress"
#: Layers every profile applies, ``none`` included.
BASE_LAYERS = ("rlimits",)


def check_layers(policy: str, applied: list[str], missing: list[str], plugin: str, network: bool = False) -> str | None:
    """None if the worker may run, else why not (the worker is then killed).

    ``network``: the plugin holds a network grant, so ``strict`` also requires the egress layer."""
    have = set(applied)
    absent_base = [layer for layer in BASE_LAYERS if layer not in have]
    if absent_base:
        return f"worker did not apply {', '.join(absent_base)}"
    if policy == "strict":
        required = STRICT_LAYERS + ((EGRESS_LAYER,) if network else ())
        absent = [layer for layer in required if layer not in have]
        if absent or missing:
            return "strict policy: worker lacks isolation layers: " + ", ".join(sorted(set(absent) | set(missing)))
    elif policy == "compat":
        if missing:
            log("isolation_degraded", level="warning", plugin=plugin, missing=missing, applied=applied)
    elif policy == "none":
        log("isolation_disabled", level="warning", plugin=plugin, applied=applied,
            note="policy 'none': plugin code runs without sandboxing (unsafe)"
            + ("; its network grant is not enforced: it shares the host's network" if network else ""))
    else:
        return f"unknown policy {policy!r}"
    return None
