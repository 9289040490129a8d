"""The capability probe and ``toolcell doctor``."""

from __future__ import annotations

from typing import Any

import pytest

from runtime import doctor
from sandbox.isolation import LAYERS


def test_probe_reports_every_layer_with_reason_and_fix(probe: dict[str, Any]) -> None:
    assert set(probe["layers"]) == set(LAYERS)
    for info in probe["layers"].values():
        assert isinstance(info["available"], bool)
        assert info["reason"]
        assert info["available"] or info["fix"]


def test_probe_in_process_returns_tuples() -> None:
    from sandbox.isolation.probe import probe

    got = probe(("hygiene", "rlimits"))
    assert got["hygiene"][0] is True and got["rlimits"][0] is True


def test_doctor_prints_a_table_and_exits_0_iff_strict_can_run(
    probe: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    code = doctor.main([])
    out = capsys.readouterr().out
    for layer in LAYERS:
        assert layer in out
    assert "strict" in out and "compat" in out and "none" in out
    strict_ok = all(v["available"] for v in probe["layers"].values()) and probe.get("strict", {}).get("ok")
    assert code == (0 if strict_ok else 1)


def test_doctor_explains_missing_layers() -> None:
    report = {
        "layers": {name: {"available": True, "reason": "ok", "fix": ""} for name in LAYERS},
        "strict": {"ok": False, "detail": "x"},
    }
    report["layers"]["landlock"] = {"available": False, "reason": "Landlock not enabled", "fix": "add landlock to lsm="}
    text, ok = doctor.render(report)
    assert not ok
    assert "MISSING" in text and "add landlock to lsm=" in text and "CANNOT run (missing landlock)" in text
