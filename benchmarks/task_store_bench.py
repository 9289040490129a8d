"""Task store benchmark: fill each backend with many tasks, then read them at high concurrency.

Store mode (the default) measures the durable task store itself (``runtime.task_store``), the way
the daemon uses it: ``create`` at concurrency C until N tasks exist (spread over 2,000 principals),
``transition`` half of them to completed with a small result, then ``get`` random tasks at
concurrency C for S seconds. It prints calls/s and latency percentiles per backend, with the
versions, core count and load average. Redis runs as a private ``redis-server`` on a unix socket
(started and stopped here) unless ``--redis-url`` names one.

    python benchmarks/task_store_bench.py                       # sqlite and redis, 100,000 tasks, c=64, 10 s
    python benchmarks/task_store_bench.py --backends sqlite --tasks 10000 -s 3 --markdown

End to end through a daemon (``tasks/get`` polling over HTTP): ``benchmarks/tasks_poll_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TypeVar

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import report  # noqa: E402
from runtime.bench import stats  # noqa: E402

from runtime.task_store import (  # noqa: E402
    Limits,
    TaskRecord,
    new_owner_id,
    new_task_id,
    wall_clock_ms,
)
from runtime.task_store_open import connect_task_store  # noqa: E402

#: 50 tasks per principal, under the daemon's default cap of 100 live tasks each.
PRINCIPALS = 2_000
CAP = 100
T = TypeVar("T")
RESULT = json.dumps({"content": [{"type": "text", "text": "x" * 160}], "isError": False}).encode()


class Measured(msgspec.Struct):
    """One measured operation: throughput and latency percentiles (ms)."""

    op: str
    concurrency: int
    calls: int
    seconds: float
    calls_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int


class BackendResult(msgspec.Struct):
    backend: str
    tasks: int
    ops: list[Measured]
    footprint: str


async def measure(op: Callable[[int], Awaitable[object]], concurrency: int, seconds: float, warmup_s: float = 0.5,
                  name: str = "get") -> Measured:
    """Run ``op(i)`` (i counts calls) from ``concurrency`` trio tasks for ``warmup_s + seconds``; time each
    call after the warm-up. Reusable for any awaitable operation, the store's or a client's."""
    latencies: list[int] = []
    errors = 0
    counter = 0
    start = time.perf_counter_ns()
    record_from = start + int(warmup_s * 1e9)
    stop_at = record_from + int(seconds * 1e9)

    async def worker() -> None:
        nonlocal counter, errors
        while True:
            t0 = time.perf_counter_ns()
            if t0 >= stop_at:
                return
            counter += 1
            try:
                await op(counter)
            except Exception:
                if t0 >= record_from:
                    errors += 1
            if t0 >= record_from:
                latencies.append(time.perf_counter_ns() - t0)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    window = (time.perf_counter_ns() - record_from) / 1e9
    lat = sorted(latencies)
    return Measured(op=name, concurrency=concurrency, calls=len(lat), seconds=window,
                    calls_per_s=len(lat) / window if window > 0 else 0.0, p50_ms=percentile(lat, 0.5) / 1e6,
                    p99_ms=percentile(lat, 0.99) / 1e6, errors=errors)


async def run_each(items: Sequence[T], op: Callable[[T], Awaitable[object]], concurrency: int,
                   name: str) -> Measured:
    """Apply ``op`` to every item once, from ``concurrency`` trio tasks; time each call."""
    latencies: list[int] = []
    pending = iter(items)  # one shared iterator: each item is taken once
    start = time.perf_counter_ns()

    async def worker() -> None:
        for item in pending:
            t0 = time.perf_counter_ns()
            await op(item)
            latencies.append(time.perf_counter_ns() - t0)

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(worker)
    window = (time.perf_counter_ns() - start) / 1e9
    lat = sorted(latencies)
    return Measured(op=name, concurrency=concurrency, calls=len(lat), seconds=window, calls_per_s=len(lat) / window,
                    p50_ms=percentile(lat, 0.5) / 1e6, p99_ms=percentile(lat, 0.99) / 1e6, errors=0)


async def bench_backend(name: str, url: str, state_dir: str, n: int, concurrency: int,
                        seconds: float) -> BackendResult:
    store = await connect_task_store(url, state_dir, limits=Limits(), namespace=f"bench-{os.getpid()}")
    try:
        owner = new_owner_id()
        now_ms = wall_clock_ms()
        records = [TaskRecord(task_id=new_task_id(), principal=f"principal-{i % PRINCIPALS}", tool="bench_tool",
                              era="2026-07-28", status="working", created_at_ms=now_ms + i // 50,
                              updated_at_ms=now_ms + i // 50, ttl_ms=86_400_000, poll_interval_ms=1000, owner=owner)
                   for i in range(n)]
        filled = await run_each(records, lambda rec: store.create(rec, CAP), concurrency, "create (fill)")

        async def complete(rec: TaskRecord) -> None:
            await store.transition(rec.task_id, status="completed", now_ms=now_ms, result=RESULT)

        finished = await run_each(records[: n // 2], complete, concurrency, "transition to completed")
        rng = random.Random(7)
        picks = [(r.task_id, r.principal) for r in records]
        rng.shuffle(picks)
        misses = 0

        async def get(i: int) -> None:
            nonlocal misses
            task_id, principal = picks[i % len(picks)]
            if await store.get(task_id, principal) is None:
                misses += 1

        got = await measure(get, concurrency, seconds, name="get")
        if misses:
            got = msgspec.structs.replace(got, errors=got.errors + misses)
        empty = [r.task_id for r in records[-64:]]
        taken = await measure(lambda i: store.take(empty), concurrency, min(seconds, 3.0), name="take (64 ids, empty)")
        footprint = _footprint(name, url, state_dir)
    finally:
        await store.aclose()
    return BackendResult(backend=name, tasks=n, ops=[filled, finished, got, taken], footprint=footprint)


def _footprint(name: str, url: str, state_dir: str) -> str:
    if name == "sqlite":
        path = url[len("sqlite://"):]
        size = sum(os.path.getsize(p) for p in (path, path + "-wal") if os.path.exists(p))
        return f"file {size / 1e6:.1f} MB"
    import redis

    info = redis.Redis.from_url(url).info("memory")
    return f"used_memory {int(info['used_memory']) / 1e6:.1f} MB"


class PrivateRedis:
    """A redis-server on a unix socket in a temporary folder, stopped on close."""

    def __init__(self) -> None:
        import redis

        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.folder = tempfile.mkdtemp(prefix="toolcell-bench-redis-")
        self.socket = os.path.join(self.folder, "redis.sock")
        self.proc = subprocess.Popen([binary, "--port", "0", "--unixsocket", self.socket, "--unixsocketperm", "700",
                                      "--save", "", "--appendonly", "no", "--dir", self.folder],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(unix_socket_path=self.socket).ping()
                return
            except (redis.exceptions.ConnectionError, FileNotFoundError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.folder, ignore_errors=True)


def store_environment(redis_url: str | None) -> dict[str, object]:
    env = report.environment()
    versions = dict(env["versions"])  # type: ignore[call-overload]
    versions["redis-py"] = report._version("redis")
    versions["sqlite"] = sqlite3.sqlite_version
    if redis_url is not None:
        import redis

        versions["redis-server"] = redis.Redis.from_url(redis_url).info("server")["redis_version"]
    env["versions"] = versions
    return env


def percentile(latencies_ns: Sequence[int], fraction: float) -> float:
    """The ``fraction`` percentile of latencies (ns), from an HDR histogram (``runtime.bench.stats``)."""
    hist = stats.histogram()
    for ns in latencies_ns:
        hist.record_value(max(1, ns // 1000))
    return float(hist.get_value_at_percentile(fraction * 100)) * 1000 if latencies_ns else 0.0


def _table(results: Sequence[BackendResult], markdown: bool) -> str:
    head = ["backend", "tasks", "operation", "c", "calls/s", "p50 ms", "p99 ms", "errors"]
    rows = [[r.backend, f"{r.tasks:,}", m.op, str(m.concurrency), f"{m.calls_per_s:,.0f}", f"{m.p50_ms:.3f}",
             f"{m.p99_ms:.3f}", str(m.errors)] for r in results for m in r.ops]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|---|---:|---|---:|---:|---:|---:|---:|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                     for row in [head, ["-" * w for w in widths], *rows])


def run_store_mode(args: argparse.Namespace) -> int:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    private = PrivateRedis() if "redis" in backends and args.redis_url is None else None
    redis_url = args.redis_url or (private.url if private else None)
    results: list[BackendResult] = []
    try:
        env = store_environment(redis_url)
        for backend in backends:
            with tempfile.TemporaryDirectory(prefix="toolcell-bench-tasks-") as state_dir:
                url = f"sqlite:///{state_dir}/tasks.sqlite3" if backend == "sqlite" else redis_url
                if url is None or backend not in ("sqlite", "redis"):
                    print(f"unknown backend {backend!r}", file=sys.stderr)
                    return 2
                print(f"{backend}: filling {args.tasks:,} tasks…", file=sys.stderr)
                results.append(trio.run(bench_backend, backend, url, state_dir, args.tasks, args.concurrency,
                                        args.seconds))
    finally:
        if private is not None:
            private.close()
    env["loadavg_after"] = os.getloadavg()
    print(_table(results, args.markdown))
    print()
    v = env["versions"]
    assert isinstance(v, dict)
    print(f"python {env['python']}, trio {v.get('trio')}, msgspec {v.get('msgspec')}, redis-py {v.get('redis-py')}, "
          f"redis-server {v.get('redis-server', '-')}, SQLite {v.get('sqlite')}; {env['nproc']} cores "
          f"({env['cpu_model']}); load average {_load(env['loadavg_before'])} -> {_load(env['loadavg_after'])}; "
          f"git {env['git_commit']}")
    for r in results:
        print(f"{r.backend}: {r.footprint} for {r.tasks:,} tasks")
    if args.json:
        Path(args.json).write_bytes(msgspec.json.encode({"environment": env, "results": results}))
    return 0


def _load(value: object) -> str:
    return "/".join(f"{x:.2f}" for x in value) if isinstance(value, (list, tuple)) else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,redis", help="comma-separated: sqlite, redis")
    parser.add_argument("--tasks", type=int, default=None,
                        help="tasks to fill the store with (default 100000)")
    parser.add_argument("-c", "--concurrency", type=int, default=64)
    parser.add_argument("-s", "--seconds", type=float, default=10.0, help="measured seconds of get / tasks/get")
    parser.add_argument("--redis-url", help="an existing Redis to use (default: a private redis-server)")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table")
    parser.add_argument("--json", help="write the environment and figures to this file")
    args = parser.parse_args(argv)
    args.tasks = args.tasks or 100_000
    return run_store_mode(args)


if __name__ == "__main__":
    sys.exit(main())
