"""A lean load generator for MCP servers over stdio.

It spawns a server command, opens the session (legacy ``initialize`` handshake at 2025-06-18,
or ``--modern``: 2026-07-28 requests carrying ``params._meta`` and no handshake), checks that
the tool exists and answers, warms up, then keeps exactly C ``tools/call`` requests in flight
on the one pipe for a fixed time and reports calls/s, latency percentiles and errors (JSON-RPC
errors and ``isError`` results both count), plus the server tree's CPU time per call and RSS.

The client is one thread around ``poll``: requests are pre-encoded (see ``mcpwire``), every
refill goes out in one ``write``, responses are read in 1 MiB chunks and decoded a chunk at a
time. Its own CPU use is reported beside the result so a saturated client is visible.

    python benchmarks/loadgen.py -c 16 -s 10 -- python benchmarks/peers/sdk_server.py
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import select
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec

import mcpwire
import procstats
from stdio_peer import READ_CHUNK, ServerError, StdioServer


class LoadConfig(msgspec.Struct, frozen=True):
    """What to run: tool, arguments, era, concurrency and timings."""

    tool: str = "echo"
    arguments: dict[str, Any] = msgspec.field(default_factory=lambda: {"text": "hello"})
    modern: bool = False
    concurrency: int = 16
    seconds: float = 10.0
    warmup_s: float = 1.0
    startup_timeout_s: float = 60.0
    drain_timeout_s: float = 10.0
    settle_s: float = 0.3


class LoadResult(msgspec.Struct):
    """One measured run. Latencies are in milliseconds, CPU in seconds unless named otherwise."""

    concurrency: int
    modern: bool
    duration_s: float
    calls: int
    calls_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    mean_ms: float
    errors: int
    lost: int
    unexpected: int
    error_sample: str | None
    server_cpu_s: float
    server_cpu_us_per_call: float
    server_cpu_pct: float
    client_cpu_pct: float
    ready_s: float
    request_bytes: int
    rss_idle: list[procstats.ProcMemory]
    rss_loaded: list[procstats.ProcMemory]


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """Nearest-rank percentile of an ascending sequence (``q`` in 0..1); 0 when empty."""
    if not sorted_values:
        return 0
    rank = math.ceil(q * len(sorted_values) - 1e-9)
    return sorted_values[min(len(sorted_values), max(1, rank)) - 1]


def _client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def open_session(server: StdioServer, config: LoadConfig) -> None:
    """Open the session and prove the tool works: handshake (legacy), tools/list, one tools/call."""
    timeout = config.startup_timeout_s
    if not config.modern:
        server.handshake(timeout)
    names: list[str] = []
    params: dict[str, Any] = {}
    for _ in range(100):  # follow pagination, bounded
        reply = server.call("tools/list", params or None, config.modern, timeout)
        if "result" not in reply:
            raise ServerError(f"tools/list failed: {reply}")
        names += [tool.get("name", "") for tool in reply["result"].get("tools", [])]
        cursor = reply["result"].get("nextCursor")
        if not cursor or config.tool in names:
            break
        params = {"cursor": cursor}
    if config.tool not in names:
        raise ServerError(f"tool {config.tool!r} is not listed; the server has: {sorted(names)[:20]}")
    reply = server.call("tools/call", {"name": config.tool, "arguments": config.arguments}, config.modern, timeout)
    if "error" in reply or reply.get("result", {}).get("isError"):
        raise ServerError(f"probe call to {config.tool!r} failed: {reply}")


class _Drive:
    """Mutable state of one measured drive (kept on an object so the loop reads locals)."""

    def __init__(self) -> None:
        self.latencies_ns: list[int] = []
        self.errors = 0
        self.unexpected = 0
        self.error_sample: str | None = None
        self.lost = 0
        self.window_ns = 0
        self.cpu_before: dict[int, float] = {}
        self.cpu_after: dict[int, float] = {}
        self.client_cpu_s = 0.0
        self.rss_loaded: list[procstats.ProcMemory] = []


def drive(server: StdioServer, config: LoadConfig) -> _Drive:
    """Keep ``config.concurrency`` calls in flight through warm-up and the measured window, then drain."""
    template = mcpwire.CallTemplate(config.tool, config.arguments, config.modern)
    state = _Drive()
    rfd, wfd = server.read_fd, server.write_fd
    poller = select.poll()
    poller.register(rfd, select.POLLIN)
    clock = time.perf_counter_ns
    sent: dict[int, int] = {}
    latencies = state.latencies_ns
    concurrency = config.concurrency
    buf = server.pending
    outbuf = b""
    next_id = 0
    measuring = stopping = False
    t_measure = clock() + int(config.warmup_s * 1e9)
    t_end = t_measure + int(config.seconds * 1e9)
    t_drain = t_end + int(config.drain_timeout_s * 1e9)
    client_cpu0 = 0.0
    while True:
        # Refill to exactly C in flight and push everything pending in one write.
        if not stopping and len(sent) < concurrency:
            count = concurrency - len(sent)
            outbuf += template.many(next_id, count)
            sent.update(dict.fromkeys(range(next_id, next_id + count), clock()))
            next_id += count
        if outbuf:
            try:
                outbuf = outbuf[os.write(wfd, outbuf) :]
            except BlockingIOError:
                pass
            except BrokenPipeError as exc:
                raise ServerError(f"server closed its stdin; stderr:\n{server.stderr_tail()}") from exc
        now = clock()
        if not measuring and now >= t_measure:
            state.cpu_before = procstats.cpu_snapshot(server.pid)
            client_cpu0 = _client_cpu_s()
            measuring = True
            t_measure = now = clock()
        elif measuring and not stopping and now >= t_end:
            state.cpu_after = procstats.cpu_snapshot(server.pid)
            state.client_cpu_s = _client_cpu_s() - client_cpu0
            state.window_ns = now - t_measure
            state.rss_loaded = procstats.memory_snapshot(server.pid)
            stopping = True
        if stopping and (not sent or now >= t_drain):
            break
        boundary = t_drain if stopping else (t_end if measuring else t_measure)
        timeout_ms = max(1, (boundary - now) // 1_000_000 + 1)
        if outbuf:
            poller.register(wfd, select.POLLOUT)
        ready = poller.poll(timeout_ms)
        if outbuf:
            poller.unregister(wfd)
        if not any(fd == rfd for fd, _ in ready):
            continue
        chunk = os.read(rfd, READ_CHUNK)
        if not chunk:
            raise ServerError(f"server closed its stdout (exit {server.proc.poll()}); stderr:\n{server.stderr_tail()}")
        buf += chunk
        cut = buf.rfind(b"\n")
        if cut < 0:
            continue
        messages = mcpwire.decode_lines(buf[:cut])
        buf = buf[cut + 1 :]
        t_recv = clock()
        in_window = measuring and not stopping
        for msg in messages:
            t_sent = sent.pop(msg.id, None) if type(msg.id) is int else None
            if t_sent is None:
                if msg.method is not None and msg.id is not None:
                    outbuf += mcpwire.refusal(msg.id)
                elif msg.id is not None or msg.error is not None:
                    state.unexpected += 1
                continue
            failed = msg.error is not None or (msg.result is not None and msg.result.isError)
            if failed and state.error_sample is None:
                state.error_sample = msgspec.json.encode(msg).decode()[:500]
            if in_window:
                latencies.append(t_recv - t_sent)
                state.errors += failed
    state.lost = len(sent)
    server.pending = buf
    return state


def measure(argv: Sequence[str], config: LoadConfig, cwd: str | None = None) -> LoadResult:
    """Spawn ``argv``, open a session, drive it, stop it, and summarise one run."""
    t0 = time.perf_counter()
    server = StdioServer(argv, cwd=cwd)
    try:
        open_session(server, config)
        ready_s = time.perf_counter() - t0
        time.sleep(config.settle_s)
        rss_idle = procstats.memory_snapshot(server.pid)
        state = drive(server, config)
    finally:
        server.stop()
    lat = sorted(state.latencies_ns)
    window_s = state.window_ns / 1e9 or config.seconds
    cpu_s = procstats.cpu_delta_s(state.cpu_before, state.cpu_after)
    calls = len(lat)
    return LoadResult(
        concurrency=config.concurrency,
        modern=config.modern,
        duration_s=window_s,
        calls=calls,
        calls_per_s=calls / window_s,
        p50_ms=percentile(lat, 0.50) / 1e6,
        p90_ms=percentile(lat, 0.90) / 1e6,
        p99_ms=percentile(lat, 0.99) / 1e6,
        max_ms=(lat[-1] if lat else 0) / 1e6,
        mean_ms=(sum(lat) / calls / 1e6) if calls else 0.0,
        errors=state.errors + state.lost,
        lost=state.lost,
        unexpected=state.unexpected,
        error_sample=state.error_sample,
        server_cpu_s=cpu_s,
        server_cpu_us_per_call=cpu_s / calls * 1e6 if calls else 0.0,
        server_cpu_pct=100.0 * cpu_s / window_s,
        client_cpu_pct=100.0 * state.client_cpu_s / window_s,
        ready_s=ready_s,
        request_bytes=mcpwire.CallTemplate(config.tool, config.arguments, config.modern).line_bytes,
        rss_idle=rss_idle,
        rss_loaded=state.rss_loaded,
    )


def main(argv: list[str] | None = None) -> int:
    """Command line: run one load point against one server command and print the result."""
    parser = argparse.ArgumentParser(description="Drive one MCP stdio server with C calls in flight.")
    parser.add_argument("-c", "--concurrency", type=int, default=16)
    parser.add_argument("-s", "--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds of load before measuring")
    parser.add_argument("--modern", action="store_true", help="2026-07-28 requests with _meta, no handshake")
    parser.add_argument("--tool", default="echo")
    parser.add_argument("--args", default='{"text": "hello"}', help="tool arguments as a JSON object")
    parser.add_argument("--json", action="store_true", help="print the full result as JSON")
    parser.add_argument("command", nargs="+", help="server command (put it after --)")
    args = parser.parse_args(argv)
    config = LoadConfig(
        tool=args.tool,
        arguments=json.loads(args.args),
        modern=args.modern,
        concurrency=args.concurrency,
        seconds=args.seconds,
        warmup_s=args.warmup,
    )
    try:
        result = measure(args.command, config)
    except ServerError as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(msgspec.json.format(msgspec.json.encode(result)).decode())
    else:
        r = result
        print(
            f"c={r.concurrency} {r.calls_per_s:,.0f} calls/s  p50 {r.p50_ms:.3f} ms  p90 {r.p90_ms:.3f} ms  "
            f"p99 {r.p99_ms:.3f} ms  max {r.max_ms:.3f} ms  errors {r.errors}  "
            f"server CPU {r.server_cpu_us_per_call:.1f} us/call ({r.server_cpu_pct:.0f}%)  "
            f"client CPU {r.client_cpu_pct:.0f}%"
        )
        if r.error_sample:
            print(f"first error: {r.error_sample}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
