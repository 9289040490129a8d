"""Host/Origin allowlists, bearer tokens and scopes, rate limits, size caps and timeouts, audit
log and metrics, against a real ``toolcell serve --http`` process."""

from __future__ import annotations

import json
import socket
import time
from contextlib import AsyncExitStack
from pathlib import Path

import httpx2
import pytest
import trio
from http_harness import TOKENS, ServerProcess, make_plugins, open_http, sha
from httpkit import LEGACY, MODERN, initialize, legacy_headers, modern_body, modern_post, rpc

from runtime.http_config import Token

FULL = TOKENS["full"]


@pytest.fixture
def client() -> httpx2.Client:
    with httpx2.Client(timeout=30) as c:
        yield c


def test_a_foreign_host_is_refused_and_localhost_is_served(locked_server: ServerProcess, client: httpx2.Client) -> None:
    evil = {"host": "evil.example.com", "origin": "http://evil.example.com"}
    r = modern_post(client, locked_server.url, "tools/list", token=FULL, headers=evil)
    assert r.status_code == 403
    assert r.json()["error"]["message"].startswith("Forbidden")
    port = locked_server.url.split(":")[2].split("/")[0]
    ok = modern_post(client, locked_server.url, "tools/list", token=FULL,
                     headers={"host": f"localhost:{port}", "origin": f"http://localhost:{port}"})
    assert ok.status_code == 200


def test_a_foreign_origin_gets_403_and_an_allowed_one_gets_cors_headers(locked_server: ServerProcess,
                                                                         client: httpx2.Client) -> None:
    bad = modern_post(client, locked_server.url, "tools/list", token=FULL, headers={"origin": "https://evil.example"})
    assert bad.status_code == 403
    good = modern_post(client, locked_server.url, "tools/list", token=FULL,
                       headers={"origin": "https://app.example.com"})
    assert good.status_code == 200
    assert good.headers["access-control-allow-origin"] == "https://app.example.com"
    assert "mcp-session-id" in good.headers["access-control-expose-headers"]
    pre = client.options(locked_server.url, headers={"origin": "https://app.example.com",
                                                     "access-control-request-method": "POST",
                                                     "access-control-request-headers": "authorization, mcp-method"})
    assert pre.status_code == 204
    assert "POST" in pre.headers["access-control-allow-methods"]


def test_requests_without_a_valid_bearer_token_get_401(locked_server: ServerProcess, client: httpx2.Client) -> None:
    for token in (None, "wrong-token"):
        r = modern_post(client, locked_server.url, "tools/list", token=token)
        assert r.status_code == 401
        assert r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["code"] == -32600
    basic = modern_post(client, locked_server.url, "tools/list", headers={"authorization": "Basic Zm9vOmJhcg=="})
    assert basic.status_code == 401


def test_healthz_reports_readiness_without_authentication_and_details_only_with_a_token(
        locked_server: ServerProcess, client: httpx2.Client) -> None:
    """A balancer needs the status (and the HTTP code); how many plugins are refused, the catalog's
    fingerprint (which plugin set), the other replicas' host:pid ids, sessions and calls in flight are
    for the operator, not for whoever can reach the port."""
    r = client.get(locked_server.base + "/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ready"}
    for token in ("wrong-token", None):
        headers = {"authorization": f"Bearer {token}"} if token else {}
        assert client.get(locked_server.base + "/healthz", headers=headers).json() == {"status": "ready"}
    detailed = client.get(locked_server.base + "/healthz", headers={"authorization": f"Bearer {FULL}"})
    assert detailed.status_code == 200
    assert detailed.json()["status"] == "ready" and detailed.json()["tools"] >= 7
    assert {"catalog", "catalog_differs", "refused", "plugins"} <= set(detailed.json())
    assert client.get(locked_server.base + "/other").status_code == 404


def test_readiness_and_liveness_are_answered_apart_without_authentication(locked_server: ServerProcess,
                                                                          client: httpx2.Client) -> None:
    ready = client.get(locked_server.base + "/readyz")
    assert (ready.status_code, ready.json()) == (200, {"ready": True})
    assert ready.headers["cache-control"] == "no-store"
    alive = client.get(locked_server.base + "/livez")
    assert (alive.status_code, alive.json()) == (200, {"status": "alive"})
    assert client.head(locked_server.base + "/readyz").status_code == 200


