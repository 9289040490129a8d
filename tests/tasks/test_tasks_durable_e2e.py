"""Durable tasks end to end: a daemon SIGKILLed mid-task and restarted on the same SQLite store
serves the results of the tasks it finished and reads the ones it was running as ``failed``; two
daemons sharing one Redis serve one task (read, answered and cancelled through the other daemon)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import redis
import trio
from store_harness import RedisServer
from task_e2e import (
    REPO,
    RELATED,
    TOKENS,
    WAIT_S,
    Http,
    HttpDaemon,
    SseStream,
    descendants,
    error_code,
    open_http_daemon,
    read_pid,
    sigkill,
    sleeper_plugin,
    text_of,
    wait_pids_gone,
    write_config,
)

ELICIT = {"elicitation": {"form": {}}}
TERMINAL = {"completed", "failed", "cancelled"}


async def toolcell(*args: str) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(60):
        return await trio.run_process([sys.executable, "-m", "runtime.cli", *args], cwd=str(REPO),
                                      capture_stdout=True, capture_stderr=True, check=False)


async def test_a_sigkilled_daemon_restarted_on_its_sqlite_store_serves_finished_tasks_and_fails_running_ones(
        tmp_path: Path) -> None:
    config = write_config(tmp_path / "daemon", tokens=True)
    state_dir = tmp_path / "daemon" / "state"
    async with httpx2.AsyncClient(timeout=WAIT_S) as client:
        async with open_http_daemon(config, log=tmp_path / "first.log") as first:
            alice = Http(client, first.url, TOKENS["alice"])
            session = await alice.legacy_session()
            legacy_done = (await alice.legacy(session, "tools/call", {
                "name": "slow_compute", "arguments": {"seconds": 0, "label": "legacy"}, "task": {}}))["result"]["task"]
            assert (await alice.legacy_wait(session, legacy_done["taskId"], TERMINAL))["status"] == "completed"
            done = (await alice.modern("tools/call", {"name": "slow_compute",
                                                      "arguments": {"seconds": 0, "label": "modern"}}))[1]["result"]
            assert (await alice.wait_task(done["taskId"], TERMINAL))["status"] == "completed"
            long = (await alice.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 60}}))[1]
            long_id = long["result"]["taskId"]
            asking = (await alice.modern("tools/call", {"name": "confirm_delete", "arguments": {"filename": "z"}},
                                         caps=ELICIT))[1]["result"]["taskId"]
            assert (await alice.wait_task(asking, {"input_required"} | TERMINAL))["status"] == "input_required"
            assert (await alice.task_get(long_id))["status"] == "working"
            assert descendants(first.pid), "the daemon runs its tools in worker processes"
            await sigkill(first)  # the daemon, its process group, and (checked) every worker it had

        # The store, read by the operator command while no daemon runs: nobody has failed them yet.
        listed = await toolcell("tasks", "--config", str(config), "--json")
        assert listed.returncode == 0, listed.stderr
        before = {t["task_id"]: t["status"] for t in json.loads(listed.stdout)}
        assert before[long_id] == "working" and before[done["taskId"]] == "completed"

        async with open_http_daemon(config, log=tmp_path / "second.log") as second:
            alice = Http(client, second.url, TOKENS["alice"])
            # The very first read after the restart: failed with a reason, never working.
            failed = await alice.task_get(long_id)
            assert failed["status"] == "failed", failed
            assert failed["error"]["code"] == -32603 and "stopped before it finished" in failed["error"]["message"]
            assert "stopped" in failed["statusMessage"]
            assert (await alice.task_get(asking))["status"] == "failed"
            kept = await alice.task_get(done["taskId"])
            assert kept["status"] == "completed" and text_of(kept["result"]) == "computed modern after 0.0 s"
            # A 2025-11-25 client gets its finished task's result from the new daemon.
            session = await alice.legacy_session()
            result = (await alice.legacy(session, "tasks/result", {"taskId": legacy_done["taskId"]}))["result"]
            assert text_of(result) == "computed legacy after 0.0 s"
            assert result["_meta"][RELATED] == {"taskId": legacy_done["taskId"]}
            long_error = await alice.legacy(session, "tasks/result", {"taskId": long_id})
            assert error_code(long_error) == -32603 and "stopped" in long_error["error"]["message"]
            listed_tasks = (await alice.legacy(session, "tasks/list"))["result"]["tasks"]
            assert {t["taskId"]: t["status"] for t in listed_tasks} == {
                legacy_done["taskId"]: "completed", done["taskId"]: "completed", long_id: "failed", asking: "failed"}
            bob = Http(client, second.url, TOKENS["bob"])
            status, unknown = await bob.modern("tasks/get", {"taskId": done["taskId"]})
            assert error_code(unknown) == -32602

    listed = await toolcell("tasks", "--config", str(config), "--json")
    assert listed.returncode == 0, listed.stderr
    after = {t["task_id"]: t for t in json.loads(listed.stdout)}
    assert {k: t["status"] for k, t in after.items()} == {
        legacy_done["taskId"]: "completed", done["taskId"]: "completed", long_id: "failed", asking: "failed"}
    assert {t["principal"] for t in after.values()} == {"alice"}
    shown = await toolcell("tasks", "show", long_id, "--config", str(config))
    assert shown.returncode == 0, shown.stderr
    assert b"failed" in shown.stdout and b"stopped before it finished" in shown.stdout
    table = await toolcell("tasks", "--config", str(config))
    assert table.returncode == 0 and long_id.encode() in table.stdout and done["taskId"].encode() in table.stdout
    assert (state_dir / "tasks.sqlite3").exists()


@asynccontextmanager
async def two_daemons(tmp_path: Path, redis_server: RedisServer, make_plugin: Callable[..., Path]
                      ) -> AsyncIterator[tuple[HttpDaemon, HttpDaemon, httpx2.AsyncClient]]:
    """Daemons A and B (HTTP, ports of their own) sharing one Redis store, the requestState key and
    the tokens; each with a state dir of its own."""
    url = redis_server.url(db=9)  # the daemons use the default namespace: a database of their own
    redis.Redis.from_url(url).flushdb()
    plugins = sleeper_plugin(make_plugin)
    shared: dict[str, Any] = {"tasks": {"store": url}, "tokens": True, "key_file": tmp_path / "state.key"}
    config_a = write_config(tmp_path / "a", **shared)
    config_b = write_config(tmp_path / "b", **shared)
    async with open_http_daemon(config_a, plugins, log=tmp_path / "a.log") as a, \
            open_http_daemon(config_b, plugins, log=tmp_path / "b.log") as b, \
            httpx2.AsyncClient(timeout=WAIT_S) as client:
        assert a.url != b.url
        yield a, b, client


async def test_two_daemons_sharing_redis_serve_one_task_read_and_answered_through_the_other(
        tmp_path: Path, redis_server: RedisServer, make_plugin: Callable[..., Path]) -> None:
    async with two_daemons(tmp_path, redis_server, make_plugin) as (a, b, client):
        via_a = Http(client, a.url, TOKENS["alice"])
        via_b = Http(client, b.url, TOKENS["alice"])

        # Created through A, read and answered through B; A's worker finishes it.
        asking = (await via_a.modern("tools/call", {"name": "confirm_delete", "arguments": {"filename": "r.txt"}},
                                     caps=ELICIT))[1]["result"]
        assert asking["resultType"] == "task"
        waiting = await via_b.wait_task(asking["taskId"], {"input_required"} | TERMINAL)
        assert waiting["status"] == "input_required"
        [(key, request)] = waiting["inputRequests"].items()
        assert request["params"]["message"] == "Delete r.txt?"
        status, ack = await via_b.modern("tasks/update", {"taskId": asking["taskId"], "inputResponses": {
            key: {"action": "accept", "content": {"confirm": True}}}})
        assert status == 200 and ack["result"]["resultType"] == "complete"
        done = await via_b.wait_task(asking["taskId"], TERMINAL)
        assert done["status"] == "completed" and text_of(done["result"]) == "Deleted r.txt"
        assert (await via_a.task_get(asking["taskId"]))["status"] == "completed"

        # Created through A, cancelled through B: cancelled for everyone at once.
        sleeping = (await via_a.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 60}}))[1]
        sleeping_id = sleeping["result"]["taskId"]
        status, ack = await via_b.modern("tasks/cancel", {"taskId": sleeping_id})
        assert status == 200 and ack["result"]["resultType"] == "complete"
        assert (await via_a.wait_task(sleeping_id, TERMINAL))["status"] == "cancelled"
        assert (await via_b.task_get(sleeping_id))["status"] == "cancelled"

        # 2025-11-25: a task created in a session on A is read, listed, its result served and
        # cancelled on B.
        session_a = await via_a.legacy_session()
        session_b = await via_b.legacy_session()
        legacy = (await via_a.legacy(session_a, "tools/call", {
            "name": "slow_compute", "arguments": {"seconds": 0.5, "label": "shared"}, "task": {}}))["result"]["task"]
        assert (await via_b.legacy_status(session_b, legacy["taskId"]))["taskId"] == legacy["taskId"]
        result = (await via_b.legacy(session_b, "tasks/result", {"taskId": legacy["taskId"]}))["result"]
        assert text_of(result) == "computed shared after 0.5 s"
        assert result["_meta"][RELATED] == {"taskId": legacy["taskId"]}
        long = (await via_a.legacy(session_a, "tools/call", {
            "name": "slow_compute", "arguments": {"seconds": 60}, "task": {}}))["result"]["task"]
        cancelled = (await via_b.legacy(session_b, "tasks/cancel", {"taskId": long["taskId"]}))["result"]
        assert cancelled["status"] == "cancelled"
        assert (await via_a.legacy_status(session_a, long["taskId"]))["status"] == "cancelled"
        listed = (await via_b.legacy(session_b, "tasks/list"))["result"]["tasks"]
        assert {t["taskId"] for t in listed} == {asking["taskId"], sleeping_id, legacy["taskId"], long["taskId"]}
        # Another principal reads none of them through either daemon.
        for daemon in (a, b):
            bob = Http(client, daemon.url, TOKENS["bob"])
            for task_id in (asking["taskId"], sleeping_id):
                status, reply = await bob.modern("tasks/get", {"taskId": task_id})
                assert error_code(reply) == -32602

        # A dies (SIGKILL) mid-task: B, which shares the store, fails its task (A's pid is gone).
        orphan = (await via_a.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 60}}))[1]
        orphan_id = orphan["result"]["taskId"]
        await sigkill(a)
        failed = await via_b.wait_task(orphan_id, TERMINAL, within=30)
        assert failed["status"] == "failed" and "stopped before it finished" in failed["error"]["message"]


async def test_a_task_cancelled_through_the_other_daemon_has_its_worker_stopped(
        tmp_path: Path, redis_server: RedisServer, make_plugin: Callable[..., Path]) -> None:
    async with two_daemons(tmp_path, redis_server, make_plugin) as (a, b, client):
        via_a = Http(client, a.url, TOKENS["alice"])
        via_b = Http(client, b.url, TOKENS["alice"])
        marker = tmp_path / "pid"
        sleeping = (await via_a.modern("tools/call", {"name": "pid_sleep", "arguments": {"marker": str(marker)}}))[1]
        sleeping_id = sleeping["result"]["taskId"]
        worker = await read_pid(marker)
        assert worker in descendants(a.pid)
        status, ack = await via_b.modern("tasks/cancel", {"taskId": sleeping_id})
        assert status == 200 and ack["result"]["resultType"] == "complete"
        assert (await via_a.wait_task(sleeping_id, TERMINAL))["status"] == "cancelled"
        await wait_pids_gone([worker], within=10)  # A stops the worker that ran it


async def test_legacy_tasks_result_through_the_other_daemon_relays_the_tasks_question(
        tmp_path: Path, redis_server: RedisServer, make_plugin: Callable[..., Path]) -> None:
    async with two_daemons(tmp_path, redis_server, make_plugin) as (a, b, client), trio.open_nursery() as nursery:
        via_a = Http(client, a.url, TOKENS["alice"])
        via_b = Http(client, b.url, TOKENS["alice"])
        session_a = await via_a.legacy_session(ELICIT)
        session_b = await via_b.legacy_session(ELICIT)
        task_id = (await via_a.legacy(session_a, "tools/call", {
            "name": "confirm_delete", "arguments": {"filename": "q.txt"}, "task": {}}))["result"]["task"]["taskId"]
        await via_b.legacy_wait(session_b, task_id, {"input_required"})
        # B's client listens everywhere a question could come: its session's GET stream and the
        # tasks/result POST's own stream.
        get_stream, post_stream = SseStream(), SseStream()
        await nursery.start(lambda task_status: get_stream.run(
            client, "GET", b.url, headers={**via_b.legacy_headers(session_b), "accept": "text/event-stream"},
            task_status=task_status))
        request = json.dumps({"jsonrpc": "2.0", "id": 77, "method": "tasks/result",
                              "params": {"taskId": task_id}}).encode()
        nursery.start_soon(lambda: post_stream.run(client, "POST", b.url, headers=via_b.legacy_headers(session_b),
                                                   content=request))
        asked = trio.Event()
        found: list[dict[str, Any]] = []

        async def watch(stream: SseStream) -> None:
            found.append(await stream.wait_for(lambda m: m.get("method") == "elicitation/create", within=60))
            asked.set()

        nursery.start_soon(watch, get_stream)
        nursery.start_soon(watch, post_stream)
        with trio.fail_after(8):
            await asked.wait()
        await via_b.legacy_answer(session_b, found[0]["id"], {"action": "accept", "content": {"confirm": True}})
        assert (await via_a.legacy_wait(session_a, task_id, TERMINAL))["status"] == "completed"
        nursery.cancel_scope.cancel()
