"""Time from spawning ``toolcell serve --stdio`` to its first answer, with every bundled plugin loaded.

The daemon answers only once every plugin has been loaded (a worker started, isolated and the
plugin imported), so the first ``initialize`` answer marks "ready". Prints the median and max of
``--runs`` starts, and checks from the ``tools/list`` answer that every bundled plugin's tools are
there. Usage: ``python benchmarks/startup.py [--runs 10] [--policy strict]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one(policy: str) -> tuple[float, int]:
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--stdio", "--no-watch", "--policy", policy]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdin and proc.stdout
    proc.stdin.write(b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25",'
                     b'"capabilities":{},"clientInfo":{"name":"startup","version":"1"}}}\n')
    proc.stdin.flush()
    proc.stdout.readline()
    elapsed = time.perf_counter() - start
    proc.stdin.write(b'{"jsonrpc":"2.0","id":2,"method":"tools/list"}\n')
    proc.stdin.flush()
    tools = json.loads(proc.stdout.readline())["result"]["tools"]
    proc.stdin.close()
    proc.wait(10)
    return elapsed, len(tools)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--policy", default="strict")
    args = ap.parse_args()
    times, counts = [], set()
    for i in range(args.runs):
        t, n = one(args.policy)
        times.append(t * 1000)
        counts.add(n)
        print(f"  run {i + 1}/{args.runs}: {t * 1000:.0f} ms, {n} tools", file=sys.stderr)
    print(json.dumps({"policy": args.policy, "runs": args.runs, "median_ms": round(statistics.median(times)),
                      "max_ms": round(max(times)), "tools": sorted(counts), "nproc": os.cpu_count(),
                      "loadavg": os.getloadavg()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
