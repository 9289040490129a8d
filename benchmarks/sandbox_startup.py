"""Worker start-up cost, idle memory and per-call (zygote) throughput, by isolation policy.

Spawns workers exactly as the daemon does (``python -I -S -c <bootstrap>``, IPC socket on fd 3,
new session, scratch dir as cwd), on a one-tool plugin written to a temp dir, and measures:

* start-up: spawn -> ``Ready`` received (median and p90 of N runs), per policy;
* idle memory of a ready worker's whole process tree (RSS and PSS, from /proc/<pid>/smaps_rollup);
* calls/s and latency (p50, p99) of a trivial tool at concurrency 1 and 16 (median of ``--repeat``
  runs, configurations interleaved), with the worker tree's CPU per call:
  - one worker driven directly over its IPC socket (``per_call`` strict and none, pooled strict,
    and ``per_call`` strict with a plugin that imports logging, threading, random and the like);
  - the daemon's own ``WorkerPool`` (trio; up to ``max_concurrency`` = 4 workers, i.e. zygotes in
    ``per_call`` mode), ``per_call`` strict beside pooled strict;
* ``--profile``: the zygote's per-phase timings of N sequential ``per_call`` calls
  (``TOOLCELL_ZYGOTE_PROFILE=1``, reported on the worker's stderr).

Usage: ``python benchmarks/sandbox_startup.py [--runs 20] [--calls 1000] [--seconds 3] [--repeat 3]
[--concurrency 1,16] [--skip-startup] [--profile] [--json]``.
Not a test; records its environment with the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import site
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
sys.path.insert(0, REPO_ROOT)

from sandbox.isolation import cgroups
from sandbox.wire import (Call, CallReturned, Init, Limits, Permissions, Shutdown, encode_frame, from_worker_decoder,
                          split_frames)

PLUGIN = """
from sandbox import tool

@tool
def echo(text: str) -> str:
    return text
