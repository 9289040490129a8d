"""Worker behaviour, seen from a client of a real ``toolcell serve --stdio`` process.

Every call runs in a worker process; these tests make workers crash, hang, fork, flood and
lie, and check that only the offending call fails, that the worker (and what it spawned) is
gone, and that the next call is served. The pools are tested only through the daemon.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import probe_plugins
import psutil
import pytest
import trio
from stdio_peer import StdioPeer, open_toolcell, process_gone, text_of, wait_gone

PROBE_LIMITS = {"timeout_s": 10, "max_concurrency": 4, "max_output_bytes": 4096}
DEADLINE_LIMITS = {"timeout_s": 0.5, "max_concurrency": 2}


@pytest.fixture
def plugins(make_plugin: Callable[..., Path]) -> Path:
    make_plugin("probe", probe_plugins.PROBE, limits=PROBE_LIMITS)
    make_plugin("deadline", probe_plugins.DEADLINE, limits=DEADLINE_LIMITS)
    return make_plugin("single", probe_plugins.SINGLE, limits={"timeout_s": 10, "max_concurrency": 1,
                                                               "max_queue": 1})


@pytest.fixture
async def peer(plugins: Path, tmp_path: Path) -> AsyncIterator[StdioPeer]:
    async with open_toolcell(plugins, stderr_path=tmp_path / "daemon.log") as p:
        await p.initialize("2025-11-25")
        yield p


def pid_from_progress(peer: StdioPeer, token: Any) -> int:
    for note in peer.notifications("notifications/progress"):
        if note["params"]["progressToken"] == token:
            match = re.fullmatch(r"pid=(\d+)", note["params"].get("message", ""))
            if match:
                return int(match.group(1))
    raise AssertionError("the tool did not report its pid")


async def reported_pid(peer: StdioPeer, token: Any) -> int:
    await peer.wait_for(lambda m: m.get("method") == "notifications/progress"
                        and m["params"]["progressToken"] == token)
    return pid_from_progress(peer, token)


def kill_if_alive(pid: int) -> None:
    """Clean up a grandchild this test made a worker fork (only if the daemon failed to)."""
    if not process_gone(pid):
        os.kill(pid, signal.SIGKILL)


def assert_is_error(response: Any, *fragments: str) -> str:
    assert "error" not in response, response
    assert response["result"].get("isError") is True, response
    text = text_of(response)
    for fragment in fragments:
        assert fragment in text, text
    return text


async def assert_still_serving(peer: StdioPeer) -> None:
    response = await peer.call("echo", {"text": "still here"})
    assert response["result"]["content"] == [{"type": "text", "text": "still here"}]
    assert "isError" not in response["result"]


async def test_a_tool_call_runs_in_a_worker_process_not_in_the_daemon(peer: StdioPeer) -> None:
    response = await peer.call("pid")
    worker_pid = int(text_of(response))
    assert worker_pid != peer.proc.pid
    assert worker_pid in [c.pid for c in psutil.Process(peer.proc.pid).children(recursive=True)]


async def test_structured_results_come_back_with_their_json_text(peer: StdioPeer) -> None:
    response = await peer.call("add", {"a": 2, "b": 40})
    assert response["result"]["structuredContent"] == {"result": 42}
    assert response["result"]["content"][0]["text"].replace(" ", "") == '{"result":42}'


async def test_an_integer_no_worker_frame_can_carry_fails_its_own_call_before_it_is_queued(peer: StdioPeer) -> None:
    # Valid JSON and a valid "integer" for the schema, but beyond what the worker channel (msgpack,
    # 64 bits) can carry: the call is refused with -32602, nothing is queued, the pool goes on.
    response = await peer.call("add", {"a": 10**30, "b": 1})
    assert response["error"]["code"] == -32602, response
    assert "cannot be passed to a worker" in response["error"]["message"]
    assert (await peer.call("add", {"a": 2, "b": 40}))["result"]["structuredContent"] == {"result": 42}
    await assert_still_serving(peer)


async def test_a_crashing_tool_fails_only_its_call_and_the_next_call_works(peer: StdioPeer) -> None:
    response = await peer.call("crash", {"code": 3}, token="c")
    assert_is_error(response, "crash")
    await wait_gone(pid_from_progress(peer, "c"))
    await assert_still_serving(peer)


async def test_garbage_on_the_worker_channel_fails_only_that_call(peer: StdioPeer) -> None:
    response = await peer.call("garbage")
    text = assert_is_error(response, "garbage")
    assert "sent garbage" not in text
    await assert_still_serving(peer)


async def test_output_above_max_output_bytes_is_an_is_error_result(peer: StdioPeer) -> None:
    just_over = await peer.call("big", {"size": 6000})
    assert_is_error(just_over, "4096")
    far_over = await peer.call("big", {"size": 500_000})
    text = assert_is_error(far_over)
    assert "x" * 100 not in text
    await assert_still_serving(peer)
    within = await peer.call("big", {"size": 1000})
    assert text_of(within) == "x" * 1000


async def test_a_tool_that_raises_gives_its_message_without_a_traceback(peer: StdioPeer) -> None:
    response = await peer.call("fail", {"message": "the answer is not 41"})
    text = assert_is_error(response, "the answer is not 41", "ValueError")
    assert "Traceback" not in text and "File \"" not in text and "line " not in text
    assert "inner" not in text


async def test_a_plugin_printing_to_stdout_cannot_corrupt_the_protocol(peer: StdioPeer) -> None:
    response = await peer.call("noisy")
    assert text_of(response) == "quiet result"
    await assert_still_serving(peer)
    assert not any(isinstance(m.get("result"), dict) and m["result"].get("forged") for m in peer.messages)
    assert all(b"plugin chatter" not in line for line in peer.raw_lines)


async def test_many_calls_at_once_are_all_answered(peer: StdioPeer) -> None:
    ids = [await peer.start_call("echo", {"text": f"n{i}"}) for i in range(40)]
    for i, request_id in enumerate(ids):
        assert text_of(await peer.response(request_id)) == f"n{i}"


async def test_a_slow_call_does_not_hold_up_a_fast_one(peer: StdioPeer) -> None:
    slow_id = await peer.start_call("slow", {"seconds": 1.5})
    fast = await peer.call("echo", {"text": "fast"}, timeout=5)
    assert text_of(fast) == "fast"
    assert peer.responses_to(slow_id) == []  # the slow one is still running
    assert text_of(await peer.response(slow_id)) == "slept 1.5"


async def test_a_full_queue_answers_busy_instead_of_growing(peer: StdioPeer) -> None:
    # One worker and one queue slot: of three concurrent calls one runs, one waits, one is refused.
    ids = [await peer.start_call("hold", {"seconds": 0.6}) for _ in range(3)]
    responses = [await peer.response(i) for i in ids]
    busy = [r for r in responses if "error" in r]
    assert len(busy) == 1, responses
    assert busy[0]["error"]["code"] == -31001
    assert "busy" in busy[0]["error"]["message"].lower()
    assert all(text_of(r) == "held" for r in responses if "error" not in r)
    # Once the queue drains the plugin serves again.
    assert text_of(await peer.call("hold", {"seconds": 0})) == "held"


async def test_cancelling_a_call_kills_its_worker_and_suppresses_its_result(peer: StdioPeer) -> None:
    slow_id = await peer.start_call("slow", {"seconds": 30}, token="s")
    slow_pid = await reported_pid(peer, "s")
    await peer.notify("notifications/cancelled", {"requestId": slow_id, "reason": "test"})
    await wait_gone(slow_pid)
    after = int(text_of(await peer.call("pid")))
    assert after != slow_pid
    # Calls that start after the cancellation finish; the cancelled one never answers.
    for _ in range(3):
        await peer.call("slow", {"seconds": 0.1})
    assert peer.responses_to(slow_id) == []


async def test_cancelling_a_queued_call_drops_it_without_touching_the_running_one(peer: StdioPeer) -> None:
    running = await peer.start_call("hold", {"seconds": 0.8})
    queued = await peer.start_call("hold", {"seconds": 0})
    await trio.sleep(0.2)
    await peer.notify("notifications/cancelled", {"requestId": queued})
    assert text_of(await peer.response(running)) == "held"
    assert text_of(await peer.call("hold", {"seconds": 0})) == "held"
    assert peer.responses_to(queued) == []


async def test_cancelling_an_unknown_or_finished_request_changes_nothing(peer: StdioPeer) -> None:
    done_id = await peer.start_call("echo", {"text": "done"})
    await peer.response(done_id)
    await peer.notify("notifications/cancelled", {"requestId": done_id})
    await peer.notify("notifications/cancelled", {"requestId": "never-sent"})
    await assert_still_serving(peer)
    assert len(peer.responses_to(done_id)) == 1


async def test_a_call_past_its_deadline_is_an_is_error_result_and_its_worker_is_killed(peer: StdioPeer) -> None:
    response = await peer.call("sleepy", {"seconds": 30}, token="t")
    assert_is_error(response, "timed out after 0.5 s")
    await wait_gone(pid_from_progress(peer, "t"))
    assert text_of(await peer.call("quick")) == "quick"


async def test_a_worker_that_floods_its_channel_cannot_stall_the_daemon_or_outlive_its_deadline(
        peer: StdioPeer) -> None:
    """The reader lets the rest of the daemon run between batches of frames: a worker keeping its
    socket full used to hold the event loop (another plugin's call waited ~40 s, and the flood ran
    past its own 0.5 s deadline because the watchdog never ran)."""
    flood = await peer.start_call("flood_channel", {"seconds": 30})
    await trio.sleep(0.3)
    with trio.fail_after(10):
        await assert_still_serving(peer)  # another plugin, served meanwhile
        response = await peer.response(flood, 10)
    assert_is_error(response, "timed out after 0.5 s")
    await assert_still_serving(peer)


async def test_the_deadline_kills_a_double_forked_grandchild_in_its_own_session(peer: StdioPeer) -> None:
    response = await peer.call("escape", token="g")
    assert_is_error(response, "timed out")
    grandchild = pid_from_progress(peer, "g")
    try:
        await wait_gone(grandchild, timeout=5)
    finally:
        kill_if_alive(grandchild)
    assert text_of(await peer.call("quick")) == "quick"


async def test_the_deadline_kills_a_double_forked_grandchild_that_detached_its_stdio(peer: StdioPeer) -> None:
    response = await peer.call("escape_quietly", token="q")
    assert_is_error(response, "timed out")
    grandchild = pid_from_progress(peer, "q")
    try:
        await wait_gone(grandchild, timeout=5)
    finally:
        kill_if_alive(grandchild)
    assert text_of(await peer.call("quick")) == "quick"


async def test_progress_and_log_notifications_reach_the_client_while_the_call_runs(peer: StdioPeer) -> None:
    await peer.request("logging/setLevel", {"level": "info"})
    response = await peer.call("chatty", {"steps": 3}, token=77)
    assert text_of(response) == "chatty done"
    progress = [n["params"] for n in peer.notifications("notifications/progress") if n["params"]["progressToken"] == 77]
    assert [p["progress"] for p in progress] == [1, 2, 3]
    assert all(p["total"] == 3 for p in progress)
    assert progress[0]["message"] == "step 1 of 3"
    logs = [n["params"] for n in peer.notifications("notifications/message")]
    assert [entry["data"] for entry in logs] == [{"step": 1}, {"step": 2}, {"step": 3}]  # debug is filtered
    assert all(entry["level"] == "warning" and entry["logger"] == "probe" for entry in logs)
    # Notifications come before the response they belong to.
    position = {id(m): i for i, m in enumerate(peer.messages)}
    last_note = max(i for i, m in enumerate(peer.messages) if m.get("method") == "notifications/progress")
    assert last_note < position[id(response)]


async def test_no_progress_is_sent_without_a_progress_token(peer: StdioPeer) -> None:
    response = await peer.call("chatty", {"steps": 2})
    assert text_of(response) == "chatty done"
    assert peer.notifications("notifications/progress") == []


async def test_a_crash_in_one_plugin_never_disturbs_another_plugins_call(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    make_plugin("probe", probe_plugins.PROBE, limits=PROBE_LIMITS)
    plugins = make_plugin("neighbour", probe_plugins.NEIGHBOUR, limits={"timeout_s": 10})
    async with open_toolcell(plugins, stderr_path=tmp_path / "daemon.log") as peer:
        await peer.initialize()
        waiting = await peer.start_call("wait_then_answer", {"seconds": 1.0})
        await trio.sleep(0.3)
        for code in (3, 9):
            assert_is_error(await peer.call("crash", {"code": code}))
        assert_is_error(await peer.call("garbage"))
        assert text_of(await peer.response(waiting)) == "neighbour answered"


async def test_deeply_nested_structured_output_fails_the_call_not_the_daemon(peer: StdioPeer) -> None:
    response = await peer.call("deep", {"depth": 400}, timeout=3)
    assert_is_error(response)
    await assert_still_serving(peer)


async def test_an_argument_the_worker_channel_cannot_carry_fails_only_its_call(peer: StdioPeer) -> None:
    response = await peer.call("add", {"a": 2**70, "b": 1}, timeout=5)
    assert "error" in response or response["result"].get("isError") is True
    await assert_still_serving(peer)


async def test_a_worker_killed_by_a_signal_from_outside_fails_only_its_call(peer: StdioPeer) -> None:
    slow_id = await peer.start_call("slow", {"seconds": 30}, token="k")
    os.kill(await reported_pid(peer, "k"), signal.SIGKILL)
    assert_is_error(await peer.response(slow_id))
    await assert_still_serving(peer)


async def test_the_daemon_exits_when_stdin_closes_while_a_replacement_worker_is_starting(peer: StdioPeer) -> None:
    assert_is_error(await peer.call("crash"))  # its worker is gone; a replacement is being started
    assert await peer.close(timeout=4) == 0


async def test_the_daemon_exits_cleanly_when_the_client_closes_stdin(peer: StdioPeer) -> None:
    workers = [c.pid for c in psutil.Process(peer.proc.pid).children(recursive=True)]
    assert workers
    assert await peer.close() == 0
    for pid in workers:
        await wait_gone(pid, timeout=5)
    assert all(process_gone(pid) for pid in workers)


# -- resource limits ---------------------------------------------------------------------------------

LIMITS = {"timeout_s": 10, "memory_mb": 64, "cpu_s": 1, "max_open_files": 32, "max_file_size_mb": 1,
          "max_concurrency": 1}


@pytest.fixture
async def limited(make_plugin: Callable[..., Path], tmp_path: Path) -> AsyncIterator[StdioPeer]:
    plugins = make_plugin("limited", probe_plugins.LIMITED, limits=LIMITS)
    async with open_toolcell(plugins, stderr_path=tmp_path / "daemon.log") as p:
        await p.initialize("2025-11-25")
        yield p


async def test_a_tool_over_its_memory_limit_fails_only_its_call(limited: StdioPeer) -> None:
    # RLIMIT_AS is memory_mb plus a fixed slack for the interpreter's virtual mappings.
    assert_is_error(await limited.call("hog", {"mb": 2048}), "MemoryError")
    assert text_of(await limited.call("hog", {"mb": 8})) == f"allocated {8 * 1024 * 1024}"


async def test_a_tool_over_its_cpu_limit_is_stopped_and_the_next_call_works(limited: StdioPeer) -> None:
    assert_is_error(await limited.call("spin"), "CPU")
    assert text_of(await limited.call("fine")) == "fine"


async def test_a_tool_over_its_open_files_limit_fails_only_its_call(limited: StdioPeer) -> None:
    assert_is_error(await limited.call("open_many", {"count": 100}), "Too many open files")
    assert text_of(await limited.call("open_many", {"count": 5})) == "opened 5"


async def test_a_tool_over_its_file_size_limit_fails_only_its_call(limited: StdioPeer) -> None:
    assert_is_error(await limited.call("write_big", {"mb": 4}), "File too large")
    assert text_of(await limited.call("fine")) == "fine"


# -- refused plugins ----------------------------------------------------------------------------------


async def test_broken_plugins_are_refused_and_the_others_keep_serving(make_plugin: Callable[..., Path],
                                                                      tmp_path: Path) -> None:
    make_plugin("raises", "import nonexistent_module_for_tests\n")
    make_plugin("exits", "import os\nos._exit(3)\n")
    make_plugin("badschema", """
