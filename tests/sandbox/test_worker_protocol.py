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


WAITS = '''
import os
import time
from sandbox import tool


@tool
def quick() -> str:
    return "quick"


@tool
def wait_for(path: str) -> str:
    deadline = time.monotonic() + 20
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)
    return "waited"
'''


@pytest.mark.parametrize("mode", ["pooled", "per_call"])
def test_an_answer_leaves_before_the_next_call_of_its_batch_starts(tmp_path: Path, mode: str) -> None:
    """A quick call batched before a slow one is answered while the slow one runs: held back, the
    daemon would take the quick call for the running one (its deadline, a crash, blamed on it) and
    run the slow call again elsewhere after a kill. Here the slow call waits for a file the test
    creates only once it has the quick call's answer: an answer held back would never come."""
    plugin = write_plugin(tmp_path / "p", WAITS)
    gate = tmp_path / "gate"
    with Worker(plugin, policy="none", mode=mode) as w:
        w.ready()
        w.sock.sendall(encode_frame(Call(1, "quick", {})) + encode_frame(Call(2, "wait_for", {"path": str(gate)})))
        first = w.recv(timeout_s=10)
        assert first.id == 1 and text_of(first) == "quick", first
        gate.touch()
        later = [w.recv(timeout_s=30) for _ in range(1 if mode == "pooled" else 3)]
    assert [(type(f).__name__, f.id) for f in later][-1] in (("ResultReturned", 2), ("CallReturned", 2)), later
