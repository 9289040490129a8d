"""A task's question round ends when it times out in the tool (``limits.ask_timeout_s``): the task is
``working`` again and lists no requests, and answers go only to the round they answer, never to a
later one (``TaskRun`` passes ``to=`` the round to the pool)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest
import trio
import trio.testing

from sandbox import wire

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "asking"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "http"))

MODERN = "2026-07-28"
FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
ANN = wire.InputResponse("name", "result", {"action": "accept", "content": {"name": "Ann"}})


# -- the task's side, with a pool that behaves like WorkerPool.answer -------------------------------------------


class _Pool:
    """What ``WorkerPool.answer`` does with ``to``: answers go only to the round the call waits on."""

    def __init__(self) -> None:
        self.asking: wire.Ask | None = None
        self.delivered: list[tuple[wire.Ask, list[wire.InputResponse]]] = []

    def answer(self, call: Any, handle: Any, responses: list[wire.InputResponse], missing: str = "error",
               why: str = "", to: wire.Ask | None = None) -> bool:
        ask = self.asking
        if ask is None or (to is not None and to is not ask):
            return False
        self.asking = None
        self.delivered.append((ask, responses))
        return True


class _Manager:
    def __init__(self, nursery: trio.Nursery, pool: _Pool) -> None:
        self.nursery = nursery
        self.calls = pool
        self.transitions: list[tuple[str, dict[str, Any]]] = []

    async def guarded(self, work: Any, task_id: str = "") -> None:
        await work

    async def transition(self, run: Any, status: str, **fields: Any) -> Any:
        self.transitions.append((status, fields))
        return SimpleNamespace(status=status)


def _run(nursery: trio.Nursery, ask_timeout_s: float) -> tuple[Any, _Manager, _Pool]:
    from runtime.tasks import TaskRun

    pool = _Pool()
    manager = _Manager(nursery, pool)
    limits = wire.Limits(ask_timeout_s=ask_timeout_s)
    call = SimpleNamespace(version=MODERN, client_caps={"elicitation": {"form": {}}}, modern=True,
                           entry=SimpleNamespace(runner=SimpleNamespace(limits=limits), name="t", plugin="p"))
    run = TaskRun(manager, SimpleNamespace(task_id="task-1"), call, "")  # type: ignore[arg-type]
    run.running = SimpleNamespace(call=call, handle=object())  # type: ignore[assignment]
    return run, manager, pool


def _round(message: str) -> wire.Ask:
    return wire.Ask(1, [wire.InputRequest("name", "elicitation/create", {"message": message, "requestedSchema": FORM})])


async def test_a_late_answer_never_lands_on_a_later_round(autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        run, manager, pool = _run(nursery, ask_timeout_s=60)
        first = _round("Name?")
        pool.asking = first
        await run._ask(first)
        assert run.open and manager.transitions[-1][0] == "input_required"
        # The first round timed out in the pool and the tool asked again, same key; the task has not
        # taken up the new round yet when the client's answer to the first one comes.
        second = _round("Name, once more?")
        pool.asking = second
        await run.take_answers({"name": ANN})
        assert pool.delivered == []  # not taken for the second round
        assert pool.asking is second
        await run._ask(second)
        await run.take_answers({"name": ANN})
        assert pool.delivered == [(second, [ANN])]
        nursery.cancel_scope.cancel()


async def test_a_round_that_times_out_leaves_the_task_working_with_no_requests(
        autojump_clock: trio.testing.MockClock) -> None:
    async with trio.open_nursery() as nursery:
        run, manager, pool = _run(nursery, ask_timeout_s=30)
        ask = _round("Name?")
        pool.asking = ask
        await run._ask(ask)
        await trio.sleep(29)
        assert run.open and manager.transitions[-1][0] == "input_required"
        await trio.sleep(2)
        pool.asking = None  # the pool answered the tool "timeout"
        assert not run.open and run.round is None
        assert manager.transitions[-1] == ("working", {"input_requests": None})
        before = len(manager.transitions)
        await run.take_answers({"name": ANN})  # late: ignored
        assert pool.delivered == [] and len(manager.transitions) == before
        # An answered round does not expire later.
        again = _round("Name again?")
        pool.asking = again
        await run._ask(again)
        await run.take_answers({"name": ANN})
        assert pool.delivered == [(again, [ANN])]
        count = len(manager.transitions)
        await trio.sleep(100)
        assert len(manager.transitions) == count
        nursery.cancel_scope.cancel()


# -- end to end: an in-process daemon, raw 2026-07-28 requests ---------------------------------------------------

PLUGIN = r'''
import time
from sandbox import current, tool
from sandbox.asking import InputTimeout

FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@tool(task_support="required")
def slow_ask() -> str:
    try:
        answer = current().elicit("Name?", FORM, key="name")
    except InputTimeout:
        time.sleep(3)
        return "tool heard: timeout"
    return f"tool heard: {answer.content!r}"
'''

EXT = "io.modelcontextprotocol/tasks"
META = {"io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": {"elicitation": {"form": {}}, "extensions": {EXT: {}}}}


async def _modern(client: httpx2.AsyncClient, url: str, method: str, params: dict[str, Any], name: str) -> Any:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": META}}
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
               "mcp-protocol-version": MODERN, "mcp-method": method, "mcp-name": name}
    with trio.fail_after(20):
        r = await client.post(url, content=json.dumps(body).encode(), headers=headers)
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        from httpkit import sse_messages

        return [m for m in sse_messages(r.text) if "id" in m][-1]
    return r.json()


async def _until(get: Any, done: Callable[[dict[str, Any]], bool], within: float) -> dict[str, Any]:
    """The first task record ``get`` returns for which ``done`` holds (polled, bounded)."""
    with trio.fail_after(within):
        while True:
            task: dict[str, Any] = await get()
            if done(task):
                return task
            await trio.sleep(0.05)


@pytest.mark.parametrize("late_answer", [False, True])
async def test_a_task_whose_question_timed_out_lists_no_requests(
        make_plugin: Callable[..., Path], tmp_path: Path, late_answer: bool) -> None:
    from ask_harness import serve_http

    plugins = make_plugin("p", PLUGIN, limits={"timeout_s": 20, "ask_timeout_s": 1})
    async with serve_http(plugins, tmp_path / "state") as srv, httpx2.AsyncClient(timeout=20) as client:
        created = (await _modern(client, srv.url, "tools/call", {"name": "slow_ask", "arguments": {}}, "slow_ask"))
        task_id = created["result"]["taskId"]

        async def get() -> dict[str, Any]:
            reply = await _modern(client, srv.url, "tasks/get", {"taskId": task_id}, task_id)
            return dict(reply["result"])

        task = await _until(get, lambda t: t["status"] == "input_required", 10)
        assert set(task["inputRequests"]) == {"name"}
        # The tool hears "timeout" after 1 s and works 3 s more: meanwhile the task is working and
        # asks nothing (it used to list the dead question until the tool finished).
        task = await _until(get, lambda t: t["status"] != "input_required", 2.5)
        assert task["status"] == "working" and not task.get("inputRequests"), task
        if late_answer:
            ack = await _modern(client, srv.url, "tasks/update", {"taskId": task_id, "inputResponses": {
                "name": {"action": "accept", "content": {"name": "Ann"}}}}, task_id)
            assert "result" in ack, ack
            assert (await get())["status"] == "working"
        task = await _until(get, lambda t: t["status"] in ("completed", "failed", "cancelled"), 10)
        assert task["status"] == "completed"
        assert task["result"]["content"][0]["text"] == "tool heard: timeout"
