"""A hostile worker asks: hand-made ``Ask`` frames written straight onto the worker's IPC channel, and
tools that ask more than their plugin allows. Each fails only its own call, with a clear message;
the daemon keeps serving the same plugin and a bystander call that is waiting for its own answer.

A real ``toolcell serve --stdio`` under the default ``strict`` policy, pooled and per_call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from ask_plugins import HOSTILE_ASK
from stdio_peer import StdioPeer, open_toolcell, text_of

ALL = {"elicitation": {}, "sampling": {}, "roots": {}}
LIMITS = {"timeout_s": 10, "ask_timeout_s": 20, "max_concurrency": 2, "max_asks": 3}


@pytest.fixture(params=["pooled", "per_call"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def peer(make_plugin: Callable[..., Path], mode: str, tmp_path: Path) -> AsyncIterator[StdioPeer]:
    plugins = make_plugin("hostile", HOSTILE_ASK, limits=LIMITS, manifest={"isolation": mode})
    async with open_toolcell(plugins, policy="strict", stderr_path=tmp_path / "daemon.log") as p:
        result = await p.request("initialize", {"protocolVersion": "2025-11-25", "capabilities": ALL,
                                                "clientInfo": {"name": "raw", "version": "0"}})
        assert "result" in result
        await p.notify("notifications/initialized")
        yield p


def failed_with(response: Any, *fragments: str) -> str:
    assert "error" not in response, response
    assert response["result"].get("isError") is True, response
    text = text_of(response)
    for fragment in fragments:
        assert fragment in text, text
    return text


def requests_for(peer: StdioPeer, method: str) -> list[dict[str, Any]]:
    return [m for m in peer.messages if isinstance(m, dict) and m.get("method") == method and "id" in m]


async def answer_until_done(peer: StdioPeer, call: Any) -> Any:
    """Answer every roots/list request as it comes, until ``call`` has its response."""
    answered: set[Any] = set()

    def progress(m: Any) -> bool:
        return m.get("id") == call and "method" not in m or (m.get("method") == "roots/list" and m["id"] not in answered)

    while True:
        message = await peer.wait_for(lambda m: isinstance(m, dict) and progress(m))
        if "method" not in message:
            return message
        answered.add(message["id"])
        await peer.send({"jsonrpc": "2.0", "id": message["id"], "result": {"roots": []}})


KINDS = [
    ("unknown_method", "which a tool cannot ask"),
    ("duplicate_key", "unique"),
    ("hundred", "over 16 in one round"),
    ("deep_params", "nested deeper"),
    ("bad_key", "keys must be"),
    ("empty", "asks nothing"),
    ("params_not_a_map", "malformed frame"),
    ("not_running", "unexpected frame"),
    ("second_while_pending", "unexpected frame"),
]


async def test_a_hand_made_ask_fails_only_its_call(peer: StdioPeer, mode: str) -> None:
    """Every kind in turn on one daemon, while a bystander call waits for its own answer throughout."""
    bystander = await peer.start_call("wait_for_name", {})
    await peer.wait_for(lambda m: m.get("method") == "elicitation/create" and m["params"]["message"] == "Your name?")
    for kind, fragment in KINDS:
        hostile = await peer.call("raw_ask", {"kind": kind}, timeout=30)
        if mode == "per_call" and kind in ("not_running", "params_not_a_map"):
            # per_call: the relay between the call's process and the daemon forwards only frames it can decode
            # that belong to the running call; the rest never reach the daemon.
            assert text_of(hostile) == "sent", kind
        else:
            text = failed_with(hostile, fragment)
            assert "the worker sent" in text, (kind, text)
        assert text_of(await peer.call("echo", {"text": f"after {kind}"})) == f"after {kind}"
    # the one proper question among them (the first of two Asks) reached the client before its call failed
    assert [r["params"]["message"] for r in requests_for(peer, "elicitation/create")] == ["Your name?", "hand-made"]
    assert not requests_for(peer, "roots/list") and not requests_for(peer, "sampling/createMessage")
    late = requests_for(peer, "elicitation/create")[1]
    await peer.send({"jsonrpc": "2.0", "id": late["id"], "result": {"action": "decline"}})  # ignored: its call is gone
    # the bystander waited throughout, and gets its answer
    asked = requests_for(peer, "elicitation/create")[0]
    await peer.send({"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "accept", "content": {"name": "Bo"}}})
    assert text_of(await peer.response(bystander)) == "accept:{'name': 'Bo'}"
    assert text_of(await peer.call("echo", {"text": "still here"})) == "still here"
    assert peer.proc.returncode is None


async def test_more_questions_than_max_asks_fail_the_call(peer: StdioPeer) -> None:
    within = await peer.start_call("ask_rounds", {"n": 3})
    assert text_of(await answer_until_done(peer, within)) == "asked 3"
    over = await peer.start_call("ask_rounds", {"n": 4})
    failed_with(await answer_until_done(peer, over), "more than 3 questions", "max_asks")
    assert len(requests_for(peer, "roots/list")) == 6  # the fourth question of the second call was never sent
    at_once = await peer.call("ask_at_once", {"n": 4})
    failed_with(at_once, "more than 3 questions")
    assert len(requests_for(peer, "roots/list")) == 6
    assert text_of(await peer.call("echo", {"text": "still here"})) == "still here"
