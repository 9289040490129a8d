"""One call inside the worker, in this process (``sandbox.calls``, ``sandbox.api``'s running call,
``sandbox.wire.decode_frames``): what each way a tool can end becomes in the call's ``Result``; the
call's context, made only when the tool asks for it, and its questions, always for its own call; the
worker's frame reader. The real worker process runs these paths in ``test_worker_protocol``."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sandbox import api, asking, calls, errors
from sandbox.wire import (
    MAX_FRAME_BYTES,
    Answer,
    Call,
    CancelCall,
    InputResponse,
    Result,
    ResultReturned,
    Shutdown,
    decode_frames,
    encode_frame,
    to_worker_decoder,
)


class Point(msgspec.Struct):
    x: int
    y: int


def _tools() -> dict[str, api.ToolDef]:
    before = list(api.TOOLS)
    api.TOOLS.clear()
    try:
        @api.tool
        def echo(text: str, times: int = 1) -> str:
            return text * times

        @api.tool
        def point(x: int) -> Point:
            return Point(x, x)

        @api.tool
        def number(x: int) -> int:
            return x

        @api.tool
        def full() -> api.ToolResult:
            return api.ToolResult([api.text("a")], {"k": 1}, has_structured=True, is_error=True)

        @api.tool
        def refuse() -> str:
            raise api.ToolError("no")

        @api.tool
        def bad_request() -> str:
            raise errors.RequestError("bad cursor")

        @api.tool
        def lacks() -> str:
            raise asking.CapabilityMissing("no roots here", method="roots/list")

        @api.tool
        def crash() -> str:
            raise KeyError("boom")

        @api.tool(input_schema={"type": "object"})
        def untyped(a: Any) -> str:
            return str(a)

        return {t.name: t for t in api.TOOLS}
    finally:
        api.TOOLS[:] = before


def _run(tool: str, arguments: dict[str, Any], returned: bool = False) -> Result:
    return calls.run_call(_tools(), Call(7, tool, arguments), lambda msg: None, returned=returned)


def _fields(r: Result) -> tuple[Any, ...]:
    return (r.id, r.content, r.structured, r.has_structured, r.is_error, r.retire, r.killed, r.missing_capability,
            r.request_error)


def text(value: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": value}]


@pytest.mark.parametrize(("tool", "arguments", "expected"), [
    ("echo", {"text": "hi", "times": "2"}, (7, text("hihi"), None, False, False, None, False, None, None)),
    ("point", {"x": 3}, (7, text('{"x":3,"y":3}'), {"x": 3, "y": 3}, True, False, None, False, None, None)),
    ("number", {"x": 3}, (7, text('{"result":3}'), {"result": 3}, True, False, None, False, None, None)),
    ("full", {}, (7, text("a"), {"k": 1}, True, True, None, False, None, None)),
    ("refuse", {}, (7, text("no"), None, False, True, None, False, None, None)),
    ("bad_request", {}, (7, text("bad cursor"), None, False, True, None, False, None, "bad cursor")),
    ("lacks", {}, (7, text("no roots here"), None, False, True, None, False, "roots", None)),
    ("crash", {}, (7, text("KeyError: 'boom'"), None, False, True, None, False, None, None)),
    ("echo", {"text": 1}, (7, text("Invalid arguments: Expected `str`, got `int` - at `$.text`"), None, False, True,
                           None, False, None, None)),
    ("untyped", {"b": 1}, (7, text("Invalid arguments: missing a required argument: 'a'"), None, False, True,
                           None, False, None, None)),
    ("missing", {}, (7, text("Unknown tool: missing"), None, False, True, None, False, None, None)),
])
def test_each_way_a_call_ends_becomes_its_result(tool: str, arguments: dict[str, Any], expected: tuple[Any, ...]) -> None:
    result = _run(tool, arguments)
    assert type(result) is Result
    assert _fields(result) == expected
    assert (result.traceback is not None) == (tool == "crash")
    assert result.run_ns > 0 and 0 <= result.blocked_ns <= result.run_ns


def test_a_pooled_call_is_answered_with_one_result_returned_frame() -> None:
    result = _run("echo", {"text": "hi"}, returned=True)
    assert type(result) is ResultReturned
    decoded = msgspec.msgpack.decode(calls.encode_result(result)[4:], type=ResultReturned)
    assert _fields(decoded) == _fields(_run("echo", {"text": "hi"}))


def test_the_context_is_the_running_calls_and_only_while_it_runs() -> None:
    seen: list[api.CallContext] = []
    before = list(api.TOOLS)

    @api.tool
    def look() -> str:
        seen.extend([api.current(), api.current()])
        return api.current().traceparent

    tdef = api.TOOLS[-1]
    api.TOOLS[:] = before
    sent: list[Any] = []
    call = Call(5, "look", {}, progress=True, log_level=0, traceparent="00-ab-cd-01")
    result = calls.run_call({"look": tdef}, call, sent.append)
    assert result.content == text("00-ab-cd-01")
    assert seen[0] is seen[1] and seen[0].call_id == 5  # one context for the whole call
    seen[0].progress(1.0)
    seen[0].log("info", "x")
    assert [(type(m).__name__, m.id) for m in sent] == [("Progress", 5), ("Log", 5)]
    with pytest.raises(RuntimeError, match="only available while a tool call is running"):
        api.current()
    # A call that never asks for its context leaves none behind for the next one.
    calls.run_call(_tools(), Call(6, "echo", {"text": "x"}), sent.append)
    with pytest.raises(RuntimeError):
        api.current()


def test_a_context_asks_for_its_own_call_even_when_kept_past_it() -> None:
    """The worker has one ``exchange`` for every call: each context binds its own call's id."""
    asked: list[tuple[int, list[str]]] = []

    def exchange(call_id: int, requests: list[Any]) -> list[Any]:
        asked.append((call_id, [r.key for r in requests]))
        return [InputResponse(r.key, "result", {"roots": []}) for r in requests]

    kept: list[api.CallContext] = []
    before = list(api.TOOLS)

    @api.tool
    def keep() -> str:
        kept.append(api.current())
        return str(len(api.current().roots()))

    tdef = api.TOOLS[-1]
    api.TOOLS[:] = before
    assert calls.run_call({"keep": tdef}, Call(1, "keep", {}), lambda m: None, exchange).content == text("0")
    assert calls.run_call({"keep": tdef}, Call(2, "keep", {}), lambda m: None, exchange).content == text("0")
    kept[0].roots(key="later")
    assert [a[0] for a in asked] == [1, 2, 1]
    # Without an exchange (a call that cannot ask), asking says so.
    calls.run_call({"keep": tdef}, Call(3, "keep", {}), lambda m: None)
    with pytest.raises(asking.CapabilityMissing):
        kept[-1].roots()


