"""A lean load generator for MCP servers over Streamable HTTP (HTTP/1.1 keep-alive).

It opens C keep-alive connections to an MCP endpoint, sets up the session (legacy: one
``initialize`` at 2025-06-18 and its ``notifications/initialized``; the session id, if the server
hands one out, is sent on every request; ``--modern``: 2026-07-28 stateless requests carrying
``params._meta`` and the ``Mcp-Method``/``Mcp-Name`` headers, no handshake), checks that the tool
answers, warms up, then keeps one ``tools/call`` in flight on every connection for a fixed time
and reports calls/s, latency percentiles and errors (non-200 statuses, JSON-RPC errors and
``isError`` results all count). Like a real client it waits for each response before sending the
next request on that connection (no pipelining).

The client is one thread around ``epoll``: requests are pre-encoded byte strings with the id
spliced in, and responses are framed by ``Content-Length`` or chunked encoding, or read as an
SSE stream until the response to the request arrives. Its own CPU use is reported beside the
result so a saturated client is visible. The server is whatever listens at the URL: this module
does not start it (``benchmarks/run.py --http`` does).

    python benchmarks/http_loadgen.py -c 16 -s 10 http://127.0.0.1:8765/mcp
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import mcpwire
import msgspec
import procstats
from loadgen import LoadResult, _client_cpu_s, percentile

READ_CHUNK = 256 * 1024


class HttpLoadConfig(msgspec.Struct, frozen=True):
    """What to run: endpoint, tool, arguments, era, concurrency, timings and credentials."""

    url: str
    tool: str = "echo"
    arguments: dict[str, Any] = msgspec.field(default_factory=lambda: {"text": "hello"})
    modern: bool = False
    concurrency: int = 16
    seconds: float = 10.0
    warmup_s: float = 1.0
    token: str | None = None
    connect_timeout_s: float = 30.0


class HttpError(Exception):
    """The server answered something the load generator cannot use."""


class _Response(msgspec.Struct):
    """The bits of a JSON-RPC response we look at."""

    id: int | str | None = None
    result: mcpwire.CallResult | None = None
    error: mcpwire.ErrorObject | None = None


_decode_response = msgspec.json.Decoder(_Response).decode
_encode = msgspec.json.Encoder().encode


class Endpoint:
    """Where to connect and the fixed part of every request's head."""

    def __init__(self, url: str, token: str | None) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise HttpError(f"only http:// URLs are supported, got {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.path = parts.path or "/"
        host_header = parts.netloc.rsplit("@", 1)[-1]
        fixed = [f"Host: {host_header}", "Accept: application/json, text/event-stream",
                 "Content-Type: application/json", "Connection: keep-alive"]
        if token:
            fixed.append(f"Authorization: Bearer {token}")
        self.fixed = fixed

    def head(self, body_len: int, extra: Sequence[str] = ()) -> bytes:
        lines = [f"POST {self.path} HTTP/1.1", *self.fixed, *extra, f"Content-Length: {body_len}", "", ""]
        return "\r\n".join(lines).encode()

    def connect(self) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock


class Conn:
    """One keep-alive connection with at most one request in flight."""

    __slots__ = ("buf", "sent_at", "sock", "want_id")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.sent_at = 0
        self.want_id: int | None = None


def _parse_head(buf: bytes, end: int) -> tuple[int, dict[bytes, bytes]]:
    lines = buf[:end].split(b"\r\n")
    status_line = lines[0].split(b" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/1."):
        raise HttpError(f"bad status line {lines[0][:80]!r}")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line[1]), headers


def _dechunk(data: bytes) -> tuple[bytes, int] | None:
    """(body, bytes consumed) if ``data`` holds a whole chunked body, else None."""
    pos = 0
    parts = []
    while True:
        eol = data.find(b"\r\n", pos)
        if eol < 0:
            return None
        size = int(data[pos:eol].split(b";", 1)[0], 16)
        start = eol + 2
        if size == 0:
            trailer_end = data.find(b"\r\n\r\n", eol)
            if data[start:start + 2] == b"\r\n":
                return b"".join(parts), start + 2
            if trailer_end < 0:
                return None
            return b"".join(parts), trailer_end + 4
        if len(data) < start + size + 2:
            return None
        parts.append(data[start:start + size])
        pos = start + size + 2


