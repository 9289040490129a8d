"""Policy profiles, fail-closed behaviour, the process tree and cgroup lifecycle of a real worker."""

from __future__ import annotations

import json
import os
import shutil
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandbox_harness import Worker, text_of

from sandbox.isolation import LAYERS, cgroups

NO_LANDLOCK = "import sandbox.isolation.landlock as _ll; _ll.abi_version = lambda: 0"


def wait_until(cond: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_strict_reports_every_layer(spawn: Callable[..., Worker], require: Any) -> None:
    require(*LAYERS)
    ready = spawn("strict").ready()
    assert type(ready).__name__ == "Ready"
    assert ready.layers == list(LAYERS)
    assert ready.missing == []


def test_none_applies_only_hygiene_and_rlimits(spawn: Callable[..., Worker]) -> None:
    w = spawn("none")
    ready = w.ready()
    assert ready.layers == ["hygiene", "rlimits"]
    assert ready.missing == []
    assert json.loads(text_of(w.call("whoami")))["uid"] == os.geteuid()


def test_strict_fails_closed_naming_the_missing_layer(spawn: Callable[..., Worker]) -> None:
    msg = spawn("strict", prelude=NO_LANDLOCK).ready()
    assert type(msg).__name__ == "LoadFailed"
    assert msg.stage == "isolation"
    assert "landlock" in msg.error


def test_compat_runs_without_the_missing_layer_and_reports_it(spawn: Callable[..., Worker], require: Any) -> None:
    require("namespaces", "seccomp")
    w = spawn("compat", prelude=NO_LANDLOCK)
    ready = w.ready()
    assert type(ready).__name__ == "Ready"
    assert ready.missing == ["landlock"]
    assert "landlock" not in ready.layers and "seccomp" in ready.layers
    assert json.loads(text_of(w.call("whoami")))["pid"] == 1


def test_unknown_policy_is_refused(spawn: Callable[..., Worker]) -> None:
    msg = spawn("lenient").ready()
    assert type(msg).__name__ == "LoadFailed"
    assert "policy" in msg.error


def test_ipc_fd_other_than_3_keeps_working(spawn: Callable[..., Worker], require: Any) -> None:
    require(*LAYERS)
    w = spawn("strict", ipc_fd=7)
    assert w.ready().layers == list(LAYERS)
    assert json.loads(text_of(w.call("whoami")))["pid"] == 1


def test_only_stdio_and_the_ipc_fd_are_open_in_the_plugin(spawn: Callable[..., Worker], require: Any) -> None:
    require("namespaces", "landlock")
    w = spawn("strict")
    w.ready()
    got = json.loads(text_of(w.call("list_dir", path="/proc/self/fd")))
    assert got["ok"], got
    fds = sorted(int(x) for x in json.loads(got["detail"].replace("'", '"')))
    # 0-2 stdio, 3 IPC and the one listdir itself opened; nothing of the worker's own runtime (the call
    # guard keeps no descriptor: sandbox.call_guard).
    assert fds[:4] == [0, 1, 2, 3] and len(fds) == 5
    got = json.loads(text_of(w.call("fd_targets")))
    assert got == [], got


def start_survivor(w: Worker) -> None:
    """A call still running, with a double-forked survivor beside it. (A pooled call that returned
    leaving one would retire its worker at once: see sandbox.call_guard.)"""
    from sandbox.wire import Call, encode_frame

    w.sock.sendall(encode_frame(Call(999, "spawn_survivor", {"seconds": 30, "linger": 30})))
    assert wait_until(lambda: len(cgroups.members(w.proc.pid)) >= 3)


def test_killing_the_worker_kills_its_whole_tree_and_cleanup_removes_the_cgroup(
    spawn: Callable[..., Worker], require: Any
) -> None:
    require("namespaces", "cgroup")
    w = spawn("strict")
    w.ready()
    start_survivor(w)
    pid = w.proc.pid
    assert len(cgroups.members(pid)) >= 3  # reaper, pid 1, the setsid'd double-fork survivor
    os.kill(pid, 9)  # the reaper only: pid 1 follows (PDEATHSIG), everything else follows pid 1
    w.proc.wait(timeout=5)
    assert wait_until(lambda: cgroups.members(pid) == [])
    assert cgroups.cleanup(pid)
    lay = cgroups.layout(pid)
    assert lay is not None and not any(os.path.exists(d) for d in lay.dirs)


def test_kill_all_reaches_every_process_of_a_worker(spawn: Callable[..., Worker], require: Any) -> None:
    require("cgroup")
    w = spawn("strict")
    w.ready()
    start_survivor(w)
    assert cgroups.kill_all(w.proc.pid)
    assert cgroups.members(w.proc.pid) == []
    w.proc.wait(timeout=5)


def test_plugin_dir_under_a_root_only_directory_is_reachable(
    spawn: Callable[..., Worker], require: Any, tmp_path: Path, plugin_dir: Path
) -> None:
    # The plugin lives under a root-only (0700) directory of its own, and the interpreter under /root
    # (0700): the worker uid reaches both only through the rebuilt mount view. (Made here rather than
    # relying on pytest's /tmp/pytest-of-root, whose mode other test runs on the machine may change.)
    require(*LAYERS)
    root_only = tmp_path / "root-only"
    root_only.mkdir(mode=0o700)
    os.chmod(root_only, 0o700)
    plugin = root_only / plugin_dir.name
    shutil.copytree(plugin_dir, plugin)
    assert (os.stat(root_only).st_mode & 0o077) == 0
    w = spawn("strict", plugin=plugin)
    assert type(w.ready()).__name__ == "Ready"


def test_worker_survives_the_exit_of_the_thread_that_spawned_it(plugin_dir: Path, require: Any) -> None:
    # trio spawns from its thread cache; PR_SET_PDEATHSIG fires when that *thread* exits.
    require("namespaces")
    box: list[Any] = []

    def spawn_and_wait_ready() -> None:  # the thread exits only once the worker armed its signal
        box.append(Worker(plugin_dir, policy="strict"))
        box.append(box[0].ready())

    t = threading.Thread(target=spawn_and_wait_ready)
    t.start()
    t.join(timeout=10)
    w = box[0]
    try:
        assert type(box[1]).__name__ == "Ready"
        time.sleep(0.1)
        assert json.loads(text_of(w.call("whoami")))["pid"] == 1
        assert w.proc.poll() is None
    finally:
        w.close()


DAEMON_STANDIN = r"""
import sys, time
sys.path[:0] = {paths!r}
from sandbox_harness import Worker
from pathlib import Path
w = Worker(Path({plugin!r}), policy="strict")
w.ready()
# A call that is still running when the daemon dies, with a double-forked survivor beside it (a pooled
# call that returned leaving one would retire its worker: see sandbox.call_guard).
from sandbox.wire import Call, encode_frame
w.sock.sendall(encode_frame(Call(99, "spawn_survivor", {{"seconds": 30, "linger": 30}})))
time.sleep(1.0)
print(w.proc.pid, flush=True)
time.sleep(60)
"""


def test_the_whole_worker_tree_dies_with_the_daemon(plugin_dir: Path, require: Any) -> None:
    require("namespaces", "cgroup")
    here = os.path.dirname(__file__)
    code = DAEMON_STANDIN.format(paths=[here, str(Path(here).parents[1])], plugin=str(plugin_dir))
    daemon = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert daemon.stdout is not None
        ready, _, _ = select.select([daemon.stdout], [], [], 10)
        assert ready, "stand-in daemon did not start a worker"
        worker_pid = int(daemon.stdout.readline())
        assert len(cgroups.members(worker_pid)) >= 3
    finally:
        daemon.kill()
        daemon.wait(timeout=5)
        if daemon.stdout is not None:
            daemon.stdout.close()
    assert wait_until(lambda: cgroups.members(worker_pid) == [])
    assert cgroups.cleanup(worker_pid)


def test_sweep_stale_removes_only_empty_worker_cgroups(spawn: Callable[..., Worker], require: Any) -> None:
    require("cgroup")
    w = spawn("strict")
    w.ready()
    lay = cgroups.layout("stale-test")
    assert lay is not None
    for d in lay.dirs:
        os.makedirs(d, exist_ok=True)
    cgroups.sweep_stale(prefix="stale-test")  # other daemons may share this machine's hierarchy
    cgroups.sweep_stale(prefix=str(w.proc.pid))
    assert not any(os.path.exists(d) for d in lay.dirs)
    assert len(cgroups.members(w.proc.pid)) >= 2  # a live worker's cgroup is left alone
