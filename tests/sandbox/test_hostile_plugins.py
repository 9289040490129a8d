"""A hostile plugin attacks the trusted side: everything a worker sends is untrusted input.

Each test runs a real ``toolcell serve --stdio`` under the default ``strict`` policy (pooled and
per_call) with a plugin whose tools send values that are deep, huge, many or fast, or write
hand-made frames straight onto the worker's channel. The rule checked every time: that call fails
(or its notifications are cut to the call's budget) with a clear message, and the daemon keeps
serving the same plugin and another client.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from hostile_plugin_source import HOSTILE
from stdio_peer import StdioPeer, open_toolcell, text_of

LIMITS = {"timeout_s": 8, "max_concurrency": 2, "max_output_bytes": 65536, "max_notification_bytes": 16384}


@pytest.fixture(params=["pooled", "per_call"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def plugins(make_plugin: Callable[..., Path], mode: str) -> Path:
    return make_plugin("hostile", HOSTILE, limits=LIMITS, manifest={"isolation": mode})


@pytest.fixture
async def peer(plugins: Path, tmp_path: Path) -> AsyncIterator[StdioPeer]:
    async with open_toolcell(plugins, policy="strict", stderr_path=tmp_path / "daemon.log") as p:
        await p.initialize("2025-11-25")  # a legacy client: every log level is sent by default
        yield p


async def still_serving(peer: StdioPeer) -> None:
    response = await peer.call("echo", {"text": "still here"})
    assert response["result"]["content"] == [{"type": "text", "text": "still here"}], response
    assert peer.proc.returncode is None


def failed_with(response: Any, *fragments: str) -> str:
    assert "error" not in response, response
    assert response["result"].get("isError") is True, response
    text = text_of(response)
    for fragment in fragments:
        assert fragment in text, text
    return text


def max_depth(value: Any) -> int:
    depth, stack = 0, [(value, 1)]
    while stack:
        item, d = stack.pop()
        depth = max(depth, d)
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return depth


async def test_a_deeply_nested_log_message_fails_its_call_not_the_daemon(peer: StdioPeer) -> None:
    response = await peer.call("deep_log", {"depth": 400})
    failed_with(response, "nested")
    for note in peer.notifications("notifications/message"):
        assert max_depth(note) < 100
    await still_serving(peer)


async def test_a_deeply_nested_structured_result_fails_its_call(peer: StdioPeer) -> None:
    response = await peer.call("deep_result", {"depth": 400})
    failed_with(response, "nested")
    await still_serving(peer)


async def test_a_log_nested_within_the_limit_is_delivered(peer: StdioPeer) -> None:
    response = await peer.call("deep_log", {"depth": 10})
    assert response["result"]["content"] == [{"type": "text", "text": "logged"}], response
    assert peer.notifications("notifications/message"), "the shallow log message was not relayed"


@pytest.mark.parametrize("kind, fragment", [
    ("deep_log", "malformed"),        # decodable but too deep to relay
    ("bad_key_log", "malformed"),     # a map key that is not a string
    ("ext_log", "malformed"),         # a msgpack extension type JSON cannot carry
    ("nan_progress", "malformed"),    # NaN / infinity as progress
    ("bad_level", "malformed"),       # a log level outside the table
    ("surrogate_log", "malformed"),   # invalid UTF-8 in a string
    ("wrong_id_log", "unexpected"),   # a frame for a call it was not given
    ("ready_again", "unexpected"),    # a start-up frame in the middle of a call
    ("truncated", "timed out"),       # a frame that never completes: the deadline ends the call
    ("returned_early", "returned before"),  # "the call returned" before its answer
])
async def test_a_hand_made_frame_fails_its_call_and_recycles_the_worker(peer: StdioPeer, mode: str, kind: str,
                                                                       fragment: str) -> None:
    first = await peer.call("raw_frames", {"kind": kind}, timeout=30)
    if mode == "per_call" and kind == "truncated":
        # per_call: the call's process exits with the frame unfinished; the relay reports that.
        failed_with(first, "without a result")
    elif mode == "per_call" and not first["result"].get("isError"):
        # per_call: the relay process between the call's process and the daemon forwards only frames it
        # can decode that belong to the running call; the rest never reach the daemon.
        assert kind in ("deep_log", "surrogate_log", "wrong_id_log", "ready_again", "returned_early"), first
        assert not peer.notifications("notifications/message")
    else:
        failed_with(first, fragment)
    await still_serving(peer)


async def test_a_plugin_sees_only_its_stdio_and_its_ipc_channel(peer: StdioPeer, mode: str) -> None:
    # The whole list of descriptors plugin code may see, pooled and per_call: stdin (/dev/null), stdout
    # and stderr (pipes to the daemon's log) and the one socket its tool's frames go out on (pooled: the
    # worker's IPC socket to the daemon, fd 3; per_call: the call process's socket to its relay). Nothing
    # the worker's own runtime holds (the call guard's views of /proc, the zygote's control socket, the
    # relay's daemon channel) may be among them: plugin code runs in the same process and could use it.
    for _ in range(2):  # and again on a worker that has already served a call
        response = await peer.call("fd_list", {})
        fds = response["result"]["structuredContent"]
        assert set(fds) - {"0", "1", "2"} and len(fds) == 4, fds
        ipc = (set(fds) - {"0", "1", "2"}).pop()
        assert fds[ipc].startswith("socket:"), fds
        assert fds["0"] == "/dev/null" and fds["1"].startswith("pipe:") and fds["2"].startswith("pipe:"), fds
        if mode == "pooled":
            assert ipc == "3", fds


async def test_a_call_that_answers_early_keeps_its_worker_busy_until_its_deadline_kills_it(
        make_plugin: Callable[..., Path], mode: str, tmp_path: Path) -> None:
    # Plugin code writes a valid Result for its call straight onto the IPC channel, then runs on. The
    # answer reaches the client, but only the worker's runtime frees the worker (sandbox.wire,
    # CallReturned): until then no other call lands on it and the call's deadline runs; at the deadline
    # (2 s, long before the 60 s sleep ends) the worker is killed. per_call: the call's process never
    # speaks to the daemon, its relay does; it relays that Result and ends the process at once.
    plugins = make_plugin("hostile", HOSTILE, limits={**LIMITS, "timeout_s": 2}, manifest={"isolation": mode})
    async with open_toolcell(plugins, policy="strict", stderr_path=tmp_path / "daemon.log") as peer:
        await peer.initialize("2025-11-25")
        forger = await peer.start_call("forge_result", {"sleep_s": 60})
        forged = await peer.response(forger, timeout=30)
        assert text_of(forged).startswith("forged by "), forged
        forger_instance = text_of(forged).split()[-1]
        for _ in range(6):
            response = await peer.call("instance", {}, timeout=30)
            assert not response["result"].get("isError"), response
            if mode == "pooled":
                assert text_of(response) != forger_instance, "a call landed on the worker whose call still runs"
        log = tmp_path / "daemon.log"
        if mode == "pooled":
            with trio.fail_after(30):
                while "timed out after 2 s" not in log.read_text(errors="replace"):
                    await trio.sleep(0.1)
            assert "worker_killed_after_answer" in log.read_text(errors="replace")
        else:
            assert "worker_killed_after_answer" not in log.read_text(errors="replace")
        await still_serving(peer)


async def test_a_second_answer_to_a_call_ends_its_worker(
        make_plugin: Callable[..., Path], mode: str, tmp_path: Path) -> None:
    # A forged Result, then the runtime's own when the tool returns: two answers to one call are a
    # protocol violation, and the worker is killed (per_call: the relay forwards only the first).
    plugins = make_plugin("hostile", HOSTILE, limits=LIMITS, manifest={"isolation": mode})
    async with open_toolcell(plugins, policy="strict", stderr_path=tmp_path / "daemon.log") as peer:
        await peer.initialize("2025-11-25")
        forged = await peer.call("forge_result", {"sleep_s": 0.2}, timeout=30)
        assert text_of(forged).startswith("forged by "), forged
        forger_instance = text_of(forged).split()[-1]
        log = tmp_path / "daemon.log"
        if mode == "pooled":
            with trio.fail_after(30):
                while "answered the same call twice" not in log.read_text(errors="replace"):
                    await trio.sleep(0.1)
        for _ in range(3):
            response = await peer.call("instance", {}, timeout=30)
            assert not response["result"].get("isError"), response
            if mode == "pooled":
                assert text_of(response) != forger_instance, response
        await still_serving(peer)


async def test_a_forged_result_returned_frame_is_only_what_pooled_code_could_forge_anyway(
        make_plugin: Callable[..., Path], mode: str, tmp_path: Path) -> None:
    # ResultReturned is a Result and its CallReturned in one frame (sandbox.wire). Pooled, plugin code
    # can write it as it can write those two (the documented limit): the client gets the forged answer
    # and the runtime's own answer after it, for a call the worker no longer has, ends the worker. per_call, the relay between the call's
    # process and the daemon passes only Result (and progress/log/ask), so the forged frame never
    # reaches the daemon: the client gets the tool's real answer, and only the relay frees the worker.
    plugins = make_plugin("hostile", HOSTILE, limits=LIMITS, manifest={"isolation": mode})
    async with open_toolcell(plugins, policy="strict", stderr_path=tmp_path / "daemon.log") as peer:
        await peer.initialize("2025-11-25")
        answer = await peer.call("forge_result", {"sleep_s": 0.2, "merged": True}, timeout=30)
        log = tmp_path / "daemon.log"
        if mode == "pooled":
            assert text_of(answer).startswith("forged by "), answer
            with trio.fail_after(30):  # the forged frame freed the worker: the real answer is for no call
                while "answered a call it was not given" not in log.read_text(errors="replace"):
                    await trio.sleep(0.1)
        else:
            assert text_of(answer) == "returned", answer
            assert "answered the same call twice" not in log.read_text(errors="replace")
        for _ in range(3):
            response = await peer.call("instance", {}, timeout=30)
            assert not response["result"].get("isError"), response
        await still_serving(peer)


async def test_a_log_flood_is_cut_to_the_call_budget_and_the_daemon_stays_small(peer: StdioPeer) -> None:
    daemon = psutil.Process(peer.proc.pid)
    await still_serving(peer)
    before = daemon.memory_info().rss
    # 20,000 messages of 32 KiB: 640 MiB if the daemon relayed (and buffered) them all.
    response = await peer.call("log_flood", {"count": 20000, "size": 32768}, timeout=60)
    grown_mib = (daemon.memory_info().rss - before) / (1 << 20)
    assert grown_mib < 96, f"the daemon grew by {grown_mib:.0f} MiB"
    notes = [n for n in peer.notifications("notifications/message")]
    sent = sum(len(str(n)) for n in notes)
    assert sent < 4 << 20, f"{sent} bytes of log notifications reached the client"
    # Either the call finished with its notifications cut, or it was stopped as a flood.
    if response["result"].get("isError"):
        failed_with(response, "limit")
    assert "notification_budget_exhausted" in peer.stderr()
    await still_serving(peer)


async def test_a_progress_flood_is_cut_to_the_call_budget(peer: StdioPeer) -> None:
    response = await peer.call("progress_flood", {"count": 5000, "size": 200000}, token="p1", timeout=60)
    notes = [n for n in peer.notifications("notifications/progress") if n["params"]["progressToken"] == "p1"]
    assert sum(len(str(n)) for n in notes) < 4 << 20
    for note in notes:
        assert len(note["params"].get("message", "")) <= 16384
    assert "isError" in response["result"] or response["result"]["content"]
    await still_serving(peer)


async def test_calls_running_beside_a_hostile_one_are_not_disturbed(peer: StdioPeer) -> None:
    hostile = [await peer.start_call("raw_frames", {"kind": "deep_log"}),
               await peer.start_call("log_flood", {"count": 3000, "size": 30000})]
    for i in range(10):
        response = await peer.call("echo", {"text": f"bystander {i}"})
        assert response["result"]["content"] == [{"type": "text", "text": f"bystander {i}"}], response
    for request_id in hostile:
        assert "result" in await peer.response(request_id, timeout=30)
    await still_serving(peer)


UNIX_CLIENT = r'''
import socket

from sandbox import tool


@tool
def connect_unix(path: str) -> str:
    """Connect to a path-based unix socket of the host and read its greeting."""
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(path)
        return "connected: " + s.recv(64).decode()
    except OSError as exc:
        return f"refused: {type(exc).__name__}: {exc}"


@tool
def pair() -> str:
    """socketpair still works (it reaches nothing)."""
    a, b = socket.socketpair()
    a.sendall(b"ok")
    return b.recv(2).decode()
'''


@pytest.fixture
def host_socket(tmp_path: Path) -> Iterator[str]:
    """A world-writable listening unix socket in a host folder every worker can see (/run), as a
    database's or a container engine's would be; it greets whoever connects."""
    path = f"/run/toolcell-test-{os.getpid()}-{tmp_path.name[-12:]}.sock"
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
    try:
        yield path
    finally:
        stop.set()
        thread.join(2)
        server.close()
        os.unlink(path)


@pytest.mark.parametrize("policy", ["strict", "none"])
async def test_a_host_unix_socket_is_out_of_reach_under_strict(make_plugin: Callable[..., Path], tmp_path: Path,
                                                               host_socket: str, mode: str, policy: str) -> None:
    plugins = make_plugin("unixclient", UNIX_CLIENT, manifest={"isolation": mode}, root=f"u-{mode}")
    async with open_toolcell(plugins, policy=policy, stderr_path=tmp_path / "d.log") as peer:
        await peer.initialize()
        text = text_of(await peer.call("connect_unix", {"path": host_socket}))
        if policy == "none":
            # The canary: unsandboxed, the same attack succeeds, so the test can see its own success.
            assert text == "connected: host secret service", text
        else:
            assert text.startswith("refused: PermissionError"), text
        assert text_of(await peer.call("pair")) == "ok"
