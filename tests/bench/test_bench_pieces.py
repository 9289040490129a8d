"""The bench's pieces: templated requests, response checks against hostile input, the weighted
mix, the missing-extra message, and the daemon
never loading any of it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hdrh")

from runtime.bench import scenario, wire  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def test_a_template_fills_the_id_and_every_placeholder_and_an_int_placeholder_becomes_a_number() -> None:
    t = wire.RequestTemplate("tools/call", {"name": "echo", "arguments": {
        "text": "a {{seq}} b {{ seq }}", "n": "{{int:seq}}", "u": "{{uuid}}", "keep": "{{nope}}"}}, modern=False)
    v = wire.Variables(41, t.used)
    msg = json.loads(t.render(7, v))
    assert msg["id"] == 7 and msg["method"] == "tools/call"
    args = msg["params"]["arguments"]
    assert args["text"] == "a 41 b 41" and args["n"] == 41 and re.fullmatch(r"[0-9a-f]{32}", args["u"])
    assert args["keep"] == "{{nope}}"
    plain = wire.RequestTemplate("tools/call", {"name": "echo", "arguments": {"text": "x"}}, modern=True)
    assert plain.simple
    modern = json.loads(plain.render(3, None))
    assert modern["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"] == "2026-07-28"


@pytest.mark.parametrize("line, kind", [
    (b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"hi"}]}}', "ok"),
    (b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"hi"}],"isError":true}}', "tool_error"),
    (b'{"jsonrpc":"2.0","id":1,"error":{"code":-32602,"message":"no"}}', "rpc_error"),
    (b'{"jsonrpc":"1.0","id":1,"result":{"content":[]}}', "invalid"),
    (b'{"jsonrpc":"2.0","id":1}', "invalid"),
    (b'{"jsonrpc":"2.0","id":1,"result":{"content":"x"}}', "invalid"),
    (b'{"jsonrpc":"2.0","id":1,"result":null}', "invalid"),
    (b'{"jsonrpc":"2.0","id":1,"result":{"content":[]},"error":{"code":1,"message":"x"}}', "invalid"),
    (b'{"jsonrpc":"2.0","id":1,"result":{"content":[],"resultType":"input_required"}}', "invalid"),
    (b'{"jsonrpc":"2.0","id":1,"error":{"code":"x","message":5}}', "garbage"),
    (b'{"jsonrpc":"2.0","id":[1],"result":' + b"[" * 5000 + b"]" * 5000 + b"}", "garbage"),
    (b"\xff\xfe not json", "garbage"),
])
def test_every_response_is_classified_and_nothing_a_server_sends_raises(line: bytes, kind: str) -> None:
    (msg,) = wire.decode_lines(line)
    if isinstance(msg, wire.Garbage):
        assert kind == "garbage", msg.reason
        return
    assert wire.check_call(msg, None, "hi" if kind == "ok" else None)[0] == kind


def test_expectations_catch_wrong_text_and_schema_mismatches() -> None:
    (msg,) = wire.decode_lines(b'{"jsonrpc":"2.0","id":1,"result":{"content":[{"type":"text","text":"hi 3"}],'
                               b'"structuredContent":{"n":"3"}}}')
    assert isinstance(msg, wire.Envelope)
    assert wire.check_call(msg, None, "hi 3") == ("ok", None)
    assert wire.check_call(msg, None, "hi 4")[0] == "invalid"
    schema = scenario.schema_check({"type": "object", "properties": {"n": {"type": "integer"}}})
    assert wire.check_call(msg, wire.CallCheck(schema=schema), None)[0] == "invalid"
    assert wire.check_call(msg, wire.CallCheck(contains="hi"), None) == ("ok", None)


def test_the_weighted_mix_is_exact_and_deterministic() -> None:
    mix = scenario.Mix([3, 1, 0])
    drawn = [mix.next() for _ in range(400)]
    assert drawn.count(0) == 300 and drawn.count(1) == 100 and 2 not in drawn
    again = scenario.Mix([3, 1, 0])
    assert [again.next() for _ in range(400)] == drawn


def test_bad_scenarios_are_refused_with_the_reason(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[call]]\ntool = "x"\nwieght = 2\n')
    with pytest.raises(scenario.ScenarioError, match="wieght"):
        scenario.load_file(str(bad))
    with pytest.raises(scenario.ScenarioError, match="not JSON"):
        scenario.parse_call_flag("echo {nope")
    with pytest.raises(scenario.ScenarioError, match="nothing to send"):
        scenario.from_flags(["0*echo"], None, None, None, None, None)


@pytest.mark.timeout(60)
def test_a_scenario_file_that_is_a_fifo_deep_or_not_text_is_refused_with_the_reason(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)  # opened for reading, it would block until someone writes
    with pytest.raises(scenario.ScenarioError, match="is not a regular file: it is a FIFO"):
        scenario.load_file(str(fifo))
    deep = tmp_path / "deep.toml"
    deep.write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(scenario.ScenarioError, match="nested too deeply"):
        scenario.load_file(str(deep))
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe = 1\n")
    with pytest.raises(scenario.ScenarioError, match="not UTF-8"):
        scenario.load_file(str(binary))
    big = tmp_path / "big.toml"
    big.write_text("#" * (scenario.MAX_SCENARIO_BYTES + 1))
    with pytest.raises(scenario.ScenarioError, match="larger than"):
        scenario.load_file(str(big))


def test_without_the_bench_extra_it_says_how_to_install_it(tmp_path: Path) -> None:
    blocker = tmp_path / "hdrh"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('not installed (test)')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", "trivial"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "pip install 'toolcell[bench]'" in proc.stderr


def test_the_daemon_never_loads_the_bench() -> None:
    code = ("import sys, runtime.cli, runtime.serve, runtime.daemon, runtime.metrics\n"
            "print([m for m in sys.modules if m.startswith(('runtime.bench', 'hdrh', 'plotly'))])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_per_interval_sampler_reads_what_psutil_reads_for_the_whole_tree() -> None:
    from runtime.bench import procs

    code = ("import subprocess, sys, time; kids = [subprocess.Popen([sys.executable, '-c', 'import time; "
            "time.sleep(60)']) for _ in range(2)]; sum(range(3 * 10**6)); print('ready', flush=True); time.sleep(60)")
    root = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert root.stdout is not None and root.stdout.readline() == "ready\n"
        sampler = procs.TreeSampler(root.pid)
        cpu_s, rss = sampler.sample() or (0.0, 0)
        assert sampler.fds is not None and len(sampler.fds) == 3
        assert cpu_s == pytest.approx(procs.cpu_delta_s({}, procs.cpu_snapshot(root.pid)), abs=0.02)
        assert rss == pytest.approx(sum(m.rss_bytes for m in procs.memory_snapshot(root.pid)), rel=0.1)
        sampler.close()
        assert sampler.sample() is None
    finally:
        for proc in reversed(procs._tree(root.pid)):
            proc.kill()
        root.wait(10)
        if root.stdout is not None:
            root.stdout.close()
