"""The worker's side of the daemon channel: results come back in the order the calls were sent,
including a call cancelled while it was still queued behind another (the daemon matches results
to calls by order, so an early answer would be read as garbage and kill the worker)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sandbox_harness import Worker, text_of, write_plugin

from sandbox.wire import Call, CancelCall, encode_frame

NAP = '''
import time
from sandbox import tool


@tool
def nap(s: float) -> str:
    time.sleep(s)
    return "ok"
'''


@pytest.mark.parametrize("mode", ["pooled", "per_call"])
def test_a_queued_call_cancelled_is_answered_in_its_turn(tmp_path: Path, mode: str) -> None:
    plugin = write_plugin(tmp_path / "p", NAP)
    with Worker(plugin, policy="none", mode=mode) as w:
        w.ready()
        w.sock.sendall(b"".join(encode_frame(Call(i, "nap", {"s": 0.3 if i == 100 else 0})) for i in (100, 101, 102)))
        time.sleep(0.05)  # 100 is running, 101 and 102 are queued
        w.sock.sendall(encode_frame(CancelCall(102)))
        frames = [w.recv() for _ in range(3 if mode == "pooled" else 6)]
    # Each answer says that its call's code returned (sandbox.wire): a pooled worker's runtime writes
    # one ResultReturned per call; per_call, R follows the call process's Result with its CallReturned.
    if mode == "pooled":
        assert [type(f).__name__ for f in frames] == ["ResultReturned"] * 3
        answers = frames
    else:
        answers = frames[0::2]
        assert [(type(f).__name__, f.id) for f in frames[1::2]] == [("CallReturned", i) for i in (100, 101, 102)]
    assert [(r.id, text_of(r)) for r in answers] == [(100, "ok"), (101, "ok"), (102, "cancelled")]
    assert answers[2].is_error
