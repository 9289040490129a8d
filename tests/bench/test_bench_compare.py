"""``toolcell bench compare`` (noise-aware, repeat by repeat) and ``--fail-if`` gates, on reports
generated here. Changed reports are made from a real one by scaling its repeats, so that what is
asserted (which verdict, which exit code) never depends on the machine's noise."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hdrh")

from runtime.bench import gates, significance  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
REPEATS = 5


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli", "bench", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=180)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One target, two steps, five repeats."""
    out = tmp_path_factory.mktemp("compare") / "base.json"
    proc = run("trivial", "--tool", "echo", "-c", "1,2", "--repeat", str(REPEATS), "--duration", "0.3", "--warmup",
               "0.05", "--quiet", "--no-ceiling", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.read_text())
    assert len(report["segments"]) == 2 * REPEATS
    # The repeats' own spread is the machine's noise (on a loaded machine one repeat's p99 can be ten
    # times another's), and then "3x slower in every repeat" would overlap the base: what the tests
    # assert must not depend on it. So each repeat keeps its step's median, moved by 1 % per repeat.
    for step in {seg["step"] for seg in report["segments"]}:
        segs = [seg for seg in report["segments"] if seg["step"] == step]
        calls = statistics.median(seg["calls_per_s"] for seg in segs)
        lat = {key: statistics.median(seg["latency"][key] for seg in segs) for key in ("p50_ms", "p99_ms")}
        for seg in segs:
            spread = 1 + 0.01 * seg["repeat"]
            seg["calls_per_s"] = calls * spread
            for key, value in lat.items():
                seg["latency"][key] = value * spread
    return report


def write(tmp_path: Path, name: str, report: dict[str, Any]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(report))
    return str(path)


def changed(report: dict[str, Any], repeats: set[int], calls: float = 1.0, latency: float = 1.0) -> dict[str, Any]:
    """``report`` with the given repeats' calls/s and latencies scaled, and its summary moved as
    a summary over those repeats moves (the merged p99 follows the slowest repeat)."""
    out: dict[str, Any] = json.loads(json.dumps(report))
    for seg in out["segments"]:
        if seg["repeat"] in repeats:
            seg["calls_per_s"] *= calls
            for key in ("p50_ms", "p99_ms"):
                seg["latency"][key] *= latency
    for row in out["summary"]:
        row["calls_per_s"] *= calls if len(repeats) == REPEATS else 1.0
        row["latency"]["p99_ms"] *= latency if len(repeats) == REPEATS else 1.279
    return out


def test_two_runs_of_the_same_build_with_one_noisy_repeat_are_no_significant_change(base: dict[str, Any],
                                                                                    tmp_path: Path) -> None:
    """One repeat of five three times slower moved the merged p99 by +27.9 %: the old compare
    called that a REGRESSION. Four repeats of five did not move: it is within noise."""
    noisy = changed(base, {3}, latency=3.0)
    proc = run("compare", write(tmp_path, "base", base), write(tmp_path, "noisy", noisy))
    assert proc.returncode == 0, proc.stdout
    assert "REGRESSION" not in proc.stdout
    assert "no significant change" in proc.stdout and "no significant regression" in proc.stdout
    assert f"{REPEATS}+{REPEATS}" in proc.stdout


def test_a_change_every_repeat_shows_is_a_significant_regression_and_exits_1(base: dict[str, Any],
                                                                             tmp_path: Path) -> None:
    slower = changed(base, set(range(1, REPEATS + 1)), calls=0.5, latency=3.0)
    b, s = write(tmp_path, "base", base), write(tmp_path, "slower", slower)
    worse = run("compare", b, s)
    assert worse.returncode == 1, worse.stdout
    # five repeats against five, every one beyond every other: the smallest p there is
    p = f"p={2 / math.comb(2 * REPEATS, REPEATS):.3f}"
    assert f"calls/s -50.0% ({p})" in worse.stdout and f"p99 +200.0% ({p})" in worse.stdout
    assert worse.stdout.count("REGRESSION") == 2 * 3  # calls/s, p50, p99 at both steps
    better = run("compare", s, b)
    assert better.returncode == 0 and "better" in better.stdout and "REGRESSION" not in better.stdout
    # a significant change inside the threshold is worse, not a regression
    assert run("compare", b, s, "--threshold", "250").returncode == 0