def test_a_tool_outside_the_tokens_scopes_is_indistinguishable_from_an_unknown_tool(
        locked_server: ServerProcess, client: httpx2.Client) -> None:
    alpha = TOKENS["alpha"]
    listed = modern_post(client, locked_server.url, "tools/list", token=alpha).json()["result"]
    names = {t["name"] for t in listed["tools"]}
    assert names and all(n.startswith("a_") for n in names)
    assert listed["cacheScope"] == "private"
    full = {t["name"] for t in modern_post(client, locked_server.url, "tools/list", token=FULL).json()["result"]["tools"]}
    assert "b_secret" in full
    hidden = modern_post(client, locked_server.url, "tools/call", {"name": "b_secret", "arguments": {}}, token=alpha, id=7)
    missing = modern_post(client, locked_server.url, "tools/call", {"name": "b_nosuch", "arguments": {}}, token=alpha, id=7)
    assert hidden.status_code == missing.status_code == 400
    h, m = hidden.json(), missing.json()
    assert h["id"] == m["id"] == 7
    assert h["error"]["code"] == m["error"]["code"] == -32602
    assert h["error"]["message"].replace("b_secret", "X") == m["error"]["message"].replace("b_nosuch", "X")
    # The same holds in a legacy session: the session's listing is the principal's view.
    sid = initialize(client, locked_server.url, alpha)
    r = client.post(locked_server.url, json=rpc("tools/list", {}), headers=legacy_headers(alpha, sid))
    assert {t["name"] for t in r.json()["result"]["tools"]} == names


def test_a_principal_over_its_rate_limit_gets_429_saying_when_to_retry(locked_server: ServerProcess,
                                                                       client: httpx2.Client) -> None:
    slow = TOKENS["slow"]
    statuses = [modern_post(client, locked_server.url, "tools/list", token=slow, id=i).status_code for i in range(3)]
    assert statuses == [200, 200, 200]
    r = modern_post(client, locked_server.url, "tools/list", token=slow, id="over")
    assert r.status_code == 429
    assert int(r.headers["retry-after"]) >= 1
    body = r.json()
    assert body["id"] == "over"
    assert body["error"]["data"]["retryAfterMs"] > 0
    assert "principal slow" in body["error"]["message"] and "retry in" in body["error"]["message"]
    # Other principals are not affected.
    assert modern_post(client, locked_server.url, "tools/list", token=FULL).status_code == 200


def test_a_tool_over_its_rate_limit_gets_429(locked_server: ServerProcess, client: httpx2.Client) -> None:
    call = {"name": "b_limited", "arguments": {}}
    first = [modern_post(client, locked_server.url, "tools/call", call, token=FULL, id=i) for i in range(2)]
    assert [r.status_code for r in first] == [200, 200]
    r = modern_post(client, locked_server.url, "tools/call", call, token=FULL, id=3)
    assert r.status_code == 429
    assert r.json()["error"]["data"]["limit"] == "tool b_limited"
    assert r.json()["id"] == 3
    # Another tool is still served.
    ok = modern_post(client, locked_server.url, "tools/call", {"name": "a_echo", "arguments": {"text": "x"}}, token=FULL)
    assert ok.status_code == 200


def test_a_body_over_the_cap_gets_413(locked_server: ServerProcess, client: httpx2.Client) -> None:
    big = {"name": "a_echo", "arguments": {"text": "x" * 70_000}}
    r = modern_post(client, locked_server.url, "tools/call", big, token=FULL)
    assert r.status_code == 413


def _raw(server: ServerProcess, data: bytes, pause_s: float = 0.0, rest: bytes = b"") -> bytes:
    host, port = server.url.split("//")[1].split("/")[0].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(data)
        if pause_s:
            time.sleep(pause_s)
            try:
                s.sendall(rest)
            except OSError:
                pass
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except (TimeoutError, ConnectionResetError):
                break
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks):
                break
    return b"".join(chunks)


def test_oversized_headers_get_431(locked_server: ServerProcess) -> None:
    request = (b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nX-Filler: " + b"a" * 8000 +
               b"\r\nContent-Length: 2\r\n\r\n{}")
    assert _raw(locked_server, request).startswith(b"HTTP/1.1 431")