def take_response(buf: bytes) -> tuple[int, dict[bytes, bytes], bytes, bytes] | None:
    """(status, headers, body, rest) when ``buf`` starts with a whole response, else None.

    An SSE response (``text/event-stream``) is complete once its stream has ended (chunked
    terminator or Content-Length reached); the body is the raw event text.
    """
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    status, headers = _parse_head(buf, end)
    rest = buf[end + 4:]
    if b"content-length" in headers:
        n = int(headers[b"content-length"])
        if len(rest) < n:
            return None
        return status, headers, rest[:n], rest[n:]
    if headers.get(b"transfer-encoding", b"").lower() == b"chunked":
        got = _dechunk(rest)
        if got is None:
            return None
        return status, headers, got[0], rest[got[1]:]
    if status in (202, 204, 304) or 100 <= status < 200:
        return status, headers, b"", rest
    raise HttpError("response without Content-Length or chunked encoding (connection-close framing)")


def json_messages(headers: dict[bytes, bytes], body: bytes) -> list[bytes]:
    """The JSON-RPC messages in a response body (plain JSON, or SSE ``data:`` lines)."""
    if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
        out = []
        for event in body.replace(b"\r\n", b"\n").split(b"\n\n"):
            data = [line[5:].lstrip() for line in event.split(b"\n") if line.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data))
        return out
    return [body] if body else []


def roundtrip(sock: socket.socket, request: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    """Blocking request/response on one connection (session set-up and checks only)."""
    sock.sendall(request)
    buf = b""
    deadline = time.monotonic() + 30
    while True:
        got = take_response(buf)
        if got is not None:
            return got[0], got[1], got[2]
        if time.monotonic() > deadline:
            raise HttpError("no complete response within 30 s")
        chunk = sock.recv(READ_CHUNK)
        if not chunk:
            raise HttpError("server closed the connection")
        buf += chunk


class Plan:
    """Pre-encoded call requests for one endpoint, era and session."""

    def __init__(self, ep: Endpoint, config: HttpLoadConfig, session_id: bytes | None) -> None:
        extra: list[str] = []
        if config.modern:
            extra += [f"MCP-Protocol-Version: {mcpwire.MODERN_PROTOCOL_VERSION}", "Mcp-Method: tools/call",
                      f"Mcp-Name: {config.tool}"]
            params: dict[str, Any] = {"name": config.tool, "arguments": config.arguments,
                                      "_meta": mcpwire.modern_meta()}
        else:
            extra.append(f"MCP-Protocol-Version: {mcpwire.LEGACY_PROTOCOL_VERSION}")
            params = {"name": config.tool, "arguments": config.arguments}
        if session_id:
            extra.append(f"Mcp-Session-Id: {session_id.decode()}")
        self.ep = ep
        self.extra = extra
        body = _encode({"jsonrpc": "2.0", "id": 0, "method": "tools/call", "params": params})
        # Split around the id so issuing a call is two concatenations.
        marker = b'"id":0,'
        cut = body.index(marker)
        self.body_prefix = body[:cut] + b'"id":'
        self.body_suffix = b"," + body[cut + len(marker):]

    def request(self, call_id: int) -> bytes:
        body = self.body_prefix + str(call_id).encode() + self.body_suffix
        return self.ep.head(len(body), self.extra) + body


def open_session(ep: Endpoint, config: HttpLoadConfig) -> bytes | None:
    """Legacy: initialize and return the session id (None for stateless servers). Modern: None."""
    if config.modern:
        return None
    init = _encode({"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
        "protocolVersion": mcpwire.LEGACY_PROTOCOL_VERSION, "capabilities": {}, "clientInfo": mcpwire.CLIENT_INFO}})
    deadline = time.monotonic() + config.connect_timeout_s
    while True:
        try:
            sock = ep.connect()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    with sock:
        status, headers, body = roundtrip(sock, ep.head(len(init)) + init)
        if status != 200:
            raise HttpError(f"initialize answered HTTP {status}: {body[:200]!r}")
        session = headers.get(b"mcp-session-id")
        extra = [f"MCP-Protocol-Version: {mcpwire.LEGACY_PROTOCOL_VERSION}"]
        if session:
            extra.append(f"Mcp-Session-Id: {session.decode()}")
        note = _encode({"jsonrpc": "2.0", "method": "notifications/initialized"})
        status, _, body = roundtrip(sock, ep.head(len(note), extra) + note)
        if status not in (200, 202, 204):
            raise HttpError(f"notifications/initialized answered HTTP {status}: {body[:200]!r}")
    return session


