"""The load benchmark runs end to end (stdio and HTTP). Whether it is fast is for benchmarks/ only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_run_py_measures_toolcell_and_the_sdk_side_by_side(transport: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, str(REPO / "benchmarks" / "run.py"), "--servers", "toolcell,sdk", "--concurrency", "2",
            "--repeat", "1", "--seconds", "0.5", "--warmup", "0.2", "--json", str(out)]
    if transport == "http":
        argv.append("--http")
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    runs = {r["server"]: r for r in data["runs"]}
    assert set(runs) == {"toolcell", "sdk"}
    for name, run in runs.items():
        assert run["error"] is None, (name, run["error"])
        result = run["result"]
        assert result["calls"] > 0 and result["errors"] == 0, (name, result)
        assert result["server_cpu_s"] > 0, (name, result)
    heading = "Streamable HTTP" if transport == "http" else "over stdio"
    assert heading in proc.stdout
    # The table has one row per server with a ratio against the SDK.
    assert any(line.startswith("toolcell") for line in proc.stdout.splitlines())
