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
