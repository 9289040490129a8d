"""Tools that ask a legacy client (2024-11-05 … 2025-11-25), raw JSON-RPC: over stdio (a real
``toolcell serve --stdio``) and over a legacy HTTP session. Answers that never come, come late or
come after the call's own deadline would have passed; stdin closing and cancellation while a tool
waits; pooled and per_call workers under each policy; what each revision may be asked.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from ask_harness import serve_http
from ask_plugins import ASKER
from httpkit import legacy_headers, sse_messages
from stdio_peer import StdioPeer, open_toolcell, text_of, wait_gone

ALL = {"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {}}
ANN = {"action": "accept", "content": {"name": "Ann"}}
WAIT_S = 20.0


@pytest.fixture
def plugins(make_plugin: Callable[..., Path]) -> Path:
    # One daemon, three timing profiles: quick (a question and the call both end soon), slow (the call
    # could run long, its questions may not wait long) and patient (the call is short, the wait long).
    make_plugin("quick", ASKER, prefix="quick_", limits={"timeout_s": 2, "ask_timeout_s": 0.5})
    make_plugin("slow", ASKER, prefix="slow_", limits={"timeout_s": 60, "ask_timeout_s": 0.5})
    return make_plugin("patient", ASKER, prefix="patient_",
                       limits={"timeout_s": 1, "ask_timeout_s": 30, "max_concurrency": 3})


@asynccontextmanager
async def legacy_stdio(plugins: Path, tmp_path: Path, caps: dict[str, Any] | None = None, version: str = "2025-11-25",
                       policy: str = "none") -> AsyncIterator[StdioPeer]:
    async with open_toolcell(plugins, policy=policy, stderr_path=tmp_path / "daemon.log") as peer:
        result = await peer.request("initialize", {"protocolVersion": version, "capabilities": ALL if caps is None
                                                   else caps, "clientInfo": {"name": "raw", "version": "0"}})
        assert result["result"]["protocolVersion"] == version
        await peer.notify("notifications/initialized")
        yield peer


def server_requests(peer: StdioPeer, method: str | None = None) -> list[dict[str, Any]]:
    return [m for m in peer.messages if "method" in m and "id" in m and (method is None or m["method"] == method)]


async def next_request(peer: StdioPeer, method: str, after: int = 0, wait_s: float = WAIT_S) -> dict[str, Any]:
    """The first server->client request for ``method`` beyond the first ``after`` of them."""
    def found(_: Any) -> bool:
        return len(server_requests(peer, method)) > after
    await peer.wait_for(found, wait_s)
    return server_requests(peer, method)[after]


async def answer(peer: StdioPeer, request: dict[str, Any], result: Any = None, error: Any = None) -> None:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": request["id"]}
    if error is not None:
        message["error"] = error
    else:
        message["result"] = result
    await peer.send(message)


async def still_serving(peer: StdioPeer) -> None:
    response = await peer.call("patient_echo", {"text": "still here"})
    assert text_of(response) == "still here"


async def test_a_question_never_answered_times_out_the_call_completes_and_a_late_answer_is_ignored(
        plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path) as peer:
        call = await peer.start_call("quick_patient", {})
        asked = await next_request(peer, "elicitation/create")
        assert asked["params"] == {"mode": "form", "message": "Still there?", "requestedSchema": {
            "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}
        response = await peer.response(call)
        assert text_of(response) == "timeout:the client did not answer within 0.5 s"
        assert not response["result"].get("isError")
        await answer(peer, asked, ANN)  # late: nobody waits for it
        await answer(peer, {"id": "toolcell-999"}, ANN)  # never asked
        await answer(peer, {"id": 5}, ANN)
        await still_serving(peer)
        assert len(peer.responses_to(call)) == 1
        assert not [m for m in peer.messages if "error" in m]


async def test_a_question_times_out_at_ask_timeout_s_even_when_the_call_may_run_longer(
        plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path) as peer:
        # (it asks after 0.3 s: by then the pool's watchdog sleeps until the call's own deadline)
        call = await peer.start_call("slow_patient", {"before_s": 0.3})
        await next_request(peer, "elicitation/create")
        with trio.move_on_after(4):
            response = await peer.response(call)
            assert text_of(response).startswith("timeout:")
            return
        raise AssertionError("the question did not time out within 4 s (its ask_timeout_s is 0.5 s)")


async def test_the_call_deadline_does_not_run_while_the_tool_waits_for_its_answer(plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path) as peer:
        # timeout_s is 1: the tool runs 0.6 s in all, and waits 1.5 s for its answer in between.
        call = await peer.start_call("patient_patient", {"before_s": 0.3, "after_s": 0.3})
        asked = await next_request(peer, "elicitation/create")
        await trio.sleep(1.5)
        await answer(peer, asked, ANN)
        response = await peer.response(call)
        assert text_of(response) == "accept:{'name': 'Ann'}", response
        # and a call that really overruns still times out after answering
        overrun = await peer.start_call("patient_patient", {"before_s": 0.0, "after_s": 5})
        asked = await next_request(peer, "elicitation/create", after=1)
        await answer(peer, asked, ANN)
        late = await peer.response(overrun)
        assert late["result"].get("isError") is True and "timed out" in text_of(late)


async def _late_answer_then_next(peer: StdioPeer, same_key: bool) -> str:
    call = await peer.start_call("quick_ask_again", {"same_key": same_key})
    first = await next_request(peer, "elicitation/create")
    second = await next_request(peer, "elicitation/create", after=1)  # "First?" timed out in the tool
    assert first["params"]["message"] == "First?" and second["params"]["message"] == "Second?"
    await answer(peer, first, {"action": "decline"})  # too late for "First?"
    await trio.sleep(0.2)
    await answer(peer, second, {"action": "accept", "content": {"name": "B"}})
    return text_of(await peer.response(call))


async def test_a_late_answer_does_not_answer_the_tools_next_question(plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path) as peer:
        assert await _late_answer_then_next(peer, same_key=False) == "second:accept:{'name': 'B'}"


async def test_a_key_cannot_name_a_second_question_so_a_late_answer_has_nothing_to_answer(
        plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path) as peer:
        call = await peer.start_call("quick_ask_again", {"same_key": True})
        first = await next_request(peer, "elicitation/create")
        result = text_of(await peer.response(call))  # "First?" timed out; "Second?" under its key is refused
        assert result.startswith("second:not asked:") and "already asked" in result
        await answer(peer, first, {"action": "decline"})  # too late: ignored
        assert [m for m in peer.messages if m.get("method") == "elicitation/create"] == [first]
        await still_serving(peer)


async def test_stdin_closing_while_a_tool_waits_cancels_its_question_and_the_daemon_exits(
        plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path) as peer:
        call = await peer.start_call("patient_patient", {})
        await next_request(peer, "elicitation/create")
        assert peer.proc.stdin is not None
        await peer.proc.stdin.aclose()
        # The tool hears InputCancelled at once (its question would wait 30 s), answers, and the daemon exits.
        response = await peer.response(call, timeout=10)
        assert text_of(response) == "cancelled:the client closed its input; it cannot answer"
        with trio.fail_after(10):
            assert await peer.proc.wait() == 0


async def test_cancelling_a_call_while_its_tool_waits_stops_it(plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path) as peer:
        call = await peer.start_call("patient_patient", {}, token="t")
        asked = await next_request(peer, "elicitation/create")
        note = await peer.wait_for(lambda m: m.get("method") == "notifications/progress")
        pid = int(note["params"]["message"].removeprefix("pid="))
        await peer.notify("notifications/cancelled", {"requestId": call, "reason": "changed my mind"})
        await wait_gone(pid)
        await answer(peer, asked, ANN)  # too late: ignored
        await still_serving(peer)
        assert peer.responses_to(call) == []


async def test_concurrent_calls_each_get_their_own_answers(plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path) as peer:
        calls = [await peer.start_call("patient_confirm", {}), await peer.start_call("patient_sample", {"prompt": "p"}),
                 await peer.start_call("patient_roots", {})]
        elicit = await next_request(peer, "elicitation/create")
        sample = await next_request(peer, "sampling/createMessage")
        roots = await next_request(peer, "roots/list")
        assert len({elicit["id"], sample["id"], roots["id"]}) == 3
        assert sample["params"] == {"messages": [{"role": "user", "content": {"type": "text", "text": "p"}}],
                                    "maxTokens": 50, "systemPrompt": "be brief"}
        assert roots["params"] == {}
        await answer(peer, roots, {"roots": [{"uri": "file:///r", "name": "r"}], "_meta": {"x": 1}})
        await answer(peer, sample, {"role": "assistant", "content": {"type": "text", "text": "hi"}, "model": "m"})
        await answer(peer, elicit, {"action": "accept", "content": {"ok": True}})
        texts = [text_of(await peer.response(c)) for c in calls]
        assert texts == ["accept:Confirm:True:", "assistant:m:hi", "file:///r|r"]


async def test_what_the_client_answers_wrongly_reaches_the_tool_as_a_refusal(plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path) as peer:
        for i, (result, error, expected) in enumerate([
            (None, {"code": -1, "message": "the user said no"}, "refused:the client answered with an error: the user said no"),
            ("yes", None, "refused:the client's answer was not a JSON object"),
            ({"action": "perhaps"}, None, "refused:the client's answer to elicitation/create does not fit"),
            ({"action": "accept", "content": {"note": "no ok"}}, None, "refused:the client's answer to elicitation/create"),
            ({"action": "accept", "content": {"ok": 2 ** 70}}, None,
             "refused:the client's answer could not be passed to the tool (OverflowError)"),
        ]):
            call = await peer.start_call("patient_confirm", {})
            asked = await next_request(peer, "elicitation/create", after=i)
            await answer(peer, asked, result, error)
            said = text_of(await peer.response(call))
            assert said.startswith(expected), said
        await still_serving(peer)


async def test_only_what_the_client_declared_is_asked(plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path, caps={"sampling": {}}) as peer:
        call = await peer.start_call("patient_elicit_then_sample", {})
        sample = await next_request(peer, "sampling/createMessage")
        await answer(peer, sample, {"role": "assistant", "content": {"type": "text", "text": "hi"}})
        assert text_of(await peer.response(call)) == "form:missing greeting=hi"
        uncaught = await peer.call("patient_roots", {})
        assert uncaught["result"].get("isError") is True and "roots" in text_of(uncaught)
        assert text_of(await peer.call("patient_url", {})).startswith("missing:")
        assert server_requests(peer, "elicitation/create") == [] and server_requests(peer, "roots/list") == []


async def test_each_legacy_revision_is_asked_only_what_it_has(plugins: Path, tmp_path: Path) -> None:
    async with legacy_stdio(plugins, tmp_path, version="2025-06-18") as peer:
        call = await peer.start_call("patient_confirm", {})
        asked = await next_request(peer, "elicitation/create")
        assert "mode" not in asked["params"] and asked["params"]["message"] == "Proceed?"
        await answer(peer, asked, {"action": "decline"})
        assert text_of(await peer.response(call)) == "decline:None"
        assert text_of(await peer.call("patient_url", {})).startswith("missing:")  # URL mode came with 2025-11-25
    async with legacy_stdio(plugins, tmp_path, version="2024-11-05") as peer:
        assert text_of(await peer.call("patient_confirm", {})) == "missing:elicitation"
        call = await peer.start_call("patient_sample", {"prompt": "old"})
        asked = await next_request(peer, "sampling/createMessage")
        await answer(peer, asked, {"role": "assistant", "content": {"type": "text", "text": "still works"}})
        assert text_of(await peer.response(call)) == "assistant::still works"
    async with legacy_stdio(plugins, tmp_path, version="2025-03-26") as peer:
        # A batch member has nobody to carry its question: it hears CapabilityMissing.
        await peer.send([{"jsonrpc": "2.0", "id": "b1", "method": "tools/call",
                          "params": {"name": "patient_confirm", "arguments": {}}},
                         {"jsonrpc": "2.0", "id": "b2", "method": "tools/call",
                          "params": {"name": "patient_echo", "arguments": {"text": "x"}}}])
        batch = await peer.wait_for(lambda m: isinstance(m, list))
        by_id = {m["id"]: m for m in batch}
        assert text_of(by_id["b1"]) == "missing:elicitation" and text_of(by_id["b2"]) == "x"
    async with legacy_stdio(plugins, tmp_path) as peer:  # 2025-11-25 with elicitation.url: URL mode
        call = await peer.start_call("patient_url", {})
        asked = await next_request(peer, "elicitation/create")
        assert asked["params"] == {"mode": "url", "message": "Log in, please", "url": "https://example.com/login",
                                   "elicitationId": "login"}
        await answer(peer, asked, {"action": "accept"})
        assert text_of(await peer.response(call)) == "url:accept"


@pytest.mark.parametrize("policy", ["strict", "none"])  # strict: as the other sandbox tests, this machine can
@pytest.mark.parametrize("isolation", ["pooled", "per_call"])
async def test_a_round_trip_in_each_isolation_mode_and_policy(make_plugin: Callable[..., Path], tmp_path: Path,
                                                              isolation: str, policy: str) -> None:
    plugins = make_plugin("asker", ASKER, limits={"timeout_s": 10, "ask_timeout_s": 10},
                          manifest={"isolation": isolation})
    async with legacy_stdio(plugins, tmp_path, policy=policy) as peer:
        for round_ in range(2):
            call = await peer.start_call("two_rounds", {})
            form = await next_request(peer, "elicitation/create", after=round_)
            await answer(peer, form, ANN)
            sample = await next_request(peer, "sampling/createMessage", after=round_)
            await answer(peer, sample, {"role": "assistant", "content": {"type": "text", "text": "hey"}})
            said = text_of(await peer.response(call))
            assert said.endswith("who=Ann greeting=hey"), said
        # and a call cancelled while its tool waits
        call = await peer.start_call("confirm", {})
        await next_request(peer, "elicitation/create", after=2)
        await peer.notify("notifications/cancelled", {"requestId": call})
        response = await peer.call("echo", {"text": "next"})
        assert text_of(response) == "next"


# -- a legacy HTTP session -------------------------------------------------------------------------


async def _post(client: httpx2.AsyncClient, url: str, message: Any, sid: str, accept: str | None = None
                ) -> httpx2.Response:
    headers = legacy_headers(session=sid) if accept is None else legacy_headers(session=sid, accept=accept)
    with trio.fail_after(WAIT_S):
        return await client.post(url, content=json.dumps(message).encode(), headers=headers)


async def test_a_legacy_http_session_gets_the_question_on_the_calls_stream_and_answers_by_post(
        plugins: Path, tmp_path: Path) -> None:
    async with serve_http(plugins, tmp_path / "state") as srv, httpx2.AsyncClient(timeout=WAIT_S) as client:
        init = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": ALL, "clientInfo": {"name": "raw", "version": "0"}}}
        r = await client.post(srv.url, json=init, headers=legacy_headers(version=None))
        sid = r.headers["mcp-session-id"]
        other = (await client.post(srv.url, json=init, headers=legacy_headers(version=None))).headers["mcp-session-id"]
        assert (await _post(client, srv.url, {"jsonrpc": "2.0", "method": "notifications/initialized"}, sid)).status_code \
            == 202
        call = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "patient_confirm", "arguments": {}}}
        with trio.fail_after(WAIT_S):
            async with client.stream("POST", srv.url, content=json.dumps(call).encode(),
                                     headers=legacy_headers(session=sid)) as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                seen = ""
                answered = False
                async for chunk in stream.aiter_text():
                    seen += chunk
                    messages = sse_messages(seen)
                    asked = [m for m in messages if m.get("method") == "elicitation/create"]
                    if asked and not answered:
                        # Another session cannot answer this session's question (taken, and ignored).
                        forged = {"jsonrpc": "2.0", "id": asked[0]["id"],
                                  "result": {"action": "accept", "content": {"ok": False, "note": "forged"}}}
                        assert (await _post(client, srv.url, forged, other)).status_code == 202
                        reply = {"jsonrpc": "2.0", "id": asked[0]["id"],
                                 "result": {"action": "accept", "content": {"ok": True, "note": "http"}}}
                        assert (await _post(client, srv.url, reply, sid)).status_code == 202
                        answered = True
                    if any(m.get("id") == 7 for m in messages):
                        break
        final = next(m for m in sse_messages(seen) if m.get("id") == 7)
        assert final["result"]["content"][0]["text"] == "accept:Confirm:True:http"
        # A POST that cannot take a stream cannot carry a question: the tool hears CapabilityMissing.
        plain = await _post(client, srv.url, {**call, "id": 8}, sid, accept="application/json")
        assert plain.json()["result"]["content"][0]["text"] == "missing:elicitation"
