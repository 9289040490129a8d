"""Tools that ask a 2026-07-28 client over stdio (raw lines, no handshake, ``_meta`` on every request):
the same ``input_required`` and retry rules as over HTTP, on the one stream stdio has."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from ask_harness import ALL_CAPS, HELLO, NAME, ROOTS, call_params, starts
from ask_plugins import ASKER
from stdio_peer import StdioPeer, open_toolcell

#: Answers the daemon cannot seal into a requestState: over its 256 KiB cap, or not encodable as msgpack.
UNSEALABLE = {
    "over_256_kib": {"action": "accept", "content": {"name": "x" * 300_000}},
    "int_over_64_bits": {"action": "accept", "content": {"name": 2 ** 70}},
}


@pytest.fixture
def plugins(make_plugin: Callable[..., Path]) -> Path:
    return make_plugin("asker", ASKER, limits={"timeout_s": 20, "ask_timeout_s": 20, "max_parked": 3})


@asynccontextmanager
async def modern_stdio(plugins: Path, tmp_path: Path, policy: str = "none") -> AsyncIterator[StdioPeer]:
    async with open_toolcell(plugins, policy=policy, stderr_path=tmp_path / "daemon.log") as peer:
        yield peer


async def call(peer: StdioPeer, name: str, arguments: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    return await peer.request("tools/call", call_params(name, arguments, **kw))  # type: ignore[no-any-return]


def input_required(message: dict[str, Any]) -> tuple[dict[str, Any], str]:
    result = message["result"]
    assert result["resultType"] == "input_required", message
    return result["inputRequests"], result["requestState"]


def text(message: dict[str, Any]) -> str:
    result = message["result"]
    assert result["resultType"] == "complete", message
    return " ".join(c["text"] for c in result["content"] if c["type"] == "text")


@pytest.mark.parametrize("isolation, policy", [("pooled", "none"), ("per_call", "strict")])
async def test_a_modern_stdio_client_answers_round_after_round_of_one_running_call(
        make_plugin: Callable[..., Path], tmp_path: Path, isolation: str, policy: str) -> None:
    marks = tmp_path / "marks"
    marks.mkdir(mode=0o777)
    marks.chmod(0o777)
    plugins = make_plugin("asker", ASKER, limits={"timeout_s": 20, "ask_timeout_s": 20},
                          manifest={"isolation": isolation, "permissions": {"write": [str(marks)]}})
    marker = marks / "starts"
    args = {"marker": str(marker)}
    async with modern_stdio(plugins, tmp_path, policy) as peer:
        requests, state1 = input_required(await call(peer, "two_rounds", args, caps=ALL_CAPS))
        assert list(requests) == ["name"] and requests["name"]["method"] == "elicitation/create"
        requests, state2 = input_required(await call(peer, "two_rounds", args, caps=ALL_CAPS, responses={"name": NAME},
                                                     state=state1))
        assert list(requests) == ["greeting"] and state2 != state1
        done = await call(peer, "two_rounds", args, caps=ALL_CAPS, responses={"greeting": HELLO}, state=state2)
        pids = starts(marker)
        assert len(pids) == 1 and text(done) == f"pid={pids[0]} who=Ann greeting=hello Ann"
        # all answers up front: no round trip at all
        done = await call(peer, "one_round", args, caps=ALL_CAPS,
                          responses={"name": NAME, "greeting": HELLO, "roots": ROOTS})
        assert text(done).endswith("who=Ann greeting=hello Ann roots=1")


async def test_modern_stdio_refusals_are_json_rpc_errors(plugins: Path, tmp_path: Path) -> None:
    async with modern_stdio(plugins, tmp_path) as peer:
        missing = await call(peer, "must_sample", caps={"roots": {}})
        assert missing["error"]["code"] == -32021
        assert missing["error"]["data"] == {"requiredCapabilities": {"sampling": {}}}
        _, state = input_required(await call(peer, "form", caps=ALL_CAPS))
        tampered = state[:-5] + ("A" if state[-5] != "A" else "B") + state[-4:]
        assert (await call(peer, "form", caps=ALL_CAPS, responses={"name": NAME}, state=tampered))["error"]["code"] \
            == -32602
        bad = await call(peer, "form", caps=ALL_CAPS, responses={"name": {"action": "nope"}}, state=state)
        assert bad["error"]["code"] == -32602 and "action" in bad["error"]["message"]
        assert text(await call(peer, "echo", {"text": "still here"}, caps=ALL_CAPS)) == "still here"


async def test_stdin_closing_with_a_parked_call_lets_the_daemon_exit(plugins: Path, tmp_path: Path) -> None:
    async with modern_stdio(plugins, tmp_path) as peer:
        input_required(await call(peer, "form", caps=ALL_CAPS))
        assert peer.proc.stdin is not None
        await peer.proc.stdin.aclose()
        with trio.fail_after(15):  # the parked call would wait 20 s for a retry that cannot come
            assert await peer.proc.wait() == 0


@pytest.mark.parametrize("kind", list(UNSEALABLE))
async def test_a_retry_with_answers_that_cannot_be_sealed_does_not_bring_the_stdio_daemon_down(
        plugins: Path, tmp_path: Path, kind: str) -> None:
    async with modern_stdio(plugins, tmp_path) as peer:
        _, state = input_required(await call(peer, "one_round", caps=ALL_CAPS))
        request_id = await peer.start_request("tools/call", call_params("one_round", caps=ALL_CAPS,
                                                                         responses={"name": UNSEALABLE[kind]},
                                                                         state=state))
        with trio.move_on_after(10):
            await peer.wait_for(lambda m: m.get("id") == request_id or peer.proc.returncode is not None)
        assert peer.proc.returncode is None, "the daemon exited"
        answer = peer.responses_to(request_id)
        assert answer and answer[0]["error"]["code"] == -32602
        assert text(await call(peer, "echo", {"text": "still here"}, caps=ALL_CAPS)) == "still here"