def test_a_client_that_sends_its_body_too_slowly_gets_408(locked_server: ServerProcess) -> None:
    head = (b"POST /mcp HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + FULL.encode() + b"\r\nContent-Length: 40\r\n\r\n{\"jsonrpc\":")
    response = _raw(locked_server, head, pause_s=1.6, rest=b"\"2.0\"")
    assert response.startswith(b"HTTP/1.1 408")


def test_wrong_content_type_gets_415_and_unacceptable_accept_gets_406(locked_server: ServerProcess,
                                                                       client: httpx2.Client) -> None:
    r = modern_post(client, locked_server.url, "tools/list", token=FULL, headers={"content-type": "text/plain"})
    assert r.status_code == 415
    r = modern_post(client, locked_server.url, "tools/list", token=FULL, headers={"accept": "text/html"})
    assert r.status_code == 406


def test_the_audit_log_has_one_json_line_per_tool_call_with_sizes_not_arguments(
        locked_server: ServerProcess, client: httpx2.Client) -> None:
    secret_text = "do-not-log-this-argument"
    r = modern_post(client, locked_server.url, "tools/call", {"name": "a_echo", "arguments": {"text": secret_text}},
                    token=FULL)
    assert r.status_code == 200
    size = len(json.dumps({"text": secret_text}, separators=(",", ":")))
    deadline = time.monotonic() + 5
    mine: list[dict] = []
    while time.monotonic() < deadline and not mine:
        lines = [json.loads(x) for x in locked_server.audit_path.read_text().splitlines() if x.strip()]
        mine = [rec for rec in lines if rec["tool"] == "a_echo" and rec["argument_bytes"] == size]
        time.sleep(0.05)
    assert len(mine) == 1
    rec = mine[0]
    assert rec["event"] == "tool_call" and rec["outcome"] == "ok" and rec["plugin"] == "alpha"
    assert rec["principal"] == "full"
    assert rec["duration_ms"] >= 0
    text = locked_server.audit_path.read_text()
    assert secret_text not in text
    assert all(tok not in text for tok in TOKENS.values())
    assert all(tok not in locked_server.stderr_path.read_text() for tok in TOKENS.values())


def test_metrics_are_served_on_their_own_listener(locked_server: ServerProcess, client: httpx2.Client) -> None:
    modern_post(client, locked_server.url, "tools/call", {"name": "a_echo", "arguments": {"text": "m"}}, token=FULL)
    r = client.get(locked_server.metrics_url)
    assert r.status_code == 200
    text = r.text
    for name in ("toolcell_tool_calls_total", "toolcell_tool_call_duration_seconds_bucket", "toolcell_queue_depth",
                 "toolcell_workers_alive", "toolcell_worker_restarts_total", "toolcell_limit_kills_total",
                 "toolcell_http_responses_total", "toolcell_calls_in_flight"):
        assert name in text, name
    assert 'tool="a_echo"' in text
    # The MCP endpoint does not serve metrics, and the metrics listener does not serve MCP.
    assert client.get(locked_server.base + "/metrics").status_code == 404
    assert client.post(locked_server.metrics_url.replace("/metrics", "/mcp"), json={}).status_code == 404


def test_legacy_sessions_belong_to_their_principal(locked_server: ServerProcess, client: httpx2.Client) -> None:
    sid = initialize(client, locked_server.url, FULL)
    other = client.post(locked_server.url, json=rpc("tools/list", {}), headers=legacy_headers(TOKENS["alpha"], sid))
    assert other.status_code == 404
    own = client.post(locked_server.url, json=rpc("tools/list", {}), headers=legacy_headers(FULL, sid))
    assert own.status_code == 200
    assert own.json()["id"] == 1 and LEGACY


def test_every_refused_tool_call_gets_exactly_one_audit_line_with_its_outcome(
        locked_server: ServerProcess, client: httpx2.Client) -> None:
    alpha = TOKENS["alpha"]
    cases = [
        ({"name": "no_such_tool_audit", "arguments": {}}, FULL, "invalid_params", "no_such_tool_audit"),
        ({"name": "b_secret", "arguments": {"marker": "scope"}}, alpha, "invalid_params", "b_secret"),
        ({"name": "a_echo", "arguments": {"text": 12345}}, FULL, "invalid_arguments", "a_echo"),
    ]
    before = len(locked_server.audit_path.read_text().splitlines())
    for params, token, _, _ in cases:
        modern_post(client, locked_server.url, "tools/call", params, token=token)
    slow = TOKENS["slow"]
    for i in range(6):  # the slow principal's bucket holds 3: some of these are rate limited
        modern_post(client, locked_server.url, "tools/call", {"name": "a_echo", "arguments": {"text": f"rl{i}"}},
                    token=slow, id=f"rl{i}")
    deadline = time.monotonic() + 5
    new: list[dict] = []
    while time.monotonic() < deadline:
        lines = [json.loads(x) for x in locked_server.audit_path.read_text().splitlines() if x.strip()]
        new = lines[before:]
        if len(new) >= len(cases) + 6:
            break
        time.sleep(0.05)
    assert len(new) == len(cases) + 6, new
    for _params, _token, outcome, tool in cases:
        matching = [rec for rec in new if rec["tool"] == tool and rec["outcome"] == outcome]
        assert len(matching) == 1, (tool, outcome, new)
    slow_lines = [rec for rec in new if rec["principal"] == "slow"]
    assert len(slow_lines) == 6 and any(rec["outcome"] == "rate_limited" for rec in slow_lines)


def test_an_absolute_form_target_with_a_foreign_authority_is_refused_whatever_the_host_header(
        locked_server: ServerProcess) -> None:
    """RFC 9112 3.2.2: with ``POST http://authority/mcp`` the authority is the host; a matching Host
    header must not let a foreign authority through (nor a foreign Host header a local one)."""
    port = int(locked_server.url.split(":")[2].split("/")[0])
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}).encode()

    def status_for(target: str, host: str) -> int:
        head = (f"POST {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {FULL}\r\n"
                f"Content-Type: application/json\r\nAccept: application/json, text/event-stream\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(head + body)
            data = b""
            while b"\r\n" not in data:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
        return int(data.split(b" ")[1])

    assert status_for("http://evil.example.com/mcp", f"localhost:{port}") == 403
    assert status_for(f"http://localhost:{port}/mcp", "evil.example.com") == 200
    assert status_for("/mcp", f"localhost:{port}") == 200


def _exchange(server: ServerProcess, request: bytes) -> tuple[int, bytes]:
    """Send one whole request (with ``Connection: close``); the status and the whole response."""
    port = int(server.url.split(":")[2].split("/")[0])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        data = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
    return int(data.split(b" ")[1]), data


def _routed_request(port: int, extra: list[tuple[str, str]], drop: str = "") -> bytes:
    """A valid 2026-07-28 ``tools/call`` of ``a_routed`` (its region mirrored in Mcp-Param-Region),
    with ``extra`` header lines added after the regular ones (``drop``: one regular header left out)."""
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "a_routed", "arguments": {"region": "eu"},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                  "io.modelcontextprotocol/clientCapabilities": {}}}}).encode()
    headers = [("Host", f"127.0.0.1:{port}"), ("Origin", "https://app.example.com"),
               ("Authorization", f"Bearer {FULL}"), ("Content-Type", "application/json"),
               ("Accept", "application/json, text/event-stream"), ("MCP-Protocol-Version", "2026-07-28"),
               ("Mcp-Method", "tools/call"), ("Mcp-Name", "a_routed"), ("Mcp-Param-Region", "eu"),
               ("Content-Length", str(len(body))), ("Connection", "close")]
    lines = [f"{k}: {v}" for k, v in headers if k != drop] + [f"{k}: {v}" for k, v in extra]
    return ("POST /mcp HTTP/1.1\r\n" + "\r\n".join(lines) + "\r\n\r\n").encode() + body