def check_call(sock: socket.socket, plan: Plan) -> None:
    status, headers, body = roundtrip(sock, plan.request(1))
    messages = json_messages(headers, body)
    if status != 200 or not messages:
        raise HttpError(f"tools/call answered HTTP {status}: {body[:300]!r}")
    response = _decode_response(messages[-1])
    if response.error is not None or response.result is None or response.result.isError:
        raise HttpError(f"tools/call failed: {messages[-1][:300]!r}")


class _Drive:
    def __init__(self) -> None:
        self.latencies_ns: list[int] = []
        self.errors = 0
        self.statuses: dict[str, int] = {}


def drive(plan: Plan, conns: list[Conn], seconds: float, record_from_ns: int) -> _Drive:
    """Keep one call in flight per connection until ``seconds`` pass; record after a time."""
    out = _Drive()
    ep = select.epoll()
    by_fd: dict[int, Conn] = {}
    next_id = 2
    now = time.perf_counter_ns()
    for c in conns:
        by_fd[c.sock.fileno()] = c
        c.sock.setblocking(False)
        ep.register(c.sock.fileno(), select.EPOLLIN)
        c.want_id = next_id
        c.sent_at = now
        c.sock.send(plan.request(next_id))
        next_id += 1
    stop_at = now + int(seconds * 1e9)
    in_flight = len(conns)
    stopping = False
    latencies = out.latencies_ns
    statuses = out.statuses
    while in_flight:
        events = ep.poll(1.0)
        now = time.perf_counter_ns()
        if now >= stop_at:
            stopping = True
        if not events and now > stop_at + 10_000_000_000:
            raise HttpError(f"{in_flight} calls still unanswered 10 s after the end")
        for fd, _ in events:
            c = by_fd[fd]
            chunk = c.sock.recv(READ_CHUNK)
            if not chunk:
                raise HttpError("server closed a keep-alive connection")
            c.buf += chunk
            got = take_response(c.buf)
            if got is None:
                continue
            status, headers, body, c.buf = got
            key = str(status)
            statuses[key] = statuses.get(key, 0) + 1
            ok = False
            if status == 200:
                for message in json_messages(headers, body):
                    r = _decode_response(message)
                    if r.id == c.want_id:
                        ok = r.error is None and r.result is not None and not r.result.isError
            if c.sent_at >= record_from_ns:
                latencies.append(now - c.sent_at)
                if not ok:
                    out.errors += 1
            if stopping:
                in_flight -= 1
                ep.unregister(fd)
                continue
            c.want_id = next_id
            c.sent_at = now
            c.sock.send(plan.request(next_id))
            next_id += 1
    ep.close()
    return out


class HttpServer:
    """A server process started for one run: ``argv`` with ``{port}`` replaced by a free port."""

    def __init__(self, argv: Sequence[str], cwd: str | None = None) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.stderr = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(self.argv, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self.stderr)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, max_bytes: int = 2000) -> str:
        self.stderr.seek(0, os.SEEK_END)
        size = self.stderr.tell()
        self.stderr.seek(max(0, size - max_bytes))
        return self.stderr.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.stderr.close()


