"""``toolcell bench`` against hostile servers: each misbehaviour ends as a target reported down,
broken or with errors, with why, and the run goes on; nothing the server does makes the bench
hang, grow without end, or leave processes behind. The servers are small scripts in ``tmp_path``.
No timing is asserted."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest

pytest.importorskip("hdrh")

from runtime.bench import wire  # noqa: E402
from runtime.bench.http_client import Response, classify  # noqa: E402
from runtime.bench.targets import MAX_LISTING_BYTES  # noqa: E402
from runtime.bench.stdio_client import (  # noqa: E402
    MAX_LINE_BYTES,
    MAX_UNSENT_BYTES,
    LineSplitter,
    StdioConnection,
    TargetDown,
)

REPO = Path(__file__).resolve().parents[2]
QUICK = ["--tool", "echo", "-c", "2", "--duration", "0.5", "--warmup", "0", "--timeout", "2", "--quiet", "--no-ceiling"]

# A stdio MCP server that behaves until its MODE says otherwise.
STDIO_SERVER = r'''
import json, os, subprocess, sys
mode = sys.argv[1]
out = sys.stdout.buffer
def send(obj):
    out.write(json.dumps(obj).encode() + b"\n"); out.flush()
RESULTS = {
    "initialize": {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": {"name": "h", "version": "1"}},
    "tools/list": {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]},
    "tools/call": {"content": [{"type": "text", "text": "hi"}]},
}
if mode == "orphan":  # a grandchild whose parent is gone: no longer in the server's tree
    subprocess.run(["sh", "-c", f"sleep 120 >/dev/null 2>&1 & echo $! > {sys.argv[2]}"])
if mode == "stderr":
    for _ in range(200):
        os.write(2, b"e" * (1 << 20))
    os.write(2, b"\nlast words\n")
calls = 0
for line in sys.stdin.buffer:
    msg = json.loads(line)
    method, rid = msg.get("method"), msg.get("id")
    if rid is None:
        continue
    if method == "initialize" and mode == "endless":
        while True:
            out.write(b"x" * 65536)
    if method == "initialize" and mode == "wrong-id":
        send({"jsonrpc": "2.0", "id": 999, "result": RESULTS[method]}); continue
    if method == "initialize" and mode == "huge-error":
        send({"jsonrpc": "2.0", "id": rid, "error": {"code": -1, "message": "no" * 500_000}}); continue
    if method == "tools/list" and mode == "biglist":  # 20 pages of ~10 MB of tools (the bench keeps every schema)
        page = int((msg.get("params") or {}).get("cursor") or 0)
        schema = {"type": "object", "description": "d" * 10_000}
        tools = [{"name": f"t{page}_{i}", "inputSchema": schema} for i in range(1000)]
        result = {"tools": tools, **({"nextCursor": str(page + 1)} if page < 19 else {})}
        send({"jsonrpc": "2.0", "id": rid, "result": result}); continue
    if method == "tools/call":
        calls += 1
        if mode == "stderr" and calls > 1:
            sys.exit(3)
        if mode == "flood" and calls > 1:  # requests to the client, never reading its answers
            # long ids: each refusal the bench owes is ~4 KB, so unbounded refusals show within a run
            block = b"".join(b'{"jsonrpc":"2.0","id":"s%d%s","method":"ping"}\n' % (i, b"x" * 4000) for i in range(100))
            while True:
                out.write(block)
    send({"jsonrpc": "2.0", "id": rid, "result": RESULTS[method]})
'''

# A Streamable HTTP MCP server on raw sockets that behaves until its MODE says otherwise.
HTTP_SERVER = r'''
import json, socketserver, sys, time
mode, port = sys.argv[1], int(sys.argv[2])  # argv[3]: where a request head with an injected line goes
RESULTS = {
    "initialize": {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": {"name": "h", "version": "1"}},
    "tools/list": {"tools": [{"name": "echo", "inputSchema": {"type": "object"}}]},
    "tools/call": {"content": [{"type": "text", "text": "hi"}]},
}
class Handler(socketserver.StreamRequestHandler):
    def handle(self):
        while True:
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                c = self.rfile.read(1)
                if not c:
                    return
                head += c
            size = next(int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:"))
            msg = json.loads(self.rfile.read(size))
            w = self.wfile
            if "id" not in msg:
                w.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: 0\r\n\r\n"); continue
            if b"injected:" in head.lower():  # a header line of ours made from the server's schema
                open(sys.argv[3], "ab").write(head)
            result = RESULTS[msg["method"]]
            if msg["method"] == "tools/list" and mode == "inject":  # a header name with a line break in it
                header = {"type": "string", "x-mcp-header": "Text\r\nInjected: yes"}
                result = {"tools": [{"name": "echo", "inputSchema": {"type": "object", "properties": {"text": header}}}]}
            body = json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}).encode()
            if msg["method"] == "tools/list" and mode == "trickle":  # a byte at a time, never the whole body
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n")
                while True:
                    w.write(b" "); w.flush(); time.sleep(0.005)
            if msg["method"] == "tools/list" and mode == "headers":  # 8 MiB of headers, then silence
                w.write(b"HTTP/1.1 200 OK\r\n")
                for i in range(8192):
                    w.write(b"X-H%d: %s\r\n" % (i, b"v" * 1000))
                w.flush(); time.sleep(60)
            if msg["method"] == "tools/call" and mode == "sse-held":  # the answer, then the stream stays open
                w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\ndata: " + body + b"\n\n"); w.flush()
                time.sleep(60)
            w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
class Server(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128
Server(("127.0.0.1", port), Handler).serve_forever()
'''


def bench(tmp_path: Path, *args: str, fsize: int | None = None) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], int]:
    """Run the bench; (process, report, the largest RSS in KiB of the bench or a process it waited for)."""
    out = tmp_path / f"report-{len(list(tmp_path.iterdir()))}.json"
    limits = f"resource.setrlimit(resource.RLIMIT_FSIZE, ({fsize}, {fsize}))\n" if fsize else ""
    # A parent of its own, so that the RSS high-water mark is this run's alone.
    wrapper = ("import resource, subprocess, sys\n" + limits +
               "p = subprocess.run(sys.argv[1:])\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
               "sys.exit(p.returncode)\n")
    argv = [sys.executable, "-c", wrapper, sys.executable, "-m", "runtime.cli", "bench", *args, "--json", str(out)]
    with subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as running:
        try:
            stdout, stderr = running.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(running.pid, signal.SIGINT)  # a bench that hangs: Ctrl-C, so that it stops its servers
            stdout, stderr = running.communicate(timeout=30)
            raise AssertionError(f"the bench did not end: {stderr[-2000:]}") from None
    proc = subprocess.CompletedProcess(argv, running.returncode, stdout, stderr)
    assert out.exists(), proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), int(proc.stderr.split()[-1])


def target(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(t for t in report["targets"] if t["name"] == name)


def stdio(tmp_path: Path, name: str, *args: str) -> str:
    script = tmp_path / "stdio_server.py"
    script.write_text(STDIO_SERVER)
    return f"{name}=stdio:{sys.executable} {script} {' '.join(args)}"


def http(tmp_path: Path, name: str, mode: str) -> str:
    script = tmp_path / "http_server.py"
    script.write_text(HTTP_SERVER)
    return f"{name}=http:{sys.executable} {script} {mode} {{port}} {tmp_path / 'injected.txt'}"


def test_a_line_is_cut_from_its_chunks_and_one_without_end_is_refused() -> None:
    lines = LineSplitter()
    assert lines.feed(b'{"a"') is None and lines.feed(b":1}") is None
    assert lines.feed(b'\n{"b":2}\n{"c"') == b'{"a":1}\n{"b":2}'
    assert lines.feed(b":3}\n") == b'{"c":3}'
    chunk = b"x" * (1 << 20)
    with pytest.raises(TargetDown, match="longer than"):
        for _ in range(MAX_LINE_BYTES // len(chunk) + 1):
            lines.feed(chunk)


def test_stdio_servers_that_break_the_handshake_are_reported_down_with_why_and_the_others_run(tmp_path: Path) -> None:
    proc, report, _ = bench(tmp_path, stdio(tmp_path, "endless", "endless"), stdio(tmp_path, "wrong-id", "wrong-id"),
                            stdio(tmp_path, "huge-error", "huge-error"), stdio(tmp_path, "good", "good"), *QUICK)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"a line longer than {MAX_LINE_BYTES} bytes" in target(report, "endless")["problem"]
    # an answer to an id never asked fails at once (it was skipped until the 60 s handshake timeout)
    assert "an answer to id 999, which was never asked" in target(report, "wrong-id")["problem"]
    huge = target(report, "huge-error")
    assert huge["status"] == "down" and len(huge["problem"]) < 400
    assert target(report, "good")["status"] == "ok"


def test_a_stdio_server_flooding_requests_without_reading_its_stdin_does_not_grow_the_bench(tmp_path: Path) -> None:
    # Every request gets a refusal (~4 KB each, echoing the long id); unread, they piled up in the bench.
    # Past MAX_UNSENT_BYTES (16 MiB) the server's requests are counted but not answered.
    proc, report, max_rss_kib = bench(tmp_path, stdio(tmp_path, "flood", "flood"), *QUICK[:-4], "--duration", "2",
                                      "--timeout", "1", "--quiet", "--no-ceiling")
    (seg,) = report["segments"]
    assert seg["server_requests"] > 0, seg
    assert max_rss_kib < 150 * 1024


def test_past_the_unsent_cap_a_servers_request_is_counted_and_gets_no_refusal() -> None:
    # The rule the run above depends on, shown without timing: without the cap the refusals owed to a
    # server that never reads pile up (end to end, the bench then spends its time re-joining them).
    conn = StdioConnection.__new__(StdioConnection)
    conn.unsent, conn.timed_out = 0, set()
    loop = SimpleNamespace(stats=SimpleNamespace(server_requests=0, unexpected=0))
    request = wire.decode_one(b'{"jsonrpc":"2.0","id":"s1","method":"ping"}')
    out: list[bytes] = []
    conn._stray(loop, request, out)  # type: ignore[arg-type]
    assert len(out) == 1 and b'"s1"' in out[0] and conn.unsent == len(out[0])
    conn.unsent = MAX_UNSENT_BYTES + 1
    conn._stray(loop, request, out)  # type: ignore[arg-type]
    assert len(out) == 1 and loop.stats.server_requests == 2


def test_a_listing_past_its_cap_fails_the_check_instead_of_being_kept_whole(tmp_path: Path) -> None:
    proc, report, _ = bench(tmp_path, stdio(tmp_path, "biglist", "biglist"), *QUICK)
    big = target(report, "biglist")
    assert f"the listing is over {MAX_LISTING_BYTES} bytes after 7 page(s)" in big["problem"], big


def test_a_server_is_stopped_with_its_group_and_its_stderr_is_kept_short(tmp_path: Path) -> None:
    pid_file = tmp_path / "orphan.pid"
    # Under a 16 MiB file size limit: 200 MiB of stderr went to a temporary file, and the server died of SIGXFSZ.
    proc, report, _ = bench(tmp_path, stdio(tmp_path, "orphan", "orphan", str(pid_file)),
                            stdio(tmp_path, "noisy", "stderr"), *QUICK, fsize=16 << 20)
    try:
        orphan = psutil.Process(int(pid_file.read_text()))
    except psutil.NoSuchProcess:
        orphan = None
    if orphan is not None:
        _, alive = psutil.wait_procs([orphan], timeout=10)  # a bounded wait for it to be reaped, if it was killed
        for left in alive:
            left.kill()  # the grandchild our test server started, which the bench left behind
        assert alive == []
    noisy = target(report, "noisy")
    assert noisy["status"] == "died", noisy
    assert "exited with 3" in noisy["problem"] and "last words" in noisy["problem"]
    assert resource.getrlimit(resource.RLIMIT_FSIZE)[0] != 16 << 20  # the limit was the bench's alone


def test_http_servers_that_trickle_or_send_endless_headers_are_reported_broken_and_an_open_sse_stream_answers(
        tmp_path: Path) -> None:
    proc, report, max_rss_kib = bench(tmp_path, http(tmp_path, "trickle", "trickle"),
                                      http(tmp_path, "headers", "headers"), http(tmp_path, "sse-held", "sse-held"),
                                      *QUICK)
    # a byte every 5 ms restarted the socket's timeout at every recv: the handshake never ended
    trickle = target(report, "trickle")
    assert trickle["status"] == "broken" and "no answer in time" in trickle["problem"]
    headers = target(report, "headers")
    assert "response head over 1048576 bytes" in headers["problem"]
    assert max_rss_kib < 200 * 1024
    # the answer came; that the stream stays open after it is no timeout
    (seg,) = [s for s in report["segments"] if s["target"] == "sse-held"]
    assert seg["ok"] > 0 and "timeout" not in seg["errors"], seg


def test_a_tool_whose_header_annotation_would_inject_a_header_line_is_dropped(tmp_path: Path) -> None:
    # x-mcp-header names the header a 2026-07-28 client mirrors an argument into; the name came from the
    # server's schema into our request unchecked. The spec: clients MUST drop a tool that breaks its rules.
    proc, report, _ = bench(tmp_path, http(tmp_path, "inject", "inject"), "--tool", "echo", "--args",
                            '{"text": "hi"}', *QUICK[2:])
    assert not (tmp_path / "injected.txt").exists()
    checks = " | ".join(f"{c.get('name')}: {c.get('detail')}" for c in target(report, "inject").get("checks", []))
    assert "'echo' dropped: inputSchema.properties.text: x-mcp-header must be a non-empty RFC 9110 token" in checks, \
        checks or report


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_bench_stopped_by_sigterm_or_sighup_stops_the_servers_it_started(tmp_path: Path, sig: int) -> None:
    # `timeout`, the end of a CI job, a closed terminal: their default action ended the bench at once, and
    # the servers it had started, each in a session of its own, ran on.
    argv = [sys.executable, "-m", "runtime.cli", "bench", http(tmp_path, "h", "good"), "--tool", "echo", "-c", "2",
            "--duration", "60", "--warmup", "0", "--quiet", "--no-ceiling"]
    with subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as running:
        me = psutil.Process(running.pid)
        servers: list[psutil.Process] = []
        for _ in range(300):  # the server is up once it has been started and the bench is calling it
            servers = [p for p in me.children() if "http_server.py" in " ".join(p.cmdline())]
            if servers and any(c.status == psutil.CONN_ESTABLISHED for c in servers[0].net_connections("tcp")):
                break
            psutil.wait_procs([me], timeout=0.1)
        assert servers, "the bench never started its server"
        running.send_signal(sig)
        try:
            _, stderr = running.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(running.pid, signal.SIGKILL)
            raise
    _, alive = psutil.wait_procs(servers, timeout=10)
    for left in alive:
        left.kill()  # the server our bench started and left behind
    assert alive == [], "the bench left its server running"
    assert running.returncode == 128 + sig and f"stopped by {signal.Signals(sig).name}" in stderr, stderr[-2000:]


@pytest.mark.parametrize("newline", [b"\n", b"\r\n"])
def test_an_sse_answer_is_found_however_the_reads_cut_it(newline: bytes) -> None:
    # The stream is searched only where it was not searched before (an event without end was re-copied and
    # re-scanned at every read: 60 s of CPU to reach the body cap); a cut anywhere, a CRLF's middle too, is found.
    answer = b'{"jsonrpc":"2.0","id":7,"result":{"content":[]}}'
    stream = newline.join([b": keep-alive", b"", b"event: message", b"data: " + answer, b"", b""])
    for cut in range(1, len(stream)):
        response = Response(7)
        response.on_header(b"content-type", b"text/event-stream")
        response.on_headers_complete()
        response.on_body(stream[:cut])
        response.on_body(stream[cut:])
        assert response.answer is not None and response.answer.id == 7, cut


def test_an_sse_stream_that_ends_without_the_answer_says_what_it_carried_instead() -> None:
    response = Response(3)
    response.on_header(b"content-type", b"text/event-stream")
    response.on_headers_complete()
    response.on_body(b'data: {"jsonrpc":"2.0","method":"notifications/progress","params":{}}\n\n'  # expected: not named
                     b"data: <html>oops</html>\n\ndata: nor this\n\n")
    response.on_message_complete()
    kind, detail, _ = classify(response, 200, 3, legacy_session=False)
    assert kind == wire.INVALID and detail is not None
    assert "ended without the response (2 event(s) that were not JSON-RPC, the first: " in detail, detail
