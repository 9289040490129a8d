"""The task store benchmark runs end to end: store mode on both backends, and its MCP tasks/get
polling mode against a small stand-in server (the daemon's tasks/get comes with the lead's part).
Whether anything is fast is for benchmarks/ only."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks" / "task_store_bench.py"


def test_store_mode_fills_and_reads_both_backends(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(BENCH), "--tasks", "300", "-c", "8", "-s", "0.3", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["backend"] for r in data["results"]] == ["sqlite", "redis"]
    for r in data["results"]:
        ops = {m["op"]: m for m in r["ops"]}
        assert ops["create (fill)"]["calls"] == 300 and ops["transition to completed"]["calls"] == 150
        assert ops["get"]["calls"] > 0 and ops["get"]["errors"] == 0
    assert data["environment"]["versions"]["redis-server"]
    assert "cores" in proc.stdout and "load average" in proc.stdout


class _FakeTasksServer(http.server.BaseHTTPRequestHandler):
    """Task-augmented tools/call makes a task; tasks/get answers it. Both eras, barely checked."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        msg = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        method, params = msg.get("method"), msg.get("params", {})
        result: dict[str, Any] | None = None
        if method == "initialize":
            result = {"protocolVersion": "2025-11-25", "capabilities": {"tasks": {}}, "serverInfo": {"name": "fake"}}
        elif method == "tools/call":
            task = {"taskId": f"task-{msg['id']}", "status": "working", "ttl": 60000}
            modern = "io.modelcontextprotocol/tasks" in json.dumps(params.get("_meta", {}))
            result = {"resultType": "task", **task} if modern else ({"task": task} if "task" in params else None)
        elif method == "tasks/get" and self.headers.get("Mcp-Name", params["taskId"]) == params["taskId"]:
            result = {"taskId": params["taskId"], "status": "working"}
        if "id" not in msg:
            self.send_response(202)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        reply = {"jsonrpc": "2.0", "id": msg["id"]}
        reply.update({"result": result} if result is not None else {"error": {"code": -32602, "message": "no"}})
        body = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if method == "initialize":
            self.send_header("Mcp-Session-Id", "fake-session")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def fake_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeTasksServer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/mcp"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("era", ["2025-11-25", "2026-07-28"])
def test_mcp_mode_creates_tasks_then_polls_tasks_get(fake_server: str, era: str, tmp_path: Path) -> None:
    out = tmp_path / "mcp.json"
    argv = [sys.executable, str(BENCH), "--mcp-url", fake_server, "--tasks", "3", "-c", "4", "-s", "0.3",
            "--warmup", "0.1", "--json", str(out)]
    if era == "2026-07-28":
        argv.append("--modern")
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    (polled,) = result["ops"]
    assert result["tasks"] == 3 and era in polled["op"]
    assert polled["calls"] > 0 and polled["errors"] == 0