def measure_server(argv: Sequence[str], url_template: str, config: HttpLoadConfig,
                   cwd: str | None = None) -> LoadResult:
    """Start ``argv`` (``{port}`` filled in), measure its endpoint, stop it: one ``LoadResult``
    with the server tree's CPU and memory, comparable with stdio runs (``benchmarks/run.py``)."""
    t0 = time.perf_counter()
    server = HttpServer(argv, cwd) if argv else None  # no command: a server that is already running
    url = url_template.replace("{port}", str(server.port)) if server is not None else url_template
    config = msgspec.structs.replace(config, url=url)
    conns: list[Conn] = []
    try:
        endpoint = Endpoint(url, config.token)
        try:
            session = open_session(endpoint, config)
        except (HttpError, OSError) as exc:
            if server is not None and server.proc.poll() is not None:
                raise HttpError(f"server exited with {server.proc.returncode}: {server.stderr_tail()}") from exc
            raise
        ready_s = time.perf_counter() - t0
        plan = Plan(endpoint, config, session)
        for _ in range(config.concurrency):
            conns.append(Conn(endpoint.connect()))
        check_call(conns[0].sock, plan)
        time.sleep(0.3)
        # A server we did not start is not ours to account: no CPU or memory figures for it.
        pid = server.pid if server is not None else None
        rss_idle = procstats.memory_snapshot(pid) if pid is not None else []
        cpu_before = procstats.cpu_snapshot(pid) if pid is not None else {}
        client0 = _client_cpu_s()
        start = time.perf_counter_ns()
        record_from = start + int(config.warmup_s * 1e9)
        state = drive(plan, conns, config.warmup_s + config.seconds, record_from)
        end = time.perf_counter_ns()
        cpu_after = procstats.cpu_snapshot(pid) if pid is not None else {}
        rss_loaded = procstats.memory_snapshot(pid) if pid is not None else []
        client_cpu = _client_cpu_s() - client0
    finally:
        for c in conns:
            c.sock.close()
        if server is not None:
            server.stop()
    total_s = (end - start) / 1e9
    window_s = (end - record_from) / 1e9
    lat = sorted(state.latencies_ns)
    calls = len(lat)
    answered = sum(state.statuses.values())
    cpu_s = procstats.cpu_delta_s(cpu_before, cpu_after)
    bad = {k: v for k, v in state.statuses.items() if k != "200"}
    return LoadResult(
        concurrency=config.concurrency, modern=config.modern, duration_s=window_s, calls=calls,
        calls_per_s=calls / window_s if window_s > 0 else 0.0,
        p50_ms=percentile(lat, 0.50) / 1e6, p90_ms=percentile(lat, 0.90) / 1e6, p99_ms=percentile(lat, 0.99) / 1e6,
        max_ms=(lat[-1] if lat else 0) / 1e6, mean_ms=(sum(lat) / calls / 1e6) if calls else 0.0,
        errors=state.errors, lost=0, unexpected=0, error_sample=f"HTTP statuses {bad}" if bad else None,
        server_cpu_s=cpu_s, server_cpu_us_per_call=cpu_s / answered * 1e6 if answered else 0.0,
        server_cpu_pct=100.0 * cpu_s / total_s, client_cpu_pct=100.0 * client_cpu / total_s, ready_s=ready_s,
        request_bytes=len(plan.request(1)), rss_idle=rss_idle, rss_loaded=rss_loaded)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the MCP endpoint, e.g. http://127.0.0.1:8765/mcp")
    parser.add_argument("-c", "--concurrency", type=int, default=16)
    parser.add_argument("-s", "--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--tool", default="echo")
    parser.add_argument("--arguments", default='{"text": "hello"}', help="JSON object")
    parser.add_argument("--modern", action="store_true", help="2026-07-28 stateless requests")
    parser.add_argument("--token", default=os.environ.get("TOOLCELL_BENCH_TOKEN"),
                        help="bearer token (default: $TOOLCELL_BENCH_TOKEN)")
    args = parser.parse_args(argv)
    config = HttpLoadConfig(url=args.url, tool=args.tool, arguments=json.loads(args.arguments),
                            modern=args.modern, concurrency=args.concurrency, seconds=args.seconds,
                            warmup_s=args.warmup, token=args.token)
    try:
        result = measure_server([], args.url, config)  # no command: the server at the URL
    except (HttpError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(msgspec.json.encode(result).decode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
