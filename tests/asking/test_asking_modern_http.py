"""Tools that ask a 2026-07-28 client over HTTP (raw JSON-RPC posts): ``input_required``, the retry
that resumes the parked call or runs the tool again (after a restart, on another daemon, when
parking is full or expired), several rounds, and every way a retry can be wrong.

A daemon runs in this trio run (real worker processes) so that its 2026-07-28 bookkeeping
(``daemon.mrtr``) can be looked at; what the tools did is also seen from outside: a tool records
each of its starts (its worker's pid) in a marker file and says its pid in its result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
from ask_harness import ALL_CAPS, HELLO, NAME, ROOTS, modern_http, poll_until, result_text, serve_http, starts
from ask_plugins import ASKER

from runtime.protocol.request_state import Sealer, digest_arguments

CONFORMANCE = Path(__file__).resolve().parents[2] / "plugins" / "conformance"
LIMITS = {"timeout_s": 20, "ask_timeout_s": 20, "max_concurrency": 3, "max_parked": 3}


@pytest.fixture
def plugins(make_plugin: Callable[..., Path]) -> Path:
    return make_plugin("asker", ASKER, limits=LIMITS)


def config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"state_key_file": str(tmp_path / "shared" / "state.key"), **extra}


def input_required(message: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """(inputRequests, requestState) of an ``input_required`` result."""
    result = message["result"]
    assert result["resultType"] == "input_required", message
    assert "content" not in result and "isError" not in result
    assert isinstance(result["requestState"], str) and result["requestState"]
    return result["inputRequests"], result["requestState"]


def refused(status: int, message: dict[str, Any], code: int = -32602, fragment: str = "") -> str:
    assert status == 400, (status, message)
    error = message["error"]
    assert error["code"] == code, message
    assert fragment in error["message"], message
    return str(error["message"])


async def test_input_required_names_each_open_question_and_carries_sealed_state(plugins: Path, tmp_path: Path) -> None:
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        status, message = await c.call("one_round", caps=ALL_CAPS)
        assert status == 200
        requests, state = input_required(message)
        assert message["result"]["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "toolcell"
        assert requests == {
            "name": {"method": "elicitation/create",
                     "params": {"mode": "form", "message": "Name?",
                                "requestedSchema": {"type": "object", "properties": {"name": {"type": "string"}},
                                                    "required": ["name"]}}},
            "greeting": {"method": "sampling/createMessage",
                         "params": {"messages": [{"role": "user", "content": {"type": "text", "text": "Hello"}}],
                                    "maxTokens": 1000}},
            "roots": {"method": "roots/list", "params": {}},
        }
        key = (tmp_path / "shared" / "state.key").read_bytes()
        sealed = Sealer(key).open(state, int(time.time() * 1000))
        assert sealed.tool == "one_round" and sealed.asked == ["name", "greeting", "roots"] and sealed.park
        assert sealed.arguments == digest_arguments({})
        assert srv.daemon.mrtr.stats["input_required"] == 1 and len(srv.daemon.mrtr.parking.parked) == 1


async def test_each_retry_resumes_the_parked_call_and_every_round_has_new_state(plugins: Path, tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    args = {"marker": str(marker)}
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        _, first = await c.call("two_rounds", args, caps=ALL_CAPS)
        requests, state1 = input_required(first)
        assert list(requests) == ["name"]
        _, second = await c.call("two_rounds", args, caps=ALL_CAPS, responses={"name": NAME}, state=state1)
        requests, state2 = input_required(second)
        assert list(requests) == ["greeting"] and requests["greeting"]["params"]["messages"][0]["content"]["text"] == \
            "Greet Ann"
        assert state2 != state1
        status, done = await c.call("two_rounds", args, caps=ALL_CAPS, responses={"greeting": HELLO}, state=state2)
        assert status == 200
        text = result_text(done)
        pids = starts(marker)
        assert len(pids) == 1, "the tool ran once: each retry resumed it"
        assert text == f"pid={pids[0]} who=Ann greeting=hello Ann"
        assert srv.daemon.mrtr.stats == {"input_required": 2, "resumed": 2, "rerun": 0, "rejected": 0}
        assert not srv.daemon.mrtr.parking.parked


async def test_answers_given_before_being_asked_are_used_and_only_missing_ones_are_asked_again(
        plugins: Path, tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    args = {"marker": str(marker)}
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        # The client knows the key "name" in advance: the tool runs with it answered.
        _, first = await c.call("one_round", args, caps=ALL_CAPS, responses={"name": NAME, "unknown": {"x": 1}})
        requests, state1 = input_required(first)
        assert sorted(requests) == ["greeting", "roots"]
        # Only one of the two: the other is asked again, the call stays parked.
        _, second = await c.call("one_round", args, caps=ALL_CAPS, responses={"greeting": HELLO}, state=state1)
        requests, state2 = input_required(second)
        assert list(requests) == ["roots"] and state2 != state1
        # Nothing new at all: asked again once more.
        _, third = await c.call("one_round", args, caps=ALL_CAPS, state=state2)
        requests, state3 = input_required(third)
        assert list(requests) == ["roots"]
        status, done = await c.call("one_round", args, caps=ALL_CAPS, responses={"roots": ROOTS, "bogus": {}},
                                    state=state3)
        assert status == 200
        pids = starts(marker)
        assert result_text(done) == f"pid={pids[0]} who=Ann greeting=hello Ann roots=1"
        assert len(pids) == 1
        assert srv.daemon.mrtr.stats["resumed"] == 3


async def test_a_retry_after_the_daemon_restarted_runs_the_tool_again_and_completes(plugins: Path, tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    args = {"marker": str(marker)}
    async with serve_http(plugins, tmp_path / "a", **config(tmp_path)) as first, modern_http(first.url) as c:
        _, asked = await c.call("two_rounds", args, caps=ALL_CAPS)
        _, state1 = input_required(asked)
    assert len(starts(marker)) == 1
    async with serve_http(plugins, tmp_path / "b", **config(tmp_path)) as second, modern_http(second.url) as c:
        _, again = await c.call("two_rounds", args, caps=ALL_CAPS, responses={"name": NAME}, state=state1)
        requests, state2 = input_required(again)  # run again: "name" answered from the retry, "greeting" asked
        assert list(requests) == ["greeting"]
        _, done = await c.call("two_rounds", args, caps=ALL_CAPS, responses={"greeting": HELLO}, state=state2)
        pids = starts(marker)
        assert len(pids) == 2 and result_text(done) == f"pid={pids[1]} who=Ann greeting=hello Ann"
        assert second.daemon.mrtr.stats["rerun"] == 1 and second.daemon.mrtr.stats["resumed"] == 1


async def test_a_retry_that_reaches_another_daemon_sharing_the_key_runs_there(plugins: Path, tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    args = {"marker": str(marker)}
    async with serve_http(plugins, tmp_path / "a", **config(tmp_path)) as one, \
            serve_http(plugins, tmp_path / "b", **config(tmp_path)) as other, \
            serve_http(plugins, tmp_path / "c", state_key_file=str(tmp_path / "foreign.key")) as stranger, \
            modern_http(one.url) as c1, modern_http(other.url) as c2, modern_http(stranger.url) as c3:
        _, asked = await c1.call("one_round", args, caps=ALL_CAPS)
        _, state = input_required(asked)
        answers = {"name": NAME, "greeting": HELLO, "roots": ROOTS}
        status, message = await c3.call("one_round", args, caps=ALL_CAPS, responses=answers, state=state)
        refused(status, message, fragment="requestState")
        status, done = await c2.call("one_round", args, caps=ALL_CAPS, responses=answers, state=state)
        assert status == 200
        pids = starts(marker)
        assert len(pids) == 2 and result_text(done) == f"pid={pids[1]} who=Ann greeting=hello Ann roots=1"
        assert other.daemon.mrtr.stats["rerun"] == 1
        assert len(one.daemon.mrtr.parking.parked) == 1  # still waiting on the first daemon (until ask_timeout_s)


async def test_with_no_room_to_park_every_retry_runs_the_tool_again(plugins: Path, tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    args = {"marker": str(marker)}
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path, max_parked_calls=0)) as srv, \
            modern_http(srv.url) as c:
        _, first = await c.call("two_rounds", args, caps=ALL_CAPS)
        _, state1 = input_required(first)
        _, second = await c.call("two_rounds", args, caps=ALL_CAPS, responses={"name": NAME}, state=state1)
        requests, state2 = input_required(second)
        assert list(requests) == ["greeting"]
        _, done = await c.call("two_rounds", args, caps=ALL_CAPS, responses={"greeting": HELLO}, state=state2)
        pids = starts(marker)
        assert len(pids) == 3 and result_text(done) == f"pid={pids[2]} who=Ann greeting=hello Ann"
        assert srv.daemon.mrtr.stats["rerun"] == 2 and srv.daemon.mrtr.stats["resumed"] == 0


async def test_a_plugin_holds_at_most_its_max_parked_calls_and_the_others_run_again(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    plugins = make_plugin("asker", ASKER, limits={**LIMITS, "max_parked": 1})
    markers = [tmp_path / "first", tmp_path / "second"]
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        states = []
        for marker in markers:
            _, asked = await c.call("form", {"marker": str(marker)}, caps=ALL_CAPS)
            states.append(input_required(asked)[1])
        assert len(srv.daemon.mrtr.parking.parked) == 1  # the second call was stopped, not parked
        for marker, state in zip(markers, states, strict=True):
            status, done = await c.call("form", {"marker": str(marker)}, caps=ALL_CAPS, responses={"name": NAME},
                                        state=state)
            assert status == 200 and result_text(done) == "accept:{'name': 'Ann'}"
        assert [len(starts(m)) for m in markers] == [1, 2]
        assert srv.daemon.mrtr.stats["resumed"] == 1 and srv.daemon.mrtr.stats["rerun"] == 1


async def test_a_parked_call_whose_question_expires_is_run_again_by_its_retry(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    # timeout_s leaves room on a loaded machine: what expires here is the question (ask_timeout_s).
    plugins = make_plugin("asker", ASKER, limits={"timeout_s": 5, "ask_timeout_s": 0.5, "max_parked": 2})
    marker = tmp_path / "starts"
    args = {"marker": str(marker)}
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        _, first = await c.call("form", args, caps=ALL_CAPS)
        _, state = input_required(first)
        await poll_until(lambda: not srv.daemon.mrtr.parking.parked)  # its question times out in the tool
        status, done = await c.call("form", args, caps=ALL_CAPS, responses={"name": NAME}, state=state)
        assert status == 200 and result_text(done) == "accept:{'name': 'Ann'}"
        assert len(starts(marker)) == 2 and srv.daemon.mrtr.stats["rerun"] == 1


async def test_malformed_answers_are_invalid_params(plugins: Path, tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    args = {"marker": str(marker)}
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        refused(*await c.call("form", args, caps=ALL_CAPS, responses=[NAME]), fragment="inputResponses")
        refused(*await c.call("form", args, caps=ALL_CAPS, responses={"name": "Ann"}), fragment="inputResponses")
        refused(*await c.call("form", args, caps=ALL_CAPS, state=42), fragment="requestState")
        # Given before being asked, malformed: refused when the tool asks for it.
        refused(*await c.call("form", args, caps=ALL_CAPS, responses={"name": {"action": "sure"}}),
                fragment="inputResponses['name']")
        refused(*await c.call("sample", {"prompt": "p"}, caps=ALL_CAPS,
                              responses={"sample-1": {"role": "assistant"}}), fragment="sampling answer")
        # Given to the parked call: refused, and the call is stopped.
        _, asked = await c.call("form", args, caps=ALL_CAPS)
        _, state = input_required(asked)
        refused(*await c.call("form", args, caps=ALL_CAPS, responses={"name": {"action": "accept", "content": "Ann"}},
                              state=state), fragment="content must be an object")
        assert not srv.daemon.mrtr.parking.parked
        # The same state again: nothing waits for it any more; the tool runs again and completes.
        status, done = await c.call("form", args, caps=ALL_CAPS, responses={"name": NAME}, state=state)
        assert status == 200 and result_text(done) == "accept:{'name': 'Ann'}"
        assert srv.daemon.mrtr.stats["rejected"] >= 3
        status, echoed = await c.call("echo", {"text": "still serving"}, caps=ALL_CAPS)
        assert result_text(echoed) == "still serving"


async def test_tampered_expired_and_foreign_state_is_invalid_params(plugins: Path, tmp_path: Path) -> None:
    marker = tmp_path / "starts"
    args = {"marker": str(marker)}
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        _, asked = await c.call("form", args, caps=ALL_CAPS)
        _, state = input_required(asked)
        answer = {"name": NAME}
        sealer = Sealer((tmp_path / "shared" / "state.key").read_bytes())
        now = int(time.time() * 1000)
        sealed = sealer.open(state, now)
        flipped = state[:10] + ("A" if state[10] != "A" else "B") + state[11:]
        tampered_tag = state[:-3] + ("A" if state[-3] != "A" else "B") + state[-2:]
        expired = sealer.seal(msgspec.structs.replace(sealed, expires_ms=now - 1000))
        other_principal = sealer.seal(msgspec.structs.replace(sealed, principal="mallory"))
        for bad, fragment in ((flipped, "requestState"), (tampered_tag, "requestState"), ("garbage", "requestState"),
                              (expired, "expired"), (other_principal, "another principal or tool")):
            refused(*await c.call("form", args, caps=ALL_CAPS, responses=answer, state=bad), fragment=fragment)
        # the state of one call, for another tool or other arguments
        refused(*await c.call("two_rounds", args, caps=ALL_CAPS, responses=answer, state=state),
                fragment="another principal or tool")
        refused(*await c.call("form", {"marker": str(marker) + "x"}, caps=ALL_CAPS, responses=answer, state=state),
                fragment="other arguments")
        assert len(srv.daemon.mrtr.parking.parked) == 1  # none of those touched the parked call
        status, done = await c.call("form", args, caps=ALL_CAPS, responses=answer, state=state)
        assert status == 200 and result_text(done) == "accept:{'name': 'Ann'}"
        assert len(starts(marker)) == 1


async def test_a_refused_retry_is_audited_like_any_refused_call(plugins: Path, tmp_path: Path) -> None:
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        events: list[dict[str, Any]] = []
        srv.daemon.call_hooks.append(events.append)
        refused(*await c.call("form", caps=ALL_CAPS, responses={"name": NAME}, state="not.ours"))
        refused(*await c.call("nope", caps=ALL_CAPS), fragment="Unknown tool")  # (a refusal the audit does see)
        assert [e["outcome"] for e in events] == ["invalid_params", "invalid_params"], events


async def test_only_the_capabilities_declared_on_the_request_are_asked(plugins: Path, tmp_path: Path) -> None:
    async with serve_http([plugins, CONFORMANCE], tmp_path / "state", **config(tmp_path)) as srv, \
            modern_http(srv.url) as c:
        _, asked = await c.call("elicit_then_sample", caps={"sampling": {}})
        requests, state = input_required(asked)
        assert list(requests) == ["greeting"]  # the form was answered "capability missing" in the tool
        _, done = await c.call("elicit_then_sample", caps={"sampling": {}}, responses={"greeting": HELLO}, state=state)
        assert result_text(done) == "form:missing greeting=hello Ann"
        # The conformance fixture: no sampling capability, left uncaught -> -32021 naming it.
        status, message = await c.call("test_missing_capability", caps={"elicitation": {}})
        refused(status, message, code=-32021, fragment="sampling")
        assert message["error"]["data"] == {"requiredCapabilities": {"sampling": {}}}
        status, message = await c.call("must_sample", caps=None)
        refused(status, message, code=-32021)
        # Caught by the tool: an ordinary result that says so.
        status, done = await c.call("sample_or_say", {"prompt": "p"}, caps={"roots": {}})
        assert status == 200 and result_text(done).startswith("missing:sampling:")
        # URL-mode elicitation needs elicitation.url
        _, done = await c.call("url", caps={"elicitation": {"form": {}}})
        assert result_text(done).startswith("missing:")
        _, asked = await c.call("url", caps={"elicitation": {"url": {}}})
        requests, _ = input_required(asked)
        assert requests["login"]["params"]["mode"] == "url"
        assert requests["login"]["params"]["url"] == "https://example.com/login"
        assert srv.daemon.mrtr.stats["rejected"] == 0


async def test_the_conformance_fixtures_complete_over_raw_retries(tmp_path: Path) -> None:
    async with serve_http(CONFORMANCE, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        _, asked = await c.call("test_input_required_result_multi_round", caps=ALL_CAPS)
        requests, state = input_required(asked)
        assert list(requests) == ["step1"]
        _, asked = await c.call("test_input_required_result_multi_round", caps=ALL_CAPS,
                                responses={"step1": NAME}, state=state)
        requests, state = input_required(asked)
        assert list(requests) == ["step2"]
        _, done = await c.call("test_input_required_result_multi_round", caps=ALL_CAPS,
                               responses={"step2": {"action": "accept", "content": {"color": "blue"}}}, state=state)
        assert "Ann" in result_text(done) and "blue" in result_text(done)
        _, asked = await c.call("test_input_required_result_capabilities", caps={"sampling": {}})
        requests, _ = input_required(asked)
        assert list(requests) == ["name_suggestion"]
        assert srv.daemon.mrtr.stats["rejected"] == 0


#: Answers the daemon cannot seal into a requestState: over its 256 KiB cap, or not encodable as msgpack.
UNSEALABLE = {
    "over_256_kib": {"action": "accept", "content": {"name": "x" * 300_000}},
    "int_over_64_bits": {"action": "accept", "content": {"name": 2 ** 70}},
}


@pytest.mark.parametrize("kind", list(UNSEALABLE))
async def test_answers_that_cannot_be_sealed_are_refused_not_left_unanswered(
        plugins: Path, tmp_path: Path, kind: str) -> None:
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        with trio.move_on_after(4):
            status, message = await c.call("one_round", caps=ALL_CAPS, responses={"name": UNSEALABLE[kind]})
            assert status == 400 and message["error"]["code"] == -32602
            return
        raise AssertionError("the request was never answered")


@pytest.mark.parametrize("kind", list(UNSEALABLE))
async def test_a_resumed_call_given_answers_that_cannot_be_sealed_is_refused_and_stopped(
        plugins: Path, tmp_path: Path, kind: str) -> None:
    async with serve_http(plugins, tmp_path / "state", **config(tmp_path)) as srv, modern_http(srv.url) as c:
        _, asked = await c.call("one_round", caps=ALL_CAPS)
        _, state = input_required(asked)
        try:
            status, message = await c.call("one_round", caps=ALL_CAPS, responses={"name": UNSEALABLE[kind]}, state=state)
        except (KeyError, ValueError) as exc:
            raise AssertionError(f"no JSON-RPC answer: {exc!r}") from None
        assert status == 400 and message["error"]["code"] == -32602
        await poll_until(lambda: not srv.daemon.calls.inflight, 10)
