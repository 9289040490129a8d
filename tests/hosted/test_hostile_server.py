"""A hostile MCP server is contained exactly like a hostile plugin.

The server (``hostile_server.py``, standard library only) runs as a hosted server under ``strict``;
each attack on the host is also run under ``none`` (the canary), where it must succeed, which proves
the attack can see its own success (as ``tests/sandbox/test_attacks.py`` does for plugins). Attacks on
the daemon (floods, garbage, deep and huge messages, a stuck server) must fail that call, or end and
restart that server, and never the daemon: the daemon answers the next call.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
from conftest import HOSTILE, PYTHON, connect, outcome, text, write_config

pytestmark = pytest.mark.filterwarnings("ignore:The logging capability is deprecated")
LIMITS = {"timeout_s": 8, "memory_mb": 128, "max_output_bytes": 1 << 20, "max_notification_bytes": 16384,
          "max_processes": 32}


@pytest.fixture
def hostile(make_server: Callable[..., Path]) -> Path:
    plugins = make_server("hostile", {"command": [PYTHON, "hostile_server.py"], "cancel_grace_s": 1.0}, limits=LIMITS)
    copy = plugins / "hostile" / "hostile_server.py"  # the plugin folder is readable by its server, the repo is not
    shutil.copy(HOSTILE, copy)
    copy.chmod(0o644)
    return plugins


@pytest.fixture
def host_secret() -> Iterator[str]:
    path = f"/var/tmp/toolcell-hosted-secret-{uuid.uuid4().hex}"
    with open(path, "w") as f:
        f.write("host-secret")
    os.chmod(path, 0o644)
    yield path
    os.unlink(path)


@pytest.fixture
def host_socket(tmp_path: Path) -> Iterator[str]:
    path = f"/run/toolcell-hosted-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    os.chmod(path, 0o777)
    server.listen(8)
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            conn.sendall(b"host secret service")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path
    stop.set()
    thread.join(2)
    server.close()
    os.unlink(path)


@pytest.fixture
def tcp_listener() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    yield srv.getsockname()[1]
    srv.close()


def expect(policy: str, got: dict[str, Any]) -> None:
    if policy == "strict":
        assert not got["ok"], f"attack succeeded under strict: {got['detail']}"
    else:
        assert got["ok"], f"canary: the attack could not detect its own success: {got['detail']}"


@pytest.mark.parametrize("policy", ["strict", "none"])
async def test_attacks_on_the_host_are_refused_by_the_sandbox(
        hostile: Path, state_dir: Path, tmp_path: Path, policy: str, host_secret: str, host_socket: str,
        tcp_listener: int) -> None:
    written = f"/var/tmp/toolcell-hosted-written-{uuid.uuid4().hex}"
    victim = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        async with connect(hostile, write_config(tmp_path, state_dir), tmp_path / "d.log", policy=policy) as client:
            expect(policy, outcome(await client.call_tool("read_file", {"path": host_secret})))
            expect(policy, outcome(await client.call_tool("write_file", {"path": written})))
            assert os.path.exists(written) == (policy == "none")
            expect(policy, outcome(await client.call_tool("tcp_connect", {"port": tcp_listener})))
            expect(policy, outcome(await client.call_tool("unix_connect", {"path": host_socket})))
            expect(policy, outcome(await client.call_tool("fork_bomb", {"n": 100})))
            expect(policy, outcome(await client.call_tool("ptrace_parent", {"pid": victim.pid})))
    finally:
        # Reaped only once its tracer (the canary's server) is gone, with the daemon.
        victim.kill()
        victim.wait(timeout=30)
        if os.path.exists(written):
            os.unlink(written)


async def test_a_server_cannot_reach_its_supervisor_and_holds_only_its_stdio(
        hostile: Path, state_dir: Path, tmp_path: Path) -> None:
    # The supervisor (the server's parent: pid 1 of the sandbox, ``sandbox.hosted``) holds the IPC
    # socket to the daemon. It is undumpable and has closed that socket, so the server (same uid,
    # same namespaces) can take neither its descriptors nor its memory. The control (the server's own
    # child) proves each probe can see its own success inside the same sandbox.
    async with connect(hostile, write_config(tmp_path, state_dir), tmp_path / "d.log") as client:
        control = outcome(await client.call_tool("reach_process", {"target": "child"}))
        assert control["ok"], f"control: the probe could not reach its own child: {control['detail']}"
        got = outcome(await client.call_tool("reach_process", {"target": "parent"}))
        assert not got["ok"], f"the server reached its supervisor: {got['detail']}"
        fds = json.loads(text(await client.call_tool("own_fds", {})))
        # stdin and stdout: the daemon's MCP pipes; stderr: the daemon's log pipe. Nothing else.
        assert sorted(fds) == ["0", "1", "2"], fds
        assert all(target.startswith("pipe:") for target in fds.values()), fds


async def test_a_memory_bomb_kills_only_that_server_and_it_comes_back(
        hostile: Path, state_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "d.log"
    async with connect(hostile, write_config(tmp_path, state_dir), log) as client:
        bomb = await client.call_tool("memory_bomb", {"mb": 512})
        assert bomb.is_error and "ran out of memory" in text(bomb), text(bomb)
        assert text(await client.call_tool("echo", {"text": "still here"})) == "still here"


@pytest.mark.parametrize("tool, args, fragment", [
    ("flood_stdout", {"mb": 64}, "limit"),          # one endless line: over the line cap, the server is restarted
    ("huge_line", {"mb": 4}, "limit"),              # a result over the cap
    ("deep_result", {"depth": 400}, "malformed"),   # nested beyond what the daemon relays
    ("bad_result", {}, "malformed"),                # content that is not a list
])
async def test_what_the_daemon_cannot_use_fails_that_call_and_the_daemon_serves_on(
        hostile: Path, state_dir: Path, tmp_path: Path, tool: str, args: dict[str, Any], fragment: str) -> None:
    log = tmp_path / "d.log"
    async with connect(hostile, write_config(tmp_path, state_dir), log) as client:
        bad = await client.call_tool(tool, args)
        assert bad.is_error and fragment in text(bad), text(bad)
        with trio.fail_after(30):
            assert text(await client.call_tool("echo", {"text": "still here"})) == "still here"


async def test_garbage_lines_and_log_floods_are_dropped_within_budget(
        hostile: Path, state_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "d.log"
    received: list[Any] = []

    async def on_log(params: Any) -> None:
        received.append(params)

    async with connect(hostile, write_config(tmp_path, state_dir), log, logging_callback=on_log) as client:
        garbage = await client.call_tool("garbage_lines", {"count": 20000})
        assert text(garbage) == "garbage sent"
        flood = await client.call_tool("log_flood", {"count": 3000, "size": 4000})
        assert text(flood) == "logged"
        assert text(await client.call_tool("echo", {"text": "still here"})) == "still here"
    assert 0 < len(received) < 3000, len(received)
    events = log.read_text()
    assert "notification_budget_exhausted" in events and "hosted_server_output_capped" in events
    assert len(events) < 8 << 20


async def test_an_overrunning_call_is_cancelled_and_a_server_that_stops_answering_is_restarted(
        hostile: Path, state_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "d.log"
    async with connect(hostile, write_config(tmp_path, state_dir), log) as client:
        slow = await client.call_tool("sleepy", {"seconds": 30})
        assert slow.is_error and "timed out after 8 s" in text(slow), text(slow)
        # It complied (answers pings): the same server serves on.
        assert text(await client.call_tool("echo", {"text": "same server"})) == "same server"
        assert "hosted_server_exited" not in log.read_text()
        stuck = await client.call_tool("hang", {})
        assert stuck.is_error and "timed out" in text(stuck), text(stuck)
        with trio.fail_after(30):
            while "hosted_server_unresponsive" not in log.read_text():
                await trio.sleep(0.2)
        assert text(await client.call_tool("echo", {"text": "a new server"})) == "a new server"


async def test_list_changed_from_the_server_reaches_the_client(
        hostile: Path, state_dir: Path, tmp_path: Path) -> None:
    changed = trio.Event()

    async def on_message(message: Any) -> None:
        if "ToolListChanged" in type(getattr(message, "root", message)).__name__ or "list_changed" in repr(message):
            changed.set()

    async with connect(hostile, write_config(tmp_path, state_dir), tmp_path / "d.log",
                       message_handler=on_message) as client:
        before = {t.name for t in (await client.list_tools()).tools}
        assert "brand_new" not in before
        assert text(await client.call_tool("add_tool", {"name": "brand_new"})) == "added"
        with trio.fail_after(20):
            await changed.wait()
        after = {t.name for t in (await client.list_tools(cache_mode="refresh")).tools}
        assert "brand_new" in after


async def test_a_client_cancellation_is_forwarded_to_the_server_which_serves_on(
        hostile: Path, state_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "d.log"
    async with connect(hostile, write_config(tmp_path, state_dir), log) as client:
        with trio.move_on_after(1.5):
            await client.call_tool("sleepy", {"seconds": 30})
            raise AssertionError("the slow call returned")
        with trio.fail_after(20):
            while True:
                cancels = json.loads(text(await client.call_tool("cancels", {})))
                if cancels:
                    break
                await trio.sleep(0.1)
        assert len(cancels) == 1 and isinstance(cancels[0], int)
        assert text(await client.call_tool("echo", {"text": "same server"})) == "same server"
    assert "hosted_server_exited" not in log.read_text()


def _hostile_with(make_server: Callable[..., Path], name: str, mode: str = "", limits: dict[str, Any] | None = None,
                  server: dict[str, Any] | None = None) -> Path:
    """A plugin folder serving hostile_server.py in ``mode`` (see its MODE), with ``limits`` over LIMITS."""
    plugins = make_server(name, {"command": [PYTHON, "hostile_server.py", *([mode] if mode else [])],
                                 "cancel_grace_s": 1.0, **(server or {})}, limits={**LIMITS, **(limits or {})})
    copy = plugins / name / "hostile_server.py"
    shutil.copy(HOSTILE, copy)
    copy.chmod(0o644)
    return plugins


async def test_a_call_started_when_another_times_out_still_has_its_deadline(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    """One call at a time: the first overruns and times out; the watchdog's pass that ends it starts
    the second (queued) call. That call's deadline must hold too (it used to be set where the
    watchdog never looked, and the call ran for as long as the server liked)."""
    plugins = _hostile_with(make_server, "one_at_a_time", limits={"timeout_s": 2, "max_concurrency": 1})
    took: dict[str, tuple[float, str]] = {}
    async with connect(plugins, write_config(tmp_path, state_dir), tmp_path / "d.log") as client:
        async def call(tag: str, after_s: float) -> None:
            await trio.sleep(after_s)
            started = trio.current_time()
            result = await client.call_tool("sleepy", {"seconds": 12})
            took[tag] = (trio.current_time() - started, text(result))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "first", 0)
                nursery.start_soon(call, "second", 0.3)
    assert "timed out after 2 s" in took["first"][1], took
    assert "timed out after 2 s" in took["second"][1], took
    assert took["second"][0] < 7, took  # ~2 s queued behind the first, then its own 2 s


@pytest.mark.parametrize("mode", ["junk_tools", "bad_schemas"])
async def test_a_list_changed_flood_with_junk_tools_logs_a_bounded_number_of_lines(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path, mode: str) -> None:
    """970 malformed tools (or well-formed ones with schemas the daemon refuses) listed again on every
    list_changed (one per 50 ms): one summary line per listing, and listings that keep changing come
    ever further apart (they used to log a line per refused tool per listing, tens of thousands of
    lines in seconds)."""
    plugins = _hostile_with(make_server, "junk", mode)
    log = tmp_path / "d.log"
    async with connect(plugins, write_config(tmp_path, state_dir), log) as client:
        with trio.fail_after(30):
            assert text(await client.call_tool("flood_changed", {"count": 100, "gap": 0.05})) == "flooded"
        assert text(await client.call_tool("echo", {"text": "still here"})) == "still here"
    lines = log.read_text().splitlines()
    dropped = [line for line in lines if "hosted_tool_dropped" in line]
    assert 1 <= len(dropped) <= 6, len(dropped)
    assert '"dropped":970' in dropped[0], dropped[0]
    assert len(lines) < 200, len(lines)


async def test_a_list_changed_flood_with_flipping_tools_changes_the_catalog_a_bounded_number_of_times(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    """970 valid tools renamed on every listing, list_changed every 50 ms: relists back off (1 s, then
    doubling while the list keeps changing), so the catalog is rebuilt a few times, not every 50 ms."""
    plugins = _hostile_with(make_server, "flipper", "flip_tools")
    log = tmp_path / "d.log"
    async with connect(plugins, write_config(tmp_path, state_dir), log) as client:
        with trio.fail_after(30):
            assert text(await client.call_tool("flood_changed", {"count": 100, "gap": 0.05})) == "flooded"
        with trio.fail_after(5):
            assert text(await client.call_tool("echo", {"text": "still here"})) == "still here"
    changes = [line for line in log.read_text().splitlines() if "hosted_tools_changed" in line]
    assert 1 <= len(changes) <= 5, len(changes)


@pytest.mark.parametrize("mode, why", [
    ("relist_never", "did not answer tools/list within 3 s"),  # the relist gives up in start_timeout_s
    ("relist_deep", "nested deeper"),                           # a malformed answer fails the relist at once
])
async def test_a_relist_that_fails_gives_up_and_a_later_change_is_still_listed(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path, mode: str, why: str) -> None:
    plugins = _hostile_with(make_server, "relister", mode, server={"start_timeout_s": 3})
    log = tmp_path / "d.log"
    async with connect(plugins, write_config(tmp_path, state_dir), log) as client:
        assert text(await client.call_tool("flood_changed", {"count": 1})) == "flooded"
        assert text(await client.call_tool("echo", {"text": "serving"})) == "serving"
        with trio.fail_after(8):
            while why not in log.read_text():
                await trio.sleep(0.1)
        assert text(await client.call_tool("echo", {"text": "still serving"})) == "still serving"
        assert text(await client.call_tool("add_tool", {"name": "brand_new"})) == "added"
        with trio.fail_after(15):
            while "brand_new" not in {t.name for t in (await client.list_tools(cache_mode="refresh")).tools}:
                await trio.sleep(0.2)
    assert log.read_text().count("hosted_relist_failed") == 1


async def test_a_cancelled_calls_open_question_is_answered_at_the_server(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    """The client cancels a call while the server's question to it is open: the server hears an error
    for its question (it used to wait for an answer that never came)."""
    plugins = _hostile_with(make_server, "asked_then_cancelled")
    asked = trio.Event()
    release = trio.Event()

    async def elicit(context: Any, params: Any) -> Any:
        asked.set()
        await release.wait()
        raise RuntimeError("released")

    async with connect(plugins, write_config(tmp_path, state_dir), tmp_path / "d.log",
                       elicitation_callback=elicit) as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.call_tool, "ask_user", {})
            with trio.fail_after(15):
                await asked.wait()
            nursery.cancel_scope.cancel()
        with trio.fail_after(10):
            while not (answers := json.loads(text(await client.call_tool("answers", {})))):
                await trio.sleep(0.1)
        release.set()
    assert len(answers) == 1 and "cancelled" in answers[0]["error"]["message"], answers


async def test_a_timed_out_calls_late_question_is_not_put_to_the_next_call(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    """The first call times out; its server goes on and asks its question just after the second call
    started. That question is not the second call's: the server hears "which call", and the second
    call's own question (asked once the first call's late answer came) reaches the client."""
    plugins = _hostile_with(make_server, "late_asker", limits={"timeout_s": 3}, server={"cancel_grace_s": 2.0})
    asked: list[str] = []

    async def elicit(context: Any, params: Any) -> Any:
        from mcp import types

        asked.append(params.message)
        return types.ElicitResult(action="accept", content={"name": "Ada"})

    async with connect(plugins, write_config(tmp_path, state_dir), tmp_path / "d.log",
                       elicitation_callback=elicit) as client:
        first = await client.call_tool("ask_user", {"delay": 3.5, "message": "first"})
        assert first.is_error and "timed out" in text(first), text(first)
        second = await client.call_tool("ask_user", {"delay": 1.5, "message": "second"})
        answers = json.loads(text(await client.call_tool("answers", {})))
    assert asked == ["second"], asked
    assert json.loads(text(second))["result"]["content"] == {"name": "Ada"}, text(second)
    assert "which call" in answers[0]["error"]["message"], answers
