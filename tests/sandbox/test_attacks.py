"""Attack-style tests: each attack is a plugin tool that reports whether it worked.

Every attack is run twice: under ``strict`` it must be blocked; under ``none`` (the canary) it must
succeed, which proves the attack can detect its own success. A layer the machine lacks skips the
strict half, with the probe's reason.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sandbox_harness import Worker, text_of

from sandbox.wire import Limits

POLICIES = ["strict", "none"]


def outcome(worker: Worker, tool: str, **args: Any) -> dict[str, Any]:
    ready = worker.ready()
    assert type(ready).__name__ == "Ready", ready
    result = worker.call(tool, **args)
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


def expect(policy: str, got: dict[str, Any]) -> None:
    if policy == "strict":
        assert not got["ok"], f"attack succeeded under strict: {got['detail']}"
    else:
        assert got["ok"], f"canary: the attack could not detect its own success: {got['detail']}"


@pytest.fixture
def host_secret() -> Iterator[str]:
    """A world-readable file outside every allowlist."""
    path = f"/var/tmp/toolcell-secret-{uuid.uuid4().hex}"
    with open(path, "w") as f:
        f.write("host-secret")
    os.chmod(path, 0o644)
    yield path
    os.unlink(path)


@pytest.mark.parametrize("policy", POLICIES)
def test_reading_etc_shadow_is_blocked(policy: str, spawn: Callable[..., Worker], require: Any) -> None:
    if policy == "strict":
        require("landlock", "identity")
    expect(policy, outcome(spawn(policy), "read_file", path="/etc/shadow"))


@pytest.mark.parametrize("policy", POLICIES)
def test_reading_a_world_readable_file_outside_the_allowlist_is_blocked(
    policy: str, spawn: Callable[..., Worker], require: Any, host_secret: str
) -> None:
    if policy == "strict":
        require("landlock")
    expect(policy, outcome(spawn(policy), "read_file", path=host_secret))


@pytest.mark.parametrize("policy", POLICIES)
def test_writing_outside_scratch_is_blocked(policy: str, spawn: Callable[..., Worker], require: Any) -> None:
    if policy == "strict":
        require("landlock", "namespaces")
    path = f"/var/tmp/toolcell-written-{uuid.uuid4().hex}"
    try:
        got = outcome(spawn(policy), "write_file", path=path)
        expect(policy, got)
        assert os.path.exists(path) == (policy == "none")
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_scratch_is_writable_and_private_under_strict(spawn: Callable[..., Worker], require: Any) -> None:
    require("namespaces")
    w = spawn("strict")
    got = outcome(w, "write_file", path="artifact.txt")
    assert got["ok"], got
    read_back = json.loads(text_of(w.call("read_file", path="artifact.txt")))
    assert read_back["ok"]
    # The scratch dir is a private tmpfs in the worker's mount namespace: the host path stays empty,
    # and the daemon reads artifacts through the worker's root while it lives.
    assert os.listdir(w.scratch) == []
    from sandbox.isolation.namespaces import host_path

    seen = host_path(w.proc.pid, w.scratch)
    assert seen is not None
    with open(os.path.join(seen, "artifact.txt"), "rb") as f:
        assert f.read() == b"pwned"


@pytest.fixture
def tcp_listener() -> Iterator[int]:
    """A listening TCP port on loopback (the kernel completes handshakes without an accept)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    yield srv.getsockname()[1]
    srv.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_tcp_connect_to_loopback_is_blocked(
    policy: str, spawn: Callable[..., Worker], require: Any, tcp_listener: int
) -> None:
    if policy == "strict":
        require("namespaces", "seccomp")
    expect(policy, outcome(spawn(policy), "tcp_connect", port=tcp_listener))


@pytest.mark.parametrize("policy", POLICIES)
def test_abstract_unix_socket_of_the_host_is_unreachable(
    policy: str, spawn: Callable[..., Worker], require: Any
) -> None:
    if policy == "strict":
        require("namespaces", "landlock")
    name = f"toolcell-test-{uuid.uuid4().hex}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + name)
    srv.listen(4)
    try:
        expect(policy, outcome(spawn(policy), "abstract_connect", name=name))
    finally:
        srv.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_killing_a_host_process_is_blocked(
    policy: str, spawn: Callable[..., Worker], require: Any, victim: subprocess.Popen[bytes]
) -> None:
    if policy == "strict":
        require("namespaces", "landlock", "identity")
    expect(policy, outcome(spawn(policy), "kill_pid", pid=victim.pid))
    try:
        victim.wait(timeout=0.3 if policy == "strict" else 5)
    except subprocess.TimeoutExpired:
        pass
    assert (victim.poll() is None) == (policy == "strict")


@pytest.mark.parametrize("policy", POLICIES)
def test_ptrace_of_a_host_process_is_blocked(
    policy: str, spawn: Callable[..., Worker], require: Any, victim: subprocess.Popen[bytes]
) -> None:
    if policy == "strict":
        require("seccomp")
    w = spawn(policy)
    try:
        expect(policy, outcome(w, "ptrace_pid", pid=victim.pid))
    finally:
        w.close()  # a tracer that outlives the test would keep the victim from being reaped


@pytest.mark.parametrize("policy", POLICIES)
def test_proc_snooping_of_host_processes_is_blocked(
    policy: str, spawn: Callable[..., Worker], require: Any, victim: subprocess.Popen[bytes]
) -> None:
    if policy == "strict":
        require("namespaces")
    expect(policy, outcome(spawn(policy), "proc_snoop", pid=victim.pid, needle="s3cret-canary"))


@pytest.mark.parametrize("policy", POLICIES)
def test_fork_bomb_stops_at_the_pids_limit(policy: str, spawn: Callable[..., Worker], require: Any) -> None:
    if policy == "strict":
        require("cgroup")
    expect(policy, outcome(spawn(policy), "fork_bomb", n=150))


@pytest.mark.parametrize("policy", POLICIES)
def test_memory_bomb_is_killed_by_the_cgroup_limit(policy: str, spawn: Callable[..., Worker], require: Any) -> None:
    if policy == "strict":
        require("cgroup")
    w = spawn(policy, limits=Limits(memory_mb=96))
    expect(policy, outcome(w, "memory_bomb", mb=320))
    # The worker itself survives its tool's memory bomb.
    assert json.loads(text_of(w.call("whoami")))["uid"] >= 0


def test_dangerous_syscalls_are_denied_by_seccomp(spawn: Callable[..., Worker], require: Any) -> None:
    require("seccomp")
    w = spawn("strict")
    w.ready()
    got = json.loads(text_of(w.call("syscall_probe")))
    assert got == {
        "unshare": "Operation not permitted",
        "ptrace_traceme": "Operation not permitted",
        "inet_socket": "Operation not permitted",
    }


def test_plugin_runs_as_unprivileged_pid_1_in_its_own_namespaces(spawn: Callable[..., Worker], require: Any) -> None:
    require("namespaces", "identity")
    w = spawn("strict")
    who = outcome(w, "whoami")
    assert who["uid"] != 0
    assert who["pid"] == 1
    assert who["host"] == "toolcell"
    assert who["cwd"] == w.scratch


def test_root_directory_listing_outside_the_allowlist_is_denied(
    spawn: Callable[..., Worker], require: Any, plugin_dir: Path
) -> None:
    require("landlock")
    w = spawn("strict")
    assert not outcome(w, "list_dir", path="/etc")["ok"]
    assert json.loads(text_of(w.call("list_dir", path=str(plugin_dir))))["ok"]
