"""The per-call zygote: a fresh process per call, nothing of one call reaches the next, a call's
processes die with it, and neither a crash nor the zygote's own death costs more than one call."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
import trio.lowlevel
from sandbox_harness import Worker, text_of, write_plugin

from runtime.manifest import Manifest
from runtime.processes import PoolSpec
from runtime.protocol.errors import WorkerFailure
from runtime.execution.pool import WorkerPool
from sandbox import zygote
from sandbox.wire import CancelCall, Limits, encode_frame

ZYGOTE_PLUGIN = r'''
import ctypes
import fcntl
import hashlib
import json
import os
import random
import re
import resource
import time

from sandbox import current, tool

STATE = {"n": 0}


@tool
def counter() -> str:
    STATE["n"] += 1
    return str(STATE["n"])


@tool
def echo(text: str) -> str:
    return text


@tool
def whoami() -> str:
    return json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "cwd": os.getcwd()})


@tool
def leave_traces(secret: str) -> str:
    """Everything a call can write that would outlive it, if nothing cleaned up after it."""
    for path in ("/tmp/trace", "/dev/shm/trace", "trace"):  # the cwd is scratch
        with open(path, "w") as f:
            f.write(secret)
    os.makedirs("/tmp/deep/" + "/".join("d" * 40), exist_ok=True)  # deeper than the reset's limit
    os.symlink("/tmp/trace", "/tmp/link")
    os.mkdir("/tmp/locked")
    os.chmod("/tmp/locked", 0)
    os.setxattr("/tmp", "user.trace", secret.encode())
    os.chmod("/tmp", 0o755)
    os.utime("/tmp", ns=(1, 2))
    os.environ["TRACE"] = secret
    fd = os.open("/tmp/trace", os.O_RDONLY)
    os.set_inheritable(fd, True)
    os.chdir("/tmp/deep")
    flags = fcntl.fcntl(1, fcntl.F_GETFL)
    fcntl.fcntl(1, fcntl.F_SETFL, flags | os.O_NONBLOCK)  # shared with every process of the worker
    fcntl.flock(1, fcntl.LOCK_EX)
    return "left"


@tool
def look_for_traces() -> str:
    seen = [p for p in ("/tmp/trace", "/dev/shm/trace", "trace", "/tmp/deep", "/tmp/link", "/tmp/locked")
            if os.path.lexists(p)]
    if "TRACE" in os.environ:
        seen.append("environment")
    if os.listxattr("/tmp"):
        seen.append("xattr")
    st = os.stat("/tmp")
    if st.st_mtime_ns == 2 or oct(st.st_mode & 0o777) == "0o755":
        seen.append("/tmp metadata")
    if fcntl.fcntl(1, fcntl.F_GETFL) & os.O_NONBLOCK:
        seen.append("stdout O_NONBLOCK")
    try:
        fcntl.flock(1, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        seen.append("stdout flock")
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    return json.dumps({"seen": seen, "cwd": os.getcwd(), "fds": fds})


@tool
def scan_memory(digest: str) -> str:
    """How many copies of a secret (given by its sha256) this process's memory holds."""
    prefix = bytes.fromhex("544f4f4c43454c4c2d5345435245542d")  # b"TOOLCELL-SECRET-", built at run time
    found = 0
    with open("/proc/self/maps") as f:
        maps = f.read().splitlines()
    for line in maps:
        parts = line.split()
        if not parts[1].startswith("rw") or (len(parts) > 5 and parts[5].startswith("[v")):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        data = ctypes.string_at(lo, hi - lo)
        for m in re.finditer(re.escape(prefix) + rb"[0-9a-f]{32}", data):
            if hashlib.sha256(m.group()).hexdigest() == digest:
                found += 1
    return str(found)


@tool
def kernel_leftovers() -> str:
    """Things that outlive a process in the kernel, or change a process the call does not own."""
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}
    out["shmget"] = libc.shmget(0x7C7C, 4096, 0o1600) >= 0
    out["msgget"] = libc.msgget(0x7C7C, 0o1600) >= 0
    out["mq_open"] = libc.mq_open(b"/toolcell-trace", os.O_CREAT | os.O_RDWR, 0o600, None) >= 0
    for target in (1, os.getppid()):
        try:
            os.setpriority(os.PRIO_PROCESS, target, 19)
            out[f"setpriority({target})"] = True
        except OSError:
            out[f"setpriority({target})"] = False
        try:
            resource.prlimit(target, resource.RLIMIT_NOFILE, (3, 3))
            out[f"prlimit({target})"] = True
        except OSError:
            out[f"prlimit({target})"] = False
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 1)  # its own: allowed
        out["own priority"] = True
    except OSError:
        out["own priority"] = False
    return json.dumps(out)


