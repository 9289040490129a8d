"""A 2026-07-28 retry that finds its call still parked, but past its question: the question already
timed out in the tool (``ask_timeout_s``), which went on and is still running. The retry's answers
are not for whatever the tool does now: that call is stopped and the tool runs again with them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import trio
from ask_harness import ALL_CAPS, NAME, modern_http, poll_until, result_text, serve_http, starts, starts_marker

PLUGIN = r'''
import os
import time
from sandbox import current, tool
from sandbox.asking import InputTimeout

FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@tool
def slow_ask(marker: str) -> str:
    with open(marker, "a") as f:
        f.write(f"{os.getpid()}\n")
    try:
        answer = current().elicit("Name?", FORM, key="name")
    except InputTimeout:
        time.sleep(4)  # still running (and parked) when the retry comes
        return "tool heard: timeout"
    return f"tool heard: {answer.content!r}"


@tool
def echo(text: str) -> str:
    return text
'''


async def test_a_retry_after_the_question_timed_out_runs_the_tool_again_with_its_answers(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    plugins = make_plugin("p", PLUGIN, limits={"timeout_s": 20, "ask_timeout_s": 1, "max_parked": 2,
                                               "max_concurrency": 2})
    marker = starts_marker(tmp_path)
    args = {"marker": str(marker)}
    async with serve_http(plugins, tmp_path / "state", state_key_file=str(tmp_path / "k")) as srv, \
            modern_http(srv.url) as c:
        mrtr = srv.daemon.mrtr
        _, msg = await c.call("slow_ask", args, caps=ALL_CAPS)
        state = msg["result"]["requestState"]
        assert len(mrtr.parking.parked) == 1
        await trio.sleep(1.6)  # past ask_timeout_s, well within the state's ttl
        assert len(mrtr.parking.parked) == 1  # the tool heard "timeout" and is still running
        status, msg = await c.call("slow_ask", args, caps=ALL_CAPS, responses={"name": NAME}, state=state)
        assert status == 200 and result_text(msg) == "tool heard: {'name': 'Ann'}", msg
        assert len(starts(marker)) == 2
        assert mrtr.stats["rerun"] == 1 and mrtr.stats["resumed"] == 0
        assert not mrtr.parking.parked and not mrtr.parking.rounds
        # The stale call was stopped (not left to finish into nobody), and the pool goes on.
        pool = next(iter(srv.daemon.plugins.values())).pool
        await poll_until(lambda: pool.in_flight == 0, 10)
        assert pool.restarts == 0  # stopped by us, not crashed
        _, echoed = await c.call("echo", {"text": "still serving"}, caps=ALL_CAPS)
        assert result_text(echoed) == "still serving"


async def test_a_retry_in_time_still_resumes_the_parked_call(make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    plugins = make_plugin("p", PLUGIN, limits={"timeout_s": 20, "ask_timeout_s": 30, "max_parked": 2})
    marker = starts_marker(tmp_path)
    args = {"marker": str(marker)}
    async with serve_http(plugins, tmp_path / "state", state_key_file=str(tmp_path / "k")) as srv, \
            modern_http(srv.url) as c:
        _, msg = await c.call("slow_ask", args, caps=ALL_CAPS)
        state = msg["result"]["requestState"]
        status, msg = await c.call("slow_ask", args, caps=ALL_CAPS, responses={"name": NAME}, state=state)
        assert status == 200 and result_text(msg) == "tool heard: {'name': 'Ann'}", msg
        assert len(starts(marker)) == 1
        assert srv.daemon.mrtr.stats["resumed"] == 1 and srv.daemon.mrtr.stats["rerun"] == 0
        assert not srv.daemon.mrtr.parking.parked
