"""Fault injection: workers SIGKILLed at random while thousands of calls run.

Every call is answered exactly once (a result, or an error that says what happened), the pool comes
back, and the daemon's process table returns to its baseline with no zombie while it still runs."""

from __future__ import annotations

import os
import random
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from stdio_peer import open_toolcell  # noqa: E402

PLUGIN = r'''
import time
from sandbox import tool


@tool
def work(ms: int = 2) -> str:
    """Sleep a little, then answer."""
    time.sleep(ms / 1000)
    return "done"
'''

CALLS = 2048
CONCURRENCY = 32


def zombies_under(pid: int) -> list[int]:
    out = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                out.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def worker_pids(daemon_pid: int) -> list[int]:
    out = []
    for child in psutil.Process(daemon_pid).children():
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.append(child.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def leftovers(daemon_pid: int, max_workers: int) -> list[str]:
    """What should not be under a daemon whose pool is idle: zombies, more worker processes than the
    pool and its spare, anything inside a worker beyond its pid-1 process (an idle pooled worker is
    its outer reaper and pid 1, nothing else)."""
    problems = [f"zombie {pid}" for pid in zombies_under(daemon_pid)]
    try:
        direct = psutil.Process(daemon_pid).children()
    except psutil.Error:
        return problems
    if len(direct) > max_workers + 1:
        problems.append(f"{len(direct)} direct children for a pool of {max_workers} and one spare")
    for child in direct:
        try:
            below = child.children(recursive=True)
        except psutil.Error:
            continue
        if len(below) > 1:
            problems.append(f"worker {child.pid} has {len(below)} processes under it: {[p.pid for p in below]}")
    return problems


async def settled(daemon_pid: int, max_workers: int, timeout_s: float = 15.0) -> list[str]:
    problems: list[str] = []
    with trio.move_on_after(timeout_s):
        while True:
            problems = leftovers(daemon_pid, max_workers)
            if not problems:
                break
            await trio.sleep(0.1)
    return problems


async def test_random_worker_kills_lose_no_call_and_leave_no_zombie(make_plugin: Callable[..., Path],
                                                                    tmp_path: Path) -> None:
    plugins = make_plugin("faulty", PLUGIN, limits={"timeout_s": 10, "max_concurrency": 4, "max_queue": 4096})
    rng = random.Random(7)
    async with open_toolcell(plugins, policy="strict", stderr_path=tmp_path / "daemon.log") as peer:
        await peer.initialize("2025-11-25")
        warm = [await peer.start_call("work", {"ms": 200}) for _ in range(16)]
        for request_id in warm:
            assert (await peer.response(request_id))["result"]["content"][0]["text"] == "done"
        daemon_pid = peer.proc.pid
        answers: dict[object, int] = {}
        kills = 0
        ids: list[object] = []

        async def killer(cancel: trio.CancelScope) -> None:
            nonlocal kills
            with cancel:
                while True:
                    await trio.sleep(0.1)
                    victims = worker_pids(daemon_pid)
                    if victims:
                        try:
                            os.kill(rng.choice(victims), signal.SIGKILL)
                            kills += 1
                        except ProcessLookupError:
                            pass

        async def client() -> None:
            for _ in range(CALLS // CONCURRENCY):
                request_id = await peer.start_call("work", {"ms": 2})
                ids.append(request_id)
                response = await peer.response(request_id, timeout=60)
                assert "result" in response or "error" in response, response
                if "result" in response and response["result"].get("isError"):
                    text = response["result"]["content"][0]["text"]
                    assert "killed by SIGKILL" in text or "exited" in text or "crashed" in text, text

        cancel = trio.CancelScope()
        sends = trio.Lock()
        original_start = peer.start_call

        async def locked_start(*args: object, **kwargs: object) -> object:
            async with sends:
                return await original_start(*args, **kwargs)  # type: ignore[arg-type]

        peer.start_call = locked_start  # type: ignore[method-assign]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(killer, cancel)
            async with trio.open_nursery() as clients:
                for _ in range(CONCURRENCY):
                    clients.start_soon(client)
            cancel.cancel()
        for message in peer.messages:
            if "id" in message and ("result" in message or "error" in message):
                answers[message["id"]] = answers.get(message["id"], 0) + 1
        assert kills > 10, "the killer did not get to kill anything"
        assert len(ids) == (CALLS // CONCURRENCY) * CONCURRENCY
        assert all(answers.get(i) == 1 for i in ids), "a call was answered not exactly once"
        # The killer's last SIGKILL can land on an idle worker just before it stopped: a call sent
        # there before the pool hears of the death fails like any call on a killed worker. The
        # daemon must go on serving: a few tries, each either done or that failure.
        for _ in range(5):
            again = await peer.call("work", {"ms": 1})
            text = again["result"]["content"][0]["text"]
            if text == "done":
                break
            assert again["result"].get("isError") and "killed by SIGKILL" in text, again
        assert text == "done", again
        problems = await settled(daemon_pid, max_workers=4)
        assert not problems, f"left under the running daemon: {problems}"
