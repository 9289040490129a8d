"""Tools that ask, without processes: the sealed ``requestState``, the revision tables of what may be
asked and what an answer must look like, the worker-side ``Asker``, and the pool's ask deadline on
trio's virtual clock (a fake worker on a socketpair)."""

from __future__ import annotations

import base64
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trio.testing

from fake_pool import fake_pool, socket_worker

from runtime.mrtr import load_state_key
from runtime.protocol import eras
from runtime.protocol.request_state import (
    MAX_STATE_BYTES,
    RequestState,
    Sealer,
    StateRejected,
    digest_arguments,
)
from sandbox import asking, wire
from sandbox.errors import ToolError

KEY = bytes(range(32))
NOW = 1_800_000_000_000

REPO = Path(__file__).resolve().parents[2]


def state(**changes: Any) -> RequestState:
    fields: dict[str, Any] = {"principal": "alice", "tool": "two_rounds", "arguments": digest_arguments({"a": 1}),
                              "expires_ms": NOW + 60_000, "answers": {"name": {"action": "accept",
                                                                               "content": {"name": "Ann"}}},
                              "asked": ["greeting"], "daemon": "d1", "park": "p1"}
    fields.update(changes)
    return RequestState(**fields)


# -- runtime.protocol.request_state -------------------------------------------------------------


def test_a_sealed_state_opens_to_what_was_sealed_and_every_seal_is_unique() -> None:
    sealer = Sealer(KEY)
    original = state()
    text = sealer.seal(original)
    opened = sealer.open(text, NOW)
    assert msgspec.structs.replace(opened, nonce="") == original
    assert opened.nonce
    again = sealer.seal(original)
    assert again != text and sealer.open(again, NOW).nonce != opened.nonce
    assert text.isascii() and text.count(".") == 1 and "=" not in text


def test_a_state_sealed_under_another_key_is_rejected() -> None:
    text = Sealer(KEY).seal(state())
    with pytest.raises(StateRejected):
        Sealer(b"k" * 32).open(text, NOW)


