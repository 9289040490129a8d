"""``toolcell serve --http/--unix/--stdio`` as a process: the printed URL, several transports on one
daemon, graceful SIGTERM, refusing an unauthenticated public address."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2
from http_harness import REPO, make_plugins, start_server, stop_server
from httpkit import modern_body, modern_headers

PLAIN_CONFIG = 'policy = "none"\nmin_workers = 1\n\n[http]\nshutdown_grace_s = 5.0\n'


def test_sigterm_lets_in_flight_calls_finish_then_exits(tmp_path: Path) -> None:
    server = start_server(tmp_path, PLAIN_CONFIG)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/mcp", server.url)
        result: dict = {}

        def call() -> None:
            with httpx2.Client(timeout=30) as c:
                result["r"] = c.post(server.url, content=modern_body(
                    "tools/call", {"name": "a_sleep", "arguments": {"seconds": 1.0}}, id="inflight"),
                    headers=modern_headers("tools/call", "a_sleep"))

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.4)
        server.proc.send_signal(signal.SIGTERM)
        thread.join(15)
        assert result["r"].status_code == 200
        assert result["r"].json()["result"]["content"][0]["text"] == "slept"
        assert server.proc.wait(timeout=15) == 0
    finally:
        stop_server(server)


def test_stdio_http_and_a_unix_socket_are_served_by_one_daemon(tmp_path: Path) -> None:
    plugins = make_plugins(tmp_path / "plugins")
    config = tmp_path / "toolcell.toml"
    config.write_text(PLAIN_CONFIG)
    sock = tmp_path / "toolcell.sock"
    stderr_path = tmp_path / "stderr.log"
    with open(stderr_path, "w") as stderr:  # the child has its own copy
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "serve", "--config", str(config), "--plugins", str(plugins),
             "--stdio", "--http", "127.0.0.1:0", "--unix", str(sock)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr,
            cwd=str(REPO),
            env=dict(os.environ, PYTHONPATH=str(REPO)))
    with proc:  # closes the stdin/stdout pipes
        try:
            deadline = time.monotonic() + 60
            url = None
            while time.monotonic() < deadline and url is None:
                m = re.search(r"MCP endpoint (http://\S+)", stderr_path.read_text())
                url = m.group(1) if m else None
                time.sleep(0.1)
            assert url is not None, stderr_path.read_text()
            assert f"MCP endpoint unix:{sock}:/mcp" in stderr_path.read_text()
            assert (sock.stat().st_mode & 0o777) == 0o600
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {
                "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                          "io.modelcontextprotocol/clientCapabilities": {}}}}).encode() + b"\n")
            proc.stdin.flush()
            over_stdio = {t["name"] for t in json.loads(proc.stdout.readline())["result"]["tools"]}
            with httpx2.Client(timeout=10) as c:
                over_tcp = {t["name"] for t in c.post(url, content=modern_body("tools/list"),
                                                      headers=modern_headers("tools/list")).json()["result"]["tools"]}
            with httpx2.Client(timeout=10, transport=httpx2.HTTPTransport(uds=str(sock))) as c:
                r = c.post("http://localhost/mcp", content=modern_body("tools/list"), headers=modern_headers("tools/list"))
                over_unix = {t["name"] for t in r.json()["result"]["tools"]}
            assert over_stdio == over_tcp == over_unix and "a_echo" in over_stdio
            proc.stdin.close()  # end of stdin stops the whole daemon
            assert proc.wait(timeout=20) == 0
            assert not sock.exists()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def test_a_public_address_without_tokens_is_refused(tmp_path: Path) -> None:
    plugins = make_plugins(tmp_path / "plugins")
    config = tmp_path / "toolcell.toml"
    config.write_text(PLAIN_CONFIG)
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--config", str(config), "--plugins",
                        str(plugins), "--http", "0.0.0.0:0"], check=False, capture_output=True, text=True, timeout=60,
                       cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 1
    assert "without authentication" in r.stderr


def test_serve_without_a_transport_says_how_to_choose_one() -> None:
    r = subprocess.run([sys.executable, "-m", "runtime.cli", "serve"], check=False, capture_output=True, text=True, timeout=60,
                       cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 2
    assert "--http" in r.stderr and "--stdio" in r.stderr


def test_sigterm_answers_calls_still_running_at_the_end_of_the_grace_on_both_eras(tmp_path: Path) -> None:
    server = start_server(tmp_path, PLAIN_CONFIG.replace("shutdown_grace_s = 5.0", "shutdown_grace_s = 1.5"))
    try:
        results: dict = {}

        def modern() -> None:
            with httpx2.Client(timeout=30) as c:
                results["modern"] = c.post(server.url, content=modern_body(
                    "tools/call", {"name": "a_sleep", "arguments": {"seconds": 30}}, id="stuck"),
                    headers=modern_headers("tools/call", "a_sleep"))

        def late() -> None:
            time.sleep(0.8)
            with httpx2.Client(timeout=30) as c:
                try:
                    results["late"] = c.post(server.url, content=modern_body(
                        "tools/call", {"name": "a_sleep", "arguments": {"seconds": 0.1}}, id="late"),
                        headers=modern_headers("tools/call", "a_sleep"))
                except httpx2.TransportError as exc:  # the listener may already be closed: also a clear refusal
                    results["late"] = exc

        threads = [threading.Thread(target=modern), threading.Thread(target=late)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(20)
        stuck = results["modern"]
        assert stuck.status_code == 200, stuck.text
        body = stuck.json()
        assert body["id"] == "stuck" and body["result"]["isError"] is True
        assert "shutting down" in body["result"]["content"][0]["text"]
        late_result = results["late"]
        if not isinstance(late_result, Exception):
            assert late_result.status_code == 503 and "shutting down" in late_result.text
        assert server.proc.wait(timeout=15) == 0
    finally:
        stop_server(server)


def test_sigterm_answers_a_legacy_session_call_still_running_at_the_end_of_the_grace(tmp_path: Path) -> None:
    server = start_server(tmp_path, PLAIN_CONFIG.replace("shutdown_grace_s = 5.0", "shutdown_grace_s = 1.0"))
    try:
        with httpx2.Client(timeout=30) as c:
            init = c.post(server.url, json={"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
                headers={"accept": "application/json, text/event-stream"})
            sid = init.headers["mcp-session-id"]
        result: dict = {}

        def call() -> None:
            with httpx2.Client(timeout=30) as c:
                result["r"] = c.post(server.url, json={"jsonrpc": "2.0", "id": "legacy-stuck", "method": "tools/call",
                                                       "params": {"name": "a_sleep", "arguments": {"seconds": 30}}},
                                     headers={"accept": "application/json, text/event-stream", "mcp-session-id": sid,
                                              "mcp-protocol-version": "2025-06-18"})

        thread = threading.Thread(target=call)
        thread.start()
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        thread.join(20)
        r = result["r"]
        assert r.status_code == 200, r.text
        text = r.text
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            text = "".join(line[5:] for line in text.splitlines() if line.startswith("data:"))
        body = json.loads(text)
        assert body["id"] == "legacy-stuck" and body["result"]["isError"] is True
        assert "shutting down" in body["result"]["content"][0]["text"]
        assert server.proc.wait(timeout=15) == 0
    finally:
        stop_server(server)
