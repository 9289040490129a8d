"""Harness of the end-to-end task tests: real ``toolcell serve`` processes (stdio and HTTP), each with
a config file of its own (its own ``state_dir``, so no two tests share a task store), raw JSON-RPC
peers for both transports, and a tasks extension for the official SDK client (``mcp`` 2.3.0).

The SDK client has no tasks support of its own: it carries the 2025-11-25 task types, but its
``tools/call`` validates every result as a ``CallToolResult``, so it cannot create a 2025-11-25 task
(a ``{"task": …}`` answer fails its validation). Its extension interface does cover the 2026-07-28
flow: a ``ResultClaim`` for ``resultType: "task"`` and ``send_request`` with requests of our own
(``TasksGet``, ``TasksUpdate``, ``TasksCancel``, carrying ``Mcp-Name`` over HTTP). The 2025-11-25
flows are therefore driven with raw JSON-RPC.

Every wait is bounded (``trio.fail_after``); nothing asserts on durations.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx2
import mcp_types
import psutil
import trio
from mcp import types
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from pydantic import ConfigDict, TypeAdapter

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from stdio_peer import CONFORMANCE, REPO, StdioPeer, kill_process_tree, open_log, open_toolcell  # noqa: E402

LEGACY = "2025-11-25"
MODERN = "2026-07-28"
EXT = "io.modelcontextprotocol/tasks"
RELATED = "io.modelcontextprotocol/related-task"
SUB_ID = "io.modelcontextprotocol/subscriptionId"
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPS = "io.modelcontextprotocol/clientCapabilities"
WAIT_S = 20.0

TOKENS = {"alice": "tok-alice-7d1c0e8a5b", "bob": "tok-bob-19f04c2e6d"}

#: A plugin of the tests: ``pid_sleep`` writes its worker's pid to a file, then sleeps (cancel
#: targets); ``quick_or_slow`` becomes a 2026-07-28 task only when it runs past ``task_after_ms``;
#: ``ask_later`` works a while before it asks.
#: Their task support comes from the manifest's ``[tools.NAME]`` tables, not the decorator.
SLEEPER = '''
import os
import time

from sandbox import current, tool


@tool
def pid_sleep(marker: str, seconds: float = 60.0) -> str:
    """Write this worker's pid to ``marker``, then sleep.

    Args:
        marker: The file that receives the pid.
        seconds: How long to sleep.
    """
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    return "slept"


@tool
def quick_or_slow(seconds: float = 0.0) -> str:
    """Sleep a while (or not), then answer.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return f"done after {seconds} s"


@tool
def ask_later(seconds: float = 0.5) -> str:
    """Work a while, then ask whether to go on.

    Args:
        seconds: How long to work before asking.
    """
    time.sleep(seconds)
    answer = current().elicit("Go on?", {"type": "object", "properties": {"go": {"type": "boolean"}},
                                         "required": ["go"]})
    go = answer.accepted and isinstance(answer.content, dict) and answer.content.get("go") is True
    return "went on" if go else "stopped"
