"""Legacy Streamable HTTP (2025-03-26 … 2025-11-25): sessions, statuses, JSON or SSE answers,
cancellation, batches, the GET stream, with raw HTTP requests."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx2
import pytest
from http_harness import TOKENS, ServerProcess
from httpkit import ACCEPT_BOTH, initialize, legacy_headers, messages, rpc

FULL = TOKENS["full"]


@pytest.fixture
def client() -> httpx2.Client:
    with httpx2.Client(timeout=30) as c:
        yield c


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
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


def test_initialize_issues_an_unguessable_visible_ascii_session_id(locked_server: ServerProcess,
                                                                     client: httpx2.Client) -> None:
    ids = {initialize(client, locked_server.url, FULL) for _ in range(3)}
    assert len(ids) == 3
    for sid in ids:
        assert len(sid) >= 32
        assert all(0x21 <= ord(c) <= 0x7E for c in sid)


def test_requests_need_a_session_and_an_unknown_or_ended_session_gets_404(locked_server: ServerProcess,
                                                                          client: httpx2.Client) -> None:
    url = locked_server.url
    no_session = client.post(url, json=rpc("tools/list", {}, id=5), headers=legacy_headers(FULL))
    assert no_session.status_code == 400
    assert no_session.json()["id"] == 5
    unknown = client.post(url, json=rpc("tools/list", {}, id=6), headers=legacy_headers(FULL, "no-such-session"))
    assert unknown.status_code == 404
    assert unknown.json()["id"] == 6
    sid = initialize(client, url, FULL)
    assert client.post(url, json=rpc("tools/list", {}), headers=legacy_headers(FULL, sid)).status_code == 200
    ended = client.delete(url, headers=legacy_headers(FULL, sid))
    assert ended.status_code == 200
    assert client.post(url, json=rpc("tools/list", {}), headers=legacy_headers(FULL, sid)).status_code == 404
    assert client.delete(url, headers=legacy_headers(FULL, sid)).status_code == 404


def test_an_unsupported_protocol_version_header_gets_400(locked_server: ServerProcess, client: httpx2.Client) -> None:
    sid = initialize(client, locked_server.url, FULL)
    bad = client.post(locked_server.url, json=rpc("tools/list", {}),
                      headers=legacy_headers(FULL, sid, version="1999-01-01"))
    assert bad.status_code == 400
    # Any supported legacy version is honoured (the conformance suite sends 2025-03-26 here).
    for version in ("2025-03-26", "2025-06-18", "2025-11-25", None):
        ok = client.post(locked_server.url, json=rpc("tools/list", {}), headers=legacy_headers(FULL, sid, version))
        assert ok.status_code == 200, version


def test_notifications_get_202_with_an_empty_body(locked_server: ServerProcess, client: httpx2.Client) -> None:
    sid = initialize(client, locked_server.url, FULL)
    r = client.post(locked_server.url, json=rpc("notifications/cancelled", {"requestId": 99}, id=None),
                    headers=legacy_headers(FULL, sid))
    assert r.status_code == 202
    assert r.content == b""


def test_a_call_answers_json_unless_notifications_must_stream(locked_server: ServerProcess,
                                                              client: httpx2.Client) -> None:
    url = locked_server.url
    sid = initialize(client, url, FULL)
    quiet = client.post(url, json=rpc("tools/call", {"name": "a_echo", "arguments": {"text": "hi"}}, id="q"),
                        headers=legacy_headers(FULL, sid))
    assert quiet.headers["content-type"].startswith("application/json")
    assert quiet.json()["result"]["content"][0]["text"] == "hi"
    streamed = client.post(url, json=rpc("tools/call", {"name": "a_progress", "arguments": {"steps": 3},
                                                         "_meta": {"progressToken": "tok"}}, id="p"),
                           headers=legacy_headers(FULL, sid))
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.headers["x-accel-buffering"] == "no"
    msgs = messages(streamed)
    progress = [m for m in msgs if m.get("method") == "notifications/progress"]
    assert [p["params"]["progress"] for p in progress] == [1, 2, 3]
    assert all(p["params"]["progressToken"] == "tok" for p in progress)
    assert msgs[-1]["id"] == "p" and msgs[-1]["result"]["content"][0]["text"] == "done"
    # The session's log level decides whether log messages stream.
    chatty = client.post(url, json=rpc("tools/call", {"name": "a_chatty", "arguments": {}}, id="c"),
                         headers=legacy_headers(FULL, sid))
    assert [m["method"] for m in messages(chatty) if "method" in m] == ["notifications/message"]
    assert client.post(url, json=rpc("logging/setLevel", {"level": "error"}, id="l"),
                       headers=legacy_headers(FULL, sid)).json()["result"] == {}
    silent = client.post(url, json=rpc("tools/call", {"name": "a_chatty", "arguments": {}}, id="s"),
                         headers=legacy_headers(FULL, sid))
    assert silent.headers["content-type"].startswith("application/json")


def test_an_accept_header_with_one_type_is_served_in_that_type(locked_server: ServerProcess,
                                                               client: httpx2.Client) -> None:
    url = locked_server.url
    sid = initialize(client, url, FULL)
    call = rpc("tools/call", {"name": "a_progress", "arguments": {}, "_meta": {"progressToken": 1}}, id=1)
    json_only = client.post(url, json=call, headers=legacy_headers(FULL, sid, accept="application/json"))
    assert json_only.headers["content-type"].startswith("application/json")
    assert json_only.json()["result"]["content"][0]["text"] == "done"
    sse_only = client.post(url, json=rpc("tools/call", {"name": "a_echo", "arguments": {"text": "e"}}, id=2),
                           headers=legacy_headers(FULL, sid, accept="text/event-stream"))
    assert sse_only.status_code == 200
    assert messages(sse_only)[-1]["result"]["content"][0]["text"] == "e"


def test_notifications_cancelled_stops_the_call_and_its_worker(locked_server: ServerProcess, client: httpx2.Client,
                                                               tmp_path: Path) -> None:
    url = locked_server.url
    sid = initialize(client, url, FULL)
    marker = tmp_path / "pid"
    result: dict = {}

    def long_call() -> None:
        with httpx2.Client(timeout=30) as c:
            result["r"] = c.post(url, json=rpc("tools/call", {"name": "a_sleep", "arguments": {
                "seconds": 20, "marker": str(marker)}}, id="long"), headers=legacy_headers(FULL, sid))

    thread = threading.Thread(target=long_call)
    thread.start()
    assert _wait_for(lambda: marker.exists() and marker.read_text().strip() != "")
    pid = int(marker.read_text())
    assert _alive(pid)
    r = client.post(url, json=rpc("notifications/cancelled", {"requestId": "long"}, id=None),
                    headers=legacy_headers(FULL, sid))
    assert r.status_code == 202
    thread.join(10)
    assert not thread.is_alive()
    # No response for a cancelled request: an empty 202 (or an SSE stream that just ends).
    assert b'"id":"long"' not in result["r"].content
    assert _wait_for(lambda: not _alive(pid))


def test_a_legacy_disconnect_is_not_a_cancellation(locked_server: ServerProcess, tmp_path: Path) -> None:
    url = locked_server.url
    with httpx2.Client(timeout=30) as client:
        sid = initialize(client, url, FULL)
        marker = tmp_path / "pid"
        with pytest.raises(httpx2.TimeoutException):
            client.post(url, json=rpc("tools/call", {"name": "a_sleep", "arguments": {
                "seconds": 1.5, "marker": str(marker)}}, id="x"), headers=legacy_headers(FULL, sid), timeout=0.7)
        assert _wait_for(lambda: marker.exists())
        pid = int(marker.read_text())
        time.sleep(0.3)
        assert _alive(pid)  # still running after the client went away


def test_a_2025_03_26_session_accepts_batches(locked_server: ServerProcess, client: httpx2.Client) -> None:
    url = locked_server.url
    sid = initialize(client, url, FULL, version="2025-03-26")
    batch = [rpc("tools/call", {"name": "a_echo", "arguments": {"text": "one"}}, id=1),
             rpc("notifications/progress", {"progressToken": 1, "progress": 1}, id=None),
             rpc("tools/list", {}, id=2)]
    r = client.post(url, json=batch, headers=legacy_headers(FULL, sid, version="2025-03-26"))
    assert r.status_code == 200
    replies = {m["id"]: m for m in r.json()}
    assert replies[1]["result"]["content"][0]["text"] == "one"
    assert "tools" in replies[2]["result"]
    newer = initialize(client, url, FULL)
    refused = client.post(url, json=batch, headers=legacy_headers(FULL, newer))
    assert refused.status_code == 400


def test_ending_a_session_stops_its_batch_members_too(locked_server: ServerProcess, client: httpx2.Client,
                                                     tmp_path: Path) -> None:
    """A batch's calls belong to the session like single ones: DELETE stops them (worker included),
    and the batch POST is answered at once with what finished (the stopped calls get no answer);
    while in flight, the batch's ids are refused to a second request."""
    url = locked_server.url
    sid = initialize(client, url, FULL, version="2025-03-26")
    marker = tmp_path / "pid"
    result: dict = {}
    batch = [rpc("tools/call", {"name": "a_sleep", "arguments": {"seconds": 20, "marker": str(marker)}}, id="long"),
             rpc("tools/call", {"name": "a_echo", "arguments": {"text": "quick"}}, id="quick")]

    def post_batch() -> None:
        with httpx2.Client(timeout=30) as c:
            result["r"] = c.post(url, json=batch, headers=legacy_headers(FULL, sid, version="2025-03-26"))

    thread = threading.Thread(target=post_batch)
    thread.start()
    assert _wait_for(lambda: marker.exists() and marker.read_text().strip() != "")
    pid = int(marker.read_text())
    dup = client.post(url, json=rpc("tools/call", {"name": "a_echo", "arguments": {"text": "x"}}, id="long"),
                      headers=legacy_headers(FULL, sid, version="2025-03-26"))
    assert dup.json()["error"]["code"] == -32600  # "long" is in flight, in the batch
    assert client.delete(url, headers=legacy_headers(FULL, sid, version="2025-03-26")).status_code == 200
    thread.join(10)
    assert not thread.is_alive()
    answered = result["r"].json() if result["r"].status_code == 200 else []  # 202: quick was stopped too
    assert [m["id"] for m in answered] in (["quick"], [])
    assert _wait_for(lambda: not _alive(pid))


def test_get_opens_a_session_stream_and_is_405_without_a_session(locked_server: ServerProcess,
                                                                 client: httpx2.Client) -> None:
    url = locked_server.url
    assert client.get(url, headers={"authorization": f"Bearer {FULL}", "accept": "text/event-stream"}).status_code == 405
    sid = initialize(client, url, FULL)
    headers = {"authorization": f"Bearer {FULL}", "accept": "text/event-stream", "mcp-session-id": sid,
               "mcp-protocol-version": "2025-11-25"}
    with client.stream("GET", url, headers=headers) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        second = client.get(url, headers=headers)
        assert second.status_code == 409
    assert client.get(url, headers={**headers, "mcp-session-id": "nope"}).status_code == 404
    assert client.get(url, headers={**headers, "accept": "application/json"}).status_code == 406


def test_a_parse_error_gets_400(locked_server: ServerProcess, client: httpx2.Client) -> None:
    r = client.post(locked_server.url, content=b"{not json", headers={"authorization": f"Bearer {FULL}",
                                                                     "content-type": "application/json",
                                                                     "accept": ACCEPT_BOTH})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == -32700
