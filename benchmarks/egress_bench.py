"""What the egress proxy costs a plugin: connection set-up, round trip in a tunnel, bulk throughput.

A plugin granted ``127.0.0.1:<port>`` of a local upstream server (a separate process) measures, from
inside its worker:

* ``connect``: open a connection and get one byte back (through the proxy: TCP to the proxy port,
  ``CONNECT``, ``200``, then the byte), median and p99 of ``--n`` connections;
* ``rtt``: one byte there and back in an open connection (tunnel);
* ``download``: ``--mb`` MiB from the upstream in one connection, MB/s.

Run once under ``strict`` (through the proxy, every layer on) and once under ``none`` (no sandbox,
no proxy: direct loopback TCP) for the baseline, each through ``toolcell call``.

With ``--https``: what a secret costs (``runtime.plugin_secrets``). An HTTPS upstream (a separate
process, certificate from ``trustme``) is reached twice from one ``strict`` worker, both through the
proxy: as ``localhost`` (a secret is bound to it: the proxy terminates TLS, checks the upstream,
relays HTTP/1.1 and puts the value in) and as ``127.0.0.1`` (a plain tunnel, TLS end to end). Each
way: ``fresh`` (connect, CONNECT, TLS, one GET) and ``keep-alive`` (one GET in an open connection),
median and p99 of ``--n`` requests, alternated between the two ways.

Usage: ``python benchmarks/egress_bench.py [--n 300] [--mb 256]`` or ``... --https [--n 300]``
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


HTTPS_UPSTREAM = r"""
import http.server, ssl, sys

class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def do_GET(self):
        body = b"ok " + self.headers.get("authorization", "").encode()[:8]
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
srv.daemon_threads = True
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(sys.argv[1])
srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
print(srv.server_address[1], flush=True)
srv.serve_forever()
"""

HTTPS_PLUGIN = r'''
import http.client
import os
import ssl
import statistics
import time

from sandbox import tool

HERE = os.path.dirname(os.path.abspath(__file__))


def _context():
    ctx = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])  # the egress CA (and the system's)
    ctx.load_verify_locations(os.path.join(HERE, "upstream-ca.pem"))   # the upstream's, for the plain tunnel
    return ctx


def _conn(host, port, ctx):
    phost, _, pport = os.environ["HTTPS_PROXY"].removeprefix("http://").rpartition(":")
    c = http.client.HTTPSConnection(phost, int(pport), context=ctx, timeout=30)
    c.set_tunnel(host, port)
    return c


def _get(c):
    c.request("GET", "/", headers={"Authorization": "Bearer " + os.environ["BENCH_TOKEN"]})
    r = c.getresponse()
    body = r.read()
    assert r.status == 200, (r.status, body)
    return body


def _pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


@tool
def bench_https(port: int, n: int = 300) -> dict:
    ctx = _context()
    ways = {"secret (TLS terminated)": "localhost", "tunnel (TLS end to end)": "127.0.0.1"}
    fresh = {w: [] for w in ways}
    kept = {w: [] for w in ways}
    open_ = {w: _conn(h, port, ctx) for w, h in ways.items()}
    saw = {w: _get(c) for w, c in open_.items()}
    for _ in range(n):
        for way, host in ways.items():
            t = time.perf_counter()
            c = _conn(host, port, ctx)
            _get(c)
            fresh[way].append((time.perf_counter() - t) * 1000)
            c.close()
            t = time.perf_counter()
            _get(open_[way])
            kept[way].append((time.perf_counter() - t) * 1000)
    return {w: {"fresh_p50_ms": round(statistics.median(fresh[w]), 3), "fresh_p99_ms": round(_pct(fresh[w], 0.99), 3),
                "keepalive_p50_ms": round(statistics.median(kept[w]), 3),
                "keepalive_p99_ms": round(_pct(kept[w], 0.99), 3), "upstream_saw": saw[w].decode()[:11]}
            for w in ways}
'''


def https_main(n: int) -> int:
    import trustme  # the test extra: only this mode needs it

    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        ca = trustme.CA()
        server_pem = Path(tmp) / "server.pem"
        ca.issue_cert("localhost", "127.0.0.1").private_key_and_cert_chain_pem.write_to_path(str(server_pem))
        upstream = subprocess.Popen([sys.executable, "-c", HTTPS_UPSTREAM, str(server_pem)], stdout=subprocess.PIPE,
                                    text=True)
        try:
            assert upstream.stdout is not None
            port = int(upstream.stdout.readline())
            folder = Path(tmp) / "plugins" / "httpsbench"
            folder.mkdir(parents=True)
            for d in (folder, folder.parent):
                d.chmod(0o755)
            (folder / "plugin.toml").write_text(textwrap.dedent(f"""\
                name = "httpsbench"
                version = "1"
                entry = "httpsbench"
                [limits]
                timeout_s = 600
                cpu_s = 600
                [permissions]
                network = ["localhost:{port}", "127.0.0.1:{port}"]
                [secrets.BENCH_TOKEN]
                host = "localhost"
                """))
            (folder / "httpsbench.py").write_text(HTTPS_PLUGIN)
            ca.cert_pem.write_to_path(str(folder / "upstream-ca.pem"))
            for f in folder.iterdir():
                f.chmod(0o644)
            config = Path(tmp) / "toolcell.toml"
            config.write_text(f'state_dir = "{tmp}/state"\negress_ca_file = "{folder / "upstream-ca.pem"}"\n'
                              '[secrets]\nBENCH_TOKEN = { env = "BENCH_TOKEN_VALUE" }\n')
            res = subprocess.run(
                [sys.executable, "-m", "runtime.cli", "call", "bench_https", json.dumps({"port": port, "n": n}),
                 "--plugins", str(folder.parent), "--policy", "strict", "--config", str(config), "--log-level", "error"],
                cwd=str(REPO), capture_output=True, text=True, timeout=1200, check=False,
                env={**os.environ, "BENCH_TOKEN_VALUE": "realvalue-0123456789"})
            if res.returncode != 0:
                print(res.stdout, res.stderr, file=sys.stderr)
                return 1
            result = json.loads(res.stdout)["structuredContent"]
            result = result.get("result", result)
        finally:
            upstream.kill()
            upstream.wait()
    print(f"# egress https: {platform.node()} {platform.machine()} {os.cpu_count()} CPUs, Python "
          f"{platform.python_version()}, load {os.getloadavg()[0]:.2f}, {time.strftime('%Y-%m-%d')}, n={n}, strict")
    print("| path (plugin → proxy → upstream) | fresh p50 ms | fresh p99 ms | keep-alive p50 ms | keep-alive p99 ms | "
          "upstream saw |")
    print("|---|---:|---:|---:|---:|---|")
    for way, r in result.items():
        print(f"| {way} | {r['fresh_p50_ms']} | {r['fresh_p99_ms']} | {r['keepalive_p50_ms']} | {r['keepalive_p99_ms']} "
              f"| `{r['upstream_saw']}` |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--https", action="store_true", help="a secret-bound host (TLS terminated) vs a plain tunnel")
    args = ap.parse_args()
    if args.https:
        return https_main(args.n)
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