'''

SLEEPER_MANIFEST = {"tools": {"pid_sleep": {"task_support": "optional"}, "ask_later": {"task_support": "optional"},
                              "quick_or_slow": {"task_support": "optional", "task_after_ms": 1500}}}


def sleeper_plugin(make_plugin: Callable[..., Path]) -> Path:
    """The folder of plugins holding ``sleeper`` (for ``--plugins``)."""
    return make_plugin("sleeper", SLEEPER, manifest=SLEEPER_MANIFEST,
                       limits={"timeout_s": 120, "max_concurrency": 4})


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def _toml(value: Any) -> str:
    return json.dumps(value)  # strings, numbers and booleans are written alike in TOML


def write_config(folder: Path, *, tasks: dict[str, Any] | None = None, tokens: bool = False,
                 state_dir: Path | None = None, key_file: Path | None = None, name: str = "toolcell.toml") -> Path:
    """A daemon config in ``folder``: its own state dir, no sandboxing (``policy = "none"``), one
    pre-started worker per plugin, the given ``[tasks]`` settings and, with ``tokens``, the bearer
    tokens of the principals ``alice`` and ``bob``."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ['policy = "none"', "min_workers = 1", "watch = false",
             f"state_dir = {_toml(str(state_dir or folder / 'state'))}"]
    if key_file is not None:
        lines.append(f"state_key_file = {_toml(str(key_file))}")
    if tasks:
        lines.append("[tasks]")
        lines += [f"{k} = {_toml(v)}" for k, v in tasks.items()]
    if tokens:
        for principal, token in TOKENS.items():
            lines += ["[[http.tokens]]", f"principal = {_toml(principal)}", f"sha256 = {_toml(sha(token))}"]
    path = folder / name
    path.write_text("\n".join(lines) + "\n")
    return path


async def until(fetch: Callable[[], Awaitable[Any]], done: Callable[[Any], bool], within: float = WAIT_S,
                pause: float = 0.05) -> Any:
    """Call ``fetch`` until ``done`` holds for what it returns (a bounded wait); returns that value."""
    with trio.fail_after(within):
        while True:
            value = await fetch()
            if done(value):
                return value
            await trio.sleep(pause)


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


async def read_pid(marker: Path, within: float = WAIT_S) -> int:
    """The pid a ``pid_sleep`` call wrote (waits for the file)."""

    async def fetch() -> str:
        return read_text(marker)

    return int(await until(fetch, lambda text: text.strip().isdigit(), within))


def pid_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def wait_pids_gone(pids: list[int], within: float = WAIT_S) -> None:
    async def fetch() -> list[int]:
        return [p for p in pids if not pid_gone(p)]

    await until(fetch, lambda alive: not alive, within)


def text_of(result: dict[str, Any]) -> str:
    return " ".join(c.get("text", "") for c in result.get("content", []) if c.get("type") == "text")


# -- stdio ------------------------------------------------------------------------------------------


@asynccontextmanager
async def open_stdio(config: Path, *plugins: Path, log: Path) -> AsyncIterator[StdioPeer]:
    """``toolcell serve --stdio --config CONFIG`` with the conformance fixtures and ``plugins``."""
    async with open_toolcell(CONFORMANCE, *plugins, extra=("--config", str(config)), stderr_path=log) as peer:
        yield peer


async def legacy_init(peer: StdioPeer, capabilities: dict[str, Any] | None = None) -> dict[str, Any]:
    """The 2025-11-25 handshake (with the given client capabilities)."""
    reply = await peer.request("initialize", {"protocolVersion": LEGACY, "capabilities": capabilities or {},
                                              "clientInfo": {"name": "task-e2e", "version": "1"}})
    assert reply["result"]["protocolVersion"] == LEGACY, reply
    await peer.notify("notifications/initialized")
    return reply["result"]


async def stdio_status(peer: StdioPeer, task_id: str) -> dict[str, Any]:
    """A 2025-11-25 ``tasks/get`` over stdio: the Task."""
    reply = await peer.request("tasks/get", {"taskId": task_id})
    assert "result" in reply, reply
    return reply["result"]


async def stdio_wait_status(peer: StdioPeer, task_id: str, statuses: set[str]) -> dict[str, Any]:
    return await until(lambda: stdio_status(peer, task_id), lambda task: task["status"] in statuses)


def error_code(reply: dict[str, Any]) -> int | None:
    return reply.get("error", {}).get("code")


# -- HTTP -------------------------------------------------------------------------------------------


@dataclass
class HttpDaemon:
    proc: trio.Process
    url: str
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid


async def start_http(config: Path, *plugins: Path, log: Path) -> HttpDaemon:
    """``toolcell serve --http 127.0.0.1:0`` in a session of its own; waits for its endpoint line."""
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--config", str(config), "--http", "127.0.0.1:0",
           "--no-watch", "--plugins", str(CONFORMANCE)]
    for folder in plugins:
        cmd += ["--plugins", str(folder)]
    with open_log(log, "wb") as errfile:
        proc = await trio.lowlevel.open_process(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                stderr=errfile, cwd=str(REPO), start_new_session=True,
                                                env={**os.environ, "PYTHONPATH": str(REPO)})
    daemon = HttpDaemon(proc, "", log)

    async def fetch() -> str:
        if proc.poll() is not None:
            raise AssertionError(f"toolcell serve exited early:\n{read_text(log)[-4000:]}")
        return read_text(log)

    try:
        text = await until(fetch, lambda t: re.search(r"MCP endpoint (http://\S+)", t) is not None, 60)
    except BaseException:
        kill_process_tree(proc.pid)
        raise
    match = re.search(r"MCP endpoint (http://\S+)", text)
    assert match is not None
    daemon.url = match.group(1)
    return daemon


def descendants(pid: int) -> list[int]:
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


async def sigkill(daemon: HttpDaemon) -> None:
    """SIGKILL the daemon and its process group; every process that was below it must be gone
    (its workers run in sessions of their own and die with it: nothing of it is left)."""
    below = descendants(daemon.pid)
    try:
        os.killpg(daemon.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    with trio.fail_after(WAIT_S):
        await daemon.proc.wait()
    assert daemon.proc.returncode == -signal.SIGKILL
    try:
        await wait_pids_gone(below)
    except trio.TooSlowError:
        left = [p for p in below if not pid_gone(p)]
        for pid in left:
            kill_process_tree(pid)
        raise AssertionError(f"processes of the killed daemon were left running: {left}") from None


@asynccontextmanager
async def open_http_daemon(config: Path, *plugins: Path, log: Path) -> AsyncIterator[HttpDaemon]:
    daemon = await start_http(config, *plugins, log=log)
    try:
        yield daemon
    finally:
        if daemon.proc.poll() is None:
            kill_process_tree(daemon.pid)
            with trio.move_on_after(WAIT_S):
                await daemon.proc.wait()


def sse_messages(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].lstrip() for line in block.split("\n") if line.startswith("data:")]
        if data and "".join(data):
            out.append(json.loads("\n".join(data)))
    return out


def response_messages(response: httpx2.Response) -> list[dict[str, Any]]:
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return sse_messages(response.text)
    return [response.json()] if response.content else []


def modern_meta(*, ext: bool = True, caps: dict[str, Any] | None = None) -> dict[str, Any]:
    capabilities = dict(caps or {})
    if ext:
        capabilities["extensions"] = {**capabilities.get("extensions", {}), EXT: {}}
    return {META_VERSION: MODERN, META_CAPS: capabilities}


@dataclass
class Http:
    """One principal's raw HTTP client of one daemon (both eras)."""

    client: httpx2.AsyncClient
    url: str
    token: str | None = None
    _ids: list[int] = field(default_factory=lambda: [0])

    def new_id(self) -> int:
        self._ids[0] += 1
        return self._ids[0]

    def _auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"} if self.token else {}

    # 2026-07-28 -------------------------------------------------------------------------------

    def modern_request(self, method: str, params: dict[str, Any] | None = None, *, ext: bool = True,
                       caps: dict[str, Any] | None = None, name: str | None = None,
                       ) -> tuple[dict[str, str], bytes]:
        params = dict(params or {})
        params["_meta"] = modern_meta(ext=ext, caps=caps)
        headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
                   "mcp-protocol-version": MODERN, "mcp-method": method, **self._auth()}
        mirrored = name if name is not None else params.get("name") if method == "tools/call" else params.get("taskId")
        if isinstance(mirrored, str):
            headers["mcp-name"] = mirrored
        body = json.dumps({"jsonrpc": "2.0", "id": self.new_id(), "method": method, "params": params}).encode()
        return headers, body

    async def modern(self, method: str, params: dict[str, Any] | None = None, *, ext: bool = True,
                     caps: dict[str, Any] | None = None, name: str | None = None) -> tuple[int, dict[str, Any]]:
        """One stateless 2026-07-28 request: (HTTP status, the JSON-RPC response)."""
        headers, body = self.modern_request(method, params, ext=ext, caps=caps, name=name)
        with trio.fail_after(WAIT_S):
            response = await self.client.post(self.url, content=body, headers=headers)
        found = response_messages(response)
        final = [m for m in found if "id" in m and "method" not in m]
        assert final, (response.status_code, response.text[:500])
        return response.status_code, final[-1]

    async def task_get(self, task_id: str) -> dict[str, Any]:
        status, reply = await self.modern("tasks/get", {"taskId": task_id})
        assert status == 200 and "result" in reply, (status, reply)
        return reply["result"]

    async def wait_task(self, task_id: str, statuses: set[str], within: float = WAIT_S) -> dict[str, Any]:
        return await until(lambda: self.task_get(task_id), lambda task: task["status"] in statuses, within)

    # 2025-11-25 -------------------------------------------------------------------------------

    def legacy_headers(self, session: str | None) -> dict[str, str]:
        headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
                   **self._auth()}
        if session is not None:
            headers["mcp-session-id"] = session
            headers["mcp-protocol-version"] = LEGACY
        return headers

    async def legacy_session(self, capabilities: dict[str, Any] | None = None) -> str:
        body = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
                "params": {"protocolVersion": LEGACY, "capabilities": capabilities or {},
                           "clientInfo": {"name": "task-e2e", "version": "1"}}}
        with trio.fail_after(WAIT_S):
            r = await self.client.post(self.url, json=body, headers=self.legacy_headers(None))
            assert r.status_code == 200, r.text
            session = r.headers["mcp-session-id"]
            r2 = await self.client.post(self.url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                                        headers=self.legacy_headers(session))
            assert r2.status_code == 202, r2.text
        return session

    async def legacy(self, session: str, method: str, params: dict[str, Any] | None = None,
                     within: float = WAIT_S) -> dict[str, Any]:
        """One request of a legacy session; returns its JSON-RPC response."""
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": self.new_id(), "method": method}
        if params is not None:
            msg["params"] = params
        with trio.fail_after(within):
            response = await self.client.post(self.url, json=msg, headers=self.legacy_headers(session))
        final = [m for m in response_messages(response) if m.get("id") == msg["id"] and "method" not in m]
        assert final, (response.status_code, response.text[:500])
        return final[-1]

    async def legacy_answer(self, session: str, request_id: Any, result: dict[str, Any]) -> None:
        """Answer a server->client request of the session (a POST the server accepts with 202)."""
        with trio.fail_after(WAIT_S):
            r = await self.client.post(self.url, json={"jsonrpc": "2.0", "id": request_id, "result": result},
                                       headers=self.legacy_headers(session))
        assert r.status_code == 202, r.text

    async def legacy_status(self, session: str, task_id: str) -> dict[str, Any]:
        reply = await self.legacy(session, "tasks/get", {"taskId": task_id})
        assert "result" in reply, reply
        return reply["result"]

    async def legacy_wait(self, session: str, task_id: str, statuses: set[str]) -> dict[str, Any]:
        return await until(lambda: self.legacy_status(session, task_id), lambda t: t["status"] in statuses)


class SseStream:
    """An open SSE response (a legacy session's GET stream, a 2026-07-28 ``subscriptions/listen``),
    read in the background; every JSON-RPC message it carries is kept in ``messages``."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.status: int | None = None
        self._changed = trio.Event()

    async def run(self, client: httpx2.AsyncClient, method: str, url: str, *, headers: dict[str, str],
                  content: bytes | None = None, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with client.stream(method, url, headers=headers, content=content, timeout=None) as response:
            self.status = response.status_code
            task_status.started()
            block: list[str] = []
            async for line in response.aiter_lines():
                if line:
                    block.append(line)
                    continue
                data = [item[5:].lstrip() for item in block if item.startswith("data:")]
                block = []
                if data and "".join(data):
                    self.messages.append(json.loads("\n".join(data)))
                    self._changed.set()
                    self._changed = trio.Event()

    async def wait_for(self, predicate: Callable[[dict[str, Any]], bool], within: float = WAIT_S) -> dict[str, Any]:
        with trio.fail_after(within):
            seen = 0
            while True:
                for message in self.messages[seen:]:
                    if predicate(message):
                        return message
                seen = len(self.messages)
                await self._changed.wait()


# -- the SDK client's tasks extension (2026-07-28) ----------------------------------------------------


class CreatedTask(mcp_types.Result):
    """The flat 2026-07-28 ``CreateTaskResult`` (``resultType: "task"``)."""

    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"] = "task"
    task_id: str
    status: str
    status_message: str | None = None
    created_at: str
    last_updated_at: str
    ttl_ms: int | None
    poll_interval_ms: int | None = None


async def _not_resolved(task: CreatedTask, ctx: ClaimContext) -> types.CallToolResult:
    raise AssertionError("the tests call tools with allow_claimed=True and poll the task themselves")


class TasksExtension(ClientExtension):
    """Declares ``io.modelcontextprotocol/tasks`` and claims ``resultType: "task"`` for tools/call."""

    identifier = EXT

    def claims(self) -> list[ResultClaim[Any]]:
        return [ResultClaim(result_type="task", model=CreatedTask, resolve=_not_resolved)]


class TaskIdParams(types.RequestParams):
    model_config = ConfigDict(extra="allow")
    task_id: str


class UpdateParams(TaskIdParams):
    input_responses: dict[str, Any]


class TasksGet(types.Request[TaskIdParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param = "taskId"


class TasksUpdate(types.Request[UpdateParams, Literal["tasks/update"]]):
    method: Literal["tasks/update"] = "tasks/update"
    name_param = "taskId"


class TasksCancel(types.Request[TaskIdParams, Literal["tasks/cancel"]]):
    method: Literal["tasks/cancel"] = "tasks/cancel"
    name_param = "taskId"


RAW = TypeAdapter(dict[str, Any])


async def sdk_get(client: Any, task_id: str) -> dict[str, Any]:
    return await client.session.send_request(TasksGet(params=TaskIdParams(task_id=task_id)), RAW)


async def sdk_wait(client: Any, task_id: str, statuses: set[str]) -> dict[str, Any]:
    return await until(lambda: sdk_get(client, task_id), lambda task: task["status"] in statuses)


async def sdk_update(client: Any, task_id: str, responses: dict[str, Any]) -> dict[str, Any]:
    return await client.session.send_request(
        TasksUpdate(params=UpdateParams(task_id=task_id, input_responses=responses)), RAW)


async def sdk_cancel(client: Any, task_id: str) -> dict[str, Any]:
    return await client.session.send_request(TasksCancel(params=TaskIdParams(task_id=task_id)), RAW)
