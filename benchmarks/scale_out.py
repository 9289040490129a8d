"""Scale-out: N = 1, 2, 3 toolcell replicas behind HAProxy (the shipped ``deploy/haproxy/haproxy.cfg``)
sharing one redis-server, measured side by side by the bench engine (``toolcell bench``, interleaved
segments) with one replica reached directly (what the balancer's hop costs) and HAProxy in front of
the bench's trivial server (the balancer's own ceiling on this machine; the engine adds the trivial
server reached directly, the client's ceiling)::

    python benchmarks/scale_out.py --duration 5 --repeat 3 --concurrency 64 [--era legacy]

Server CPU per call is measured here (the engine does not measure servers it did not start): the
user+system time of every process of a set (its replicas, their workers, its HAProxy) across the
whole run, less what the set burns idle (measured for 5 s before; a set idles while the others
are measured), divided by the calls that set answered. Warm-up is off so that the calls counted are all
the calls served. Prints a markdown table; ``--json FILE`` keeps the engine's report.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
_SERVER_LINE = re.compile(r'^    server replica(\d+) "\$\{TOOLCELL_REPLICA_\1\}" check\n', re.MULTILINE)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def haproxy_config(replicas: int, check: bool = True) -> str:
    """The shipped config with one ``server`` line per replica (without health checks for a backend
    that has no ``/healthz``: the trivial server)."""
    text = HAPROXY_CFG.read_text()
    first = _SERVER_LINE.search(text)
    assert first is not None, "deploy/haproxy/haproxy.cfg lost its server lines"
    suffix = " check" if check else ""
    servers = "".join(f'    server replica{i} "${{TOOLCELL_REPLICA_{i}}}"{suffix}\n' for i in range(1, replicas + 1))
    return text[:first.start()] + servers + _SERVER_LINE.sub("", text[first.start():])


class Stack:
    """Processes started here, stopped in reverse order."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, argv: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.work / log, "wb") as f:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=f, stderr=f, cwd=str(REPO),
                                    env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
            except psutil.Error:
                pass
            proc.kill()
            proc.wait()


def wait_for(predicate: Any, what: str, within: float = 90.0) -> Any:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"scale_out: {what} did not come up within {within:.0f} s")


def start_replica(stack: Stack, name: str, redis_url: str, key_file: Path) -> tuple[subprocess.Popen[bytes], str]:
    folder = stack.work / name
    folder.mkdir()
    cfg = folder / "toolcell.toml"
    cfg.write_text(f'state_dir = "{folder / "state"}"\nstate_key_file = "{key_file}"\nwatch = false\n'
                   f'[tasks]\nstore = "{redis_url}"\n')
    proc = stack.start([sys.executable, "-m", "runtime.cli", "serve", "--config", str(cfg), "--http", "127.0.0.1:0",
                        "--no-watch", "--plugins", str(BENCH_DIR / "plugins")], f"{name}.log")

    def endpoint() -> str | None:
        if proc.poll() is not None:
            raise SystemExit(f"scale_out: {name} exited:\n{(stack.work / f'{name}.log').read_text()[-3000:]}")
        found = re.search(r"MCP endpoint http://(\S+)/mcp", (stack.work / f"{name}.log").read_text())
        return found.group(1) if found else None

    return proc, wait_for(endpoint, name)


def start_haproxy(stack: Stack, name: str, backends: list[str], check: bool = True) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cfg = stack.work / f"{name}.cfg"
    cfg.write_text(haproxy_config(len(backends), check))
    env = {"TOOLCELL_BALANCER_LISTEN": f"127.0.0.1:{port}"}
    env |= {f"TOOLCELL_REPLICA_{i}": addr for i, addr in enumerate(backends, 1)}
    proc = stack.start([shutil.which("haproxy") or "/usr/sbin/haproxy", "-db", "-f", str(cfg)], f"{name}.log", env)
    wait_for(lambda: _accepts(port), name)
    return proc, f"127.0.0.1:{port}"