def _flip(text: str, i: int) -> str:
    """``text`` with its i-th character replaced by another base64url character whose top bit differs
    (so the decoded bytes differ too; the '.' is replaced by a letter)."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    ch = text[i]
    if ch == ".":
        return text[:i] + "A" + text[i + 1:]
    return text[:i] + alphabet[alphabet.index(ch) ^ 32] + text[i + 1:]


def test_a_state_altered_at_any_character_is_rejected() -> None:
    sealer = Sealer(KEY)
    text = sealer.seal(state())
    for i in range(len(text)):
        with pytest.raises(StateRejected):
            sealer.open(_flip(text, i), NOW)
    for altered in (text[:-1], text[1:], text + "A", "A" + text, text.replace(".", ".."), text.split(".")[0],
                    text.split(".")[0] + "." + text.split(".")[0]):
        with pytest.raises(StateRejected):
            sealer.open(altered, NOW)


@pytest.mark.parametrize("alter", ["spare_bits", "padding", "junk", "spaces"])
def test_a_state_text_other_than_the_issued_one_is_rejected(alter: str) -> None:
    sealer = Sealer(KEY)
    text = sealer.seal(state())
    body, tag = text.split(".")
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    assert len(tag) == 43  # 32 bytes: the last character carries 2 unused bits
    variant = {
        "spare_bits": body + "." + tag[:-1] + alphabet[alphabet.index(tag[-1]) ^ 1],
        "padding": text + "==",
        "junk": body[:4] + "!!!!" + body[4:] + "." + tag,
        "spaces": "    " + text,
    }[alter]
    assert variant != text
    with pytest.raises(StateRejected):
        sealer.open(variant, NOW)


def test_an_expired_state_is_rejected_and_expiry_is_inclusive() -> None:
    sealer = Sealer(KEY)
    text = sealer.seal(state(expires_ms=NOW))
    assert sealer.open(text, NOW).expires_ms == NOW
    with pytest.raises(StateRejected, match="expired"):
        sealer.open(text, NOW + 1)


@pytest.mark.parametrize("text", [None, 42, b"abc.def", "", ".", "nodot", "a.b.c", "é.é", "..", "x" * (MAX_STATE_BYTES + 1)
                                  + ".AAAA", "AAAA." + "A" * (MAX_STATE_BYTES + 1)])
def test_malformed_state_is_rejected(text: Any) -> None:
    with pytest.raises(StateRejected):
        Sealer(KEY).open(text, NOW)


def test_a_validly_tagged_payload_that_is_not_a_state_is_rejected_as_malformed() -> None:
    sealer = Sealer(KEY)
    for payload in (msgspec.msgpack.encode({"principal": "x"}), b"\xc1", msgspec.msgpack.encode([1, 2, 3]), b""):
        tag = sealer._tag(payload)
        b64 = lambda data: base64.urlsafe_b64encode(data).rstrip(b"=").decode()  # noqa: E731
        text = b64(payload) + "." + b64(tag)
        with pytest.raises(StateRejected):
            sealer.open(text, NOW)


def test_answers_too_large_for_a_state_are_refused_when_sealing() -> None:
    sealer = Sealer(KEY)
    big = state(answers={"name": {"action": "accept", "content": {"name": "x" * MAX_STATE_BYTES}}})
    with pytest.raises(StateRejected, match="do not fit"):
        sealer.seal(big)
    fits = state(answers={"name": {"action": "accept", "content": {"name": "x" * (MAX_STATE_BYTES // 2)}}})
    assert len(sealer.seal(fits)) <= MAX_STATE_BYTES


def test_the_key_must_be_long_enough() -> None:
    with pytest.raises(ValueError):
        Sealer(b"short")
    Sealer(b"k" * 16)


def test_the_arguments_digest_ignores_key_order_and_sees_every_value() -> None:
    assert digest_arguments({"a": 1, "b": [1, {"x": 2, "y": 3}]}) == digest_arguments({"b": [1, {"y": 3, "x": 2}], "a": 1})
    assert digest_arguments({"a": 1}) != digest_arguments({"a": 2})
    assert digest_arguments({"a": 1}) != digest_arguments({"a": "1"})
    assert digest_arguments({}) != digest_arguments({"a": None})
    assert len(digest_arguments({"big": 2 ** 70})) == 32  # not JSON-encodable as a 64-bit int: still a digest


def test_the_state_key_file_is_created_0600_reused_and_refused_when_readable_by_others(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "state.key"
    key = load_state_key(str(path))
    assert len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert load_state_key(str(path)) == key
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_state_key(str(path))
    path.chmod(0o640)  # group-readable: refused for a key of our own
    with pytest.raises(ValueError, match="chmod 600"):
        load_state_key(str(path))
    short = tmp_path / "short.key"
    short.write_bytes(b"tiny")
    short.chmod(0o600)
    with pytest.raises(ValueError, match="16 bytes"):
        load_state_key(str(short))


@pytest.mark.timeout(30)
def test_a_key_file_that_is_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "state.key"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ValueError, match="must be a regular file"):
        load_state_key(str(fifo))


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root (to give the key to root) and setpriv (to read it as another user)")
def test_a_key_root_provides_may_be_read_by_its_group_but_by_nobody_else() -> None:
    # A Kubernetes Secret mounted with fsGroup: root's file, 0440, in the pod's group; PostgreSQL's
    # rule for key files. Checked from an unprivileged child, the way a non-root daemon reads it.
    folder = Path(tempfile.mkdtemp(prefix="toolcell-key-", dir="/tmp"))
    folder.chmod(0o755)
    key = folder / "state.key"
    key.write_bytes(b"k" * 32)
    results = {}
    try:
        modes = (0o440, 0o640, 0o444, 0o460)
        for mode in modes:
            key.chmod(mode)
            os.chown(key, 0, 65534)
            probe = subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                 f"from runtime.mrtr import load_state_key; print(len(load_state_key({str(key)!r})))"],
                capture_output=True, text=True, cwd=str(REPO), env={"PYTHONPATH": str(REPO)}, timeout=60, check=False)
            results[oct(mode)] = probe.stdout.strip() or probe.stderr.strip().splitlines()[-1]
    finally:
        shutil.rmtree(folder)
    assert results["0o440"] == results["0o640"] == "32"
    assert "must not be readable by others" in results["0o444"]
    assert "must not be readable by others" in results["0o460"]


# -- runtime.protocol.eras: what may be asked, what an answer must be ------------------------------

FORM = {"mode": "form", "message": "m", "requestedSchema": {"type": "object", "properties": {}}}
URL = {"mode": "url", "message": "m", "url": "https://example.com", "elicitationId": "e"}
SAMPLE = {"messages": [], "maxTokens": 5}


@pytest.mark.parametrize("version, caps, method, params, refused", [
    # elicitation came with 2025-06-18, URL mode with 2025-11-25
    ("2024-11-05", {"elicitation": {}}, "elicitation/create", FORM, "has no elicitation"),
    ("2025-03-26", {"elicitation": {}}, "elicitation/create", FORM, "has no elicitation"),
    ("2025-06-18", {"elicitation": {}}, "elicitation/create", FORM, None),
    ("2025-06-18", {"elicitation": {"url": {}}}, "elicitation/create", URL, "no URL-mode"),
    ("2025-11-25", {"elicitation": {"url": {}}}, "elicitation/create", URL, None),
    ("2026-07-28", {"elicitation": {"url": {}}}, "elicitation/create", URL, None),
    ("2025-11-25", {"elicitation": {}}, "elicitation/create", URL, "elicitation.url"),
    ("2025-11-25", {"elicitation": {"form": {}}}, "elicitation/create", URL, "elicitation.url"),
    ("2025-11-25", {"elicitation": {"url": {}}}, "elicitation/create", FORM, "only URL-mode"),
    ("2025-11-25", {"elicitation": {"form": {}, "url": {}}}, "elicitation/create", FORM, None),
    ("2025-11-25", {"elicitation": True}, "elicitation/create", FORM, "did not declare the elicitation"),
    ("2025-11-25", {}, "elicitation/create", FORM, "did not declare the elicitation"),
    ("2025-11-25", None, "elicitation/create", FORM, "did not declare the elicitation"),
    # sampling and roots exist in every revision
    ("2024-11-05", {"sampling": {}}, "sampling/createMessage", SAMPLE, None),
    ("2026-07-28", {"sampling": {}}, "sampling/createMessage", SAMPLE, None),
    ("2025-11-25", {"elicitation": {}}, "sampling/createMessage", SAMPLE, "did not declare the sampling"),
    ("2025-11-25", {"sampling": {}}, "sampling/createMessage", {**SAMPLE, "includeContext": "thisServer"},
     "sampling.context"),
    ("2025-11-25", {"sampling": {}}, "sampling/createMessage", {**SAMPLE, "includeContext": "none"}, None),
    ("2025-11-25", {"sampling": {"context": {}}}, "sampling/createMessage", {**SAMPLE, "includeContext": "allServers"},
     None),
    ("2024-11-05", {"roots": {}}, "roots/list", {}, None),
    ("2026-07-28", {"roots": {"listChanged": True}}, "roots/list", {}, None),
    ("2026-07-28", {"sampling": {}}, "roots/list", {}, "did not declare the roots"),
    ("2025-11-25", ALL := {"elicitation": {}, "sampling": {}, "roots": {}}, "tools/call", {}, "cannot be asked"),
    ("2025-11-25", ALL, "ping", {}, "cannot be asked"),
])
def test_what_a_client_of_each_revision_may_be_asked(version: str, caps: Any, method: str, params: dict[str, Any],
                                                      refused: str | None) -> None:
    why = eras.input_refusal(version, caps, method, params)
    if refused is None:
        assert why is None
    else:
        assert why is not None and refused in why


def test_a_2025_06_18_elicitation_is_sent_without_mode() -> None:
    assert eras.shape_input_request("2025-06-18", "elicitation/create", FORM) == \
        {"message": "m", "requestedSchema": FORM["requestedSchema"]}
    assert eras.shape_input_request("2025-11-25", "elicitation/create", FORM) == FORM
    assert eras.shape_input_request("2025-06-18", "sampling/createMessage", SAMPLE) == SAMPLE


@pytest.mark.parametrize("method, answer, problem", [
    ("elicitation/create", {"action": "accept", "content": {"a": 1}}, None),
    ("elicitation/create", {"action": "decline"}, None),
    ("elicitation/create", {"action": "cancel", "content": None}, None),
    ("elicitation/create", {"action": "accept"}, None),
    ("elicitation/create", {"action": "maybe"}, "action"),
    ("elicitation/create", {}, "action"),
    ("elicitation/create", {"action": "accept", "content": "yes"}, "content must be an object"),
    ("elicitation/create", {"action": "accept", "content": [1]}, "content must be an object"),
    ("elicitation/create", "accept", "not an object"),
    ("elicitation/create", None, "not an object"),
    ("sampling/createMessage", {"role": "assistant", "content": {"type": "text", "text": "x"}}, None),
    ("sampling/createMessage", {"role": "assistant", "content": [{"type": "text", "text": "x"}]}, None),
    ("sampling/createMessage", {"role": "assistant"}, "role and content"),
    ("sampling/createMessage", {"content": {"type": "text", "text": "x"}}, "role and content"),
    ("sampling/createMessage", {"role": "assistant", "content": "x"}, "role and content"),
    ("sampling/createMessage", [1], "not an object"),
    ("roots/list", {"roots": []}, None),
    ("roots/list", {"roots": [{"uri": "file:///a", "name": "a"}]}, None),
    ("roots/list", {"roots": [{"name": "a"}]}, "uri"),
    ("roots/list", {"roots": [{"uri": 5}]}, "uri"),
    ("roots/list", {"roots": "file:///a"}, "uri"),
    ("roots/list", {}, "uri"),
    ("tools/call", {}, "cannot be answered"),
])
def test_what_a_2026_client_answer_must_look_like(method: str, answer: Any, problem: str | None) -> None:
    found = eras.input_response_problem(method, answer)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


# -- sandbox.asking.Asker with a fake exchange ----------------------------------------------------


class Confirm(msgspec.Struct):
    ok: bool
    note: str = ""


class FakeClient:
    """An exchange that records every round and answers from ``answers`` (key -> InputResponse args)."""

    def __init__(self, **answers: Any) -> None:
        self.rounds: list[list[wire.InputRequest]] = []
        self.answers = answers

    def __call__(self, requests: list[wire.InputRequest]) -> list[wire.InputResponse]:
        self.rounds.append(list(requests))
        out = []
        for r in requests:
            given = self.answers.get(r.key)
            if given is not None:
                out.append(given if isinstance(given, wire.InputResponse) else wire.InputResponse(r.key, "result", given))
        return out


def test_requests_are_numbered_by_kind_across_rounds_unless_keyed() -> None:
    client = FakeClient()
    asker = asking.Asker(client)
    with pytest.raises(asking.ClientRefused):
        asker.ask([asking.Elicit("a?", {"type": "object"}), asking.Sample("hi")])
    with pytest.raises(asking.ClientRefused):
        asker.ask([asking.ListRoots(), asking.Elicit("b?", Confirm, key="mine"), asking.ElicitUrl("https://x", "go")])
    assert [[r.key for r in rnd] for rnd in client.rounds] == [["elicit-1", "sample-2"], ["roots-3", "mine", "elicit-5"]]
    assert [r.method for r in client.rounds[1]] == ["roots/list", "elicitation/create", "elicitation/create"]


def test_request_params_are_worded_as_2025_11_25_does() -> None:
    client = FakeClient()
    asker = asking.Asker(client)
    with pytest.raises(asking.ClientRefused):
        asker.ask([asking.Elicit("Proceed?", Confirm), asking.ElicitUrl("https://x.test/a", "Log in"),
                   asking.Sample([{"role": "user", "content": {"type": "text", "text": "q"}}], max_tokens=7,
                                 temperature=0.5, include_context="none"),
                   asking.Sample("plain")])
    form, url, sample, plain = client.rounds[0]
    assert form.params["mode"] == "form" and form.params["message"] == "Proceed?"
    schema = form.params["requestedSchema"]
    assert schema["type"] == "object" and set(schema["properties"]) == {"ok", "note"} and schema["required"] == ["ok"]
    assert "$defs" not in schema and "$ref" not in str(schema)
    assert url.params == {"mode": "url", "message": "Log in", "url": "https://x.test/a", "elicitationId": url.key}
    assert sample.params == {"messages": [{"role": "user", "content": {"type": "text", "text": "q"}}], "maxTokens": 7,
                             "temperature": 0.5, "includeContext": "none"}
    assert plain.params == {"messages": [{"role": "user", "content": {"type": "text", "text": "plain"}}],
                            "maxTokens": 1000}


@pytest.mark.parametrize("keys", [["same", "same"], ["x" * 65], ["é"], ["tab\there"], ["elicit-2", ""]])
def test_bad_or_duplicate_keys_in_a_round_are_refused_before_anything_is_sent(keys: list[str]) -> None:
    client = FakeClient()
    with pytest.raises(ValueError, match="key"):
        asking.Asker(client).ask([asking.Elicit("q", {"type": "object"}, key=k) for k in keys])
    assert client.rounds == []


def test_a_key_used_in_an_earlier_round_of_the_call_is_refused() -> None:
    client = FakeClient(again={"action": "decline"})
    asker = asking.Asker(client)
    assert asker.ask([asking.Elicit("first?", {"type": "object"}, key="again")])[0].action == "decline"
    with pytest.raises(ValueError, match="key"):
        asker.ask([asking.Elicit("second?", {"type": "object"}, key="again")])


@pytest.mark.parametrize("outcome, exception", [
    ("declined_capability", asking.CapabilityMissing),
    ("timeout", asking.InputTimeout),
    ("cancelled", asking.InputCancelled),
    ("error", asking.ClientRefused),
    ("something-new", asking.ClientRefused),
])
def test_each_outcome_without_a_result_is_its_exception(outcome: str, exception: type[Exception]) -> None:
    client = FakeClient(k=wire.InputResponse("k", outcome, message=f"because {outcome}"))
    with pytest.raises(exception, match=f"because {outcome}") as caught:
        asking.Asker(client).ask([asking.Sample("hi", key="k")])
    error = caught.value
    assert isinstance(error, ToolError) and isinstance(error, asking.InputUnavailable)
    assert (error.key, error.method) == ("k", "sampling/createMessage")
    if isinstance(error, asking.CapabilityMissing):
        assert error.capability == "sampling"


def test_a_key_without_an_answer_is_refused_and_the_first_failure_in_order_raises() -> None:
    client = FakeClient(b=wire.InputResponse("b", "timeout"))
    with pytest.raises(asking.ClientRefused, match="no answer"):
        asking.Asker(client).ask([asking.ListRoots(key="a"), asking.ListRoots(key="b")])
    client = FakeClient(a={"roots": []}, b=wire.InputResponse("b", "timeout"))
    with pytest.raises(asking.InputTimeout):
        asking.Asker(client).ask([asking.ListRoots(key="a"), asking.ListRoots(key="b")])


def test_capability_missing_names_the_capability_of_each_method() -> None:
    for request, capability in ((asking.Elicit("q", {}), "elicitation"), (asking.ElicitUrl("https://x", "m"), "elicitation"),
                                (asking.Sample("q"), "sampling"), (asking.ListRoots(), "roots")):
        with pytest.raises(asking.CapabilityMissing) as caught:
            asking.Asker(None).ask([request])  # a call that cannot ask at all
        assert caught.value.capability == capability


def test_answers_become_typed_values() -> None:
    client = FakeClient(
        form={"action": "accept", "content": {"ok": "true", "note": "fine"}},
        plain={"action": "accept", "content": {"x": 1}},
        no={"action": "decline"},
        model={"role": "assistant", "content": [{"type": "image", "data": ""}, {"type": "text", "text": "hi"}],
               "model": "m1", "stopReason": "endTurn"},
        roots={"roots": [{"uri": "file:///a", "name": "a"}, {"uri": "file:///b"}]},
    )
    form, plain, no, model, roots = asking.Asker(client).ask([
        asking.Elicit("q", Confirm, key="form"), asking.Elicit("q", {"type": "object"}, key="plain"),
        asking.Elicit("q", Confirm, key="no"), asking.Sample("q", key="model"), asking.ListRoots(key="roots")])
    assert form.accepted and form.content == Confirm(True, "fine")  # converted, not strict: "true" -> True
    assert plain.content == {"x": 1}
    assert no.action == "decline" and not no.accepted and no.content is None
    assert (model.role, model.text, model.model, model.stop_reason) == ("assistant", "hi", "m1", "endTurn")
    assert roots == [asking.Root("file:///a", "a"), asking.Root("file:///b", None)]


@pytest.mark.parametrize("request_, answer", [
    (asking.Elicit("q", Confirm), {"action": "accept", "content": {"note": "no ok field"}}),
    (asking.Elicit("q", Confirm), {"action": "accept", "content": {"ok": "perhaps"}}),
    (asking.Elicit("q", {"type": "object"}), {"action": "whatever"}),
    (asking.Elicit("q", {"type": "object"}), {"content": {}}),
    (asking.ListRoots(), {"roots": [{"name": "no uri"}]}),
    (asking.ListRoots(), {"roots": "nope"}),
])
def test_an_answer_that_does_not_fit_is_client_refused(request_: Any, answer: Any) -> None:
    key = {asking.Elicit: "elicit-1", asking.ListRoots: "roots-1"}[type(request_)]
    with pytest.raises(asking.ClientRefused, match="does not fit"):
        asking.Asker(FakeClient(**{key: answer})).ask([request_])


def test_what_cannot_be_asked_is_a_type_error() -> None:
    asker = asking.Asker(FakeClient())
    with pytest.raises(TypeError):
        asker.ask([object()])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        asker.ask([asking.Elicit("q", str)])
    with pytest.raises(TypeError):
        asker.ask([asking.Sample(42)])
    assert asker.ask([]) == []


# -- the pool's ask deadline, on trio's virtual clock ------------------------------------------------


async def _pool_with_one_call(nursery: trio.Nursery, tmp_path: Path, limits: wire.Limits) -> tuple[Any, Any, Any]:
    """A pool whose one (fake) worker runs one call; returns (pool, slot, the worker's end of the socket)."""
    pool = fake_pool(nursery, tmp_path, limits)
    worker, theirs = socket_worker(pool, tmp_path)
    events: list[Any] = []
    slot = pool.new_slot("t", {}, False, -1, events.append, lambda s: None)
    pool.in_flight += 1
    pool._dispatch(worker, [slot])
    pool.watchdog.start(nursery)
    await trio.testing.wait_all_tasks_blocked()  # the watchdog sleeps until the running call's deadline
    return pool, slot, theirs


async def _next_frame(sock: Any, buf: bytearray) -> Any:
    while True:
        frames = wire.split_frames(buf)
        if frames:
            rest = b"".join(wire.HEADER.pack(len(f)) + f for f in frames[1:])
            buf[:0] = rest
            return wire.to_worker_decoder.decode(frames[0])
        data = await sock.recv(1 << 16)
        assert data, "the pool closed the worker's socket"
        buf += data


def _ask(slot: Any) -> wire.Ask:
    return wire.Ask(slot.call.id, [wire.InputRequest("k", "elicitation/create", FORM)])


async def test_a_question_times_out_after_ask_timeout_s_even_when_the_call_has_longer_to_run(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, no_kills: list[int]) -> None:
    async with trio.open_nursery() as nursery:
        pool, slot, sock = await _pool_with_one_call(nursery, tmp_path, wire.Limits(timeout_s=30, ask_timeout_s=0.5))
        buf = bytearray()
        assert type(await _next_frame(sock, buf)) is wire.Call
        asked_at = trio.current_time()
        pool.ask(slot, _ask(slot))
        answer = await _next_frame(sock, buf)
        waited = trio.current_time() - asked_at
        nursery.cancel_scope.cancel()
    assert type(answer) is wire.Answer and answer.responses[0].outcome == "timeout"
    assert waited == pytest.approx(0.5, abs=0.01)


async def test_the_call_deadline_stops_while_it_waits_and_resumes_with_what_was_left(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, no_kills: list[int]) -> None:
    async with trio.open_nursery() as nursery:
        pool, slot, sock = await _pool_with_one_call(nursery, tmp_path, wire.Limits(timeout_s=1, ask_timeout_s=60))
        buf = bytearray()
        assert type(await _next_frame(sock, buf)) is wire.Call
        start = trio.current_time()
        await trio.sleep(0.75)
        pool.ask(slot, _ask(slot))
        await trio.sleep(10)  # far past the call's own deadline: it waits for its answer, not killed
        assert not slot.finished and slot.asking is not None and not no_kills
        answered_at = trio.current_time()
        assert pool.answer(slot, [wire.InputResponse("k", "result", {"action": "decline"})])
        answer = await _next_frame(sock, buf)
        assert type(answer) is wire.Answer and answer.responses == [wire.InputResponse("k", "result", {"action": "decline"})]
        assert not pool.answer(slot, [])  # answered once; a second answer is not sent
        slot.event = trio.Event()
        with trio.fail_after(5):
            await slot.event.wait()
        nursery.cancel_scope.cancel()
    assert slot.error is not None and slot.error.kind == "timeout"
    assert trio.current_time() - answered_at == pytest.approx(0.25, abs=0.02)
    assert trio.current_time() - start == pytest.approx(11.0, abs=0.02)


async def test_a_question_times_out_at_ask_timeout_s_when_that_is_later_than_the_call_deadline(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, no_kills: list[int]) -> None:
    async with trio.open_nursery() as nursery:
        pool, slot, sock = await _pool_with_one_call(nursery, tmp_path, wire.Limits(timeout_s=1, ask_timeout_s=3))
        buf = bytearray()
        await _next_frame(sock, buf)
        asked_at = trio.current_time()
        pool.ask(slot, wire.Ask(slot.call.id, [wire.InputRequest("a", "roots/list", {}),
                                                wire.InputRequest("b", "sampling/createMessage", SAMPLE)]))
        answer = await _next_frame(sock, buf)
        waited = trio.current_time() - asked_at
        nursery.cancel_scope.cancel()
    assert [(r.key, r.outcome) for r in answer.responses] == [("a", "timeout"), ("b", "timeout")]
    assert "did not answer within 3 s" in answer.responses[0].message
    assert waited == pytest.approx(3.0, abs=0.01)
    assert not no_kills


async def test_a_partial_answer_fills_the_rest_with_the_missing_outcome(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, no_kills: list[int]) -> None:
    async with trio.open_nursery() as nursery:
        pool, slot, sock = await _pool_with_one_call(nursery, tmp_path, wire.Limits(timeout_s=5, ask_timeout_s=5))
        buf = bytearray()
        await _next_frame(sock, buf)
        pool.ask(slot, wire.Ask(slot.call.id, [wire.InputRequest("a", "roots/list", {}),
                                                wire.InputRequest("b", "roots/list", {})]))
        assert pool.answer(slot, [wire.InputResponse("b", "result", {"roots": []}),
                                  wire.InputResponse("zzz", "result", {})], "cancelled", "went away")
        answer = await _next_frame(sock, buf)
        nursery.cancel_scope.cancel()
    assert [(r.key, r.outcome, r.message) for r in answer.responses] == [("a", "cancelled", "went away"),
                                                                         ("b", "result", "")]


def test_max_asks_and_the_round_checks_are_declared_limits() -> None:
    assert wire.Limits().max_asks == 64 and wire.Limits().ask_timeout_s == 300.0 and wire.Limits().max_parked == 2
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"ask_timeout_s": 0}, wire.Limits)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"max_asks": -1}, wire.Limits)


