"""The daemon's own CPU per call, apart from any client and transport: a real daemon (the bundled
``echo`` plugin in real workers) driven in-process through ``runtime.connection.Connection`` with
``-c`` calls kept in flight, the request bytes made up front. What is measured is the daemon's main
thread: parsing a ``tools/call``, the checks, the pool, the worker frames, the result's checks and
its encoding — everything a transport hands over and gets back. Prints µs of CPU per call (the main
thread's, and the whole process's) and calls/s; ``--profile FILE`` writes a cProfile of one run.

    python benchmarks/daemon_path.py [--seconds 4] [--repeat 3] [-c 16] [--policy none] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.config import load_config  # noqa: E402
from runtime.connection import Connection  # noqa: E402
from runtime.daemon import open_daemon  # noqa: E402

INIT = (b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-06-18",'
        b'"capabilities":{},"clientInfo":{"name":"daemon_path","version":"1"}}}')


class _Loop:
    """A closed loop of calls: each answer sends the next request, until ``stop``."""

    def __init__(self, conn: Connection, count: int) -> None:
        self.conn = conn
        self.requests = [b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"echo",'
                         b'"arguments":{"text":"hi %d"}}}' % (i, i) for i in range(1, count + 1)]
        self.sent = self.answered = self.errors = 0
        self.stopping = False
        self.idle = trio.Event()

    def send_next(self) -> None:
        if self.stopping or self.sent >= len(self.requests):
            return
        request = self.requests[self.sent]
        self.sent += 1
        self.conn.dispatch(self.conn.receive(request), self)

    # the Sink the connection answers through
    def emit(self, data: bytes) -> None:
        pass

    def done(self, data: bytes, error_code: int | None = None) -> None:
        self.answered += 1
        if error_code is not None or b'"isError":true' in data:
            self.errors += 1
        self.send_next()
        if self.answered == self.sent:
            self.idle.set()

    def cancelled(self) -> None:
        self.done(b"", -1)


async def _run(args: argparse.Namespace, state: str) -> list[dict[str, float]]:
    cfg = load_config(None, {"plugins": [str(REPO / "benchmarks" / "plugins")], "policy": args.policy,
                             "watch": False, "state_dir": state, "log_level": "error"})
    out = []
    async with open_daemon(cfg) as daemon:
        conn = Connection(daemon)
        conn.receive(INIT)
        conn.dispatch(conn.receive(b'{"jsonrpc":"2.0","method":"notifications/initialized"}'), _Loop(conn, 0))
        for i in range(args.repeat + 1):  # the first run warms up (workers, caches) and is not counted
            loop = _Loop(conn, 10_000_000)
            if args.profile and i == args.repeat:
                import cProfile  # lazy: only --profile needs it

                profiler = cProfile.Profile()
                profiler.enable()
            thread0, process0, wall0 = time.thread_time(), time.process_time(), time.perf_counter()
            for _ in range(args.concurrency):
                loop.send_next()
            await trio.sleep(args.seconds if i else 1.0)
            loop.stopping = True
            answered, thread1, process1, wall1 = loop.answered, time.thread_time(), time.process_time(), time.perf_counter()
            if args.profile and i == args.repeat:
                profiler.disable()
                profiler.dump_stats(args.profile)
            await loop.idle.wait()
            if loop.errors:
                raise SystemExit(f"{loop.errors} calls failed")
            if i:
                out.append({"calls_per_s": answered / (wall1 - wall0),
                            "thread_us": (thread1 - thread0) / answered * 1e6,
                            "process_us": (process1 - process0) / answered * 1e6})
        conn.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("-c", "--concurrency", type=int, default=16)
    parser.add_argument("--policy", default="none", choices=["none", "compat", "strict"])
    parser.add_argument("--profile", help="write a cProfile of the last run here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="toolcell-daemon-path-") as state:
        runs = trio.run(_run, args, state)
    print(f"python {sys.version.split()[0]}, {len(os.sched_getaffinity(0))} cores, policy {args.policy}, "
          f"c={args.concurrency}, {args.repeat} x {args.seconds:g} s")
    print("| run | calls/s | daemon main thread µs CPU/call | daemon process µs CPU/call |")
    print("|---|---:|---:|---:|")
    for n, run in enumerate(runs, 1):
        print(f"| {n} | {run['calls_per_s']:,.0f} | {run['thread_us']:.1f} | {run['process_us']:.1f} |")
    median: dict[str, Any] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"| median | {median['calls_per_s']:,.0f} | {median['thread_us']:.1f} | {median['process_us']:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
