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


def test_run_py_measures_a_running_http_server_given_by_url(tmp_path: Path) -> None:
    # A server we did not start: measured by URL, with no CPU or memory figures for it.
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "peers" / "sdk_server.py"), "--http",
                               "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the SDK server did not start"
                time.sleep(0.1)
        out = tmp_path / "bench.json"
        proc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "run.py"), "--http", "--servers", "none", "--target",
             f"peer=http://127.0.0.1:{port}/mcp", "--concurrency", "2", "--repeat", "1", "--seconds", "0.5",
             "--warmup", "0.2", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (run,) = json.loads(out.read_text())["runs"]
        assert run["server"] == "peer" and run["error"] is None, run
        assert run["result"]["calls"] > 0 and run["result"]["errors"] == 0
        assert run["result"]["rss_idle"] == [] and run["result"]["server_cpu_s"] == 0
    finally:
        server.kill()
        server.wait()


def test_scale_out_measures_replicas_behind_haproxy_beside_a_direct_replica_and_the_balancers_ceiling() -> None:
    argv = [sys.executable, str(REPO / "benchmarks" / "scale_out.py"), "--duration", "0.5", "--repeat", "1",
            "--concurrency", "4", "--idle", "0.5"]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ")}
    for name in ("direct", "haproxy-1", "haproxy-2", "haproxy-3", "haproxy-trivial", "ceiling (http)"):
        assert name in rows, proc.stdout
        errors = rows[name].rstrip(" |").rsplit("|", 1)[1].strip()
        assert errors == "0", rows[name]


def test_the_limit_and_floor_servers_answer_every_call_with_its_own_text(tmp_path: Path) -> None:
    """The in-process limit and the process-hop floor are held against toolcell in RESULTS.md: each must
    run the call (the text comes back per call, ``{{seq}}`` differs every time) in every mode."""
    out = tmp_path / "bench.json"
    python = sys.executable
    targets = [f"limit=stdio:{python} benchmarks/limit_server.py",
               f"floor-task=stdio:{python} benchmarks/floor_server.py --workers 2",
               f"floor-inline=stdio:{python} benchmarks/floor_server.py --workers 1 --inline"]
    proc = subprocess.run(
        [python, "-m", "runtime.cli", "bench", *targets, "--tool", "echo", "--args", '{"text": "hi {{seq}}"}',
         "--expect-text", "hi {{seq}}", "-c", "4", "-d", "0.5", "--warmup", "0.2", "--repeat", "1", "--no-ceiling",
         "-q", "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {row["target"]: row for row in json.loads(out.read_text())["summary"]}
    assert set(rows) == {"limit", "floor-task", "floor-inline"}
    for name, row in rows.items():
        assert row["calls_per_s"] > 0 and not row["errors"], (name, row)


def test_worker_loop_measures_a_pooled_workers_own_cost_per_call() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "worker_loop.py"), "--calls", "300", "--batch", "1,4",
                           "--repeat", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [(r[0].strip(), r[1].strip()) for r in rows[1:]] == [("1", "off"), ("1", "on"), ("4", "off"), ("4", "on")]
    assert all(float(r[2]) > 0 and float(r[3].replace(",", "")) > 0 for r in rows[1:])


def test_worker_loop_in_memory_measures_the_loop_without_its_socket() -> None:
    # 3,000 calls: tens of ms of CPU, far above the CPU clock's granularity here (300 read 0 once in CI).
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "worker_loop.py"), "--calls", "3000", "--memory",
                           "--repeat", "1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [(r[0].strip(), r[1].strip()) for r in rows[1:]] == [("all (in memory)", "off"), ("all (in memory)", "on")]
    assert all(float(r[2]) > 0 and float(r[3].replace(",", "")) > 0 for r in rows[1:])


def test_daemon_path_drives_a_real_daemon_in_process_and_every_call_succeeds() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "daemon_path.py"), "--seconds", "0.3",
                           "--repeat", "1", "-c", "4"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    median = next(line for line in proc.stdout.splitlines() if line.startswith("| median"))
    calls_per_s, thread_us = (float(v.strip().replace(",", "")) for v in median.split("|")[2:4])
    assert calls_per_s > 0 and thread_us > 0
