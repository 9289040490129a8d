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


async def settled(daemon_pid: int, baseline: int, timeout_s: float = 15.0) -> tuple[int, list[int]]:
    """Wait until the daemon has as many descendants as at the baseline and no zombie."""
    count, zombies = -1, []
    with trio.move_on_after(timeout_s):
        while True:
            zombies = zombies_under(daemon_pid)
            count = len(psutil.Process(daemon_pid).children(recursive=True))  # zombies included
            if not zombies and count <= baseline:
                break
            await trio.sleep(0.1)
    return count, zombies


async def test_random_worker_kills_lose_no_call_and_leave_no_zombie(make_plugin: Callable[..., Path],
                                                                    tmp_path: Path) -> None:
    plugins = make_plugin("faulty", PLUGIN, limits={"timeout_s": 10, "max_concurrency": 4, "max_queue": 4096})
    rng = random.Random(7)
    async with open_toolcell(plugins, policy="strict", stderr_path=tmp_path / "daemon.log") as peer:
        await peer.initialize("2025-11-25")
        # Grow the pool to its size first, so that the baseline counts every worker it will have.
        warm = [await peer.start_call("work", {"ms": 200}) for _ in range(16)]
        for request_id in warm:
            assert (await peer.response(request_id))["result"]["content"][0]["text"] == "done"
        daemon_pid = peer.proc.pid
        await trio.sleep(1.0)
        baseline = len(psutil.Process(daemon_pid).children(recursive=True))
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
        again = await peer.call("work", {"ms": 1})
        assert again["result"]["content"][0]["text"] == "done"
        count, zombies = await settled(daemon_pid, baseline)
        assert not zombies, f"zombies under the running daemon: {zombies}"
        assert count <= baseline, f"{count} processes under the daemon, {baseline} at the start"
