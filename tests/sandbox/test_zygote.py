"""The per-call zygote: a fresh process per call, no shared state, children cannot hurt it."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from sandbox_harness import Worker, text_of

POLICIES = ("strict", "none")


def test_no_state_survives_between_calls(spawn: Callable[..., Worker]) -> None:
    w = spawn("strict", mode="per_call")
    assert type(w.ready()).__name__ == "Ready"
    assert [text_of(w.call("counter")) for _ in range(3)] == ["1", "1", "1"]


def test_pooled_mode_keeps_state_for_contrast(spawn: Callable[..., Worker]) -> None:
    w = spawn("strict")
    w.ready()
    assert [text_of(w.call("counter")) for _ in range(3)] == ["1", "2", "3"]


def test_a_crashing_call_gets_an_error_result_and_the_zygote_goes_on(spawn: Callable[..., Worker]) -> None:
    w = spawn("strict", mode="per_call")
    w.ready()
    r = w.call("crash")
    assert r.is_error and "status 7" in text_of(r)
    assert text_of(w.call("counter")) == "1"


def test_a_call_cannot_signal_the_zygote(spawn: Callable[..., Worker], require: Any) -> None:
    require("landlock")
    w = spawn("strict", mode="per_call")
    w.ready()
    assert json.loads(text_of(w.call("hit_zygote"))) == ["Operation not permitted"] * 3
    assert text_of(w.call("counter")) == "1"


def test_a_call_cannot_leave_processes_behind(spawn: Callable[..., Worker], require: Any) -> None:
    require("namespaces", "cgroup")
    from sandbox.isolation import cgroups

    w = spawn("strict", mode="per_call")
    w.ready()
    w.call("spawn_survivor", seconds=30)
    w.call("counter")
    # reaper + zygote only (a killed call may still be being torn down for a moment)
    deadline = time.monotonic() + 5
    while len(cgroups.members(w.proc.pid)) > 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(cgroups.members(w.proc.pid)) == 2


def test_per_call_throughput_is_reasonable(spawn: Callable[..., Worker]) -> None:
    w = spawn("strict", mode="per_call")
    w.ready()
    n = 100
    t = time.monotonic()
    for _ in range(n):
        w.call("counter")
    rate = n / (time.monotonic() - t)
    assert rate > 100, f"{rate:.0f} calls/s"