def test_one_repeat_a_side_says_it_cannot_tell_instead_of_guessing(base: dict[str, Any], tmp_path: Path) -> None:
    def first_repeat(report: dict[str, Any]) -> dict[str, Any]:
        return {**report, "segments": [s for s in report["segments"] if s["repeat"] == 1]}

    slower = changed(base, set(range(1, REPEATS + 1)), calls=0.8)
    proc = run("compare", write(tmp_path, "b1", first_repeat(base)), write(tmp_path, "s1", first_repeat(slower)))
    assert proc.returncode == 0, proc.stdout
    assert "too few repeats" in proc.stdout and "--repeat 5" in proc.stdout and "REGRESSION" not in proc.stdout


def test_compare_writes_markdown_for_a_pull_request_comment(base: dict[str, Any], tmp_path: Path) -> None:
    slower = changed(base, set(range(1, REPEATS + 1)), calls=0.5)
    proc = run("compare", write(tmp_path, "base", base), write(tmp_path, "slower", slower), "--markdown")
    assert proc.returncode == 1
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("**2 regression(s)")
    header = next(i for i, line in enumerate(lines) if line.startswith("| target | step | metric |"))
    assert lines[header + 1].startswith("|---|---|---|---:")
    rows = [line for line in lines[header + 2:] if line.startswith("| trivial |")]
    assert len(rows) == 2 * 3 and all(row.count("|") == 10 for row in rows)