@tool
def dice() -> str:
    return repr(random.random())


@tool
def crash() -> str:
    os._exit(7)


@tool
def linger(seconds: float) -> str:
    """Double-fork a grandchild into its own session, report, then sleep past any deadline."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(60)
        os._exit(0)
    os.waitpid(pid, 0)
    current().progress(1, message="forked")
    time.sleep(seconds)
    return "woke"
'''


@pytest.fixture(scope="module")
def zygote_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_plugin(tmp_path_factory.mktemp("zygote") / "plugin", ZYGOTE_PLUGIN, entry="zygote_plugin")


@pytest.fixture
def start(zygote_plugin: Path) -> Iterator[Callable[..., Worker]]:
    workers: list[Worker] = []

    def go(policy: str = "strict", **kwargs: Any) -> Worker:
        w = Worker(zygote_plugin, policy=policy, entry="zygote_plugin", **kwargs)
        workers.append(w)
        ready = w.ready()
        assert type(ready).__name__ == "Ready", ready
        return w

    yield go
    for w in workers:
        w.close()


def secret() -> str:
    return "TOOLCELL-SECRET-" + secrets.token_hex(16)


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


# -- through one worker's channel ---------------------------------------------------------------------


def test_no_state_survives_between_calls(start: Callable[..., Worker]) -> None:
    w = start(mode="per_call")
    assert [text_of(w.call("counter")) for _ in range(3)] == ["1", "1", "1"]


def test_pooled_mode_keeps_state_for_contrast(start: Callable[..., Worker]) -> None:
    w = start()
    assert [text_of(w.call("counter")) for _ in range(3)] == ["1", "2", "3"]


def test_every_call_runs_in_a_new_process_forked_from_the_zygote(start: Callable[..., Worker]) -> None:
    w = start(mode="per_call")
    seen = [json.loads(text_of(w.call("whoami"))) for _ in range(5)]
    assert len({s["pid"] for s in seen}) == 5
    assert {s["ppid"] for s in seen} == {1}  # the zygote, pid 1 of the worker's namespace: never a used process


def test_files_environment_cwd_fds_and_stdio_state_do_not_reach_the_next_call(start: Callable[..., Worker]) -> None:
    w = start(mode="per_call")
    before = json.loads(text_of(w.call("look_for_traces")))
    assert before["seen"] == []
    assert text_of(w.call("leave_traces", secret=secret())) == "left"
    after = json.loads(text_of(w.call("look_for_traces")))
    assert after["seen"] == []
    assert after["cwd"] == before["cwd"]
    # stdio, the call's own socket and the listing's own fd (numbers vary with the zygote's)
    assert len(after["fds"]) == len(before["fds"]) == 5 and after["fds"][:3] == [0, 1, 2]


def test_files_a_call_left_are_gone_under_the_none_policy_too(start: Callable[..., Worker]) -> None:
    w = start("none", mode="per_call")
    w.call("leave_traces", secret=secret())
    assert "trace" not in json.loads(text_of(w.call("look_for_traces")))["seen"]  # scratch is reset


def test_no_call_finds_an_earlier_calls_arguments_or_results_in_its_memory(start: Callable[..., Worker]) -> None:
    w = start(mode="per_call")
    argument, result = secret(), secret()
    assert text_of(w.call("echo", text=(argument + " ") * 50)) == (argument + " ") * 50
    w.call("echo", text=(result + " ") * 50)
    for _ in range(3):  # whichever warm process gets the call: none was forked from a used one
        assert text_of(w.call("scan_memory", digest=digest(argument))) == "0"
        assert text_of(w.call("scan_memory", digest=digest(result))) == "0"


def test_the_memory_scan_finds_what_a_process_does_hold(start: Callable[..., Worker]) -> None:
    """Canary: pooled mode keeps the earlier call's arguments in its memory, and the scan sees them."""
    w = start()
    argument = secret()
    w.call("echo", text=(argument + " ") * 50)
    assert int(text_of(w.call("scan_memory", digest=digest(argument)))) > 0


def test_a_call_can_leave_nothing_in_the_kernel_nor_change_another_process(start: Callable[..., Worker]) -> None:
    w = start(mode="per_call")
    got = json.loads(text_of(w.call("kernel_leftovers")))
    assert got.pop("own priority") is True
    assert not any(got.values()), got


