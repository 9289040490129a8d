"""Streamable HTTP side by side: toolcell source trees and the official SDK, with either client.

``run.py --http`` drives the servers with ``toolcell bench`` (Python). On a 2-core machine that
client takes half a core, which a single-process server such as the SDK does not miss but
toolcell (one daemon plus sandboxed workers) does. This script measures the same load
(``tools/call echo``, one call in flight on each of ``--concurrency`` keep-alive connections, a
legacy session with a bearer token and both rate limits on for toolcell, stateless JSON for the
SDK) with either client:

* ``--client wrk``: wrk (C, one thread) with a Lua hook that makes every request id unique and
  checks every answer (HTTP 200 and the echoed text);
* ``--client bench``: ``toolcell bench`` (what ``run.py`` uses).

Each server starts once and stays up; runs are interleaved (A B C A B C ...). It reports calls/s,
latency, errors, the server's CPU per call split into the daemon process and its descendants
(the sandboxed workers), and the client's CPU::

    git worktree add --detach /tmp/before 0be2cf0
    python benchmarks/http_side_by_side.py --client wrk --tree before=/tmp/before --repeat 5 --seconds 4
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from targets import BENCH_TOKEN, toolcell_http_config  # noqa: E402

LUA = r"""
local session = os.getenv("BENCH_SESSION") or ""
local token = os.getenv("BENCH_TOKEN") or ""
local n = 0
local bad = 0
request = function()
  n = n + 1
  local body = '{"jsonrpc":"2.0","id":' .. n ..
    ',"method":"tools/call","params":{"name":"echo","arguments":{"text":"hi"}}}'
  local headers = {["Content-Type"] = "application/json", ["Accept"] = "application/json, text/event-stream",
                   ["MCP-Protocol-Version"] = "2025-06-18"}
  if session ~= "" then headers["Mcp-Session-Id"] = session end
  if token ~= "" then headers["Authorization"] = "Bearer " .. token end
  return wrk.format("POST", "/mcp", headers, body)
end
response = function(status, headers, body)
  if status ~= 200 or not string.find(body, '"text":"hi"', 1, true) then bad = bad + 1 end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("BENCH %d %d %.3f %.3f %d\n", summary.requests, summary.duration,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000,
    bad + e.status + e.connect + e.read + e.write + e.timeout))