def _before_and_after(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One report holding ``before``'s only target as "before" and ``after``'s as "after" (a run of two)."""
    out: dict[str, Any] = json.loads(json.dumps(before))
    for part in ("segments", "summary"):
        out[part] = [{**row, "target": "before"} for row in before[part]] + \
                    [{**row, "target": "after"} for row in after[part]]
    (target,) = before["targets"]
    out["targets"] = [{**target, "name": "before"}, {**target, "name": "after"}]
    return out


def test_two_targets_of_one_run_are_compared_repeat_by_repeat(base: dict[str, Any], tmp_path: Path) -> None:
    run_of_two = write(tmp_path, "two", _before_and_after(base, changed(base, set(range(1, REPEATS + 1)), calls=0.5)))
    worse = run("compare", f"{run_of_two}:before", f"{run_of_two}:after")
    assert worse.returncode == 1, (worse.stdout, worse.stderr)
    assert "after vs before" in worse.stdout and "calls/s -50.0%" in worse.stdout
    assert run("compare", f"{run_of_two}:after", f"{run_of_two}:before").returncode == 0
    same = write(tmp_path, "same", _before_and_after(base, base))
    unchanged = run("compare", f"{same}:before", f"{same}:after")
    assert unchanged.returncode == 0 and "REGRESSION" not in unchanged.stdout, unchanged.stdout
    missing = run("compare", f"{run_of_two}:before", f"{run_of_two}:nope")
    assert missing.returncode == 2 and "no target 'nope'" in missing.stderr and "before, after" in missing.stderr
    one_sided = run("compare", f"{run_of_two}:before", run_of_two)
    assert one_sided.returncode == 2 and "on both sides" in one_sided.stderr


def test_compare_refuses_what_is_not_a_report(base: dict[str, Any], tmp_path: Path) -> None:
    junk = tmp_path / "junk.json"
    junk.write_text("{}")
    assert run("compare", write(tmp_path, "base", base), str(junk)).returncode == 2


@pytest.mark.timeout(120)
@pytest.mark.parametrize("side", ["base", "new", "base:TARGET"])
def test_compare_refuses_a_fifo_at_once_instead_of_waiting_on_it(base: dict[str, Any], tmp_path: Path,
                                                                   side: str) -> None:
    # Opened for reading, a FIFO blocks until something writes to it: compare would wait for good.
    fifo = tmp_path / "report.json"
    os.mkfifo(fifo)
    other = write(tmp_path, "other", base)
    target = ":TARGET" if side.endswith(":TARGET") else ""
    sides = [f"{fifo}{target}", f"{other}{target}"]
    proc = run("compare", *(sides if side.startswith("base") else sides[::-1]))
    assert proc.returncode == 2, proc.stderr
    assert f"{fifo} is not a regular file: it is a FIFO" in proc.stderr and "Traceback" not in proc.stderr


def test_compare_refuses_a_directory_and_a_missing_file(tmp_path: Path) -> None:
    other = tmp_path / "other.json"
    other.write_text("{}")
    folder = run("compare", str(tmp_path), str(other))
    assert folder.returncode == 2 and "is not a regular file: it is a directory" in folder.stderr
    proc = run("compare", str(tmp_path / "nope.json"), str(other))
    assert proc.returncode == 2 and "No such file" in proc.stderr


def test_fail_if_thresholds_exit_1_and_name_what_crossed_them(tmp_path: Path) -> None:
    out = tmp_path / "gated.json"
    proc = run("trivial", "--tool", "echo", "-c", "1", "--duration", "0.3", "--warmup", "0.05", "--quiet",
               "--no-ceiling", "--fail-if", "p99>0.001ms", "--fail-if", "errors>0", "--fail-if", "rss>100GB",
               "--markdown", "--json", str(out))
    assert proc.returncode == 1, proc.stderr[-2000:]
    crossed = [line for line in proc.stdout.splitlines() if "fail-if" in line]
    assert len(crossed) == 1 and crossed[0].startswith("- fail-if p99>0.001ms: trivial c=1 p99 is ")
    assert "| target | step | calls/s |" in proc.stdout  # the summary, as markdown
    # the same report through compare's gate, and one that passes
    assert run("compare", str(out), str(out), "--fail-if", "errors>0").returncode == 0
    assert run("compare", str(out), str(out), "--fail-if", "trivial:p50>=0").returncode == 1
    assert run("compare", str(out), str(out), "--fail-if", "nosuch:p50>1").returncode == 1


@pytest.mark.parametrize("text, metric, op, value, target", [
    ("p99>50ms", "p99", ">", 50.0, None),
    ("p99 > 0.5s", "p99", ">", 500.0, None),
    ("p50<=200us", "p50", "<=", 0.2, None),
    ("errors>0", "errors", ">", 0.0, None),
    ("error_rate>=1%", "error_rate", ">=", 0.01, None),
    ("calls/s<1000", "calls/s", "<", 1000.0, None),
    ("toolcell+http:rss>1GB", "rss", ">", 1024.0, "toolcell+http"),
])
def test_a_gate_reads_its_metric_operator_and_unit(text: str, metric: str, op: str, value: float,
                                                    target: str | None) -> None:
    gate = gates.parse(text)
    assert (gate.metric, gate.op, gate.target) == (metric, op, target)
    assert gate.value == pytest.approx(value)


@pytest.mark.parametrize("text", ["p99", "p99>50kg", "speed>1", "p99>>1", "errors>1ms", ""])
def test_a_gate_that_does_not_parse_is_refused_with_the_reason(text: str) -> None:
    with pytest.raises(gates.GateError, match="fail-if"):
        gates.parse(text)


def test_a_bad_gate_is_a_usage_error_before_anything_runs() -> None:
    proc = run("trivial", "--fail-if", "p99>50kg")
    assert proc.returncode == 2 and "takes no unit 'kg'" in proc.stderr


def _brute_force_p(a: list[float], b: list[float]) -> float:
    """Every split of the pooled values, counted one by one."""
    pooled, n1 = a + b, len(a)
    ranks = [sum(1 for x in pooled if x < v) + (sum(1 for x in pooled if x == v) + 1) / 2 for v in pooled]
    mean = n1 * (len(pooled) + 1) / 2
    seen = abs(sum(ranks[:n1]) - mean)
    if seen == 0:
        return 1.0
    splits = list(itertools.combinations(range(len(pooled)), n1))
    return sum(1 for idx in splits if abs(sum(ranks[i] for i in idx) - mean) >= seen - 1e-9) / len(splits)


def test_the_mann_whitney_p_value_is_exact_with_and_without_ties() -> None:
    assert significance.smallest_p(4, 4) == pytest.approx(2 / 70)
    assert significance.smallest_p(3, 3) == pytest.approx(0.1)  # three a side can never reach p < 0.05
    assert significance.smallest_p(1, 1) == 1.0
    assert significance.mann_whitney_p([1, 2, 3], [1, 2, 3]) == 1.0
    rng = random.Random(27)
    for _ in range(200):
        a = [float(rng.choice(range(6))) for _ in range(rng.randint(1, 7))]
        b = [float(rng.choice(range(2, 9))) for _ in range(rng.randint(1, 7))]
        assert significance.mann_whitney_p(a, b) == pytest.approx(_brute_force_p(a, b)), (a, b)


def test_large_samples_use_the_normal_approximation_and_agree_in_direction() -> None:
    rng = random.Random(5)
    same = [rng.gauss(0, 1) for _ in range(80)]
    shifted = [x + 3 for x in same[:40]]
    assert significance.mann_whitney_p(same[:40], shifted) < 1e-6
    assert significance.mann_whitney_p(same[:40], same[40:]) > 0.01


def _two_targets(report: dict[str, Any], calls: float, repeats: int = REPEATS) -> dict[str, Any]:
    """``report`` plus a second target, "other", whose every repeat does ``calls`` times the calls/s."""
    out: dict[str, Any] = json.loads(json.dumps(report))
    target = out["targets"][0]["name"]
    other_target = json.loads(json.dumps(out["targets"][0])) | {"name": "other"}
    out["targets"].append(other_target)
    for seg in [s for s in out["segments"] if s["target"] == target]:
        if seg["repeat"] <= repeats:
            out["segments"].append(json.loads(json.dumps(seg)) | {"target": "other",
                                                                  "calls_per_s": seg["calls_per_s"] * calls})
    out["segments"] = [s for s in out["segments"] if s["repeat"] <= repeats]
    for row in [r for r in out["summary"] if r["target"] == target]:
        out["summary"].append(json.loads(json.dumps(row)) | {"target": "other", "calls_per_s": row["calls_per_s"] * calls})
    out["baseline"] = target
    return out


def test_the_report_opens_with_which_is_faster_by_how_much_and_how_sure(base: dict[str, Any]) -> None:
    from msgspec import json as mjson

    from runtime.bench.report import Report, render_text, verdict

    slower = mjson.decode(json.dumps(_two_targets(base, 0.5)), type=Report)
    lines = verdict(slower)
    assert len(lines) == 2  # one per step
    assert all(" other " in line and "0.5x trivial's" in line and "slower, p=0.008" in line for line in lines), lines
    assert render_text(slower).splitlines()[2] == "verdict:"
    from runtime.bench.html_report import render

    page = render(slower)
    assert page.index("<h2>Verdict</h2>") < page.index("<h2>Summary</h2>")  # the answer comes first
    same = mjson.decode(json.dumps(_two_targets(base, 1.0)), type=Report)
    assert all("no significant difference" in line for line in verdict(same)), verdict(same)
    few = mjson.decode(json.dumps(_two_targets(base, 0.5, repeats=3)), type=Report)
    assert all("too few repeats" in line for line in verdict(few)), verdict(few)
