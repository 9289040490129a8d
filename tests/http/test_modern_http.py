"""Modern stateless Streamable HTTP (2026-07-28): headers checked against the body, the
status-code map, error ids, disconnect = cancellation, listen streams; raw HTTP requests."""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path

import httpx2
import pytest
from http_harness import TOKENS, ServerProcess
from httpkit import MODERN, messages, modern_body, modern_headers, modern_post, sse_messages

FULL = TOKENS["full"]


@pytest.fixture
def client() -> httpx2.Client:
    with httpx2.Client(timeout=30, headers={"authorization": f"Bearer {FULL}"}) as c:
        yield c


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_requests_are_served_statelessly_without_a_session(locked_server: ServerProcess, client: httpx2.Client) -> None:
    r = modern_post(client, locked_server.url, "tools/list")
    assert r.status_code == 200
    assert "mcp-session-id" not in r.headers
    result = r.json()["result"]
    assert result["resultType"] == "complete"
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "toolcell"
    assert result["ttlMs"] >= 0 and result["cacheScope"] in ("public", "private")
    d = modern_post(client, locked_server.url, "server/discover").json()["result"]
    assert "2026-07-28" in d["supportedVersions"] and d["capabilities"]["tools"]["listChanged"] is True
    # A session id is ignored, never minted or echoed.
    r2 = modern_post(client, locked_server.url, "tools/list", headers={"mcp-session-id": "whatever"})
    assert r2.status_code == 200 and "mcp-session-id" not in r2.headers


def test_get_and_delete_are_405_for_modern_traffic(locked_server: ServerProcess, client: httpx2.Client) -> None:
    h = {"mcp-protocol-version": MODERN, "accept": "text/event-stream"}
    assert client.get(locked_server.url, headers=h).status_code == 405
    assert client.delete(locked_server.url, headers=h).status_code == 405
    assert client.get(locked_server.url, headers={**h, "mcp-session-id": "x"}).status_code == 405


def test_the_status_code_map_and_error_ids(locked_server: ServerProcess, client: httpx2.Client) -> None:
    url = locked_server.url
    unknown = modern_post(client, url, "bogus/method", id="u")
    assert (unknown.status_code, unknown.json()["error"]["code"], unknown.json()["id"]) == (404, -32601, "u")
    for removed in ("initialize", "ping", "logging/setLevel"):
        r = modern_post(client, url, removed, id=3)
        assert (r.status_code, r.json()["error"]["code"], r.json()["id"]) == (404, -32601, 3), removed
    no_caps = client.post(url, content=json.dumps({"jsonrpc": "2.0", "id": 9, "method": "tools/list", "params": {
        "_meta": {"io.modelcontextprotocol/protocolVersion": MODERN}}}), headers=modern_headers("tools/list"))
    assert (no_caps.status_code, no_caps.json()["error"]["code"], no_caps.json()["id"]) == (400, -32602, 9)
    no_meta = client.post(url, content=json.dumps({"jsonrpc": "2.0", "id": 10, "method": "tools/list", "params": {}}),
                          headers=modern_headers("tools/list"))
    assert (no_meta.status_code, no_meta.json()["error"]["code"], no_meta.json()["id"]) == (400, -32602, 10)
    future = client.post(url, content=modern_body("tools/list", id=11).replace(MODERN.encode(), b"2099-01-01"),
                         headers=modern_headers("tools/list", **{"mcp-protocol-version": "2099-01-01"}))
    err = future.json()["error"]
    assert (future.status_code, err["code"], future.json()["id"]) == (400, -32022, 11)
    assert err["data"]["requested"] == "2099-01-01" and MODERN in err["data"]["supported"]
    tool_error = modern_post(client, url, "tools/call", {"name": "a_sleep", "arguments": {"seconds": "x"}}, id=12)
    assert tool_error.status_code == 200 and tool_error.json()["result"]["isError"] is True
    notification = client.post(url, content=json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}),
                               headers=modern_headers("notifications/initialized"))
    assert notification.status_code == 202 and notification.content == b""


@pytest.mark.parametrize("headers, why", [
    ({"mcp-method": "prompts/list"}, "method differs"),
    ({"mcp-method": None}, "method missing"),
    ({"mcp-method": "TOOLS/CALL"}, "values are case-sensitive"),
    ({"mcp-name": "a_sleep"}, "name differs"),
    ({"mcp-name": None}, "name missing"),
    ({"mcp-protocol-version": "2025-11-25"}, "version differs from _meta"),
    ({"mcp-protocol-version": None}, "version missing"),
])
def test_headers_that_disagree_with_the_body_get_400_and_32020(locked_server: ServerProcess, client: httpx2.Client,
                                                               headers: dict, why: str) -> None:
    r = modern_post(client, locked_server.url, "tools/call", {"name": "a_echo", "arguments": {"text": "t"}},
                    headers=headers, id="h")
    assert r.status_code == 400, why
    assert r.json()["error"]["code"] == -32020, why
    assert r.json()["id"] == "h"


def test_header_names_are_case_insensitive(locked_server: ServerProcess, client: httpx2.Client) -> None:
    r = modern_post(client, locked_server.url, "tools/call", {"name": "a_echo", "arguments": {"text": "t"}},
                    headers={"mcp-name": None, "mcp-method": None, "MCP-NAME": "a_echo", "Mcp-METHOD": "tools/call"})
    assert r.status_code == 200, r.text


def _b64(text: str) -> str:
    return "=?base64?" + base64.b64encode(text.encode()).decode() + "?="


