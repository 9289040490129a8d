"""What the egress proxy costs a plugin: connection set-up, round trip in a tunnel, bulk throughput.

A plugin granted ``127.0.0.1:<port>`` of a local upstream server (a separate process) measures, from
inside its worker:

* ``connect``: open a connection and get one byte back (through the proxy: TCP to the proxy port,
  ``CONNECT``, ``200``, then the byte), median and p99 of ``--n`` connections;
* ``rtt``: one byte there and back in an open connection (tunnel);
* ``download``: ``--mb`` MiB from the upstream in one connection, MB/s.

Run once under ``strict`` (through the proxy, every layer on) and once under ``none`` (no sandbox,
no proxy: direct loopback TCP) for the baseline, each through ``toolcell call``.

Usage: ``python benchmarks/egress_bench.py [--n 300] [--mb 256]``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

UPSTREAM = r"""
import socket, socketserver, sys

class H(socketserver.BaseRequestHandler):
    def handle(self):
        s = self.request
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        line = b""
        while not line.endswith(b"\n"):
            c = s.recv(1)
            if not c:
                return
            line += c
        if line.startswith(b"S "):
            left = int(line[2:])
            block = b"x" * 65536
            while left > 0:
                s.sendall(block[:left])
                left -= min(left, len(block))
            return
        while True:
            data = s.recv(65536)
            if not data:
                return
            s.sendall(data)

class T(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

srv = T(("127.0.0.1", 0), H)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""

PLUGIN = r'''
import os
import socket
import statistics
import time

from sandbox import tool


def _open(port):
    proxy = os.environ.get("HTTPS_PROXY", "")
    if not proxy:
        s = socket.create_connection(("127.0.0.1", port))
    else:
        host, _, pport = proxy.removeprefix("http://").rpartition(":")
        s = socket.create_connection((host, int(pport)))
        s.sendall(f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                raise OSError("proxy closed")
            head += chunk
        if not head.startswith(b"HTTP/1.1 200"):
            raise OSError(head[:200])
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


@tool
def bench(port: int, n: int = 300, mb: int = 256) -> dict:
    connect = []
    for _ in range(n):
        t = time.perf_counter()
        s = _open(port)
        s.sendall(b"E\n")
        s.sendall(b"x")
        s.recv(1)
        connect.append((time.perf_counter() - t) * 1000)
        s.close()
    s = _open(port)
    s.sendall(b"E\n")
    rtt = []
    for _ in range(n):
        t = time.perf_counter()
        s.sendall(b"x")
        s.recv(1)
        rtt.append((time.perf_counter() - t) * 1000)
    s.close()
    s = _open(port)
    s.sendall(f"S {mb << 20}\n".encode())
    got = 0
    t = time.perf_counter()
    while chunk := s.recv(1 << 20):
        got += len(chunk)
    secs = time.perf_counter() - t
    s.close()
    return {"proxied": bool(os.environ.get("HTTPS_PROXY")),
            "connect_p50_ms": round(statistics.median(connect), 3), "connect_p99_ms": round(_pct(connect, 0.99), 3),
            "rtt_p50_ms": round(statistics.median(rtt), 3), "rtt_p99_ms": round(_pct(rtt, 0.99), 3),
            "download_MBps": round(got / secs / 1e6, 1), "bytes": got}
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--mb", type=int, default=256)
    args = ap.parse_args()
    upstream = subprocess.Popen([sys.executable, "-c", UPSTREAM], stdout=subprocess.PIPE, text=True)
    try:
        assert upstream.stdout is not None
        port = int(upstream.stdout.readline())
        with tempfile.TemporaryDirectory() as tmp:
            os.chmod(tmp, 0o755)
            folder = Path(tmp) / "plugins" / "egressbench"
            folder.mkdir(parents=True)
            for d in (folder, folder.parent):
                d.chmod(0o755)
            (folder / "plugin.toml").write_text(textwrap.dedent(f"""\
                name = "egressbench"
                version = "1"
                entry = "egressbench"
                [limits]
                timeout_s = 300
                cpu_s = 300
                [permissions]
                network = ["127.0.0.1:{port}"]
                """))
            (folder / "egressbench.py").write_text(PLUGIN)
            for f in folder.iterdir():
                f.chmod(0o644)
            rows = []
            for policy in ("strict", "none"):
                res = subprocess.run(
                    [sys.executable, "-m", "runtime.cli", "call", "bench", json.dumps({"port": port, "n": args.n,
                     "mb": args.mb}), "--plugins", str(folder.parent), "--policy", policy, "--log-level", "error"],
                    cwd=str(REPO), capture_output=True, text=True, timeout=600, check=False)
                if res.returncode != 0:
                    print(res.stdout, res.stderr, file=sys.stderr)
                    return 1
                result = json.loads(res.stdout)["structuredContent"]
                result = result.get("result", result)
                rows.append((policy, result))
    finally:
        upstream.kill()
        upstream.wait()
    print(f"# egress: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d')}, n={args.n}, {args.mb} MiB")
    print("| policy | path | connect p50 ms | connect p99 ms | tunnel rtt p50 ms | rtt p99 ms | download MB/s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for policy, r in rows:
        path = "plugin → egress proxy → upstream" if r["proxied"] else "plugin → upstream (direct)"
        print(f"| {policy} | {path} | {r['connect_p50_ms']} | {r['connect_p99_ms']} | {r['rtt_p50_ms']} | "
              f"{r['rtt_p99_ms']} | {r['download_MBps']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
