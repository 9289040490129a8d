"""The task store benchmark runs end to end on both backends (the daemon's tasks/get polling is
benchmarks/tasks_poll_bench.py, which needs wrk). Whether anything is fast is for benchmarks/ only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "task_store_bench.py"


def test_store_mode_fills_and_reads_both_backends(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--tasks", "300", "-c", "8", "-s", "0.3", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["backend"] for r in data["results"]] == ["sqlite", "redis"]
    for r in data["results"]:
        ops = {m["op"]: m for m in r["ops"]}
        assert ops["create (fill)"]["calls"] == 300 and ops["transition to completed"]["calls"] == 150
        assert ops["get"]["calls"] > 0 and ops["get"]["errors"] == 0
    assert data["environment"]["versions"]["redis-server"]
    assert "cores" in proc.stdout and "load average" in proc.stdout
