"""A call is the unit of limits and of lifetime: per-call CPU, nothing left running after a pooled
call, every kind of end reported by name, and a worker's outer reaper that never falls through."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from stdio_peer import StdioPeer, open_toolcell, process_gone, text_of  # noqa: E402

PLUGIN = r'''
import os
import resource
import sys
import threading
import time

from sandbox import tool

print(f"imported-as-pid {os.getpid()}", flush=True)
WORKER = os.urandom(8).hex()  # tells one worker (one import of the plugin) from another


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@tool
def burn(seconds: float) -> str:
    """Burn this much CPU time."""
    start = _cpu()
    while _cpu() - start < seconds:
        sum(range(10000))
    return f"burnt {seconds} pid={os.getpid()} ppid={os.getppid()}"


@tool
def whoami() -> str:
    """Identify the process serving the call."""
    return f"worker={WORKER}"


@tool
def leave_grandchild(seconds: int = 30) -> str:
    """Double-fork a process that outlives the call; report its pid."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(w, str(os.getpid()).encode())
            time.sleep(seconds)
        os._exit(0)
    os.waitpid(pid, 0)
    return "grandchild=" + os.read(r, 32).decode()


@tool
def leave_thread(seconds: int = 30) -> str:
    """Start a thread that keeps running after the call answered."""
    threading.Thread(target=time.sleep, args=(seconds,), daemon=True).start()
    return "thread left"


@tool
def eat_memory(mb: int) -> str:
    """Touch ``mb`` MiB of memory."""
    blocks = [bytearray(1 << 20) for _ in range(mb)]
    return f"held {len(blocks)}"


@tool
def fork_many(n: int) -> str:
    """Start ``n`` sleeping processes."""
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            time.sleep(5)
            os._exit(0)
        pids.append(pid)
    return f"forked {len(pids)}"