#: Every request header the daemon reads to decide something, with a second value that conflicts.
SINGLE_HEADERS = [
    ("Host", "evil.example"),
    ("Origin", "https://evil.example"),
    ("Authorization", f"Bearer {TOKENS['alpha']}"),
    ("Content-Type", "text/plain"),
    ("MCP-Protocol-Version", "2025-11-25"),
    ("Mcp-Method", "tools/list"),
    ("Mcp-Name", "b_secret"),
    ("Mcp-Param-Region", "us"),
    ("Mcp-Session-Id", "a"),
    ("Last-Event-ID", "7"),
]


@pytest.mark.parametrize(("name", "other"), SINGLE_HEADERS, ids=[n for n, _ in SINGLE_HEADERS])
@pytest.mark.parametrize("same", [False, True], ids=["conflicting", "repeated"])
def test_a_header_a_decision_reads_sent_twice_gets_400_never_first_wins(
        locked_server: ServerProcess, name: str, other: str, same: bool) -> None:
    """RFC 9112 3.2 for Host, and the same rule for every header that must appear once: the second
    line is the attacker's choice of which value counts, so neither does."""
    port = int(locked_server.url.split(":")[2].split("/")[0])
    assert _exchange(locked_server, _routed_request(port, []))[0] == 200  # the request is good alone
    base = _routed_request(port, [])
    first = next((line.split(b": ", 1)[1].decode() for line in base.split(b"\r\n")
                  if line.lower().startswith(name.lower().encode() + b": ")), "first-" + other)
    # The regular value first, then a conflicting one (or the same value again: still two values).
    request = _routed_request(port, [(name, first), (name, first if same else other)], drop=name)
    status, response = _exchange(locked_server, request)
    assert status == 400, response
    assert f"the {name} header appears more than once".encode() in response
    assert b"connection: close" in response.lower()


