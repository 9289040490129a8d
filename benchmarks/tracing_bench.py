"""What traces cost: HTTP calls/s with OpenTelemetry off and on, side by side in one run.

Daemons from this tree with traces off (no ``OTEL_*``) and on (OTLP/HTTP to a receiver in this
script that reads and drops every export, so the collector costs nothing), and optionally one per
``--tree NAME=DIR`` (another checkout, e.g. the commit before traces existed: "off costs nothing"
is this tree off vs that one). Each serves ``benchmarks/plugins``; ``toolcell bench`` calls ``echo``
at ``--concurrency`` over a legacy session with a bearer token, the daemons in turn, ``--repeat``
rounds, so the machine's noise falls on all of them.

    git worktree add --detach /tmp/before <commit>
    python benchmarks/tracing_bench.py --tree before=/tmp/before [--seconds 5] [--repeat 3] [--markdown]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.bench.procs import cpu_delta_s, cpu_snapshot  # noqa: E402
TOKEN = "tc_bench_tracing_token_0123456789"


class Sink:
    """An OTLP/HTTP endpoint that reads every export and drops it (counting the bytes)."""

    def __init__(self) -> None:
        self.bytes = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                sink.bytes += len(self.rfile.read(int(self.headers.get("content-length", "0"))))
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _start(tree: Path, tmp: Path, name: str, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    config = tmp / f"{name}.toml"
    config.write_text(f'[http]\n[[http.tokens]]\nprincipal = "bench"\n'
                      f'sha256 = "{hashlib.sha256(TOKEN.encode()).hexdigest()}"\n')
    log = tmp / f"{name}.log"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--config", str(config), "--plugins",
                             str(REPO / "benchmarks" / "plugins"), "--http", "127.0.0.1:0"],
                            cwd=tree, env={**clean, "PYTHONPATH": str(tree), **env},
                            stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = re.search(r"MCP endpoint (http://\S+)", log.read_text(errors="replace"))
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{name} did not start:\n{log.read_text(errors='replace')}")


WARMUP_S = 1.0


def _bench(url: str, pid: int, seconds: float, concurrency: int) -> tuple[float, float]:
    """(calls/s, server CPU µs per call: the daemon and its workers, over warm-up and measurement)."""
    before = cpu_snapshot(pid)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "runtime.cli", "bench", url, "--token", TOKEN, "--tool", "echo",
                        "--args", '{"text": "hi"}', "-c", str(concurrency), "-d", str(seconds), "--warmup",
                        str(WARMUP_S), "--no-ceiling", "-q", "--json", out.name], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL)
        rate = float(json.loads(Path(out.name).read_bytes())["summary"][0]["calls_per_s"])
    used = cpu_delta_s(before, cpu_snapshot(pid))
    return rate, used / max(1.0, rate * (seconds + WARMUP_S)) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR", help="another checkout (traces off)")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    sink = Sink()
    with tempfile.TemporaryDirectory() as tmp_text:
        tmp = Path(tmp_text)
        servers: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        try:
            for spec in args.tree:
                name, _, directory = spec.partition("=")
                servers[name] = _start(Path(directory).resolve(), tmp, name, {})
            servers["traces off"] = _start(REPO, tmp, "off", {})
            servers["traces on"] = _start(REPO, tmp, "on", {"OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
                                                             "OTEL_SERVICE_NAME": "toolcell-bench"})
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in servers}
            for _ in range(args.repeat):
                for name, (proc, url) in servers.items():
                    runs[name].append(_bench(url, proc.pid, args.seconds, args.concurrency))
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(timeout=30)
            sink.server.shutdown()
            sink.server.server_close()
    base = statistics.median(r for r, _ in runs["traces off"])
    base_cpu = statistics.median(c for _, c in runs["traces off"])
    print(f"# tracing_bench: HTTP c={args.concurrency}, {args.repeat} rounds x {args.seconds:g} s, daemons in turn; "
          f"Python {platform.python_version()}, {os.cpu_count()} cores; {sink.bytes:,} bytes of spans exported")
    sep = " | " if args.markdown else "  "
    print(sep.join(["daemon", "calls/s (median)", "vs traces off", "server CPU µs/call (median)", "vs traces off",
                    "calls/s runs"]))
    if args.markdown:
        print("|".join(["---"] * 6))
    for name, values in runs.items():
        median = statistics.median(r for r, _ in values)
        cpu = statistics.median(c for _, c in values)
        print(sep.join([name, f"{median:,.0f}", f"{median / base:.3f}", f"{cpu:,.0f}", f"{cpu / base_cpu:.3f}",
                        ", ".join(f"{r:,.0f}" for r, _ in values)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