'''

LIMITS = {"timeout_s": 20, "cpu_s": 1, "max_concurrency": 1, "memory_mb": 128, "max_processes": 16}


@pytest.fixture(params=["pooled", "per_call"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def plugin(make_plugin: Callable[..., Path], mode: str) -> Path:
    return make_plugin("life", PLUGIN, limits=LIMITS, manifest={"isolation": mode})


def ok_text(response: dict) -> str:  # type: ignore[type-arg]
    assert "error" not in response, response
    assert not response["result"].get("isError"), response
    return text_of(response)


def error_text(response: dict) -> str:  # type: ignore[type-arg]
    assert "error" not in response, response
    assert response["result"].get("isError") is True, response
    return text_of(response)


async def test_cpu_s_is_a_budget_per_call_not_per_worker_life(make_plugin: Callable[..., Path], mode: str,
                                                              tmp_path: Path) -> None:
    async with open_toolcell(plugin(make_plugin, mode), policy="strict", stderr_path=tmp_path / "d.log") as peer:
        await peer.initialize()
        # Four calls of 0.6 s CPU: 2.4 s in all against a cpu_s of 1, and none over it alone.
        for _ in range(4):
            ok_text(await peer.call("burn", {"seconds": 0.6}, timeout=30))


async def test_a_call_over_its_cpu_budget_fails_with_the_cpu_limit_named(make_plugin: Callable[..., Path], mode: str,
                                                                        tmp_path: Path) -> None:
    async with open_toolcell(plugin(make_plugin, mode), policy="strict", stderr_path=tmp_path / "d.log") as peer:
        await peer.initialize()
        text = error_text(await peer.call("burn", {"seconds": 5}, timeout=30))
        assert "CPU limit" in text, text
        ok_text(await peer.call("burn", {"seconds": 0.1}))


async def test_a_pooled_call_that_leaves_a_process_running_retires_its_worker(make_plugin: Callable[..., Path],
                                                                             tmp_path: Path) -> None:
    async with open_toolcell(plugin(make_plugin, "pooled"), policy="strict", stderr_path=tmp_path / "d.log") as peer:
        await peer.initialize()
        before = ok_text(await peer.call("whoami"))
        old = serving_workers(peer)
        tree = old + [d for w in old for d in w.children(recursive=True)]
        ok_text(await peer.call("leave_grandchild"))
        after = ok_text(await peer.call("whoami"))
        assert before != after, "the next call ran in the worker whose call left a process running"
        assert "left 1 process(es) running" in peer.stderr() and "worker_retired" in peer.stderr()
        await assert_gone(tree)


async def test_a_pooled_call_that_leaves_a_thread_running_retires_its_worker(make_plugin: Callable[..., Path],
                                                                            tmp_path: Path) -> None:
    async with open_toolcell(plugin(make_plugin, "pooled"), policy="strict", stderr_path=tmp_path / "d.log") as peer:
        await peer.initialize()
        before = ok_text(await peer.call("whoami"))
        ok_text(await peer.call("leave_thread"))
        after = ok_text(await peer.call("whoami"))
        assert before != after, "the next call ran in the worker whose call left a thread running"
        assert "left 1 thread(s) running" in peer.stderr()


def serving_workers(peer: StdioPeer) -> list[psutil.Process]:
    """The daemon's worker processes that have a pid-1 child (spare interpreters have none)."""
    return [w for w in psutil.Process(peer.proc.pid).children()
            if "sandbox.worker" in " ".join(w.cmdline()) and w.children()]


async def assert_gone(procs: list[psutil.Process]) -> None:
    with trio.move_on_after(10):
        while not all(process_gone(p.pid) for p in procs):
            await trio.sleep(0.1)
    alive = [p.pid for p in procs if not process_gone(p.pid)]
    assert not alive, f"processes of the retired worker are still running: {alive}"


async def test_a_memory_hog_is_reported_as_out_of_memory(make_plugin: Callable[..., Path], mode: str,
                                                          tmp_path: Path) -> None:
    async with open_toolcell(plugin(make_plugin, mode), policy="strict", stderr_path=tmp_path / "d.log") as peer:
        await peer.initialize()
        text = error_text(await peer.call("eat_memory", {"mb": 600}, timeout=30))
        assert "out of memory" in text or "MemoryError" in text, text
        ok_text(await peer.call("whoami"))


async def test_a_fork_loop_is_told_it_reached_its_process_limit(make_plugin: Callable[..., Path], mode: str,
                                                              tmp_path: Path) -> None:
    async with open_toolcell(plugin(make_plugin, mode), policy="strict", stderr_path=tmp_path / "d.log") as peer:
        await peer.initialize()
        text = error_text(await peer.call("fork_many", {"n": 64}, timeout=30))
        assert "limit of processes" in text or "limit of 16 processes" in text, text
        ok_text(await peer.call("whoami"))


async def test_an_external_kill_of_pid_1_is_reported_by_signal_and_the_reaper_never_imports_the_plugin(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    for policy in ("strict", "compat"):
        plugins = make_plugin("life", PLUGIN, limits=LIMITS, root=f"plugins-{policy}")
        async with open_toolcell(plugins, policy=policy,
                                 stderr_path=tmp_path / f"{policy}.log") as peer:
            await peer.initialize()
            ok_text(await peer.call("whoami"))
            request_id = await peer.start_call("burn", {"seconds": 15})
            await trio.sleep(1.0)
            workers = [c for c in psutil.Process(peer.proc.pid).children() if "sandbox.worker" in " ".join(c.cmdline())]
            pid1 = [g for w in workers for g in w.children()]
            assert pid1, "no pid-1 process found under the workers"
            for proc in pid1:
                proc.kill()
            text = error_text(await peer.response(request_id, timeout=20))
            assert "killed by SIGKILL" in text, text
            ok_text(await peer.call("whoami"))
            log = peer.stderr()
            assert "Traceback" not in log, log[-3000:]
            imports = re.findall(r"imported-as-pid (\d+)", log)
            assert imports and set(imports) == {"1"}, f"the plugin was imported outside pid 1: {imports}"