"""
#: The same tool in a plugin that imports what real plugins commonly do: every fork from its zygote
#: carries those modules' state (and os.fork() would run their at-fork hooks).
PLUGIN_TYPICAL_IMPORTS = "import decimal, json, logging, random, threading, urllib.parse\n" + PLUGIN


def _site_dirs() -> list[str]:
    out = [p for p in sys.path if "site-packages" in p]
    out += [p for p in site.getsitepackages() if p not in out]
    return out


class Worker:
    def __init__(self, plugin_dir: str, policy: str, mode: str, env: dict[str, str] | None = None,
                 stderr: bool = False) -> None:
        self.scratch = tempfile.mkdtemp(prefix="toolcell-bench-")
        parent, child = socket.socketpair()
        code = f"import sys; sys.path[:0]={[REPO_ROOT, *_site_dirs()]!r}; from sandbox.worker import main; main(3)"
        fd = child.fileno()
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", "-S", "-c", code],
            pass_fds=[3], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE if stderr else subprocess.DEVNULL,
            start_new_session=True, env={"PATH": "/usr/bin:/bin", **(env or {})}, cwd=self.scratch,
            preexec_fn=None if fd == 3 else (lambda: os.dup2(fd, 3)),  # noqa: PLW1509 (single-threaded)
        )
        child.close()
        self.sock = parent
        self.buf = bytearray()
        self.frames: list[bytes] = []
        self.sock.sendall(encode_frame(Init(
            plugin_name="bench", plugin_dir=plugin_dir, entry="bench_plugin", sys_path=[], env={},
            limits=Limits(), permissions=Permissions(), policy=policy, scratch_dir=self.scratch, mode=mode,
        )))

    def recv(self, timeout_s: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            self.frames += split_frames(self.buf)
            while self.frames:
                msg = from_worker_decoder.decode(self.frames.pop(0))
                if not isinstance(msg, CallReturned):  # follows each Result (sandbox.wire)
                    return msg
            r, _, _ = select.select([self.sock], [], [], max(deadline - time.monotonic(), 0))
            if not r:
                raise TimeoutError
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError
            self.buf += chunk

    def send_call(self, call_id: int) -> None:
        self.sock.sendall(encode_frame(Call(call_id, "echo", {"text": "x"})))

    def close(self) -> None:
        """Kill the worker's tree and clean up."""
        try:
            os.killpg(self.proc.pid, 9)
        except OSError:
            pass
        self.proc.wait(timeout=5)
        cgroups.cleanup(self.proc.pid)
        self.sock.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def tree_pids(pid: int) -> list[int]:
    """The worker and its descendants (through /proc/<pid>/task/<pid>/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return out


def memory_kb(pid: int) -> tuple[int, int]:
    rss = pss = 0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1])
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1])
        except OSError:
            pass
    return rss, pss


def _start_once(plugin_dir: str, policy: str) -> tuple[float, int, int, list[str]]:
    w = Worker(plugin_dir, policy, "pooled")
    try:
        ready = w.recv()
        ms = (time.perf_counter() - w.t0) * 1000
        time.sleep(0.02)
        rss, pss = memory_kb(w.proc.pid)
        return ms, rss, pss, list(getattr(ready, "layers", [type(ready).__name__]))
    finally:
        w.close()


def bench_startup(plugin_dir: str, policies: tuple[str, ...], runs: int) -> list[dict[str, Any]]:
    """Policies interleaved run by run, so a busy neighbour slows them alike."""
    samples: dict[str, list[tuple[float, int, int, list[str]]]] = {p: [] for p in policies}
    for _ in range(runs):
        for p in policies:
            samples[p].append(_start_once(plugin_dir, p))
    out = []
    for p in policies:
        times = sorted(s[0] for s in samples[p])
        out.append({
            "policy": p,
            "layers": samples[p][-1][3],
            "startup_ms_min": round(times[0], 1),
            "startup_ms_median": round(statistics.median(times), 1),
            "startup_ms_p90": round(times[max(int(len(times) * 0.9) - 1, 0)], 1),
            "idle_rss_kb_tree": int(statistics.median(s[1] for s in samples[p])),
            "idle_pss_kb_tree": int(statistics.median(s[2] for s in samples[p])),
        })
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of a worker's tree: each process's own time plus what it reaped (per-call children)."""
    tck = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in tree_pids(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / tck
        except (OSError, IndexError, ValueError):
            pass
    return total


def _pct(sorted_ms: list[float], q: float) -> float:
    return round(sorted_ms[min(int(len(sorted_ms) * q), len(sorted_ms) - 1)], 3) if sorted_ms else 0.0


def bench_direct(plugin_dir: str, policy: str, mode: str, calls: int, concurrency: int,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """One worker driven over its IPC socket with ``concurrency`` calls outstanding (pipelined)."""
    w = Worker(plugin_dir, policy, mode, env=env)
    try:
        w.recv()
        for i in range(20):  # warm-up
            w.send_call(i)
            w.recv()
        lat: list[float] = []
        sent: dict[int, float] = {}
        next_id = 100
        cpu0, t0, own0 = tree_cpu_s(w.proc.pid), time.perf_counter(), _own_cpu_s()
        while len(lat) < calls:
            while len(sent) < concurrency and next_id < 100 + calls:
                sent[next_id] = time.perf_counter()
                w.send_call(next_id)
                next_id += 1
            res = w.recv()
            assert not res.is_error, res
            lat.append((time.perf_counter() - sent.pop(res.id)) * 1000)
        elapsed = time.perf_counter() - t0
        cpu = tree_cpu_s(w.proc.pid) - cpu0
        own = _own_cpu_s() - own0
        lat.sort()
        return {"calls_per_s": round(calls / elapsed), "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99),
                "worker_cpu_us_per_call": round(cpu / calls * 1e6), "driver_cpu_us_per_call": round(own / calls * 1e6)}
    finally:
        w.close()


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


async def _pool_run(plugin_dir: str, state_dir: str, policy: str, mode: str, concurrency: int,
                    seconds: float) -> dict[str, Any]:
    import trio

    from runtime.manifest import Manifest
    from runtime.processes import PoolSpec
    from runtime.execution.pool import WorkerPool

    manifest = Manifest(name="bench", version="0", entry="bench_plugin", isolation=mode)
    lat: list[float] = []
    errors = 0
    async with trio.open_nursery() as nursery:
        pool = WorkerPool(PoolSpec(manifest, plugin_dir, policy, state_dir), nursery)
        await pool.start()

        async def caller(until: float, record: bool) -> None:
            nonlocal errors
            while time.perf_counter() < until:
                t = time.perf_counter()
                try:
                    res = await pool.run("echo", {"text": "x"}, False, -1, None)
                    ok = not res.is_error
                except Exception:  # noqa: BLE001 (counted, the run goes on)
                    ok = False
                if record:
                    lat.append((time.perf_counter() - t) * 1000)
                    errors += not ok

        async with trio.open_nursery() as warm:  # lets the pool start the workers this load needs
            for _ in range(concurrency):
                warm.start_soon(caller, time.perf_counter() + 1.0, False)
        pids = [w.pid for w in pool.workers]
        cpu0, own0, t0 = sum(tree_cpu_s(p) for p in pids), _own_cpu_s(), time.perf_counter()
        async with trio.open_nursery() as run:
            for _ in range(concurrency):
                run.start_soon(caller, t0 + seconds, True)
        elapsed = time.perf_counter() - t0
        cpu = sum(tree_cpu_s(p) for p in pids) - cpu0
        own = _own_cpu_s() - own0
        workers = len(pool.workers)
        await pool.aclose(grace_s=0)
        nursery.cancel_scope.cancel()
    lat.sort()
    n = max(len(lat), 1)
    return {"calls_per_s": round(len(lat) / elapsed), "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99),
            "errors": errors, "workers": workers, "worker_cpu_us_per_call": round(cpu / n * 1e6),
            "daemon_cpu_us_per_call": round(own / n * 1e6)}


def bench_pool(plugin_dir: str, policy: str, mode: str, concurrency: int, seconds: float) -> dict[str, Any]:
    """The daemon's own ``WorkerPool`` (trio, as ``toolcell serve`` uses it) under ``concurrency`` callers."""
    import trio

    from runtime import logs

    logs.configure("error")
    state_dir = tempfile.mkdtemp(prefix="toolcell-bench-state-")
    os.chmod(state_dir, 0o711)
    try:
        return trio.run(_pool_run, plugin_dir, state_dir, policy, mode, concurrency, seconds)
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise median of repeated runs, plus the calls/s of each run (its spread)."""
    out: dict[str, Any] = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = statistics.median(values) if all(isinstance(v, (int, float)) for v in values) else values[-1]
    out["runs_calls_per_s"] = [r["calls_per_s"] for r in runs]
    return out


def _versions() -> dict[str, Any]:
    import importlib.metadata as md

    out: dict[str, Any] = {"kernel": platform.release(), "python": platform.python_version(), "cpus": os.cpu_count(),
                           "euid": os.geteuid()}
    for dist in ("msgspec", "trio", "psutil"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = None
    try:
        out["git"] = subprocess.run(["git", "-C", REPO_ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=5, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out["git"] = None
    return out


def profile_per_call(plugin_dir: str, calls: int) -> str:
    """Run ``calls`` sequential per_call/strict calls with the zygote's phase timers on; return its report."""
    import threading

    w = Worker(plugin_dir, "strict", "per_call", env={"TOOLCELL_ZYGOTE_PROFILE": "1"}, stderr=True)
    chunks: list[bytes] = []
    assert w.proc.stderr is not None
    stderr = w.proc.stderr
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: stderr.read1(65536), b"")), daemon=True)
    reader.start()
    try:
        w.recv()
        for i in range(calls):
            w.send_call(i)
            w.recv()
        w.sock.sendall(encode_frame(Shutdown()))
        try:
            w.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    finally:
        w.close()
        reader.join(timeout=5)
    err = b"".join(chunks).decode(errors="replace")
    lines = [line for line in err.splitlines() if not line.startswith("toolcell call profile: ")]
    # One line per call process: fork, start, faults, ready, faults, got call, faults, sent result, faults.
    marks = [[float(x) for x in line.split(": ", 1)[1].split()] for line in err.splitlines()
             if line.startswith("toolcell call profile: ")]
    if marks:
        def med(i: int, j: int) -> float:
            return statistics.median(m[j] - m[i] for m in marks)

        lines.append(f"toolcell call processes: {len(marks)}; fork -> first statement {med(0, 1):.0f} us "
                     f"({statistics.median(m[2] for m in marks):.0f} page faults by then); "
                     f"setup {med(1, 3):.0f} us ({med(2, 4):.0f} faults); "
                     f"call read -> result sent {med(5, 7):.0f} us ({med(6, 8):.0f} faults)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20, help="start-ups per policy")
    ap.add_argument("--calls", type=int, default=1000, help="calls per direct (one worker) run")
    ap.add_argument("--seconds", type=float, default=3.0, help="length of each pool run")
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration (medians are reported)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the zygote's per-phase timings and exit")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    plugin_dir = tempfile.mkdtemp(prefix="toolcell-bench-plugin-")
    os.chmod(plugin_dir, 0o755)
    Path(plugin_dir, "bench_plugin.py").write_text(PLUGIN)
    typical_dir = tempfile.mkdtemp(prefix="toolcell-bench-plugin-")
    os.chmod(typical_dir, 0o755)
    Path(typical_dir, "bench_plugin.py").write_text(PLUGIN_TYPICAL_IMPORTS)
    try:
        if args.profile:
            print(profile_per_call(plugin_dir, args.calls))
            return 0
        report: dict[str, Any] = {"env": {**_versions(), "loadavg_at_start": os.getloadavg()}}
        if not args.skip_startup:
            report["startup"] = bench_startup(plugin_dir, ("none", "strict"), args.runs)
        direct: dict[str, list[dict[str, Any]]] = {}
        pool: dict[str, list[dict[str, Any]]] = {}
        for _ in range(args.repeat):  # configurations interleaved run by run: a busy neighbour hits them alike
            for c in levels:
                for mode, policy in (("per_call", "strict"), ("per_call", "none")):
                    direct.setdefault(f"{mode}/{policy} c={c}", []).append(
                        bench_direct(plugin_dir, policy, mode, args.calls, c))
                direct.setdefault(f"per_call/strict, imports c={c}", []).append(
                    bench_direct(typical_dir, "strict", "per_call", args.calls, c))
                direct.setdefault(f"pooled/strict c={c}", []).append(
                    bench_direct(plugin_dir, "strict", "pooled", args.calls * 20, c))
                for mode in ("per_call", "pooled"):
                    pool.setdefault(f"{mode}/strict c={c}", []).append(
                        bench_pool(plugin_dir, "strict", mode, c, args.seconds))
        report["direct"] = {k: _median_runs(v) for k, v in direct.items()}
        report["pool"] = {k: _median_runs(v) for k, v in pool.items()}
        report["env"]["loadavg_at_end"] = os.getloadavg()
    finally:
        shutil.rmtree(plugin_dir, ignore_errors=True)
        shutil.rmtree(typical_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    env = report["env"]
    print(f"git {env['git']}, kernel {env['kernel']}, Python {env['python']}, msgspec {env['msgspec']}, "
          f"trio {env['trio']}, psutil {env['psutil']}, {env['cpus']} CPUs, euid {env['euid']}, load average "
          f"{env['loadavg_at_start'][0]:.2f} at start, {env['loadavg_at_end'][0]:.2f} at end")
    if "startup" in report:
        print(f"{'policy':8} {'ready ms: min':>13} {'median':>7} {'p90':>7} {'idle RSS KiB':>13} "
              f"{'idle PSS KiB':>13}  layers")
        for s in report["startup"]:
            print(f"{s['policy']:8} {s['startup_ms_min']:>13} {s['startup_ms_median']:>7} {s['startup_ms_p90']:>7} "
                  f"{s['idle_rss_kb_tree']:>13} {s['idle_pss_kb_tree']:>13}  {','.join(s['layers'])}")
    for title, rows, side in (("one worker, driven over its IPC socket", report["direct"], "driver"),
                              ("the daemon's WorkerPool (trio)", report["pool"], "daemon")):
        print(f"\n{title} (median of {args.repeat}):")
        print(f"{'mode/policy c':31} {'calls/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'worker CPU us/call':>19} "
              f"{side + ' CPU us/call':>19}  runs")
        for k, v in rows.items():
            print(f"{k:31} {v['calls_per_s']:>8} {v['p50_ms']:>8} {v['p99_ms']:>8} {v['worker_cpu_us_per_call']:>19} "
                  f"{v[side + '_cpu_us_per_call']:>19}  {v['runs_calls_per_s']}"
                  + (f" errors {v['errors']}" if v.get("errors") else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