@pytest.mark.parametrize("args, params, ok", [
    ({"region": "eu"}, {"Mcp-Param-Region": "eu"}, True),
    ({"region": "eu", "count": 42, "dry": True}, {"Mcp-Param-Region": "eu", "Mcp-Param-Count": "42",
                                                  "Mcp-Param-Dry": "true"}, True),
    ({"region": "eu", "count": 42}, {"Mcp-Param-Region": "eu", "Mcp-Param-Count": "042"}, True),
    ({"region": "Zürich"}, {"Mcp-Param-Region": _b64("Zürich")}, True),
    ({"region": " padded "}, {"Mcp-Param-Region": _b64(" padded ")}, True),
    ({"region": "=?base64?abc"}, {"Mcp-Param-Region": "=?base64?abc"}, True),
    ({"region": "eu"}, {}, False),
    ({"region": "eu"}, {"Mcp-Param-Region": "us"}, False),
    ({"region": "eu", "count": 42}, {"Mcp-Param-Region": "eu", "Mcp-Param-Count": "43"}, False),
    ({"region": "eu", "dry": False}, {"Mcp-Param-Region": "eu", "Mcp-Param-Dry": "true"}, False),
    ({"region": "Hello"}, {"Mcp-Param-Region": "=?base64?SGVsbG8?="}, False),
    ({"region": "Hello"}, {"Mcp-Param-Region": "=?base64?SGVs!!!bG8=?="}, False),
    ({"region": "eu"}, {"Mcp-Param-Region": "eu", "Mcp-Param-Count": "1"}, False),
])
def test_mcp_param_headers_mirror_annotated_arguments(locked_server: ServerProcess, client: httpx2.Client,
                                                      args: dict, params: dict, ok: bool) -> None:
    r = modern_post(client, locked_server.url, "tools/call", {"name": "a_routed", "arguments": args},
                    headers=params, id="p")
    if ok:
        assert r.status_code == 200, r.text
        assert r.json()["result"]["content"][0]["text"].startswith(args["region"])
    else:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == -32020 and r.json()["id"] == "p"


def test_the_tool_listing_carries_the_header_annotations(locked_server: ServerProcess, client: httpx2.Client) -> None:
    tools = {t["name"]: t for t in modern_post(client, locked_server.url, "tools/list").json()["result"]["tools"]}
    assert tools["a_routed"]["inputSchema"]["properties"]["region"]["x-mcp-header"] == "Region"


def test_progress_streams_on_the_calls_own_sse_response(locked_server: ServerProcess, client: httpx2.Client) -> None:
    r = modern_post(client, locked_server.url, "tools/call", {"name": "a_progress", "arguments": {}},
                    meta_extra={"progressToken": 5}, id=20)
    assert r.headers["content-type"].startswith("text/event-stream")
    msgs = messages(r)
    assert [m["params"]["progress"] for m in msgs[:-1]] == [1, 2, 3]
    assert msgs[-1]["id"] == 20 and msgs[-1]["result"]["resultType"] == "complete"


def test_no_log_messages_without_a_log_level_in_meta(locked_server: ServerProcess, client: httpx2.Client) -> None:
    quiet = modern_post(client, locked_server.url, "tools/call", {"name": "a_chatty", "arguments": {}})
    assert quiet.headers["content-type"].startswith("application/json")
    loud = modern_post(client, locked_server.url, "tools/call", {"name": "a_chatty", "arguments": {}},
                       meta_extra={"io.modelcontextprotocol/logLevel": "debug"})
    assert messages(loud)[0].get("method") == "notifications/message"


def test_a_client_disconnect_cancels_the_call_and_kills_its_worker(locked_server: ServerProcess, tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    body = modern_body("tools/call", {"name": "a_sleep", "arguments": {"seconds": 20, "marker": str(marker)}})
    headers = modern_headers("tools/call", "a_sleep", FULL)
    with httpx2.Client(timeout=30) as c, pytest.raises(httpx2.TimeoutException):
        c.post(locked_server.url, content=body, headers=headers, timeout=1.0)
    assert _wait_for(lambda: marker.exists() and marker.read_text().strip() != "")
    pid = int(marker.read_text())
    assert _wait_for(lambda: not _alive(pid)), "the worker running the abandoned call is still alive"
    # The pool replaces the worker and keeps serving.
    with httpx2.Client(timeout=30) as c:
        r = modern_post(c, locked_server.url, "tools/call", {"name": "a_echo", "arguments": {"text": "after"}},
                        token=FULL)
    assert r.json()["result"]["content"][0]["text"] == "after"


def test_listen_sends_the_acknowledgement_first_with_the_subscription_id(locked_server: ServerProcess,
                                                                        client: httpx2.Client) -> None:
    body = modern_body("subscriptions/listen", {"notifications": {"toolsListChanged": True, "promptsListChanged": True}},
                       id="sub-1")
    with client.stream("POST", locked_server.url, content=body,
                       headers=modern_headers("subscriptions/listen")) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        text = ""
        for chunk in r.iter_text():
            text += chunk
            if "\n\n" in text:
                break
    first = sse_messages(text)[0]
    assert first["method"] == "notifications/subscriptions/acknowledged"
    assert first["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "sub-1"
    assert first["params"]["notifications"] == {"toolsListChanged": True}
    no_sse = modern_post(client, locked_server.url, "subscriptions/listen", {"notifications": {}},
                         headers={"accept": "application/json"}, id=4)
    assert no_sse.status_code == 406 and no_sse.json()["id"] == 4
