"""What an HTTP request costs before any MCP work: toolcell's HTTP/1.1 engine with a trivial app,
and the least a trio server can do (one task per connection, httptools, msgspec), under wrk.

The daemon's CPU per HTTP call (``http_side_by_side.py``) is this floor plus the app's checks and
the call's trip to a sandboxed worker. Both servers here answer ``tools/call echo`` bodies with the
echoed text (no session, no auth, no worker), so the same wrk Lua hook checks every answer::

    python benchmarks/http_floor.py --seconds 3 --repeat 3

Prints the server's CPU per request (its own process, measured around each wrk run) and calls/s.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
sys.path.insert(0, str(BENCH_DIR))

from http_side_by_side import LUA  # noqa: E402

#: toolcell's engine (runtime.transports.h1) with the smallest app that uses its extensions.
ENGINE = r'''
import socket, sys
import msgspec, trio
sys.path.insert(0, sys.argv[2])
from runtime.http_config import HttpConfig
from runtime.transports.h1 import H1Server

dec = msgspec.json.Decoder()
enc = msgspec.json.Encoder()

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    ext = scope["extensions"]
    body = ext["toolcell.take_body"]()
    if body is None:
        body = (await receive())["body"]
    req = dec.decode(body)
    out = enc.encode({"jsonrpc": "2.0", "id": req["id"], "result": {
        "content": [{"type": "text", "text": req["params"]["arguments"]["text"]}], "isError": False}})
    await ext["toolcell.respond"](200, [(b"content-length", b"%d" % len(out)), (b"content-type", b"application/json")], out)

async def main():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(sys.argv[1])))
    await H1Server(app, HttpConfig()).serve([s], trio.sleep_forever)

trio.run(main)
'''

#: The least: wait_readable, recv, httptools, msgspec, one send.
MINIMAL = r'''
import socket, sys
import httptools, msgspec, trio

dec = msgspec.json.Decoder()
enc = msgspec.json.Encoder()

class Request:
    def __init__(self):
        self.body = b""
        self.done = False
    def on_body(self, body):
        self.body += body
    def on_message_complete(self):
        self.done = True

async def connection(raw):
    req = Request()
    parser = httptools.HttpRequestParser(req)
    while True:
        await trio.lowlevel.wait_readable(raw)
        try:
            data = raw.recv(65536)
        except OSError:
            data = b""
        if not data:
            raw.close()
            return
        parser.feed_data(data)
        if req.done:
            msg = dec.decode(req.body)
            out = enc.encode({"jsonrpc": "2.0", "id": msg["id"], "result": {
                "content": [{"type": "text", "text": msg["params"]["arguments"]["text"]}], "isError": False}})
            raw.send(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(out), out))
            req.body, req.done = b"", False

async def main():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", int(sys.argv[1])))
    s.listen(128)
    s.setblocking(False)
    async with trio.open_nursery() as nursery:
        while True:
            await trio.lowlevel.wait_readable(s)
            conn, _ = s.accept()
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nursery.start_soon(connection, conn)

trio.run(main)
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="toolcell-http-floor-"))
    script = work / "call.lua"
    script.write_text(LUA)
    rows = []
    for name, source in (("toolcell HTTP engine, trivial app", ENGINE), ("trio + httptools, minimal loop", MINIMAL)):
        path = work / f"{len(rows)}.py"
        path.write_text(source)
        port = _free_port()
        proc = subprocess.Popen([sys.executable, str(path), str(port), str(REPO)], start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.5)
            server = psutil.Process(proc.pid)
            samples = []
            for rep in range(args.repeat):
                t0 = server.cpu_times()
                out = subprocess.run(["wrk", "-t1", f"-c{args.concurrency}", f"-d{max(1, round(args.seconds))}s", "-s",
                                      str(script), f"http://127.0.0.1:{port}/mcp"], capture_output=True, text=True,
                                     env=dict(os.environ, BENCH_SESSION="", BENCH_TOKEN=""), timeout=args.seconds + 60)
                t1 = server.cpu_times()
                m = re.search(r"BENCH (\d+) (\d+) ([\d.]+) ([\d.]+) (\d+)", out.stdout)
                if m is None or int(m.group(5)):
                    raise SystemExit(f"{name}: wrk failed or saw wrong answers:\n{out.stdout}\n{out.stderr}")
                requests = int(m.group(1))
                cpu_us = (t1.user - t0.user + t1.system - t0.system) / requests * 1e6
                samples.append((cpu_us, requests / (int(m.group(2)) / 1e6)))
                print(f"{name} rep {rep + 1}: {cpu_us:.1f} µs/request, {samples[-1][1]:,.0f} requests/s", file=sys.stderr)
            rows.append((name, statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
    print(f"\nserver CPU per request under wrk, c={args.concurrency}, median of {args.repeat} x {args.seconds:g} s\n")
    print("| server | µs/request | requests/s |\n|---|---:|---:|")
    for name, cpu_us, rate in rows:
        print(f"| {name} | {cpu_us:.1f} | {rate:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
