"""Run toolcell and its peers side by side in one run, and print a comparison table.

Every (concurrency, repeat) point runs each server in turn (A B A B ...), so the machine's
noise is shared instead of landing on one server. Each run spawns a fresh server process,
opens a session, warms up, measures for ``--seconds`` and stops the server.

    python benchmarks/run.py                                   # toolcell vs the SDK, c=1,16,128, 3 x 10 s
    python benchmarks/run.py --servers sdk --seconds 2 --repeat 1 --concurrency 1,16
    python benchmarks/run.py --target "npx -y @modelcontextprotocol/server-everything" --tool echo \\
        --args '{"message": "hi"}'                             # aim it at any MCP stdio server
    python benchmarks/run.py --http --concurrency 16           # Streamable HTTP: toolcell vs the SDK
    python benchmarks/run.py --http --target "mysrv --port {port}" --target "other=http://10.0.0.5:9000/mcp"

It runs on the ``toolcell bench`` engine (``runtime/bench``); ``toolcell bench`` itself aims at
any server, this script keeps the named peers and the table RESULTS.md has always used. See
benchmarks/README.md for what is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence

import msgspec
import report
import targets
from report import LoadResult, Run

sys.path.insert(0, str(targets.REPO_ROOT))  # the engine (runtime.bench) from this checkout

from runtime.bench import runner, scenario, wire  # noqa: E402
from runtime.bench.load import Shape, Timing  # noqa: E402
from runtime.bench.procs import ProcMemory  # noqa: E402
from runtime.bench.report import Segment  # noqa: E402
from runtime.bench.runner import Events  # noqa: E402
from runtime.bench.targets import TargetSpec  # noqa: E402


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    parser = argparse.ArgumentParser(
        description="Compare MCP stdio servers under load (toolcell vs its peers).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--servers",
        default=None,
        help="comma-separated named servers: toolcell, sdk, fastmcp, fake (default: toolcell,sdk; with --target: sdk)",
    )
    parser.add_argument(
        "--target",
        action="append",
        default=[],
        metavar="[NAME=]CMD",
        help="any MCP stdio server command to benchmark too (repeatable); with --http: a command with {port} "
        "in it (served at http://127.0.0.1:{port}/mcp, see --path) or the URL of a running server",
    )
    parser.add_argument(
        "--http",
        action="store_true",
        help="Streamable HTTP instead of stdio: C keep-alive connections, one call in flight on each",
    )
    parser.add_argument("--path", default="/mcp", help="endpoint path of --http --target commands")
    parser.add_argument("--token", default=None,
                        help="bearer token sent over HTTP (default: the one the toolcell target is configured with)")
    parser.add_argument("--concurrency", type=_int_list, default=[1, 16, 128], help="calls in flight, e.g. 1,16,128")
    parser.add_argument("--repeat", type=int, default=3, help="runs per point (the median is reported)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before measuring")
    parser.add_argument("--tool", default="echo", help="tool to call")
    parser.add_argument("--args", default='{"text": "hello"}', help="tool arguments, a JSON object")
    parser.add_argument(
        "--modern",
        action="store_true",
        help="2026-07-28 requests with params._meta and no handshake (default: legacy initialize)",
    )
    parser.add_argument("--plugins", default=str(targets.BENCH_DIR / "plugins"), help="toolcell plugin directory")
    parser.add_argument("--json", metavar="PATH", help="write environment, raw runs and summary as JSON")
    parser.add_argument("--markdown", action="store_true", help="print the results as markdown (for RESULTS.md)")
    args = parser.parse_args(argv)
    if args.servers is None:
        args.servers = "sdk" if args.target else "toolcell,sdk"
    args.server_names = [s.strip() for s in args.servers.split(",") if s.strip() and s.strip() != "none"]
    arguments = json.loads(args.args)
    if not isinstance(arguments, dict):
        parser.error("--args must be a JSON object")
    args.arguments = arguments
    if args.repeat < 1 or args.seconds <= 0 or not args.concurrency or min(args.concurrency) < 1:
        parser.error("--repeat, --seconds and --concurrency must be positive")
    return args


def _progress(text: str, end: str = "\n") -> None:
    print(text, end=end, file=sys.stderr, flush=True)


def _eta(done: int, total: int, elapsed_s: float, per_run_guess_s: float) -> str:
    per_run = elapsed_s / done if done else per_run_guess_s
    left = int(per_run * (total - done))
    return f"{left // 60}m{left % 60:02d}s"


class _Progress(Events):
    """One line per run on stderr, as the runs happen."""

    def __init__(self, repeat: int, per_run_guess_s: float) -> None:
        self.repeat = repeat
        self.guess = per_run_guess_s
        self.started = time.monotonic()
        self.total = 0
        self.index = 0

    def segment_start(self, index: int, total: int, target: str, step: str, repeat: int) -> None:
        self.index, self.total = index, total
        _progress(f"[{index:{len(str(total))}}/{total}] {target} {step:<6} rep {repeat}/{self.repeat} ... ", end="")

    def segment_end(self, segment: Segment) -> None:
        if segment.skipped is not None:
            _progress(f"FAILED: {segment.skipped.splitlines()[0][:300]}")
            return
        eta = _eta(self.index, self.total, time.monotonic() - self.started, self.guess)
        errors = sum(segment.errors.values())
        cpu = segment.server_cpu_us_per_call or 0.0
        _progress(f"{segment.calls_per_s:>9,.0f} calls/s  p50 {segment.latency.p50_ms:7.3f} ms  "
                  f"p99 {segment.latency.p99_ms:7.2f} ms  err {errors}  cpu {cpu:,.0f} µs/call  (ETA {eta})")


def _memory(procs: Sequence[ProcMemory]) -> list[ProcMemory]:
    return [msgspec.structs.replace(p, role="daemon" if p.role == "server" else p.role) for p in procs]


def run_all(servers: Sequence[targets.Target], args: argparse.Namespace) -> list[Run]:
    """Run every point with the ``toolcell bench`` engine (a fresh server per run, servers
    interleaved), with a progress line per run on stderr."""
    specs = [TargetSpec(name=s.name, spec=" ".join(s.argv) or (s.url or ""), transport="http" if s.url else "stdio",
                        argv=list(s.argv), url=s.url, cwd=s.cwd) for s in servers]
    headers = []
    token = args.token or (targets.BENCH_TOKEN if args.http else None)
    if args.http and token:
        headers.append(("Authorization", f"Bearer {token}"))
    plan = runner.Plan(
        targets=specs, scenario=scenario.from_flags([], args.tool, json.dumps(args.arguments), None, None, None),
        steps=[Shape("closed", concurrency=c) for c in args.concurrency],
        timing=Timing(args.warmup, args.seconds, 0, 10.0), repeat=args.repeat, modern=args.modern, headers=headers,
        ceiling=False, phases=False, baseline=report.BASELINE if "sdk" in [s.name for s in servers] else None,
        fresh=True)
    result = runner.run(plan, _Progress(args.repeat, args.seconds + args.warmup + 2))
    request_bytes = len(wire.RequestTemplate("tools/call", {"name": args.tool, "arguments": args.arguments},
                                             args.modern).render(1, None)) - 1
    by_name = {t.name: t for t in result.targets}
    steps = {s.label(): s.concurrency for s in plan.steps}
    runs: list[Run] = []
    for seg in result.segments:
        c = steps[seg.step]
        if seg.skipped is not None:
            runs.append(Run(seg.target, c, seg.repeat, error=seg.skipped))
            continue
        t = by_name[seg.target]
        errors = sum(seg.errors.values())
        sample = next((v[0] for v in seg.error_samples.values() if v), None)
        lat = seg.latency
        runs.append(Run(seg.target, c, seg.repeat, result=LoadResult(
            concurrency=c, modern=args.modern, duration_s=seg.window_s, calls=seg.ok + errors,
            calls_per_s=seg.calls_per_s, p50_ms=lat.p50_ms, p90_ms=lat.p90_ms, p99_ms=lat.p99_ms, max_ms=lat.max_ms,
            mean_ms=lat.mean_ms, errors=errors, lost=seg.errors.get("timeout", 0), unexpected=seg.unexpected,
            error_sample=sample, server_cpu_s=seg.server_cpu_s or 0.0,
            server_cpu_us_per_call=seg.server_cpu_us_per_call or 0.0, server_cpu_pct=seg.server_cpu_pct or 0.0,
            client_cpu_pct=seg.client_cpu_pct, ready_s=t.ready_s, request_bytes=request_bytes,
            rss_idle=_memory(t.rss_idle),
            rss_loaded=[ProcMemory(0, "daemon", "whole tree", seg.server_rss_bytes)] if seg.server_rss_bytes else [])))
    return runs


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: resolve servers, run, print the table, optionally write JSON."""
    args = parse_args(argv)
    config_dir = tempfile.mkdtemp(prefix="toolcell-bench-") if args.http else None
    try:
        servers = targets.resolve(args.server_names, args.target, args.plugins, config_dir, args.path)
    except ValueError as exc:
        print(f"run.py: {exc}", file=sys.stderr)
        return 2
    if not servers:
        print("run.py: nothing to run (give --servers or --target)", file=sys.stderr)
        return 2
    env = report.environment()
    _progress("\n".join(report.environment_lines(env)[:3]))
    for srv in servers:
        _progress(f"  {srv.name}: {' '.join(srv.argv)}")
    runs = run_all(servers, args)
    env["loadavg_after"] = os.getloadavg()
    names = [s.name for s in servers]
    rows = report.summarise(runs, names, args.concurrency)
    era = "2026-07-28 (_meta, no handshake)" if args.modern else "2025-06-18 (initialize handshake)"
    transport = "Streamable HTTP (keep-alive connections, one call in flight on each)" if args.http else "stdio"
    heading = (
        f"tools/call {args.tool} over {transport}, {era}; median of {args.repeat} x {args.seconds:g} s "
        f"after {args.warmup:g} s warm-up; spread = half the min-max range of calls/s"
    )
    if args.markdown:
        print(f"{heading}\n\n{report.markdown_table(rows)}\n")
        print("\n".join(f"- {line}" for line in report.environment_lines(env) + report.memory_lines(runs, names)))
    else:
        print(f"\n{heading}\n\n{report.text_table(rows)}\n")
        print("\n".join(report.environment_lines(env) + report.memory_lines(runs, names)))
    failures = [r for r in runs if r.error]
    if failures:
        print(
            f"\n{len(failures)} run(s) failed; first: {failures[0].server} c={failures[0].concurrency}: "
            f"{failures[0].error.splitlines()[0] if failures[0].error else ''}",
            file=sys.stderr,
        )
    if args.json:
        payload = {
            "environment": env,
            "config": {k: v for k, v in vars(args).items() if k not in {"server_names"}},
            "servers": servers,
            "runs": runs,
            "summary": rows,
        }
        with open(args.json, "wb") as f:
            f.write(msgspec.json.format(msgspec.json.encode(payload)))
        _progress(f"raw results written to {args.json}")
    return 1 if failures and not rows else 0


if __name__ == "__main__":
    sys.exit(main())
