"""MCP tasks end to end, both eras, stdio and HTTP, against real ``toolcell serve`` processes: a task
created, polled, its result served; answered while ``input_required``; cancelled (its worker
stopped); listed and read only by the principal that created it; the per-tool policy errors; the
per-principal cap and TTL expiry; ``notifications/tasks`` and ``notifications/tasks/status``.

The 2026-07-28 flows over stdio and HTTP run through the official SDK client (``mcp`` 2.3.0) with a
tasks extension of ours (``task_e2e.TasksExtension``); the 2025-11-25 flows use raw JSON-RPC, since
that SDK cannot create a 2025-11-25 task (see ``task_e2e``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
import trio
from mcp import Client, types
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError
from task_e2e import (
    CONFORMANCE,
    EXT,
    MODERN,
    RELATED,
    REPO,
    SUB_ID,
    TOKENS,
    WAIT_S,
    CreatedTask,
    Http,
    SseStream,
    TasksExtension,
    error_code,
    legacy_init,
    modern_meta,
    open_http_daemon,
    open_log,
    open_stdio,
    read_pid,
    sdk_cancel,
    sdk_get,
    sdk_update,
    sdk_wait,
    sleeper_plugin,
    stdio_status,
    stdio_wait_status,
    text_of,
    until,
    wait_pids_gone,
    write_config,
)

pytestmark = pytest.mark.filterwarnings("ignore:The logging capability is deprecated")

ELICIT = {"elicitation": {"form": {}}}
TERMINAL = {"completed", "failed", "cancelled"}


def _related(result: dict[str, Any], task_id: str) -> bool:
    return result.get("_meta", {}).get(RELATED) == {"taskId": task_id}


async def _elicit_yes(ctx: Any, params: Any) -> types.ElicitResult:
    """Declares the elicitation capability for the SDK client (2026-07-28 tasks never send requests)."""
    raise AssertionError("a 2026-07-28 task asks through tasks/get inputRequests, never with a request")


def _sdk_stdio(config: Path, *plugins: Path) -> StdioServerParameters:
    args = ["-m", "runtime.cli", "serve", "--stdio", "--no-watch", "--config", str(config),
            "--plugins", str(CONFORMANCE)]
    for folder in plugins:
        args += ["--plugins", str(folder)]
    return StdioServerParameters(command=sys.executable, args=args, cwd=str(REPO))


# -- 2025-11-25 over stdio ------------------------------------------------------------------------------


async def test_legacy_stdio_tasks_are_created_polled_and_their_outcome_served_by_tasks_result(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    config = write_config(tmp_path / "daemon")
    async with open_stdio(config, sleeper_plugin(make_plugin), log=tmp_path / "daemon.log") as peer:
        init = await legacy_init(peer)
        assert init["capabilities"]["tasks"] == {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
        listed = (await peer.request("tools/list"))["result"]["tools"]
        support = {t["name"]: t.get("execution", {}).get("taskSupport") for t in listed}
        assert support["slow_compute"] == "optional" and support["failing_job"] == "required"
        assert support["greet"] in (None, "forbidden")
        assert support["pid_sleep"] == "optional"  # from the manifest's [tools.pid_sleep]

        created = await peer.request("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0.3, "label": "e2e"},
                                                    "task": {"ttl": 60_000}})
        task = created["result"]["task"]
        assert task["status"] == "working" and task["ttl"] == 60_000 and task["pollInterval"] > 0
        assert len(task["taskId"]) >= 20 and task["createdAt"].endswith("Z")
        done = await stdio_wait_status(peer, task["taskId"], TERMINAL)
        assert done["status"] == "completed"
        result = (await peer.request("tasks/result", {"taskId": task["taskId"]}))["result"]
        assert text_of(result) == "computed e2e after 0.3 s" and not result.get("isError")
        assert _related(result, task["taskId"])

        # A tool error (isError) ends a 2025-11-25 task failed; tasks/result gives the tool's result.
        failing = (await peer.request("tools/call", {"name": "failing_job", "arguments": {}, "task": {}}))["result"]
        failed = await stdio_wait_status(peer, failing["task"]["taskId"], TERMINAL)
        assert failed["status"] == "failed"
        outcome = (await peer.request("tasks/result", {"taskId": failing["task"]["taskId"]}))["result"]
        assert outcome["isError"] is True and "failed" in text_of(outcome)
        assert _related(outcome, failing["task"]["taskId"])

        # A protocol error (the tool's RequestError) ends it failed; tasks/result gives that error.
        bad = (await peer.request("tools/call", {"name": "protocol_error_job", "arguments": {}, "task": {}}))["result"]
        assert (await stdio_wait_status(peer, bad["task"]["taskId"], TERMINAL))["status"] == "failed"
        error = await peer.request("tasks/result", {"taskId": bad["task"]["taskId"]})
        assert error_code(error) == -32602 and "invalid" in error["error"]["message"]

        everything = (await peer.request("tasks/list"))["result"]["tasks"]
        assert {t["taskId"] for t in everything} == {task["taskId"], failing["task"]["taskId"], bad["task"]["taskId"]}
        # notifications/tasks/status go to the connection that created the task (no related-task meta).
        status = await peer.wait_for(lambda m: m.get("method") == "notifications/tasks/status"
                                     and m["params"]["taskId"] == task["taskId"] and m["params"]["status"] == "completed")
        assert "_meta" not in status["params"] and status["params"]["ttl"] == 60_000
        unknown = await peer.request("tasks/get", {"taskId": "no-such-task-000000000000"})
        assert error_code(unknown) == -32602


async def test_legacy_stdio_questions_of_an_input_required_task_come_through_tasks_result(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    config = write_config(tmp_path / "daemon")
    async with open_stdio(config, sleeper_plugin(make_plugin), log=tmp_path / "daemon.log") as peer:
        await legacy_init(peer, ELICIT)
        created = await peer.request("tools/call", {"name": "confirm_delete", "arguments": {"filename": "report.txt"},
                                                    "task": {}})
        task_id = created["result"]["task"]["taskId"]
        waiting = await stdio_wait_status(peer, task_id, {"input_required"} | TERMINAL)
        assert waiting["status"] == "input_required"
        # Nothing is asked until someone waits in tasks/result: then the question comes on its connection.
        assert not [m for m in peer.messages if m.get("method") == "elicitation/create"]
        result_id = await peer.start_request("tasks/result", {"taskId": task_id})
        ask = await peer.wait_for(lambda m: m.get("method") == "elicitation/create")
        assert ask["params"]["message"] == "Delete report.txt?"
        assert ask["params"]["_meta"][RELATED] == {"taskId": task_id}
        await peer.send({"jsonrpc": "2.0", "id": ask["id"], "result": {"action": "accept", "content": {"confirm": True}}})
        result = (await peer.response(result_id))["result"]
        assert text_of(result) == "Deleted report.txt" and _related(result, task_id)
        assert (await stdio_status(peer, task_id))["status"] == "completed"
        seen = [m["params"]["status"] for m in peer.notifications("notifications/tasks/status")
                if m["params"]["taskId"] == task_id]
        assert "input_required" in seen and seen[-1] == "completed"

        # Two questions at once: both are asked; both answers complete it.
        multi = (await peer.request("tools/call", {"name": "multi_input", "arguments": {}, "task": {}}))["result"]
        multi_id = multi["task"]["taskId"]
        await stdio_wait_status(peer, multi_id, {"input_required"})
        result_id = await peer.start_request("tasks/result", {"taskId": multi_id})
        asks: list[dict[str, Any]] = []
        for message in ("What is your name?", "Proceed?"):
            asks.append(await peer.wait_for(lambda m, message=message: m.get("method") == "elicitation/create"
                                            and m["params"]["message"] == message))
        answers = [{"name": "Ann"}, {"confirm": True}]
        for ask, content in zip(asks, answers, strict=True):
            assert ask["params"]["_meta"][RELATED] == {"taskId": multi_id}
            await peer.send({"jsonrpc": "2.0", "id": ask["id"], "result": {"action": "accept", "content": content}})
        result = (await peer.response(result_id))["result"]
        assert text_of(result) == "Ann: proceeding" and _related(result, multi_id)

        # Waiting in tasks/result before the task asks: the question comes when it is asked.
        later = (await peer.request("tools/call", {"name": "ask_later", "arguments": {}, "task": {}}))["result"]
        later_id = later["task"]["taskId"]
        result_id = await peer.start_request("tasks/result", {"taskId": later_id})
        ask = await peer.wait_for(lambda m: m.get("method") == "elicitation/create"
                                  and m["params"]["message"] == "Go on?")
        assert ask["params"]["_meta"][RELATED] == {"taskId": later_id}
        await peer.send({"jsonrpc": "2.0", "id": ask["id"], "result": {"action": "accept", "content": {"go": True}}})
        result = (await peer.response(result_id))["result"]
        assert text_of(result) == "went on" and _related(result, later_id)


async def test_legacy_stdio_cancel_stops_the_worker_and_cancelling_a_finished_task_is_invalid_params(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    config = write_config(tmp_path / "daemon")
    marker = tmp_path / "pid"
    async with open_stdio(config, sleeper_plugin(make_plugin), log=tmp_path / "daemon.log") as peer:
        await legacy_init(peer)
        created = await peer.request("tools/call", {"name": "pid_sleep", "arguments": {"marker": str(marker)},
                                                    "task": {}})
        task_id = created["result"]["task"]["taskId"]
        worker = await read_pid(marker)
        cancelled = await peer.request("tasks/cancel", {"taskId": task_id})
        assert cancelled["result"]["taskId"] == task_id and cancelled["result"]["status"] == "cancelled"
        await wait_pids_gone([worker])  # the worker that ran it is stopped
        assert (await stdio_status(peer, task_id))["status"] == "cancelled"
        again = await peer.request("tasks/cancel", {"taskId": task_id})
        assert error_code(again) == -32602
        await peer.wait_for(lambda m: m.get("method") == "notifications/tasks/status"
                            and m["params"]["taskId"] == task_id and m["params"]["status"] == "cancelled")

        finished = (await peer.request("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0},
                                                      "task": {}}))["result"]["task"]["taskId"]
        await stdio_wait_status(peer, finished, {"completed"})
        assert error_code(await peer.request("tasks/cancel", {"taskId": finished})) == -32602
        assert (await stdio_status(peer, finished))["status"] == "completed"
        # The plugin still serves (a new worker): the pool replaced the stopped one.
        quick = (await peer.request("tools/call", {"name": "quick_or_slow", "arguments": {}}))["result"]
        assert text_of(quick) == "done after 0.0 s"


# -- 2025-11-25 over HTTP -----------------------------------------------------------------------------------


async def test_legacy_http_tasks_belong_to_their_principal_and_questions_come_on_the_tasks_result_stream(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    config = write_config(tmp_path / "daemon", tokens=True)
    marker = tmp_path / "pid"
    async with open_http_daemon(config, sleeper_plugin(make_plugin), log=tmp_path / "daemon.log") as daemon, \
            httpx2.AsyncClient(timeout=WAIT_S) as client, trio.open_nursery() as nursery:
        alice = Http(client, daemon.url, TOKENS["alice"])
        bob = Http(client, daemon.url, TOKENS["bob"])
        a_session = await alice.legacy_session(ELICIT)
        b_session = await bob.legacy_session()
        stream = SseStream()
        await nursery.start(lambda task_status: stream.run(
            client, "GET", daemon.url, headers={**alice.legacy_headers(a_session), "accept": "text/event-stream"},
            task_status=task_status))
        assert stream.status == 200

        def create(who: Http, session: str, name: str, arguments: dict[str, Any]) -> Any:
            return who.legacy(session, "tools/call", {"name": name, "arguments": arguments, "task": {}})

        asking = (await create(alice, a_session, "confirm_delete", {"filename": "a.txt"}))["result"]["task"]["taskId"]
        quick = (await create(alice, a_session, "slow_compute", {"seconds": 0}))["result"]["task"]["taskId"]
        bobs = (await create(bob, b_session, "slow_compute", {"seconds": 0}))["result"]["task"]["taskId"]

        a_list = (await alice.legacy(a_session, "tasks/list"))["result"]["tasks"]
        b_list = (await bob.legacy(b_session, "tasks/list"))["result"]["tasks"]
        assert {t["taskId"] for t in a_list} == {asking, quick}
        assert {t["taskId"] for t in b_list} == {bobs}
        for method in ("tasks/get", "tasks/result", "tasks/cancel"):
            assert error_code(await alice.legacy(a_session, method, {"taskId": bobs})) == -32602, method
            assert error_code(await bob.legacy(b_session, method, {"taskId": asking})) == -32602, method
        assert (await bob.legacy_wait(b_session, bobs, TERMINAL))["status"] == "completed"

        # The question of alice's task comes on the stream of her tasks/result request (not on the GET
        # stream, which carries only what relates to no request); its status notifications on the GET stream.
        await alice.legacy_wait(a_session, asking, {"input_required"})
        waiting = SseStream()
        request = json.dumps({"jsonrpc": "2.0", "id": 77, "method": "tasks/result", "params": {"taskId": asking}})
        nursery.start_soon(lambda: waiting.run(client, "POST", daemon.url, headers=alice.legacy_headers(a_session),
                                               content=request.encode()))
        ask = await waiting.wait_for(lambda m: m.get("method") == "elicitation/create")
        assert ask["params"]["_meta"][RELATED] == {"taskId": asking}
        await alice.legacy_answer(a_session, ask["id"], {"action": "accept", "content": {"confirm": True}})
        done = await waiting.wait_for(lambda m: m.get("id") == 77)
        assert text_of(done["result"]) == "Deleted a.txt" and _related(done["result"], asking)
        await stream.wait_for(lambda m: m.get("method") == "notifications/tasks/status"
                              and m["params"]["taskId"] == asking and m["params"]["status"] == "completed")

        # Cancelled over HTTP: the worker is stopped.
        sleeping = (await create(alice, a_session, "pid_sleep", {"marker": str(marker)}))["result"]["task"]["taskId"]
        worker = await read_pid(marker)
        cancelled = await alice.legacy(a_session, "tasks/cancel", {"taskId": sleeping})
        assert cancelled["result"]["status"] == "cancelled"
        await wait_pids_gone([worker])
        assert (await alice.legacy_status(a_session, sleeping))["status"] == "cancelled"
        assert error_code(await alice.legacy(a_session, "tasks/cancel", {"taskId": sleeping})) == -32602
        nursery.cancel_scope.cancel()


def _async_value(box: list[Any]) -> Callable[[], Any]:
    async def fetch() -> list[Any]:
        return box

    return fetch


# -- 2026-07-28 with the SDK client -----------------------------------------------------------------------------


async def _modern_task_flows(client: Client, marker: Path) -> None:
    """The 2026-07-28 flows, run through one SDK client (stdio or HTTP)."""
    created = await client.session.call_tool("slow_compute", {"seconds": 0.3, "label": "sdk"}, allow_claimed=True)
    assert isinstance(created, CreatedTask) and created.status == "working"
    assert created.ttl_ms is not None and created.ttl_ms > 0 and created.poll_interval_ms
    done = await sdk_wait(client, created.task_id, TERMINAL)
    assert done["status"] == "completed" and done["resultType"] == "complete"
    assert text_of(done["result"]) == "computed sdk after 0.3 s"

    # input_required: the question is in tasks/get, the answer comes with tasks/update.
    asking = await client.session.call_tool("confirm_delete", {"filename": "b.txt"}, allow_claimed=True)
    assert isinstance(asking, CreatedTask)
    waiting = await sdk_wait(client, asking.task_id, {"input_required"} | TERMINAL)
    assert waiting["status"] == "input_required"
    [(key, request)] = waiting["inputRequests"].items()
    assert request["method"] == "elicitation/create" and request["params"]["message"] == "Delete b.txt?"
    ack = await sdk_update(client, asking.task_id, {key: {"action": "accept", "content": {"confirm": True}}})
    assert ack["resultType"] == "complete"
    assert text_of((await sdk_wait(client, asking.task_id, TERMINAL))["result"]) == "Deleted b.txt"

    # Two questions: a partial answer leaves only the other one open.
    multi = await client.session.call_tool("multi_input", {}, allow_claimed=True)
    assert isinstance(multi, CreatedTask)
    both = (await sdk_wait(client, multi.task_id, {"input_required"}))["inputRequests"]
    assert len(both) == 2
    name_key = next(k for k, r in both.items() if r["params"]["message"] == "What is your name?")
    other_key = next(k for k in both if k != name_key)
    await sdk_update(client, multi.task_id, {name_key: {"action": "accept", "content": {"name": "Ann"}},
                                             "no-such-key": {"action": "decline"}})
    left = await until(lambda: sdk_get(client, multi.task_id),
                       lambda t: t["status"] != "input_required" or set(t["inputRequests"]) == {other_key})
    assert left["status"] == "input_required" and set(left["inputRequests"]) == {other_key}
    await sdk_update(client, multi.task_id, {other_key: {"action": "accept", "content": {"confirm": True}}})
    assert text_of((await sdk_wait(client, multi.task_id, TERMINAL))["result"]) == "Ann: proceeding"

    # A tool error (isError) is completed in this era; a protocol error is failed with that error.
    tool_error = await client.session.call_tool("failing_job", {}, allow_claimed=True)
    assert isinstance(tool_error, CreatedTask)
    ended = await sdk_wait(client, tool_error.task_id, TERMINAL)
    assert ended["status"] == "completed" and ended["result"]["isError"] is True
    protocol_error = await client.session.call_tool("protocol_error_job", {}, allow_claimed=True)
    assert isinstance(protocol_error, CreatedTask)
    failed = await sdk_wait(client, protocol_error.task_id, TERMINAL)
    assert failed["status"] == "failed" and failed["error"]["code"] == -32602 and "result" not in failed

    # Cancelled: acknowledged, the worker stopped, the task cancelled; cancelling again is acknowledged too.
    sleeping = await client.session.call_tool("pid_sleep", {"marker": str(marker)}, allow_claimed=True)
    assert isinstance(sleeping, CreatedTask)
    worker = await read_pid(marker)
    assert (await sdk_cancel(client, sleeping.task_id))["resultType"] == "complete"
    await wait_pids_gone([worker])
    assert (await sdk_wait(client, sleeping.task_id, TERMINAL))["status"] == "cancelled"
    assert (await sdk_cancel(client, sleeping.task_id))["resultType"] == "complete"

    # A tool whose policy makes a task only after task_after_ms: a quick call is answered inline.
    inline = await client.session.call_tool("quick_or_slow", {"seconds": 0}, allow_claimed=True)
    assert isinstance(inline, types.CallToolResult) and inline.content[0].text == "done after 0.0 s"
    later = await client.session.call_tool("quick_or_slow", {"seconds": 60}, allow_claimed=True)
    assert isinstance(later, CreatedTask) and later.status == "working"
    assert (await sdk_cancel(client, later.task_id))["resultType"] == "complete"
    # A tool that never runs as a task answers inline, extension or not.
    greeting = await client.session.call_tool("greet", {"name": "Bo"}, allow_claimed=True)
    assert isinstance(greeting, types.CallToolResult) and greeting.content[0].text == "Hello, Bo!"

    with pytest.raises(MCPError) as unknown:
        await sdk_get(client, "no-such-task-000000000000")
    assert unknown.value.code == -32602


async def test_modern_stdio_sdk_client_creates_polls_answers_and_cancels_tasks(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    config = write_config(tmp_path / "daemon")
    params = _sdk_stdio(config, sleeper_plugin(make_plugin))
    with open_log(tmp_path / "daemon.log", "w") as err, trio.fail_after(90):
        async with Client(stdio_client(params, errlog=err), mode=MODERN, extensions=[TasksExtension()],
                          elicitation_callback=_elicit_yes) as client:
            await _modern_task_flows(client, tmp_path / "pid")


async def test_modern_http_sdk_client_creates_polls_answers_and_cancels_tasks(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    config = write_config(tmp_path / "daemon", tokens=True)
    async with open_http_daemon(config, sleeper_plugin(make_plugin), log=tmp_path / "daemon.log") as daemon:
        http = create_mcp_http_client(headers={"authorization": f"Bearer {TOKENS['alice']}"})
        with trio.fail_after(90):
            async with http, Client(streamable_http_client(daemon.url, http_client=http), mode="auto",
                                    extensions=[TasksExtension()], elicitation_callback=_elicit_yes) as client:
                # The SDK probes server/discover, which advertises the extension.
                found = client.session.discover_result
                assert client.protocol_version == MODERN and found is not None
                assert EXT in (found.capabilities.extensions or {})
                await _modern_task_flows(client, tmp_path / "pid")


# -- 2026-07-28 over raw HTTP: principals, Mcp-Name, policy errors ----------------------------------------------


async def test_modern_http_another_principals_task_reads_as_unknown_and_mcp_name_must_match(
        tmp_path: Path) -> None:
    config = write_config(tmp_path / "daemon", tokens=True)
    async with open_http_daemon(config, log=tmp_path / "daemon.log") as daemon, \
            httpx2.AsyncClient(timeout=WAIT_S) as client:
        alice = Http(client, daemon.url, TOKENS["alice"])
        bob = Http(client, daemon.url, TOKENS["bob"])
        status, created = await alice.modern("tools/call", {"name": "confirm_delete", "arguments": {"filename": "c"}},
                                             caps=ELICIT)
        assert status == 200 and created["result"]["resultType"] == "task"
        task_id = created["result"]["taskId"]
        waiting = await alice.wait_task(task_id, {"input_required"})
        [key] = waiting["inputRequests"]
        for method, params in (("tasks/get", {}), ("tasks/cancel", {}),
                               ("tasks/update", {"inputResponses": {key: {"action": "accept",
                                                                          "content": {"confirm": True}}}})):
            status, reply = await bob.modern(method, {"taskId": task_id, **params})
            assert error_code(reply) == -32602, (method, reply)
        # Bob's attempts changed nothing.
        assert (await alice.task_get(task_id))["status"] == "input_required"
        # Mcp-Name must carry the taskId.
        status, reply = await alice.modern("tasks/get", {"taskId": task_id}, name="another-task-id-0000")
        assert status == 400 and error_code(reply) == -32020
        status, reply = await alice.modern("tasks/update", {"taskId": task_id, "inputResponses": {
            key: {"action": "accept", "content": {"confirm": False}}}})
        assert status == 200 and reply["result"]["resultType"] == "complete"
        done = await alice.wait_task(task_id, {"completed", "failed", "cancelled"})
        assert text_of(done["result"]) == "Kept c"


async def test_task_policy_errors_for_both_eras(tmp_path: Path) -> None:
    config = write_config(tmp_path / "daemon")
    async with open_http_daemon(config, log=tmp_path / "daemon.log") as daemon, \
            httpx2.AsyncClient(timeout=WAIT_S) as client:
        http = Http(client, daemon.url)
        # 2025-11-25: a forbidden tool asked as a task, a required one asked without: -32601.
        session = await http.legacy_session()
        forbidden = await http.legacy(session, "tools/call", {"name": "greet", "arguments": {"name": "x"}, "task": {}})
        assert error_code(forbidden) == -32601
        required = await http.legacy(session, "tools/call", {"name": "failing_job", "arguments": {}})
        assert error_code(required) == -32601
        assert "task" not in (await http.legacy(session, "tools/call", {"name": "greet", "arguments": {"name": "x"}}))[
            "result"]

        # 2026-07-28 without the extension: a required tool and every tasks/* method get -32021 with data.
        wanted = {"requiredCapabilities": {"extensions": {EXT: {}}}}
        status, reply = await http.modern("tools/call", {"name": "failing_job", "arguments": {}}, ext=False)
        assert error_code(reply) == -32021 and reply["error"]["data"] == wanted
        for method, params in (("tasks/get", {}), ("tasks/cancel", {}), ("tasks/update", {"inputResponses": {}})):
            status, reply = await http.modern(method, {"taskId": "some-task-id-000000000", **params}, ext=False)
            assert error_code(reply) == -32021 and reply["error"]["data"] == wanted, (method, reply)
        headers, body = http.modern_request("subscriptions/listen", {"notifications": {"taskIds": ["t-000000000"]}},
                                            ext=False)
        r = await client.post(daemon.url, content=body, headers=headers)
        assert r.json()["error"]["code"] == -32021 and r.json()["error"]["data"] == wanted
        # An optional tool is an ordinary call for a client without the extension, a task for one with it.
        status, plain = await http.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0}}, ext=False)
        assert plain["result"]["resultType"] == "complete" and "taskId" not in plain["result"]
        status, task = await http.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0}})
        assert task["result"]["resultType"] == "task"
        status, required_task = await http.modern("tools/call", {"name": "failing_job", "arguments": {}})
        assert required_task["result"]["resultType"] == "task"
        discovered = (await http.modern("server/discover", ext=False))[1]["result"]
        assert EXT in discovered["capabilities"]["extensions"]


# -- caps and TTL ---------------------------------------------------------------------------------------------


async def test_a_principal_over_its_live_task_cap_is_refused_and_expired_tasks_read_as_unknown(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    config = write_config(tmp_path / "daemon", tasks={"max_live_per_principal": 1, "default_ttl_ms": 1000,
                                                      "max_ttl_ms": 2000})
    async with open_stdio(config, sleeper_plugin(make_plugin), log=tmp_path / "daemon.log") as peer:
        await legacy_init(peer)
        live = (await peer.request("tools/call", {"name": "pid_sleep", "arguments": {"marker": str(tmp_path / "pid")},
                                                  "task": {"ttl": 60_000}}))["result"]["task"]
        assert live["ttl"] == 2000  # the requested ttl, capped by max_ttl_ms
        refused = await peer.request("tools/call", {"name": "slow_compute", "arguments": {}, "task": {}})
        assert refused["error"]["code"] == -31001 and "Too many live tasks" in refused["error"]["message"]
        modern = await peer.request("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0},
                                                   "_meta": modern_meta()})
        assert "error" in modern and "Too many live tasks" in modern["error"]["message"], modern
        await peer.request("tasks/cancel", {"taskId": live["taskId"]})
        # Room again: a finished task does not count.
        kept = (await peer.request("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0},
                                                  "task": {}}))["result"]["task"]
        assert kept["ttl"] == 1000  # default_ttl_ms
        await stdio_wait_status(peer, kept["taskId"], {"completed"})
        fresh = (await peer.request("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0},
                                                   "_meta": modern_meta()}))["result"]
        assert fresh["resultType"] == "task" and fresh["ttlMs"] == 1000

        async def legacy_get(task_id: str) -> dict[str, Any]:
            return await peer.request("tasks/get", {"taskId": task_id})

        for task_id in (live["taskId"], kept["taskId"]):
            gone = await until(lambda task_id=task_id: legacy_get(task_id), lambda r: "error" in r, 15, pause=0.2)
            assert error_code(gone) == -32602
        expired = await until(lambda: peer.request("tasks/get", {"taskId": fresh["taskId"], "_meta": modern_meta()}),
                              lambda r: "error" in r, 15, pause=0.2)
        assert error_code(expired) == -32602
        assert (await peer.request("tasks/list"))["result"]["tasks"] == []
        assert error_code(await peer.request("tasks/result", {"taskId": kept["taskId"]})) == -32602


# -- notifications ---------------------------------------------------------------------------------------------


async def _listen(client: httpx2.AsyncClient, who: Http, task_ids: list[str], nursery: trio.Nursery
                  ) -> tuple[SseStream, int]:
    headers, body = who.modern_request("subscriptions/listen", {"notifications": {"taskIds": task_ids}})
    listen_id = who._ids[0]
    stream = SseStream()
    await nursery.start(lambda task_status: stream.run(client, "POST", who.url, headers=headers, content=body,
                                                       task_status=task_status))
    assert stream.status == 200
    return stream, listen_id


async def test_modern_notifications_tasks_arrive_on_a_listen_stream_with_the_subscription_id(tmp_path: Path) -> None:
    config = write_config(tmp_path / "daemon", tokens=True)
    async with open_http_daemon(config, log=tmp_path / "daemon.log") as daemon, \
            httpx2.AsyncClient(timeout=WAIT_S) as client, trio.open_nursery() as nursery:
        alice = Http(client, daemon.url, TOKENS["alice"])
        created = (await alice.modern("tools/call", {"name": "confirm_delete", "arguments": {"filename": "n"}},
                                      caps=ELICIT))[1]["result"]
        task_id = created["taskId"]
        waiting = await alice.wait_task(task_id, {"input_required"})
        stream, listen_id = await _listen(client, alice, [task_id], nursery)
        ack = await stream.wait_for(lambda m: m.get("method") == "notifications/subscriptions/acknowledged")
        assert ack["params"]["_meta"][SUB_ID] == listen_id
        [key] = waiting["inputRequests"]
        await alice.modern("tasks/update", {"taskId": task_id,
                                            "inputResponses": {key: {"action": "accept", "content": {"confirm": True}}}})
        done = await stream.wait_for(lambda m: m.get("method") == "notifications/tasks"
                                     and m["params"]["status"] == "completed")
        assert done["params"]["taskId"] == task_id and done["params"]["_meta"][SUB_ID] == listen_id
        assert text_of(done["params"]["result"]) == "Deleted n" and done["params"]["ttlMs"] == created["ttlMs"]
        transitions = [m["params"]["status"] for m in stream.messages if m.get("method") == "notifications/tasks"]
        assert transitions[-1] == "completed" and set(transitions) <= {"working", "completed"}
        assert all(m.get("method") not in ("notifications/progress", "notifications/message") for m in stream.messages)
        nursery.cancel_scope.cancel()


async def test_modern_listen_acknowledgement_lists_the_task_ids_it_agreed_to(tmp_path: Path) -> None:
    config = write_config(tmp_path / "daemon", tokens=True)
    async with open_http_daemon(config, log=tmp_path / "daemon.log") as daemon, \
            httpx2.AsyncClient(timeout=WAIT_S) as client, trio.open_nursery() as nursery:
        alice = Http(client, daemon.url, TOKENS["alice"])
        created = (await alice.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 30}}))[1]
        task_id = created["result"]["taskId"]
        stream, listen_id = await _listen(client, alice, [task_id], nursery)
        ack = await stream.wait_for(lambda m: m.get("method") == "notifications/subscriptions/acknowledged")
        await alice.modern("tasks/cancel", {"taskId": task_id})
        nursery.cancel_scope.cancel()
        assert ack["params"]["notifications"].get("taskIds") == [task_id]


async def test_legacy_tasks_result_serves_a_result_that_ends_while_it_waits(tmp_path: Path) -> None:
    config = write_config(tmp_path / "daemon", tasks={"poll_interval_ms": 3000, "default_ttl_ms": 2000})
    async with open_stdio(config, log=tmp_path / "daemon.log") as peer:
        await legacy_init(peer)
        created = await peer.request("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0.2},
                                                    "task": {"ttl": 2000}})
        task_id = created["result"]["task"]["taskId"]
        reply = await peer.request("tasks/result", {"taskId": task_id})  # waits while the task works
        assert "result" in reply, reply
        assert text_of(reply["result"]) == "computed result after 0.2 s"


async def test_legacy_http_tasks_result_carries_the_tasks_question_on_its_own_stream(tmp_path: Path) -> None:
    config = write_config(tmp_path / "daemon")
    async with open_http_daemon(config, log=tmp_path / "daemon.log") as daemon, \
            httpx2.AsyncClient(timeout=WAIT_S) as client, trio.open_nursery() as nursery:
        http = Http(client, daemon.url)
        session = await http.legacy_session(ELICIT)  # no GET stream: it is optional for a client
        task_id = (await http.legacy(session, "tools/call", {"name": "confirm_delete", "arguments": {"filename": "s"},
                                                             "task": {}}))["result"]["task"]["taskId"]
        await http.legacy_wait(session, task_id, {"input_required"})
        stream = SseStream()
        request = json.dumps({"jsonrpc": "2.0", "id": 91, "method": "tasks/result", "params": {"taskId": task_id}})
        nursery.start_soon(lambda: stream.run(client, "POST", daemon.url, headers=http.legacy_headers(session),
                                              content=request.encode()))
        ask = await stream.wait_for(lambda m: m.get("method") == "elicitation/create", within=8)
        assert ask["params"]["_meta"][RELATED] == {"taskId": task_id}
        await http.legacy_answer(session, ask["id"], {"action": "accept", "content": {"confirm": True}})
        done = await stream.wait_for(lambda m: m.get("id") == 91)
        assert text_of(done["result"]) == "Deleted s"
        nursery.cancel_scope.cancel()
