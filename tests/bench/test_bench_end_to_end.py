"""``toolcell bench`` end to end against real servers: the official SDK over stdio and HTTP,
toolcell itself, and the bench's trivial server made to fail in each way (errors, a broken
server, a stall, a death mid-run, garbage, a pause). Each is reported as what it is. No timing
is asserted: only structure, and relations no noise can break."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hdrh")

REPO = Path(__file__).resolve().parents[2]
SDK = f"{sys.executable} benchmarks/peers/sdk_server.py"
TRIVIAL = f"{sys.executable} -m runtime.bench.trivial_server"
SHORT = ["--duration", "0.6", "--warmup", "0.2", "--quiet"]


def bench(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", *args, "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    assert out.exists(), proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def target(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in report["targets"] if t["name"] == name)


def rows(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [r for r in report["summary"] if r["target"] == name]


def segments(report: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [s for s in report["segments"] if s["target"] == name]


def test_the_official_sdk_over_stdio_and_http_is_measured_side_by_side_with_the_clients_ceiling(tmp_path: Path) -> None:
    proc, report = bench(tmp_path, f"sdk=stdio:{SDK}", f"sdk-http=http:{SDK} --http --port {{port}}",
                         "--tool", "echo", "--args", '{"text": "hi {{seq}}"}', "--expect-text", "hi {{seq}}",
                         "-c", "1,4", *SHORT, "--timeout", "20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = [t["name"] for t in report["targets"]]
    assert names == ["sdk", "sdk-http", "ceiling (http)", "ceiling (stdio)"]
    for name in ("sdk", "sdk-http"):
        t = target(report, name)
        assert t["status"] == "ok", t
        assert t["server_info"]["name"] == "sdk-echo"
        assert [c["ok"] for c in t["checks"]] == [True, True]
        summary = rows(report, name)
        assert [r["step"] for r in summary] == ["c=1", "c=4"]
        for r in summary:
            assert r["calls_per_s"] > 0 and r["errors"] == {}
            lat = r["latency"]
            assert 0 < lat["p50_ms"] <= lat["p90_ms"] <= lat["p99_ms"] <= lat["p999_ms"] <= lat["max_ms"]
            assert r["server_cpu_us_per_call"] > 0 and r["server_rss_mb"] > 0
            assert r["ceiling_share"] is not None
    # ratios divide by the first target, at the same step
    assert all(r["ratio"] == pytest.approx(1.0) for r in rows(report, "sdk"))
    env = report["environment"]
    assert env["cores"] >= 1 and len(env["loadavg_before"]) == 3 and len(env["loadavg_after"]) == 3
    assert "hdrhistogram" in env["versions"] and "toolcell" in env["versions"]
    assert "sdk-http" in proc.stdout and "ceiling (stdio)" in proc.stdout  # the table at the end


def test_a_server_that_answers_some_calls_with_errors_has_them_counted_by_kind(tmp_path: Path) -> None:
    proc, report = bench(tmp_path, f"flaky=stdio:{TRIVIAL} --error-every 5", "--tool", "echo", "-c", "4", *SHORT,
                         "--no-ceiling")
    assert proc.returncode == 0, proc.stderr[-2000:]
    t = target(report, "flaky")
    assert t["status"] == "errors"
    (row,) = rows(report, "flaky")
    # every 5th call isError, every 5th+1 a JSON-RPC error: both kinds, counted apart, in equal shares
    assert row["errors"]["tool_error"] > 0 and row["errors"]["rpc_error"] > 0
    assert abs(row["errors"]["tool_error"] - row["errors"]["rpc_error"]) <= 2
    assert 0.3 < row["error_rate"] / 0.4 < 1.1
    (seg,) = segments(report, "flaky")
    assert seg["error_samples"]["rpc_error"][0].endswith("-32603: injected")


def test_a_server_whose_every_call_fails_is_reported_broken_and_gets_no_load(tmp_path: Path) -> None:
    proc, report = bench(tmp_path, f"bad=stdio:{TRIVIAL} --always-error", f"good=stdio:{TRIVIAL}", "--tool", "echo",
                         "-c", "2", *SHORT, "--no-ceiling")
    assert proc.returncode == 1
    bad = target(report, "bad")
    assert bad["status"] == "broken" and "always fails" in bad["problem"]
    assert [s["skipped"] is not None for s in segments(report, "bad")] == [True]
    assert rows(report, "bad") == []
    assert target(report, "good")["status"] == "ok"


def test_a_tool_the_server_does_not_list_makes_it_broken(tmp_path: Path) -> None:
    proc, report = bench(tmp_path, f"stdio:{TRIVIAL}", "--tool", "nope", "-c", "1", *SHORT, "--no-ceiling")
    assert proc.returncode == 1
    (t,) = report["targets"]
    assert t["status"] == "broken" and "'nope' is not listed" in t["problem"]


def test_a_server_that_stalls_is_reported_with_timeouts_not_as_fast(tmp_path: Path) -> None:
    proc, report = bench(tmp_path, f"stall=stdio:{TRIVIAL} --stall-after 300", "--tool", "echo", "-c", "4",
                         "--duration", "1.2", "--warmup", "0", "--timeout", "0.3", "--quiet", "--no-ceiling")
    (t,) = report["targets"]
    assert t["status"] in ("stalled", "timeouts"), t
    (row,) = rows(report, "stall")
    assert row["errors"]["timeout"] >= 4  # at least the calls in flight when it stopped answering
    (seg,) = segments(report, "stall")
    # every ok call came before the stall, and the server answered no more than it was meant to
    assert seg["ok"] <= 300


def test_a_server_that_dies_mid_run_is_reported_dead_and_skipped_afterwards(tmp_path: Path) -> None:
    # The window is a count of calls far beyond the server's life, so it dies inside it, however fast.
    proc, report = bench(tmp_path, f"mortal=stdio:{TRIVIAL} --die-after 800", f"http-mortal=http:{TRIVIAL} --http "
                         "--port {port} --die-after 800", "--tool", "echo", "-c", "4,8", "--count", "100000",
                         "--warmup", "0", "--quiet", "--no-ceiling")
    assert proc.returncode == 1
    for name in ("mortal", "http-mortal"):
        t = target(report, name)
        assert t["status"] == "died", t
        assert "exited with 3" in t["problem"], t["problem"]
        first, second = segments(report, name)
        assert first["ended_by"] is not None
        assert 1 <= first["ok"] < 800  # one call went to the correctness pass
        assert first["errors"]["transport"] >= 1  # what was in flight when it died
        assert second["skipped"] is not None and "died" in second["skipped"]
        assert [r["step"] for r in rows(report, name)] == ["c=4"]


def test_a_server_that_sends_malformed_results_has_them_counted_invalid_and_the_bench_goes_on(tmp_path: Path) -> None:
    proc, report = bench(tmp_path, f"garbage=stdio:{TRIVIAL} --garbage-every 4", "garbage-http=trivial+http",
                         "--tool", "echo", "-c", "4", *SHORT, "--no-ceiling")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = rows(report, "garbage")
    assert row["errors"]["invalid"] > 0 and set(row["errors"]) == {"invalid"}
    assert 0.15 < row["error_rate"] < 0.35
    (seg,) = segments(report, "garbage")
    assert "not a CallToolResult" in seg["error_samples"]["invalid"][0]
    assert target(report, "garbage-http")["status"] == "ok"


def test_open_loop_latency_includes_the_time_requests_waited_behind_a_paused_server(tmp_path: Path) -> None:
    """The server stops reading for P = 0.5 s at its 30th call. In an open loop at R = 80/s every
    call meant to start in the first half of that pause cannot be answered before the pause ends,
    so at least R * P / 2 = 20 calls have a latency of at least P / 2, whatever the machine does."""
    from runtime.bench import stats

    pause_ms, rate = 500, 80
    proc, report = bench(tmp_path, f"pausing=stdio:{TRIVIAL} --pause-at 30 --pause-ms {pause_ms}", "--tool", "echo",
                         "--rate", str(rate), "--duration", "1.5", "--warmup", "0", "--quiet", "--no-ceiling")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (seg,) = segments(report, "pausing")
    assert seg["errors"] == {}
    hist = stats.decode(seg["histogram"])
    slow = sum(n for value_us, n in _values(hist) if value_us >= pause_ms * 1000 / 2)
    assert slow >= rate * pause_ms / 1000 / 2
    # The schedule was kept: about R * duration calls were started, not fewer because of the pause.
    assert seg["started"] >= rate * 1.5 * 0.9
    assert seg["service"] is not None and seg["latency"]["max_ms"] >= pause_ms / 2


def _values(hist: Any) -> list[tuple[int, int]]:
    out = []
    for index in range(hist.counts_len):
        n = hist.get_count_at_index(index)
        if n:
            out.append((hist.get_value_from_index(index), n))
    return out


def test_a_scenario_file_mixes_weighted_calls_and_paginated_list_walks(tmp_path: Path) -> None:
    scenario = tmp_path / "mix.toml"
    scenario.write_text(
        '[[call]]\ntool = "a"\nweight = 3\narguments = { text = "n={{seq}}" }\nexpect_text = "n={{seq}}"\n\n'
        '[[call]]\ntool = "b"\nexpect_contains = "ok"\n\n[list]\nweight = 1\n')
    proc, report = bench(tmp_path, f"stdio:{TRIVIAL} --tools a,b,c,d,e --page-size 2", "--scenario", str(scenario),
                         "-c", "4", *SHORT, "--no-ceiling")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (t,) = report["targets"]
    assert t["status"] == "ok", t
    assert "5 tools in 3 page(s)" in t["checks"][0]["detail"]
    (seg,) = report["segments"]
    ops = {op["label"]: op["latency"]["count"] for op in seg["ops"]}
    assert set(ops) == {"call a", "call b", "tools/list walk"}
    assert ops["call a"] > ops["call b"] and ops["call a"] > ops["tools/list walk"]


def test_the_modern_era_is_spoken_over_stdio_and_http(tmp_path: Path) -> None:
    proc, report = bench(tmp_path, "trivial", "trivial+http", f"sdk=stdio:{SDK}", "--era", "modern", "--tool",
                         "echo", "--args", '{"text": "x"}', "-c", "2", *SHORT, "--no-ceiling")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert report["config"]["era"].startswith("2026-07-28")
    assert {t["name"]: t["status"] for t in report["targets"]} == {"trivial": "ok", "trivial+http": "ok", "sdk": "ok"}
    assert all(r["calls_per_s"] > 0 and r["errors"] == {} for r in report["summary"])


def test_answers_longer_than_one_read_arrive_whole_over_stdio_and_http(tmp_path: Path) -> None:
    from runtime.bench import http_client, stdio_client

    # At least two reads each (and under the 128 KiB a single command-line argument may hold).
    text = "y" * (max(http_client.READ_CHUNK, stdio_client.READ_CHUNK) + 30_000)
    proc, report = bench(tmp_path, "trivial", "trivial+http", "--tool", "echo", "--args", json.dumps({"text": text}),
                         "--expect-text", text, "-c", "2", *SHORT, "--no-ceiling")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {t["name"]: t["status"] for t in report["targets"]} == {"trivial": "ok", "trivial+http": "ok"}
    assert all(r["calls_per_s"] > 0 and r["errors"] == {} for r in report["summary"])


def test_toolcell_targets_say_where_a_calls_time_goes_per_plugin(tmp_path: Path) -> None:
    proc, report = bench(tmp_path, "toolcell:benchmarks/plugins", "toolcell+http:benchmarks/plugins", "--tool",
                         "echo", "--args", '{"text": "x"}', "-c", "4", *SHORT, "--no-ceiling", timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("toolcell", "toolcell+http"):
        assert target(report, name)["server_info"]["name"] == "toolcell"
        (row,) = rows(report, name)
        (phase,) = row["phases"]
        assert phase["plugin"] == "echo" and phase["calls"] > 0
        assert phase["worker_us"] > 0 and phase["channel_us"] > 0 and phase["queue_us"] >= 0
    assert "where a toolcell call's time goes" in proc.stdout
