"""Rules of the hosted-server session and runner that need no server process: driven directly on an
``Instance`` / ``HostedRunner`` with stand-ins for the parts a process would provide."""

from __future__ import annotations

import gc
import socket
import json
from types import SimpleNamespace
from typing import Any

import trio

from runtime.execution import hosted
from runtime.execution.child import ChildProcess
from runtime.execution.hosted import Group, HostedRunner
from runtime.execution.hosted_session import Instance
from runtime.protocol.errors import WorkerFailure
from sandbox import wire


class StubRunner:
    """What an ``Instance`` uses of its runner."""

    def __init__(self) -> None:
        self.name = "stub"
        self.server = SimpleNamespace(cancel_grace_s=1.0, start_timeout_s=1.0)
        self.stderr_tail: dict[int, bytes] = {}  # what the runner used to keep (for the test run before the fix)
        self.completed: list[Any] = []

    def complete(self, slot: Any) -> None:
        self.completed.append(slot)


class FakeStderr:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def receive_some(self, n: int) -> bytes:
        return self.chunks.pop(0) if self.chunks else b""


async def test_a_servers_stderr_stays_with_its_own_instance() -> None:
    """The stderr tail (quoted in a start failure) is the instance's own: one whose process is gone
    leaves nothing behind, and a later instance (maybe at the same address) never shows it."""
    runner = StubRunner()
    first = Instance(runner, None)  # type: ignore[arg-type]
    ours, theirs = socket.socketpair()
    with ours, theirs:
        first.child = ChildProcess(SimpleNamespace(pid=2 ** 22 + 7, returncode=None), ours, "/nonexistent")  # type: ignore[arg-type]
        await first.child._pump_output(FakeStderr([b"alice's secret token\n"]))  # type: ignore[arg-type]
    assert "alice's secret token" in first._tail()
    old = id(first)
    del first
    gc.collect()
    second = Instance(runner, None)  # type: ignore[arg-type]
    for _ in range(100):  # CPython usually hands the freed block to the next object of that size
        if id(second) == old:
            break
        second = Instance(runner, None)  # type: ignore[arg-type]
    assert "alice" not in second._tail()
    assert not runner.stderr_tail


async def test_a_malformed_answer_with_id_true_fails_no_call() -> None:
    """``true`` equals 1 in Python: a too-deep message with ``"id": true`` must not fail call 1."""
    runner = StubRunner()
    instance = Instance(runner, None)  # type: ignore[arg-type]
    slot = SimpleNamespace(request_id=1)
    instance.pending[1] = slot
    deep: Any = "bottom"
    for _ in range(400):
        deep = {"d": deep}
    instance._handle_line(json.dumps({"jsonrpc": "2.0", "id": True, "result": deep}).encode())
    assert instance.pending == {1: slot} and not runner.completed


class RunnerStub(HostedRunner):
    """A ``HostedRunner`` with no plugin behind it; spawning is recorded, not done."""

    def __init__(self) -> None:  # no super().__init__: no spec, no nursery
        self.name = "stub"
        self.server = SimpleNamespace(per_principal=True, instances=1, max_principals=2)  # type: ignore[assignment]
        self.limits = SimpleNamespace(max_concurrency=1)  # type: ignore[assignment]
        self.groups = {}
        self.closed = False
        self.restarts = 0
        self.limit_kills = 0
        self.tools = []
        self.spawned: list[Group] = []

    def _spawn(self, group: Group) -> None:
        self.spawned.append(group)


def _ended(runner: HostedRunner, group: Group) -> None:
    instance: Any = SimpleNamespace(group=group, ready=True, started_at=0.0, server_pid=2)
    group.instances.append(instance)
    runner.instance_ended(instance, WorkerFailure("crashed", "it exited"))


async def test_a_principals_instance_is_restarted_only_for_work_and_only_in_a_current_group() -> None:
    runner = RunnerStub()
    shared = runner.groups[""] = Group("")
    alice = runner.groups["alice"] = Group("alice")
    _ended(runner, shared)
    assert runner.spawned == [shared]  # the shared group is kept at its size
    runner.spawned.clear()
    _ended(runner, alice)
    assert runner.spawned == []  # idle: started again when a call comes
    alice.queue.append(SimpleNamespace())  # type: ignore[arg-type]
    _ended(runner, alice)
    assert runner.spawned == [alice]
    runner.spawned.clear()
    runner.groups["alice"] = Group("alice")  # alice's old group was dropped; a new one has her key
    _ended(runner, alice)
    assert runner.spawned == []


async def test_a_starting_group_is_not_dropped_and_an_instance_started_for_a_dropped_group_is_stopped(
        monkeypatch: Any) -> None:
    runner = RunnerStub()
    runner.groups[""] = Group("")
    alice = runner.groups["alice"] = Group("alice")
    alice.starting = 1
    bob = runner.groups["bob"] = Group("bob")
    runner._drop_idle_groups()
    assert runner.groups.get("alice") is alice and "bob" not in runner.groups

    stopped: list[WorkerFailure] = []

    class FakeInstance:
        def __init__(self, runner: Any, group: Any) -> None:
            self.group, self.dead, self.ready, self.server_pid = group, False, True, 2

        async def start(self) -> list[wire.ToolSpec]:
            del runner.groups["bob"]  # dropped while starting, then a new group under the same key
            runner.groups["bob"] = Group("bob")
            return []

        def fail(self, error: WorkerFailure) -> None:
            self.dead = True
            stopped.append(error)

    monkeypatch.setattr(hosted, "Instance", FakeInstance)
    runner.groups["bob"] = bob
    bob.starting = 1
    with trio.fail_after(5):
        await runner._start_instance(bob)
    assert len(stopped) == 1 and bob.instances == []