from sandbox import tool


@tool(input_schema={"type": "object", "properties": {"x": {"$ref": "http://example.com/x.json"}}})
def remote(x: str) -> str:
    return x
""")
    plugins = make_plugin("good", probe_plugins.NEIGHBOUR)
    log = tmp_path / "daemon.log"
    async with open_toolcell(plugins, stderr_path=log) as peer:
        await peer.initialize()
        listed = await peer.request("tools/list", {})
        assert [t["name"] for t in listed["result"]["tools"]] == ["wait_then_answer"]
        assert text_of(await peer.call("wait_then_answer", {"seconds": 0})) == "neighbour answered"
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    refused = {r["plugin"]: " ".join(r["problems"]) for r in records if r.get("event") == "plugin_refused"}
    assert set(refused) == {"raises", "exits", "badschema"}
    assert "nonexistent_module_for_tests" in refused["raises"]
    assert "remote $ref" in refused["badschema"]


# -- what a worker process sees ------------------------------------------------------------------------


async def test_a_worker_sees_only_the_allowlisted_and_fixed_environment(make_plugin: Callable[..., Path],
                                                                        tmp_path: Path) -> None:
    plugins = make_plugin("introspect", probe_plugins.INTROSPECT,
                          manifest={"env": {"allow": ["TOOLCELL_TEST_ALLOWED"], "set": {"FIXED_VAR": "fixed"}}})
    env = {"TOOLCELL_TEST_ALLOWED": "yes", "TOOLCELL_TEST_SECRET": "hunter2"}
    async with open_toolcell(plugins, stderr_path=tmp_path / "daemon.log", env=env) as peer:
        await peer.initialize()
        seen = (await peer.call("environment"))["result"]["structuredContent"]
    assert seen["TOOLCELL_TEST_ALLOWED"] == "yes"
    assert seen["FIXED_VAR"] == "fixed"
    assert "TOOLCELL_TEST_SECRET" not in seen
    assert "hunter2" not in json.dumps(seen)


async def test_a_pooled_worker_serves_many_calls_and_a_per_call_plugin_gets_a_fresh_process_each_time(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    make_plugin("pooled", probe_plugins.INTROSPECT, prefix="pooled_", limits={"max_concurrency": 1})
    plugins = make_plugin("fresh", probe_plugins.INTROSPECT, prefix="fresh_", manifest={"isolation": "per_call"})
    async with open_toolcell(plugins, stderr_path=tmp_path / "daemon.log") as peer:
        await peer.initialize()
        pooled = [text_of(await peer.call("pooled_remember")) for _ in range(3)]
        fresh = [text_of(await peer.call("fresh_remember")) for _ in range(3)]
    assert [p.split(":")[1] for p in pooled] == ["1", "2", "3"]
    assert len({p.split(":")[0] for p in pooled}) == 1
    assert [f.split(":")[1] for f in fresh] == ["1", "1", "1"]  # no state survives a call
    assert len({f.split(":")[0] for f in fresh}) == 3


async def test_a_call_batched_behind_one_whose_worker_retires_runs_on_a_new_worker(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    """A worker retires after a call that left a thread behind; the call batched behind it never
    started there, so it goes back to the queue and runs (it used to be failed "the worker retired")."""
    plugins = make_plugin("retiring", probe_plugins.RETIRING, prefix="r_",
                          limits={"timeout_s": 10, "max_concurrency": 1, "cpu_s": 10})
    async with open_toolcell(plugins, stderr_path=tmp_path / "daemon.log") as peer:
        await peer.initialize("2025-11-25")
        first_pid = text_of(await peer.call("r_whoami"))
        held = await peer.start_call("r_hold", {"seconds": 1.0})
        await trio.sleep(0.2)
        leaving = await peer.start_call("r_leave_thread")  # both queue behind the held call,
        after = await peer.start_call("r_whoami")  # and go to the worker as one batch
        assert text_of(await peer.response(held, 20)) == "held"
        assert text_of(await peer.response(leaving, 20)) == "thread left"
        response = await peer.response(after, 20)
    assert "isError" not in response["result"], response
    assert text_of(response) not in ("", first_pid)  # run by a new worker


async def test_descriptors_a_starting_worker_passes_are_not_kept(make_plugin: Callable[..., Path],
                                                                 tmp_path: Path) -> None:
    """Before it is ready a worker may pass one descriptor (its egress listener); the daemon used to
    keep every one it was sent until the frame ended, so a plugin's import could fill the daemon's
    descriptor table (here 1,600 of them; a frame that never ends kept them for good)."""
    make_plugin("probe", probe_plugins.PROBE, limits=PROBE_LIMITS)
    plugins = make_plugin("pusher", probe_plugins.FD_PUSHER, prefix="p_")
    async with open_toolcell(plugins, stderr_path=tmp_path / "daemon.log") as peer:
        daemon = psutil.Process(peer.proc.pid)
        peak = 0
        with trio.fail_after(30):
            while "pusher" not in peer.stderr_path.read_text():  # until the pusher's start is refused
                peak = max(peak, daemon.num_fds())
                await trio.sleep(0.02)
        peak = max(peak, daemon.num_fds())
        await peer.initialize("2025-11-25")
        await assert_still_serving(peer)
    assert peak < 100, peak  # the daemon holds under 20 here; it held 400+ of the pusher's 1,600


async def test_a_folder_whose_manifest_cannot_be_read_is_refused_at_start_and_on_reload(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    """A plugin.toml with a 5,000-digit number (ValueError in tomllib) or a nesting too deep for it
    (RecursionError) used to escape the loader: at start `toolcell list` crashed, and dropped in
    beside a serving plugin it stopped the daemon on the hot reload."""
    plugins = make_plugin("probe", probe_plugins.PROBE, limits=PROBE_LIMITS)
    digits = plugins / "digits"
    digits.mkdir()
    (digits / "plugin.toml").write_text('name = "digits"\nversion = "1"\nentry = "x"\n[limits]\ntimeout_s = '
                                        + "9" * 5000 + "\n")
    log = tmp_path / "daemon.log"
    async with open_toolcell(plugins, stderr_path=log, watch=True) as peer:
        await peer.initialize("2025-11-25")
        await assert_still_serving(peer)
        deep = plugins / "deep"
        deep.mkdir()
        (deep / "plugin.toml").write_text("x = " + "[" * 3000 + "]" * 3000 + "\n")
        with trio.fail_after(20):
            while '"plugin":"deep"' not in log.read_text():
                await trio.sleep(0.1)
        await assert_still_serving(peer)
    text = log.read_text()
    assert "not valid TOML" in text and "nested too deeply" in text
