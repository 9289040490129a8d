"""Worker start-up cost, idle memory and per-call (zygote) throughput, by isolation policy.

Spawns workers exactly as the daemon does (``python -I -S -c <bootstrap>``, IPC socket on fd 3,
new session, scratch dir as cwd), on a one-tool plugin written to a temp dir, and measures:

* start-up: spawn -> ``Ready`` received (median and p90 of N runs), per policy;
* idle memory of a ready worker's whole process tree (RSS and PSS, from /proc/<pid>/smaps_rollup);
* ``per_call`` mode: sequential calls per second of a trivial tool (one fork per call);
* pooled mode: sequential calls per second, for contrast.

Usage: ``python benchmarks/sandbox_startup.py [--runs 20] [--calls 1000] [--json]``.
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
from sandbox.wire import Call, Init, Limits, Permissions, encode_frame, from_worker_decoder, split_frames

PLUGIN = """
from sandbox import tool

@tool
def echo(text: str) -> str:
    return text
"""


def _site_dirs() -> list[str]:
    out = [p for p in sys.path if "site-packages" in p]
    out += [p for p in site.getsitepackages() if p not in out]
    return out


class Worker:
    def __init__(self, plugin_dir: str, policy: str, mode: str) -> None:
        self.scratch = tempfile.mkdtemp(prefix="toolcell-bench-")
        parent, child = socket.socketpair()
        code = f"import sys; sys.path[:0]={[REPO_ROOT, *_site_dirs()]!r}; from sandbox.worker import main; main(3)"
        fd = child.fileno()
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [os.path.realpath(sys.executable), "-I", "-S", "-c", code],
            pass_fds=[3], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, env={"PATH": "/usr/bin:/bin"}, cwd=self.scratch,
            preexec_fn=None if fd == 3 else (lambda: os.dup2(fd, 3)),  # noqa: PLW1509 (single-threaded)
        )
        child.close()
        self.sock = parent
        self.buf = bytearray()
        self.sock.sendall(encode_frame(Init(
            plugin_name="bench", plugin_dir=plugin_dir, entry="bench_plugin", sys_path=[], env={},
            limits=Limits(), permissions=Permissions(), policy=policy, scratch_dir=self.scratch, mode=mode,
        )))

    def recv(self, timeout_s: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            frames = split_frames(self.buf)
            if frames:
                assert len(frames) == 1
                return from_worker_decoder.decode(frames[0])
            r, _, _ = select.select([self.sock], [], [], max(deadline - time.monotonic(), 0))
            if not r:
                raise TimeoutError
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError
            self.buf += chunk

    def close(self) -> None:
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


def bench_calls(plugin_dir: str, policy: str, mode: str, calls: int, chunk: int = 200) -> dict[str, int]:
    """Sequential calls/s: overall, and the best chunk of ``chunk`` calls (the machine may be shared)."""
    w = Worker(plugin_dir, policy, mode)
    try:
        w.recv()
        for i in range(20):  # warm-up
            w.sock.sendall(encode_frame(Call(i, "echo", {"text": "x"})))
            w.recv()
        best = 0.0
        start = t = time.perf_counter()
        for i in range(calls):
            w.sock.sendall(encode_frame(Call(100 + i, "echo", {"text": "x"})))
            res = w.recv()
            assert res.id == 100 + i and not res.is_error, res
            if (i + 1) % chunk == 0:
                now = time.perf_counter()
                best = max(best, chunk / (now - t))
                t = now
        return {"overall": round(calls / (time.perf_counter() - start)), "best_chunk": round(best)}
    finally:
        w.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    plugin_dir = tempfile.mkdtemp(prefix="toolcell-bench-plugin-")
    os.chmod(plugin_dir, 0o755)
    Path(plugin_dir, "bench_plugin.py").write_text(PLUGIN)
    try:
        report: dict[str, Any] = {
            "env": {
                "kernel": platform.release(), "python": platform.python_version(), "cpus": os.cpu_count(),
                "euid": os.geteuid(), "loadavg_at_start": os.getloadavg()[0],
            },
            "startup": bench_startup(plugin_dir, ("none", "strict"), args.runs),
            "calls_per_s": {
                f"{mode}/{policy}": bench_calls(plugin_dir, policy, mode, args.calls)
                for mode in ("per_call", "pooled") for policy in ("none", "strict")
            },
        }
    finally:
        shutil.rmtree(plugin_dir, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    env = report["env"]
    print(f"kernel {env['kernel']}, Python {env['python']}, {env['cpus']} CPUs, euid {env['euid']}, "
          f"load average {env['loadavg_at_start']:.2f} at start")
    print(f"{'policy':8} {'ready ms: min':>13} {'median':>7} {'p90':>7} {'idle RSS KiB':>13} {'idle PSS KiB':>13}  layers")
    for s in report["startup"]:
        print(f"{s['policy']:8} {s['startup_ms_min']:>13} {s['startup_ms_median']:>7} {s['startup_ms_p90']:>7} "
              f"{s['idle_rss_kb_tree']:>13} "
              f"{s['idle_pss_kb_tree']:>13}  {','.join(s['layers'])}")
    for k, v in report["calls_per_s"].items():
        print(f"{k:18} {v['overall']:>8} calls/s overall, {v['best_chunk']:>8} best {200}-call chunk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