def test_the_random_module_is_reseeded_for_every_call(start: Callable[..., Worker]) -> None:
    w = start(mode="per_call")
    assert len({text_of(w.call("dice")) for _ in range(4)}) == 4


def test_a_crashing_call_gets_an_error_result_and_the_zygote_goes_on(start: Callable[..., Worker]) -> None:
    w = start(mode="per_call")
    r = w.call("crash")
    assert r.is_error and "status 7" in text_of(r)
    assert text_of(w.call("counter")) == "1"


def test_a_call_cannot_signal_the_zygote(start: Callable[..., Worker], require: Any, plugin_dir: Path) -> None:
    require("landlock")
    w = Worker(plugin_dir, policy="strict", mode="per_call")
    try:
        w.ready()
        assert json.loads(text_of(w.call("hit_zygote"))) == ["Operation not permitted"] * 3
        assert text_of(w.call("counter")) == "1"
    finally:
        w.close()


def test_a_call_cannot_leave_processes_behind(start: Callable[..., Worker], require: Any) -> None:
    require("namespaces")
    w = start(mode="per_call")
    w.call("linger", seconds=0)  # its grandchild, in a session of its own, would sleep for a minute
    w.call("counter")
    steady = 2 + zygote.CALL_PROCESSES  # zygote, relay, warm call processes (below the reaper)
    # After a call the count passes through steady + 1 (the zygote forks the next warm process
    # before it reaps the used one): wait for a count that stays at steady, not for one sample of it.
    deadline = time.monotonic() + 5
    calm_since = None
    while time.monotonic() < deadline:
        if len(_worker_processes(w.proc.pid)) > steady:
            calm_since = None
        elif calm_since is None:
            calm_since = time.monotonic()
        elif time.monotonic() - calm_since >= 0.3:
            break
        time.sleep(0.01)
    assert calm_since is not None and len(_worker_processes(w.proc.pid)) <= steady, _describe_processes(w.proc.pid)


def test_a_warm_process_that_dies_is_replaced(start: Callable[..., Worker]) -> None:
    w = start(mode="per_call")
    w.call("counter")
    zygote = psutil.Process(w.proc.pid).children()[0]
    # The zygote forks the next warm process after answering: wait (bounded) until one is there.
    deadline = time.monotonic() + 5
    while True:
        _relay, *warm = sorted(zygote.children(), key=lambda p: p.create_time())
        if warm or time.monotonic() > deadline:
            break
        time.sleep(0.005)
    assert warm
    for p in warm:
        # The call process just used can still be listed while it is reaped: gone is as good as killed.
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(_gone_now(p) for p in warm):
        time.sleep(0.005)
    assert [text_of(w.call("counter")) for _ in range(3)] == ["1", "1", "1"]


def test_a_queued_call_cancelled_before_it_starts_is_answered_in_its_turn(start: Callable[..., Worker]) -> None:
    w = start(mode="per_call")
    w.sock.sendall(b"".join(encode_frame(c) for c in _calls(("counter", {}), ("counter", {}), ("counter", {}))))
    w.sock.sendall(encode_frame(CancelCall(102)))
    frames = [w.recv() for _ in range(6)]
    results = frames[0::2]
    assert [(type(f).__name__, f.id) for f in frames[1::2]] == [("CallReturned", i) for i in (100, 101, 102)]
    assert [r.id for r in results] == [100, 101, 102]
    assert [text_of(r) for r in results] == ["1", "1", "cancelled"]
    assert results[2].is_error


def test_a_hundred_calls_in_a_row_each_start_from_the_zygote_state(start: Callable[..., Worker]) -> None:
    # How fast per_call is belongs to benchmarks/sandbox_startup.py; here: many calls, none sees another's state.
    w = start(mode="per_call")
    assert {text_of(w.call("counter")) for _ in range(100)} == {"1"}


def _calls(*calls: tuple[str, dict[str, Any]]) -> list[Any]:
    from sandbox.wire import Call

    return [Call(100 + i, tool, args) for i, (tool, args) in enumerate(calls)]