def _deep(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = {"d": value}
    return value


@pytest.mark.parametrize("requests, problem", [
    ([], "asks nothing"),
    ([("k", "tools/call", {})], "which a tool cannot ask"),
    ([("k", "roots/list", {}), ("k", "roots/list", {})], "unique"),
    ([("", "roots/list", {})], "keys"),
    (["x" * 65, "roots/list", {}], "keys"),
    ([("é", "roots/list", {})], "keys"),
    ([(f"k{i}", "roots/list", {}) for i in range(17)], "over 16"),
    ([(f"k{i}", "roots/list", {}) for i in range(100)], "over 16"),
    ([("k", "sampling/createMessage", {"deep": _deep(200)})], "nested deeper"),
    ([("k", "sampling/createMessage", {"nan": float("nan")})], "non-finite"),
])
def test_the_daemon_refuses_a_malformed_round_of_questions(requests: list[Any], problem: str) -> None:
    from runtime.worker_frames import FrameRejected, check_ask

    if requests and isinstance(requests[0], str):
        requests = [tuple(requests)]
    ask = wire.Ask(1, [wire.InputRequest(*r) for r in requests])
    with pytest.raises(FrameRejected, match=problem):
        check_ask(ask)


def test_the_daemon_accepts_a_full_round_of_questions() -> None:
    from runtime.worker_frames import check_ask

    check_ask(wire.Ask(1, [wire.InputRequest(f"k{i}", "roots/list", {}) for i in range(16)]))
    check_ask(wire.Ask(1, [wire.InputRequest("x" * 64, "elicitation/create", FORM)]))


def test_daemons_starting_together_on_a_fresh_state_dir_agree_on_one_request_state_key(tmp_path: Path) -> None:
    import threading

    from runtime.mrtr import load_state_key

    path = tmp_path / "state" / "request-state.key"
    keys: list[bytes] = []
    threads = [threading.Thread(target=lambda: keys.append(load_state_key(str(path)))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1 and len(keys[0]) == 32
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.listdir(path.parent) == ["request-state.key"]  # no temporary file left behind
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="must not be readable by others"):
        load_state_key(str(path))