def test_decode_frames_takes_whole_frames_and_leaves_the_rest() -> None:
    frames = [encode_frame(Call(1, "a", {"x": 1})), encode_frame(CancelCall(1)), encode_frame(Shutdown()),
              encode_frame(Answer(1, []))]
    data = b"".join(frames)
    for cut in range(len(data) + 1):  # every split of the stream into two reads
        buf = bytearray(data[:cut])
        got = decode_frames(buf, to_worker_decoder)
        buf += data[cut:]
        got += decode_frames(buf, to_worker_decoder)
        assert got == [Call(1, "a", {"x": 1}), CancelCall(1), Shutdown(), Answer(1, [])]
        assert buf == b""


def test_decode_frames_is_as_strict_as_the_decoder_and_the_cap() -> None:
    good = encode_frame(Call(1, "a", {}))
    bad = encode_frame(["call", "not an id", "a", {}])
    buf = bytearray(good + bad)
    with pytest.raises(msgspec.ValidationError):
        decode_frames(buf, to_worker_decoder)
    assert buf == good + bad  # nothing taken
    with pytest.raises(ValueError, match="exceeds the 4-byte cap"):
        decode_frames(bytearray(good), to_worker_decoder, max_frame=4)
    with pytest.raises(ValueError, match="cap"):
        decode_frames(bytearray((MAX_FRAME_BYTES + 1).to_bytes(4, "big")), to_worker_decoder)