def _accepts(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _haproxy_version() -> str:
    out = subprocess.run([shutil.which("haproxy") or "/usr/sbin/haproxy", "-v"], capture_output=True, text=True, check=False)
    found = re.search(r"version (\S+)", out.stdout)
    return found.group(1) if found else "?"


def cpu_s(procs: list[subprocess.Popen[bytes]]) -> float:
    """User + system CPU of these processes and everything below them (workers), dead children included."""
    total = 0.0
    for proc in procs:
        try:
            p = psutil.Process(proc.pid)
            members = [p, *p.children(recursive=True)]
        except psutil.Error:
            continue
        for m in members:
            try:
                t = m.cpu_times()
                total += t.user + t.system + (t.children_user + t.children_system if m is p else 0.0)
            except psutil.Error:
                pass
    return total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--era", choices=["modern", "legacy"], default="modern")
    ap.add_argument("--json", help="keep the engine's report here")
    ap.add_argument("--idle", type=float, default=5.0, help="seconds each set's idle CPU is measured (default 5)")
    args = ap.parse_args()
    for binary in ("haproxy", "redis-server"):
        if shutil.which(binary) is None and not os.path.exists(f"/usr/sbin/{binary}"):
            raise SystemExit(f"scale_out: {binary} is not installed (sh tests/system-packages.sh installs it)")
    work = Path(tempfile.mkdtemp(prefix="scale-out-"))
    stack = Stack(work)
    try:
        sock = work / "redis.sock"
        stack.start([shutil.which("redis-server") or "/usr/bin/redis-server", "--port", "0", "--unixsocket", str(sock),
                     "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", str(work)], "redis.log")
        wait_for(sock.exists, "redis-server")
        redis_url = f"unix://{sock}?db=0"
        key_file = work / "request-state.key"
        key_file.write_text(os.urandom(32).hex())
        key_file.chmod(0o600)

        sets: dict[str, tuple[list[subprocess.Popen[bytes]], str]] = {}
        proc, addr = start_replica(stack, "direct", redis_url, key_file)
        sets["direct"] = ([proc], addr)
        for n in (1, 2, 3):
            replicas = [start_replica(stack, f"n{n}-r{i}", redis_url, key_file) for i in range(1, n + 1)]
            balancer, addr = start_haproxy(stack, f"haproxy-n{n}", [a for _, a in replicas])
            sets[f"haproxy-{n}"] = ([p for p, _ in replicas] + [balancer], addr)
        trivial_port = free_port()
        trivial = stack.start([sys.executable, "-m", "runtime.bench.trivial_server", "--http", "--port",
                               str(trivial_port), "--tools", "echo"], "trivial.log")
        wait_for(lambda: _accepts(trivial_port), "trivial server")
        balancer, addr = start_haproxy(stack, "haproxy-trivial", [f"127.0.0.1:{trivial_port}"], check=False)
        sets["haproxy-trivial"] = ([trivial, balancer], addr)

        report = Path(args.json) if args.json else work / "report.json"
        targets = [f"{name}=http://{addr}/mcp" for name, (_, addr) in sets.items()]
        # What each set burns idle (health checks, heartbeats, spare workers), over a quiet while:
        # taken off its figure, since a set idles while the others are measured.
        quiet = {name: cpu_s(procs) for name, (procs, _) in sets.items()}
        time.sleep(args.idle)
        idle_rate = {name: (cpu_s(procs) - quiet[name]) / args.idle for name, (procs, _) in sets.items()}
        started = time.monotonic()
        before = {name: cpu_s(procs) for name, (procs, _) in sets.items()}
        bench = [sys.executable, "-m", "runtime.cli", "bench", *targets, "--tool", "echo", "--args",
                 '{"text": "hi {{seq}}"}', "--expect-text", "hi {{seq}}", "-c", str(args.concurrency),
                 "-d", str(args.duration), "--repeat", str(args.repeat), "--warmup", "0", "--era", args.era,
                 "--json", str(report), "-q"]
        done = subprocess.run(bench, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
        after = {name: cpu_s(procs) for name, (procs, _) in sets.items()}
        elapsed = time.monotonic() - started
        if done.returncode != 0:
            print(f"scale_out: toolcell bench exited {done.returncode}", file=sys.stderr)
        data = json.loads(report.read_text())
        answered: dict[str, int] = {}
        for seg in data.get("segments", []):
            answered[seg["target"]] = answered.get(seg["target"], 0) + int(seg.get("ok", 0))
        rows = {s["target"]: s for s in data.get("summary", [])}
        env = data.get("environment", {})
        print(f"\ncores: {env.get('cores')} ({env.get('cpu_model', '')}); load before {env.get('loadavg_before')}; "
              f"haproxy {_haproxy_version()}; concurrency {args.concurrency}; era {args.era}; "
              f"{args.repeat} x {args.duration:g} s segments, interleaved")
        print("\n| target | calls/s (median) | p50 ms | p99 ms | server CPU µs/call | errors |")
        print("|---|---:|---:|---:|---:|---:|")
        for name in [*sets, *[t for t in rows if t not in sets]]:
            row = rows.get(name)
            if row is None:
                continue
            lat = row["latency"]
            calls = answered.get(name, 0)
            busy = after[name] - before[name] - idle_rate[name] * elapsed if name in sets else 0.0
            cpu = f"{busy / calls * 1e6:.0f}" if name in sets and calls else "-"
            print(f"| {name} | {row['calls_per_s']:.0f} | {lat.get('p50_ms', 0):.2f} | {lat.get('p99_ms', 0):.2f} | "
                  f"{cpu} | {sum(row['errors'].values())} |")
        return done.returncode
    finally:
        stack.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
