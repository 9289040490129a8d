"""``runtime.worker_frames``: whatever a worker's frame decodes to, the daemon either relays valid JSON
or rejects it with a named reason; no other exception escapes (property test over msgpack values)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import worker_frames
from runtime.worker_frames import FrameRejected, check_value
from sandbox import wire

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.binary(max_size=8))
keys = st.text(max_size=8) | st.integers(min_value=-5, max_value=5)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=4),
                      max_leaves=40)


def nested(depth: int) -> Any:
    value: Any = "x"
    for _ in range(depth):
        value = [value]
    return value


@settings(max_examples=300, deadline=None)
@given(values)
def test_a_value_is_either_relayed_as_json_or_rejected_by_name(value: Any) -> None:
    raw = msgspec.msgpack.encode(["log", 1, 4, value, None])
    msg = wire.from_worker_decoder.decode(raw)
    try:
        worker_frames.check_log(msg)
    except FrameRejected as exc:
        assert str(exc)
        return
    encoded = msgspec.json.encode({"data": msg.data})
    assert msgspec.json.decode(encoded) is not None


def test_depth_is_bounded_without_recursion_of_our_own() -> None:
    check_value(nested(worker_frames.MAX_VALUE_DEPTH - 1), "v")
    with pytest.raises(FrameRejected, match="deeper"):
        check_value(nested(worker_frames.MAX_VALUE_DEPTH), "v")
    # far deeper than Python's recursion limit: still a clean rejection
    deep = msgspec.msgpack.decode(b"\x91" * 900 + b"\xc0")
    with pytest.raises(FrameRejected, match="deeper"):
        check_value(deep, "v")


@pytest.mark.parametrize("value, reason", [
    ({1.5: "x"}, "not a string"),
    ([float("nan")], "non-finite"),
    ({"a": math.inf}, "non-finite"),
    (msgspec.msgpack.Ext(1, b"x"), "not a JSON value"),
])
def test_values_json_cannot_carry_are_rejected(value: Any, reason: str) -> None:
    with pytest.raises(FrameRejected, match=reason):
        check_value(value, "v")


def test_results_with_flat_text_content_pass_without_a_walk_and_deep_ones_are_caught() -> None:
    worker_frames.check_result(wire.Result(1, [{"type": "text", "text": "hi"}]))
    with pytest.raises(FrameRejected):
        worker_frames.check_result(wire.Result(1, [{"type": "text", "meta": nested(100)}]))
    with pytest.raises(FrameRejected):
        worker_frames.check_result(wire.Result(1, [], nested(100), True))


def test_an_over_size_log_message_is_replaced_by_a_note_that_says_so() -> None:
    out = worker_frames.truncate_log(wire.Log(3, 4, "x" * 100000, "l" * 1000), 100010, 65536)
    assert "truncated" in out.data and "65536" in out.data and len(out.logger or "") == 256
    progress = worker_frames.truncate_progress(wire.Progress(3, 1.0, None, "p" * 100000), 1000)
    assert len(progress.message or "") <= 1000