def _gone_now(p: psutil.Process) -> bool:
    try:
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _worker_processes(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def _describe_processes(pid: int) -> str:
    """Each process under ``pid``: its parent, state, age and command (what a failure left behind)."""
    lines = []
    try:
        for p in psutil.Process(pid).children(recursive=True):
            try:
                lines.append(f"{p.pid} (parent {p.ppid()}, {p.status()}, {time.time() - p.create_time():.2f} s old,"
                             f" session {os.getsid(p.pid)}): {' '.join(p.cmdline())[:120]}")
            except (psutil.Error, OSError) as exc:
                lines.append(f"{p.pid}: {exc}")
    except psutil.Error as exc:
        lines.append(str(exc))
    return "processes left: " + "; ".join(lines)



# -- through the daemon's pool (deadlines, cancellation and restarts are the pool's) -------------------


@pytest.fixture
async def pool(zygote_plugin: Path, tmp_path: Path) -> AsyncIterator[WorkerPool]:
    state = tmp_path / "state"
    state.mkdir(mode=0o711)
    manifest = Manifest(name="zygote", version="0", entry="zygote_plugin", isolation="per_call",
                        limits=Limits(timeout_s=2.0, max_concurrency=1))
    async with trio.open_nursery() as nursery:
        p = WorkerPool(PoolSpec(manifest, str(zygote_plugin), "strict", str(state)), nursery)
        await p.start()
        try:
            yield p
        finally:
            with trio.CancelScope(shield=True):
                await p.aclose(grace_s=0)
            nursery.cancel_scope.cancel()


async def _gone(pids: list[int], timeout_s: float = 10.0) -> None:
    with trio.fail_after(timeout_s):
        for pid in pids:
            while True:
                try:
                    if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.NoSuchProcess:
                    break
                await trio.sleep(0.02)


async def _linger_until_forked(pool: WorkerPool) -> tuple[trio.Event, list[int], Callable[[Any], None]]:
    forked = trio.Event()
    snapshot: list[int] = []

    def on_event(msg: Any) -> None:
        if not forked.is_set():
            (worker,) = pool.workers
            snapshot.extend(_worker_processes(worker.pid) + [worker.pid])
            forked.set()

    return forked, snapshot, on_event


async def test_a_call_past_its_deadline_dies_with_its_whole_tree_double_fork_included(pool: WorkerPool) -> None:
    forked, snapshot, on_event = await _linger_until_forked(pool)
    with pytest.raises(WorkerFailure) as err:
        await pool.run("linger", {"seconds": 30}, True, -1, on_event)
    assert err.value.kind == "timeout"
    assert forked.is_set() and len(snapshot) >= 5  # reaper, zygote, relay, call, grandchild (+ warm)
    await _gone(snapshot)
    assert text_of(await pool.run("counter", {}, False, -1, None)) == "1"


async def test_a_cancelled_call_dies_with_its_whole_tree(pool: WorkerPool) -> None:
    forked, snapshot, on_event = await _linger_until_forked(pool)
    with trio.move_on_after(10) as scope:
        async with trio.open_nursery() as nursery:
            async def call() -> None:
                await pool.run("linger", {"seconds": 30}, True, -1, on_event)

            nursery.start_soon(call)
            await forked.wait()
            nursery.cancel_scope.cancel()
    assert not scope.cancelled_caught
    await _gone(snapshot)
    assert text_of(await pool.run("counter", {}, False, -1, None)) == "1"


async def test_a_crash_fails_only_its_own_call_and_keeps_the_worker(pool: WorkerPool) -> None:
    (worker,) = pool.workers
    results: dict[str, Any] = {}

    async def call(name: str, tool: str) -> None:
        results[name] = await pool.run(tool, {}, False, -1, None)

    async with trio.open_nursery() as nursery:
        for i, tool in enumerate(("counter", "crash", "counter", "counter")):
            nursery.start_soon(call, f"{i}-{tool}", tool)
            await trio.lowlevel.checkpoint()
    assert "status 7" in text_of(results["1-crash"]) and results["1-crash"].is_error
    assert [text_of(r) for k, r in sorted(results.items()) if k.endswith("counter")] == ["1", "1", "1"]
    assert pool.workers == {worker} and pool.restarts == 0


@pytest.mark.parametrize("victim", ["zygote", "relay"])
async def test_the_zygote_is_restarted_when_it_dies(pool: WorkerPool, victim: str) -> None:
    assert text_of(await pool.run("counter", {}, False, -1, None)) == "1"
    (worker,) = pool.workers
    zygote = psutil.Process(worker.pid).children()[0]
    relay = min(zygote.children(), key=lambda p: p.create_time())
    (zygote if victim == "zygote" else relay).send_signal(signal.SIGKILL)
    with trio.fail_after(10):
        await worker.exited.wait()
    assert text_of(await pool.run("counter", {}, False, -1, None)) == "1"
    assert pool.workers and worker not in pool.workers