end
"""


class Server:
    """One server under test, started once: its process, endpoint, and legacy session (toolcell)."""

    def __init__(self, name: str, argv: list[str], cwd: str, port: int, token: str | None) -> None:
        self.name = name
        self.port = port
        self.token = token
        self.session: str | None = None
        self.proc = subprocess.Popen(argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.samples: list[dict[str, float]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def post(self, message: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream",
                   "MCP-Protocol-Version": "2025-06-18"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self.session:
            headers["Mcp-Session-Id"] = self.session
        try:
            conn.request("POST", "/mcp", json.dumps(message), headers)
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def open_session(self, stateless: bool) -> None:
        """Wait until the server answers, then open a legacy session (not for a stateless server)."""
        deadline = time.monotonic() + 60
        init = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
                "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                           "clientInfo": {"name": "http_side_by_side", "version": "1"}}}
        while True:
            try:
                status, headers, body = self.post(init)
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{self.name} did not start") from None
                time.sleep(0.3)
        if status != 200:
            raise SystemExit(f"{self.name}: initialize answered {status}: {body[:300]!r}")
        if not stateless:
            self.session = headers.get("mcp-session-id")
            self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=15)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports (all held open while choosing: a port closed and chosen again
    would put two servers on one port)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tree_cpu(pid: int) -> tuple[float, float]:
    """(the process's own CPU seconds, its descendants' CPU seconds)."""
    proc = psutil.Process(pid)
    own = proc.cpu_times()
    children = 0.0
    for child in proc.children(recursive=True):
        try:
            t = child.cpu_times()
            children += t.user + t.system
        except psutil.Error:
            pass
    return own.user + own.system, children


def _client_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_wrk(server: Server, concurrency: int, seconds: float, script: str) -> dict[str, float]:
    env = dict(os.environ, BENCH_SESSION=server.session or "", BENCH_TOKEN=server.token or "")
    out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "-s", script, server.url],
                         capture_output=True, text=True, env=env, timeout=seconds + 60)
    m = re.search(r"BENCH (\d+) (\d+) ([\d.]+) ([\d.]+) (\d+)", out.stdout)
    if m is None:
        raise SystemExit(f"wrk failed against {server.name}:\n{out.stdout}\n{out.stderr}")
    requests, duration_us, p50, p99, bad = m.groups()
    return {"calls": float(requests), "calls_per_s": int(requests) / (int(duration_us) / 1e6), "p50_ms": float(p50),
            "p99_ms": float(p99), "errors": float(bad), "window_s": int(duration_us) / 1e6}


def _run_bench(server: Server, concurrency: int, seconds: float, out: str) -> dict[str, float]:
    argv = [sys.executable, "-m", "runtime.cli", "bench", server.url, "--tool", "echo", "--args", '{"text": "hi"}',
            "--expect-text", "hi", "-c", str(concurrency), "-d", str(seconds), "--warmup", "0", "--no-ceiling",
            "--no-phases", "-q", "--json", out]
    if server.token:
        argv[4:4] = ["--token", server.token]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=seconds * 10 + 60)
    if proc.returncode != 0:
        raise SystemExit(f"toolcell bench failed against {server.name}: {proc.stderr[-2000:]}")
    seg = json.loads(Path(out).read_text())["segments"][0]
    errors = sum(seg["errors"].values()) + seg["unexpected"]
    return {"calls": float(seg["ok"] + errors), "calls_per_s": float(seg["calls_per_s"]),
            "p50_ms": float(seg["latency"]["p50_ms"]), "p99_ms": float(seg["latency"]["p99_ms"]),
            "errors": float(errors), "window_s": float(seg["window_s"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--client", choices=("wrk", "bench"), default="wrk")
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="another toolcell source tree to serve from (repeatable); this checkout is 'toolcell'")
    parser.add_argument("--no-sdk", action="store_true", help="leave out the official SDK server")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = parser.parse_args(argv)
    if args.client == "wrk" and shutil.which("wrk") is None:
        parser.error("--client wrk needs wrk (apt-get install wrk)")
    trees = [("toolcell", str(REPO))]
    for spec in args.tree:
        name, sep, directory = spec.partition("=")
        if not sep or not Path(directory, "runtime").is_dir():
            parser.error(f"--tree wants NAME=DIR with DIR a toolcell source tree: {spec!r}")
        trees.append((name, str(Path(directory).resolve())))
    work = tempfile.mkdtemp(prefix="toolcell-http-sbs-")
    script = os.path.join(work, "call.lua")
    Path(script).write_text(LUA)
    servers: list[Server] = []
    ports = _free_ports(len(trees) + 1)
    try:
        for (name, directory), port in zip(trees, ports, strict=False):
            os.makedirs(os.path.join(work, name))
            config = toolcell_http_config(os.path.join(work, name), os.path.join(directory, "benchmarks", "plugins"))
            servers.append(Server(name, [sys.executable, "-m", "runtime.cli", "serve", "--config", config, "--http",
                                         f"127.0.0.1:{port}"], directory, port, BENCH_TOKEN))
        if not args.no_sdk:
            port = ports[-1]
            servers.append(Server("sdk", [sys.executable, str(BENCH_DIR / "peers" / "sdk_server.py"), "--http",
                                          "--port", str(port)], str(REPO), port, None))
        for server in servers:
            server.open_session(stateless=server.name == "sdk")
        time.sleep(1)
        for server in servers:  # each answered on its own port, and is still the one there
            if server.proc.poll() is not None:
                raise SystemExit(f"{server.name} exited (code {server.proc.returncode}) after start-up")
            owner = [c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == server.port
                     and c.status == psutil.CONN_LISTEN]
            if owner and owner != [server.proc.pid]:
                raise SystemExit(f"{server.name}: port {server.port} is held by pid {owner}, not {server.proc.pid}")
        out = os.path.join(work, "bench.json")

        def one(server: Server, seconds: float) -> dict[str, float]:
            if args.client == "wrk":
                return _run_wrk(server, args.concurrency, seconds, script)
            return _run_bench(server, args.concurrency, seconds, out)

        for server in servers:  # warm-up, and a check that every answer is right
            warm = one(server, 1)
            if warm["errors"]:
                raise SystemExit(f"{server.name}: {warm['errors']:.0f} wrong answers in the warm-up")
        total = args.repeat * len(servers)
        done = 0
        for rep in range(args.repeat):
            for server in servers:
                own0, kids0 = _tree_cpu(server.proc.pid)
                client0 = _client_cpu()
                sample = one(server, args.seconds)
                own1, kids1 = _tree_cpu(server.proc.pid)
                client1 = _client_cpu()
                calls = max(1.0, sample["calls"])
                sample["daemon_us"] = (own1 - own0) / calls * 1e6
                sample["tree_us"] = (own1 - own0 + kids1 - kids0) / calls * 1e6
                sample["client_pct"] = (client1 - client0) / sample["window_s"] * 100
                server.samples.append(sample)
                done += 1
                print(f"[{done}/{total}] {server.name} rep {rep + 1}: {sample['calls_per_s']:,.0f} calls/s, p50 "
                      f"{sample['p50_ms']:.2f} ms, errors {sample['errors']:.0f}, daemon {sample['daemon_us']:.0f} "
                      f"µs/call, tree {sample['tree_us']:.0f} µs/call", file=sys.stderr)
    finally:
        for server in servers:
            server.stop()

    def med(server: Server, key: str) -> float:
        return statistics.median(s[key] for s in server.samples)

    sdk = next((s for s in servers if s.name == "sdk"), None)
    wrk = " ".join(subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.split()[:2]) \
        if args.client == "wrk" else "toolcell bench"
    print(f"\ntools/call echo over Streamable HTTP, c={args.concurrency} keep-alive connections, client {wrk}; "
          f"median of {args.repeat} x {args.seconds:g} s; {psutil.cpu_count()} CPUs; load average after "
          f"{os.getloadavg()[0]:.2f}\n")
    header = ["server", "calls/s", "spread", "p50 ms", "p99 ms", "errors", "daemon µs/call", "tree µs/call",
              "client CPU", "× sdk"]
    rows = []
    for server in servers:
        cps = [s["calls_per_s"] for s in server.samples]
        spread = (max(cps) - min(cps)) / 2 / statistics.median(cps) * 100
        ratio = f"{med(server, 'calls_per_s') / med(sdk, 'calls_per_s'):.2f}" if sdk is not None else "-"
        rows.append([server.name, f"{med(server, 'calls_per_s'):,.0f}", f"±{spread:.0f}%", f"{med(server, 'p50_ms'):.3f}",
                     f"{med(server, 'p99_ms'):.2f}", f"{sum(s['errors'] for s in server.samples):.0f}",
                     f"{med(server, 'daemon_us'):.0f}", f"{med(server, 'tree_us'):.0f}",
                     f"{med(server, 'client_pct'):.0f}%", ratio])
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|---|" + "---:|" * (len(header) - 1))
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))))
    return 0 if all(s["errors"] == 0 for server in servers for s in server.samples) else 1


if __name__ == "__main__":
    sys.exit(main())
