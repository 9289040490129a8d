"""The daemon's memory after hostile HTTP rounds: does the same attack again add anything?

Issue 23 (finding 10) saw ``toolcell serve --http`` go from 48 to 58 MB of RSS after one hostile
run with every connection closed. This runs the same attack several times against one daemon (a
bearer token on, ``benchmarks/plugins``) and records its RSS after each round, once every attack
connection is closed and the daemon has had ``--settle`` seconds. Bounded means: the first round
may raise RSS (allocator arenas, caches that fill up to their caps), later rounds add ~nothing.

One round, each phase from many client addresses (127.0.0.2 ... : all of 127/8 is loopback), as
an attacker with many addresses would:

* malformed requests (garbage, bad framing, oversized heads, duplicate headers);
* idle connections: ``--idle`` of them held open at once (half never send a byte, half make one
  authenticated request and then idle), then closed;
* slow-loris: ``--slow`` connections trickling a head that never ends, then dropped;
* abrupt disconnects: connections that send a whole ``tools/call`` and reset (SO_LINGER 0);
* a session flood: ``--sessions`` legacy ``initialize`` calls (each opens a session).

Then: RSS (``/proc/PID/status``), and ``/healthz`` (sessions, calls in flight). Prints a table,
``--markdown`` for RESULTS.md::

    python benchmarks/http_hostile_memory.py --rounds 5
    python benchmarks/http_hostile_memory.py --rounds 5 --tree before=/tmp/before   # another tree
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from targets import BENCH_TOKEN, toolcell_http_config  # noqa: E402

MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nabc",
    b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    b"GET /mcp HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n",
    b"GET /mcp HTTP/1.1\r\nHost: localhost\r\nX-Filler: " + b"a" * 20000 + b"\r\n\r\n",
    b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n{not json",
]


def _addresses(count: int) -> list[str]:
    return [f"127.0.{(i // 250) + 1}.{(i % 250) + 2}" for i in range(count)]


def _body(method: str, params: dict[str, Any], id: int = 1) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode()


def _post(port: int, body: bytes, *extra: str) -> bytes:
    head = ["POST /mcp HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Authorization: Bearer {BENCH_TOKEN}",
            "Content-Type: application/json", "Accept: application/json, text/event-stream",
            f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _call(port: int) -> bytes:
    return _post(port, _body("tools/call", {"name": "echo", "arguments": {"text": "hi"}}), "MCP-Protocol-Version: 2025-06-18")


async def _open(port: int, source: str) -> trio.SocketStream | None:
    try:
        return await trio.open_tcp_stream("127.0.0.1", port, local_address=source)
    except OSError:
        return None


async def _read_head(stream: trio.SocketStream, within_s: float = 10.0) -> bytes:
    data = b""
    with trio.move_on_after(within_s):
        try:
            while b"\r\n\r\n" not in data:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
    return data


def _reset(stream: trio.SocketStream) -> None:
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def _malformed(port: int, sources: list[str], count: int) -> None:
    async def one(i: int) -> None:
        s = await _open(port, sources[i % len(sources)])
        if s is None:
            return
        async with s:
            try:
                await s.send_all(MALFORMED[i % len(MALFORMED)])
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            await _read_head(s)

    limit = trio.CapacityLimiter(64)

    async def bounded(i: int) -> None:
        async with limit:
            await one(i)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(bounded, i)


async def _idle(port: int, sources: list[str], count: int, hold_s: float) -> None:
    streams: list[trio.SocketStream] = []
    try:
        for i in range(count):
            s = await _open(port, sources[i % len(sources)])
            if s is None:
                continue
            streams.append(s)
            if i % 2:  # a token holder's connection: one call, then idle
                try:
                    await s.send_all(_call(port))
                    await _read_head(s)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
        await trio.sleep(hold_s)
    finally:
        for s in streams:
            await s.aclose()


async def _slowloris(port: int, sources: list[str], count: int, seconds: float) -> None:
    streams = [s for s in [await _open(port, sources[i % len(sources)]) for i in range(count)] if s is not None]
    try:
        head = f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
        for s in streams:
            try:
                await s.send_all(head)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        deadline = trio.current_time() + seconds
        n = 0
        while trio.current_time() < deadline:
            n += 1
            for s in streams:
                try:
                    await s.send_all(b"X-Slow-%d: 1\r\n" % n)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await trio.sleep(0.25)
    finally:
        for s in streams:
            _reset(s)
            await s.aclose()


async def _abrupt(port: int, sources: list[str], count: int) -> None:
    for i in range(count):
        s = await _open(port, sources[i % len(sources)])
        if s is None:
            continue
        try:
            await s.send_all(_call(port))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        _reset(s)
        await s.aclose()


async def _sessions(port: int, count: int) -> None:
    init = _body("initialize", {"protocolVersion": "2025-06-18", "capabilities": {},
                                "clientInfo": {"name": "flood", "version": "1"}}, 0)
    async with await trio.open_tcp_stream("127.0.0.1", port) as s:
        for _ in range(count):
            await s.send_all(_post(port, init))
            head = await _read_head(s)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            body = head.split(b"\r\n\r\n", 1)[1]
            while len(body) < length:
                body += await s.receive_some(65536)


async def _round(port: int, args: argparse.Namespace) -> None:
    sources = _addresses(args.addresses)
    await _malformed(port, sources, args.malformed)
    await _idle(port, sources, args.idle, args.hold)
    await _slowloris(port, sources, args.slow, args.slow_seconds)
    await _abrupt(port, sources, args.abrupt)
    await _sessions(port, args.sessions)


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _health(port: int) -> dict[str, Any]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        # The details (sessions, calls in flight) are for a token holder.
        s.sendall(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {BENCH_TOKEN}\r\n"
                  "Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return json.loads(data.split(b"\r\n\r\n", 1)[1])


def _connections(port: int) -> int:
    """The daemon's TCP connections on the MCP port (from /proc/net/tcp: no psutil needed)."""
    hexport = f"{port:04X}"
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[1].endswith(":" + hexport) and fields[3] == "01":  # ESTABLISHED, local side ours
                count += 1
    return count


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_tree(name: str, directory: str, args: argparse.Namespace, work: str) -> list[dict[str, Any]]:
    os.makedirs(os.path.join(work, name), exist_ok=True)
    config = toolcell_http_config(os.path.join(work, name), os.path.join(directory, "benchmarks", "plugins"))
    port = _free_port()
    log = open(os.path.join(work, name, "daemon.log"), "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--config", config, "--http",
                             f"127.0.0.1:{port}"], cwd=directory, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=log)
    rows: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if _health(port)["status"] == "ready":
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{name}: the daemon did not start (see {log.name})")
            time.sleep(0.2)
        # Warm: a few real calls, so that round 1 is not also the first call ever.
        trio.run(_abrupt, port, ["127.0.0.1"], 0)
        trio.run(_sessions, port, 3)
        time.sleep(args.settle)
        rows.append({"round": 0, "rss_kb": _rss_kb(proc.pid), **_health(port), "open": _connections(port)})
        print(f"{name} start: {rows[-1]['rss_kb'] / 1024:.1f} MB", file=sys.stderr)
        for r in range(1, args.rounds + 1):
            started = time.monotonic()
            trio.run(_round, port, args)
            time.sleep(args.settle)
            health = _health(port)
            rows.append({"round": r, "rss_kb": _rss_kb(proc.pid), **health, "open": _connections(port),
                         "seconds": time.monotonic() - started})
            print(f"{name} round {r}: {rows[-1]['rss_kb'] / 1024:.1f} MB, sessions {health['sessions']}, "
                  f"open connections {rows[-1]['open']}, {rows[-1]['seconds']:.0f} s", file=sys.stderr)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="another toolcell source tree to run too (repeatable); this checkout is 'toolcell'")
    parser.add_argument("--addresses", type=int, default=64, help="client addresses the attack comes from")
    parser.add_argument("--malformed", type=int, default=600)
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--hold", type=float, default=2.0, help="seconds the idle connections are held")
    parser.add_argument("--slow", type=int, default=200)
    parser.add_argument("--slow-seconds", type=float, default=3.0)
    parser.add_argument("--abrupt", type=int, default=300)
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after a round before RSS is read")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)
    trees = [("toolcell", str(REPO))]
    for spec in args.tree:
        name, sep, directory = spec.partition("=")
        if not sep or not Path(directory, "runtime").is_dir():
            parser.error(f"--tree wants NAME=DIR with DIR a toolcell source tree: {spec!r}")
        trees.append((name, str(Path(directory).resolve())))
    work = tempfile.mkdtemp(prefix="toolcell-hostile-")
    results = {name: run_tree(name, directory, args, work) for name, directory in trees}
    print(f"\nRSS of `toolcell serve --http` after each hostile round (every attack connection closed, "
          f"{args.settle:g} s settle); round: {args.malformed} malformed, {args.idle} idle held {args.hold:g} s, "
          f"{args.slow} slow-loris for {args.slow_seconds:g} s, {args.abrupt} abrupt disconnects, "
          f"{args.sessions} sessions, from {args.addresses} addresses; {os.cpu_count()} CPUs\n")
    for name, rows in results.items():
        start = rows[0]["rss_kb"]
        later = [b["rss_kb"] - a["rss_kb"] for a, b in zip(rows[1:], rows[2:], strict=False)]
        print(f"{name}: start {start / 1024:.1f} MB, after round 1 {rows[1]['rss_kb'] / 1024:.1f} MB, after the last "
              f"{rows[-1]['rss_kb'] / 1024:.1f} MB; median change per round after the first "
              f"{(statistics.median(later) if later else 0) / 1024:+.2f} MB")
        if args.markdown:
            print("\n| round | RSS MB | change MB | sessions | open connections | in flight |")
            print("|---:|---:|---:|---:|---:|---:|")
            prev = None
            for row in rows:
                change = f"{(row['rss_kb'] - prev) / 1024:+.1f}" if prev is not None else "-"
                print(f"| {row['round'] or 'start'} | {row['rss_kb'] / 1024:.1f} | {change} | {row['sessions']} | "
                      f"{row['open']} | {row['inflight']} |")
                prev = row["rss_kb"]
            print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