@pytest.mark.parametrize("framing", [
    [("Content-Length", "2")],                       # conflicting lengths
    [("Content-Length", "0")],
    [("Transfer-Encoding", "chunked")],              # both framings
])
def test_conflicting_body_framing_headers_get_400(locked_server: ServerProcess, framing: list[tuple[str, str]]) -> None:
    port = int(locked_server.url.split(":")[2].split("/")[0])
    status, response = _exchange(locked_server, _routed_request(port, framing))
    assert status == 400, response


def test_a_repeated_accept_is_one_list_not_a_duplicate(locked_server: ServerProcess) -> None:
    """Accept is a list header (RFC 9110 12.5.1): two lines are the two halves of one list."""
    port = int(locked_server.url.split(":")[2].split("/")[0])
    request = _routed_request(port, [("Accept", "application/json"), ("Accept", "text/event-stream")], drop="Accept")
    assert _exchange(locked_server, request)[0] == 200


async def test_holding_every_connection_with_a_head_begun_does_not_lock_out_a_token_holder(tmp_path: Path) -> None:
    """Issue 23 finding 4, on the daemon's own app: an attacker with no token takes every connection
    ``max_connections`` allows, each with a head begun and never ended, and keeps taking more; a
    token holder is still served at once (and not after ``idle_timeout_s``) on new connections, and
    on the keep-alive one it had before."""
    plugins = make_plugins(tmp_path / "plugins")
    token = Token(principal="full", sha256=sha(FULL))
    async with open_http(plugins, tmp_path / "state", tokens=[token], max_connections=8,
                         max_unauthenticated_per_address=8) as http, AsyncExitStack() as held:
        port = int(http.url.split(":")[2].split("/")[0])
        body = modern_body("tools/list")
        head = (f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
                f"Accept: application/json\r\nMCP-Protocol-Version: {MODERN}\r\nMcp-Method: tools/list\r\n"
                f"Content-Length: {len(body)}\r\n").encode()

        async def ask(stream: trio.SocketStream) -> int:
            await stream.send_all(head + f"Authorization: Bearer {FULL}\r\n\r\n".encode() + body)
            data = b""
            with trio.fail_after(5):  # idle_timeout_s is 60: a lockout would show here
                while b"\r\n\r\n" not in data:
                    data += await stream.receive_some(65536)
            return int(data.split(b" ")[1])

        keeper = await trio.open_tcp_stream("127.0.0.1", port)
        held.push_async_callback(keeper.aclose)
        assert await ask(keeper) == 200
        for _ in range(3):
            for _ in range(10):  # more than max_connections, from another address
                s = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.2")
                held.push_async_callback(s.aclose)
                await s.send_all(head)  # the head begun, never ended
            await trio.sleep(0.05)
            async with await trio.open_tcp_stream("127.0.0.1", port) as newcomer:
                assert await ask(newcomer) == 200
            assert await ask(keeper) == 200
