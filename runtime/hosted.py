"""Hosted MCP servers: an existing server (npm, PyPI, any executable) run in a worker sandbox, its
tools served in the catalog like a plugin's. The daemon is the server's MCP client.

How this works:

* A plugin of kind "server" gets a ``HostedRunner`` where other plugins get a ``WorkerPool``; the
  call dispatcher (``runtime.calls``) cannot tell them apart (``new_slot``, ``submit``, ``withdraw``).
* Each instance is one worker process started like any worker (``Init`` over its IPC fd, every
  isolation layer, the same limits, the egress proxy for a network grant), which then executes the
  server (``sandbox.hosted``) with its stdin and stdout piped to this module. Why the client lives
  here and not in the worker: an MCP server takes many requests at once, and the daemon already
  multiplexes, times out and relays; a client in the worker would add a second hop, a second decode of
  every message and a process of its own, and would be no more trusted than the server beside it.
* Everything the server writes is untrusted: each line is capped (``max_line_bytes``; an overlong
  line ends the instance, as an over-size frame ends a worker), decoded strictly, checked for depth and
  size (``runtime.worker_frames``), and shaped field by field. A bad response fails its own call; a
  bad notification is dropped; what cannot be tied to a call is logged, capped. Any exception while
  handling what it sent ends that instance, never the daemon. Its stderr goes to the log, capped.
* Calls: ``tools/call`` with a fresh id (and a progress token when the client asked for progress),
  at most ``limits.max_concurrency`` in flight per instance, the rest queued (``max_queue``, then
  "busy"). Progress is relayed within the call's budget; a log message is relayed to the call it
  belongs to when exactly one call is running on that instance (stdio carries no other link), else logged.
* Deadlines hold: a call running past ``timeout_s`` is answered "timed out" and cancelled at the
  server (``notifications/cancelled``); a client's cancellation is forwarded the same way. The server
  must then answer a ``ping`` within ``cancel_grace_s``, or it is restarted.
* ``notifications/tools/list_changed`` makes the runner list the tools again and tell the daemon.
* An instance that exits or breaks fails its running calls ("the server ... exited"), is logged and
  started again with backoff; queued calls wait for it. ``instances`` > 1 spreads calls over several
  servers (least busy first); ``per_principal`` gives each principal instances of its own.
"""

from __future__ import annotations

import collections
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from typing import Any, Callable, cast

import msgspec
import trio

from runtime import egress, worker_frames
from runtime.egress_rules import Grant
from runtime.logs import log
from runtime.processes import (
    LIVE_WORKER_PIDS,
    LIVE_WORKER_TOKENS,
    SPAWNED,
    WORKER_SYS_PATH,
    _PYTHON,
    PoolSpec,
    kill_tree,
    sweep_orphans,
)
from runtime.protocol.errors import PoolBusy, WorkerFailure
from runtime.worker_frames import FrameRejected
from runtime.workers import PluginLoadError, Worker
from sandbox import wire
from sandbox.isolation import cgroups

PROTOCOL_VERSION = "2025-11-25"
KNOWN_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
#: Most tools a hosted server may list, and most pages it may take to list them.
MAX_TOOLS = 1000
MAX_PAGES = 50
#: Bytes of stderr (and of messages that belong to no call) logged per instance.
MAX_LOGGED = 256 * 1024
#: Input the server has not read yet; beyond it the server is considered stuck and restarted.
MAX_UNREAD_INPUT = 8 << 20
BACKOFF_MAX_S = 30.0
#: An instance up this long has recovered: its restart backoff starts again from the shortest.
STABLE_AFTER_S = 30.0
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class HostedSlot:
    """One call on its way to a hosted server (the dispatcher's handle)."""

    __slots__ = ("tool", "arguments", "progress", "log_level", "on_event", "on_done", "result", "error", "finished",
                 "principal", "request_id", "instance", "deadline", "notes", "note_bytes", "notes_dropped")

    def __init__(self, tool: str, arguments: dict[str, Any], progress: bool, log_level: int,
                 on_event: Callable[[Any], None] | None, on_done: Callable[[Any], None] | None,
                 principal: str | None) -> None:
        self.tool = tool
        self.arguments = arguments
        self.progress = progress
        self.log_level = log_level
        self.on_event = on_event
        self.on_done = on_done
        self.result: wire.Result | None = None
        self.error: WorkerFailure | None = None
        self.finished = False
        self.principal = principal
        self.request_id = 0
        self.instance: Instance | None = None
        self.deadline = math.inf
        self.notes = 0
        self.note_bytes = 0
        self.notes_dropped = 0

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        on_done, self.on_done = self.on_done, None
        self.on_event = None
        if on_done is not None:
            try:
                on_done(self)
            except Exception as exc:  # our bug; the runner keeps going
                log("internal_error", level="error", where="hosted call completion", error=f"{type(exc).__name__}: {exc}")


def _tool_spec(raw: Any) -> wire.ToolSpec:
    """A tool definition as the server listed it, shaped field by field (raises ``ValueError``)."""
    if not isinstance(raw, dict):
        raise ValueError("a tool that is not an object")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool without a name")
    schema = raw.get("inputSchema")
    if not isinstance(schema, dict):
        raise ValueError(f"tool {name[:64]!r} has no inputSchema object")
    out = raw.get("outputSchema")
    description = raw.get("description")
    title = raw.get("title")
    annotations = raw.get("annotations")
    icons = raw.get("icons")
    meta = raw.get("_meta")
    return wire.ToolSpec(
        name=name,
        description=description if isinstance(description, str) else "",
        input_schema=schema,
        output_schema=out if isinstance(out, dict) else None,
        title=title if isinstance(title, str) else None,
        annotations=annotations if isinstance(annotations, dict) else None,
        icons=icons if isinstance(icons, list) and all(isinstance(i, dict) for i in icons) else None,
        meta=meta if isinstance(meta, dict) else None,
    )


def _result(request_id: int, raw: Any) -> wire.Result:
    """A ``CallToolResult`` from the server as a ``wire.Result`` (raises ``ValueError`` / ``FrameRejected``)."""
    if not isinstance(raw, dict):
        raise ValueError("the result is not an object")
    content = raw.get("content", [])
    if not isinstance(content, list) or not all(isinstance(c, dict) for c in content):
        raise ValueError("the result's content is not a list of objects")
    has_structured = "structuredContent" in raw and raw["structuredContent"] is not None
    structured = raw.get("structuredContent") if has_structured else None
    if has_structured and not isinstance(structured, dict):
        raise ValueError("the result's structuredContent is not an object")
    # Depth, size and JSON-cleanness were checked on the whole message (``Instance._handle_line``).
    return wire.Result(request_id, content, structured, has_structured, raw.get("isError") is True)


def _text(text: str, limit: int = 2000) -> str:
    text = "".join(ch if ch.isprintable() or ch in "\n\t" else "?" for ch in text[:limit])
    return text


class Instance:
    """One server process and the MCP session with it."""

    def __init__(self, runner: HostedRunner, group: Group) -> None:
        self.runner = runner
        self.group = group
        self.proc: trio.Process | None = None
        self.ipc: Worker | None = None
        self.pid = 0
        self.server_pid = 0
        self.token = ""
        self.scratch = ""
        self.pending: dict[int, HostedSlot] = {}
        self.progress_tokens: dict[int, HostedSlot] = {}
        self.waiters: dict[int, Callable[[Any], None]] = {}
        self.next_id = 0
        self.dead = False
        self.ready = False
        self.started_at = 0.0
        self.out: list[bytes] = []
        self.out_bytes = 0
        #: The server's stdin (non-blocking, as trio set it up), written directly when nothing is queued.
        self.stdin_fd = -1
        self.writing = False
        self.out_wake = trio.Event()
        self.exited = trio.Event()
        self.egress: trio.CancelScope | None = None
        self.logged = 0
        self.checking = False
        self.relisting = False
        self.failure: WorkerFailure | None = None
        self.server_info: dict[str, Any] = {}

    # -- start-up ------------------------------------------------------------------------------

    async def start(self) -> list[wire.ToolSpec]:
        """Start the sandboxed process, do the MCP handshake and list the tools. Raises ``PluginLoadError``."""
        runner = self.runner
        spec = runner.spec
        os.makedirs(spec.state_dir, mode=0o711, exist_ok=True)
        self.scratch = tempfile.mkdtemp(prefix=f"{os.getpid()}~{runner.name}-", dir=spec.state_dir)
        self.token = secrets.token_hex(8)
        LIVE_WORKER_TOKENS.add(self.token)
        env = spec.env(self.token)
        env.setdefault("HOME", self.scratch)
        env.setdefault("TMPDIR", "/tmp")
        try:
            self.proc, raw = await spawn_piped(env, self.scratch)
        except OSError as exc:
            LIVE_WORKER_TOKENS.discard(self.token)
            shutil.rmtree(self.scratch, ignore_errors=True)
            raise PluginLoadError("spawn", f"could not start a worker: {exc}") from None
        self.pid = self.proc.pid
        LIVE_WORKER_PIDS.add(self.pid)
        self.ipc = Worker(self.proc, raw, self.scratch, wire.MAX_FRAME_BYTES)
        runner.nursery.start_soon(self._watch)
        try:
            with trio.fail_after(runner.server.start_timeout_s):
                ready = await self._sandbox(env)
                self.server_pid = ready.pid
                assert self.proc.stdin is not None
                self.stdin_fd = int(cast(Any, self.proc.stdin).fileno())  # a trio FdStream over the pipe
                runner.nursery.start_soon(self._write_loop)
                runner.nursery.start_soon(self._read_loop)
                runner.nursery.start_soon(self._pump_stderr)
                init = await self.request("initialize", {
                    "protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                    "clientInfo": {"name": "toolcell", "version": _version()}})
                self._check_initialize(init)
                self.notify("notifications/initialized", None)
                tools = await self.list_tools()
        except BaseException as exc:
            why = self._start_failure(exc)
            self.kill()
            if why is None:
                raise
            with trio.move_on_after(1.0):
                await self.exited.wait()
            raise PluginLoadError("start", why) from None
        self.ready = True
        self.started_at = time.monotonic()
        return tools

    def _start_failure(self, exc: BaseException) -> str | None:
        if isinstance(exc, PluginLoadError):
            return exc.message
        if isinstance(exc, trio.TooSlowError):
            return f"the server did not start within {self.runner.server.start_timeout_s:g} s" + self._tail()
        if isinstance(exc, WorkerFailure):
            return exc.message.removesuffix("; it is being restarted") + self._tail()
        if isinstance(exc, ValueError):
            return f"the server's answer was unusable: {exc}"
        if isinstance(exc, OSError):
            return f"could not start the server: {exc}"
        return None

    def _tail(self) -> str:
        tail = self.runner.stderr_tail.get(id(self), b"").decode("utf-8", "replace").strip()
        return f"; it printed: {_text(tail[-1500:])}" if tail else ""

    async def _sandbox(self, env: dict[str, str]) -> wire.Ready:
        """Send ``Init`` and wait for the sandbox's ``Ready`` (with the egress socket, if granted)."""
        from runtime.policy import EGRESS_LAYER, check_layers

        runner = self.runner
        m = runner.spec.manifest
        ipc = self.ipc
        assert ipc is not None
        init = wire.Init(plugin_name=m.name, plugin_dir=runner.spec.plugin_dir, entry="", sys_path=WORKER_SYS_PATH,
                         env=env, limits=m.limits, permissions=m.permissions, policy=runner.spec.policy,
                         scratch_dir=self.scratch, command=list(runner.argv), command_read=list(runner.command_read))
        if not ipc.write(wire.encode_frame(init)):
            raise WorkerFailure("crashed", "the worker process exited unexpectedly")
        try:
            msg = await ipc.read_message(with_fds=True)
            if isinstance(msg, wire.EgressListener):
                if not runner.grant or self.egress is not None:
                    raise WorkerFailure("garbage", "the worker sent an egress socket its plugin has no grant for")
                try:
                    listener = egress.adopt_listener(ipc.fds, msg.port)
                except ValueError as exc:
                    raise WorkerFailure("garbage", str(exc)) from None
                self.egress = trio.CancelScope()
                runner.nursery.start_soon(egress.serve_proxy, listener, runner.grant, runner.name, self.pid, self.egress)
                msg = await ipc.read_message(with_fds=True)
        finally:
            ipc.close_fds()
        if isinstance(msg, wire.LoadFailed):
            raise PluginLoadError(msg.stage, msg.error)
        if not isinstance(msg, wire.Ready):
            raise PluginLoadError("start", "the worker sent something other than Ready")
        if EGRESS_LAYER in msg.layers and self.egress is None:
            raise PluginLoadError("isolation", "the worker reported an egress proxy but handed over no socket")
        problem = check_layers(runner.spec.policy, msg.layers, msg.missing, runner.name, network=bool(runner.grant))
        if problem:
            raise PluginLoadError("isolation", problem)
        self.runner.layers = list(msg.layers)
        return msg

    def _check_initialize(self, result: Any) -> None:
        if not isinstance(result, dict):
            raise ValueError("initialize: the result is not an object")
        version = result.get("protocolVersion")
        if version not in KNOWN_VERSIONS:
            raise ValueError(f"initialize: unsupported protocol version {str(version)[:40]!r}")
        info = result.get("serverInfo")
        self.server_info = info if isinstance(info, dict) else {}

    async def list_tools(self) -> list[wire.ToolSpec]:
        """Every tool the server lists (all pages), shaped; raises ``ValueError`` for a broken listing."""
        raw_tools: list[Any] = []
        cursor: Any = None
        for _ in range(MAX_PAGES):
            page = await self.request("tools/list", {"cursor": cursor} if cursor is not None else {})
            if not isinstance(page, dict) or not isinstance(page.get("tools"), list):
                raise ValueError("tools/list: the result has no tools list")
            raw_tools += page["tools"]
            if len(raw_tools) > MAX_TOOLS:
                raise ValueError(f"tools/list: more than {MAX_TOOLS} tools")
            cursor = page.get("nextCursor")
            if cursor is None:
                break
            if not isinstance(cursor, str) or len(cursor) > 1024:
                raise ValueError("tools/list: a malformed nextCursor")
        else:
            raise ValueError(f"tools/list: more than {MAX_PAGES} pages")
        specs: list[wire.ToolSpec] = []
        for raw in raw_tools:
            try:
                specs.append(_tool_spec(raw))
            except ValueError as exc:
                log("hosted_tool_dropped", level="warning", plugin=self.runner.name, problem=str(exc))
        return specs

    # -- talking to the server -----------------------------------------------------------------

    def send(self, obj: dict[str, Any]) -> None:
        """Write one message now if the pipe takes it (no task switch on the hot path), else queue it
        for the writer task."""
        if self.dead:
            return
        data = _encode(obj) + b"\n"
        if not self.out and not self.writing and self.stdin_fd >= 0:
            try:
                sent = os.write(self.stdin_fd, data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self.fail(WorkerFailure("crashed", "the server closed its input"))
                return
            if sent == len(data):
                return
            data = data[sent:]
        self.out.append(data)
        self.out_bytes += len(data)
        if self.out_bytes > MAX_UNREAD_INPUT:
            self.fail(WorkerFailure("unavailable", "the server stopped reading its input"))
            return
        self.out_wake.set()

    def notify(self, method: str, params: Any) -> None:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    async def request(self, method: str, params: Any) -> Any:
        """Send a request and wait for its result; raises ``WorkerFailure`` / ``ValueError``."""
        request_id = self._new_id()
        box: list[Any] = []
        done = trio.Event()

        def answer(msg: Any) -> None:
            box.append(msg)
            done.set()

        self.waiters[request_id] = answer
        self.send({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})
        try:
            await done.wait()
        finally:
            self.waiters.pop(request_id, None)
        msg = box[0]
        if isinstance(msg, WorkerFailure):
            raise msg
        if "error" in msg:
            raise ValueError(f"{method}: the server answered with an error: {_error_text(msg['error'])}")
        return msg.get("result")

    def call(self, slot: HostedSlot) -> None:
        request_id = self._new_id()
        slot.request_id = request_id
        slot.instance = self
        self.pending[request_id] = slot
        params: dict[str, Any] = {"name": slot.tool, "arguments": slot.arguments}
        if slot.progress:
            params["_meta"] = {"progressToken": request_id}
            self.progress_tokens[request_id] = slot
        slot.deadline = trio.current_time() + self.runner.limits.timeout_s
        self.runner.wake_watchdog(slot.deadline)
        self.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params})

    def forget(self, slot: HostedSlot) -> None:
        self.pending.pop(slot.request_id, None)
        self.progress_tokens.pop(slot.request_id, None)

    def cancel(self, slot: HostedSlot, reason: str) -> None:
        """Stop ``slot`` at the server; the server must then show it is still responsive."""
        self.forget(slot)
        self.notify("notifications/cancelled", {"requestId": slot.request_id, "reason": reason})
        if not self.checking and not self.dead:
            self.checking = True
            self.runner.nursery.start_soon(self._check_responsive)

    async def _check_responsive(self) -> None:
        try:
            with trio.move_on_after(self.runner.server.cancel_grace_s) as scope:
                try:
                    await self.request("ping", {})
                except (WorkerFailure, ValueError):
                    return  # dead already, or answered (an error is an answer)
            if scope.cancelled_caught and not self.dead:
                log("hosted_server_unresponsive", level="warning", plugin=self.runner.name, pid=self.server_pid,
                    grace_s=self.runner.server.cancel_grace_s, note="restarting it")
                self.fail(WorkerFailure("timeout", "the server stopped responding after a call was cancelled; "
                                                   "it was restarted"))
        finally:
            self.checking = False

    async def _write_loop(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdin is not None
        stdin = proc.stdin
        try:
            while not self.dead:
                await self.out_wake.wait()
                self.out_wake = trio.Event()
                while self.out and not self.dead:
                    data = b"".join(self.out)
                    self.out.clear()
                    self.writing = True
                    try:
                        await stdin.send_all(data)
                    finally:
                        self.writing = False
                    self.out_bytes -= len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            self.fail(WorkerFailure("crashed", "the server closed its input"))

    async def _read_loop(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        stdout = proc.stdout
        limit = self.runner.max_line_bytes
        buf = bytearray()
        try:
            while not self.dead:
                chunk = await stdout.receive_some(1 << 16)
                if not chunk:
                    break
                buf += chunk
                start = 0
                while True:
                    end = buf.find(b"\n", start)
                    if end < 0:
                        break
                    line = bytes(buf[start:end])
                    start = end + 1
                    if len(line) > limit:
                        raise WorkerFailure("output_cap", f"the server sent a message over the {limit}-byte limit")
                    if line.strip():
                        self._handle_line(line)
                    if self.dead:
                        return
                del buf[:start]
                if len(buf) > limit:
                    raise WorkerFailure("output_cap", f"the server sent a message over the {limit}-byte limit")
        except WorkerFailure as exc:
            self.fail(exc)
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception as exc:  # our bug, triggered by what the server sent: end this instance only
            log("internal_error", level="error", where="hosted server message", plugin=self.runner.name,
                error=f"{type(exc).__name__}: {str(exc)[:300]}")
            self.fail(WorkerFailure("garbage", "the daemon could not handle what the server sent"))
            return
        if not self.dead:
            with trio.move_on_after(0.5):
                await self.exited.wait()
            self.fail(self._exit_failure())

    def _handle_line(self, line: bytes) -> None:
        try:
            msg = _decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError, ValueError) as exc:
            self._log_stray("hosted_server_garbage", line, why=str(exc)[:200])
            return
        try:
            worker_frames.check_value(msg, "a message")
        except FrameRejected as exc:
            # Too deep, too big or not JSON-clean: the call it answers (if any) fails, nothing is relayed.
            raw_id = msg.get("id") if isinstance(msg, dict) and "method" not in msg else None
            request_id = raw_id if isinstance(raw_id, int) else -1
            slot = self.pending.pop(request_id, None)
            if slot is not None:
                self.progress_tokens.pop(request_id, None)
                slot.error = WorkerFailure("garbage", f"the server sent a malformed result: {exc}")
                self.runner.complete(slot)
            else:
                self._log_stray("hosted_server_garbage", line[:2000], why=str(exc)[:200])
            return
        if not isinstance(msg, dict):
            self._log_stray("hosted_server_garbage", line, why="not a JSON-RPC message")
            return
        method = msg.get("method")
        if "id" in msg and method is None:
            self._response(msg)
        elif isinstance(method, str):
            if "id" in msg:
                self._server_request(msg, method)
            else:
                self._notification(msg, method)
        else:
            self._log_stray("hosted_server_garbage", line, why="not a JSON-RPC message")

    def _response(self, msg: dict[str, Any]) -> None:
        request_id = msg.get("id")
        if type(request_id) is not int:
            self._log_stray("hosted_server_stray_response", _encode(msg)[:500], why="an id this client never sent")
            return
        waiter = self.waiters.pop(request_id, None)
        if waiter is not None:
            waiter(msg)
            return
        slot = self.pending.pop(request_id, None)
        if slot is None:
            return  # the answer to a call that was cancelled or timed out
        self.progress_tokens.pop(request_id, None)
        if "error" in msg:
            text = f"the server answered with an error: {_error_text(msg['error'])}"
            slot.result = wire.Result(request_id, [{"type": "text", "text": text}], is_error=True)
        else:
            try:
                slot.result = _result(request_id, msg.get("result"))
            except (ValueError, FrameRejected) as exc:
                slot.error = WorkerFailure("garbage", f"the server sent a malformed result: {exc}")
        self.runner.complete(slot)

    def _server_request(self, msg: dict[str, Any], method: str) -> None:
        request_id = msg["id"]
        if not isinstance(request_id, (int, str)) or (isinstance(request_id, str) and len(request_id) > 256):
            return
        if method == "ping":
            self.send({"jsonrpc": "2.0", "id": request_id, "result": {}})
        else:
            # toolcell offers hosted servers no client capabilities (roots, sampling, elicitation) yet.
            self.send({"jsonrpc": "2.0", "id": request_id,
                       "error": {"code": -32601, "message": f"Method not found: {method[:100]}"}})

    def _notification(self, msg: dict[str, Any], method: str) -> None:
        params = msg.get("params")
        if method == "notifications/progress" and isinstance(params, dict):
            token = params.get("progressToken")
            slot = self.progress_tokens.get(token) if type(token) is int else None
            progress, total, message = params.get("progress"), params.get("total"), params.get("message")
            if slot is None or type(progress) not in (int, float):
                return
            frame = wire.Progress(slot.request_id, float(progress),  # type: ignore[arg-type]
                                  float(total) if type(total) in (int, float) else None,  # type: ignore[arg-type]
                                  message if isinstance(message, str) else None)
            self.runner.relay(slot, frame, len(_encode(params)))
        elif method == "notifications/message" and isinstance(params, dict):
            level = params.get("level")
            if level not in wire.LOG_LEVELS:
                return
            logger = params.get("logger")
            running = list(self.pending.values())
            if len(running) == 1:
                frame_log = wire.Log(running[0].request_id, wire.LOG_LEVELS.index(level), params.get("data"),
                                     logger[:256] if isinstance(logger, str) else None)
                self.runner.relay(running[0], frame_log, len(_encode(params)))
            else:
                self._log_stray("hosted_server_log", _encode(params)[:2000], why=str(level))
        elif method == "notifications/tools/list_changed":
            if self.ready and not self.relisting:
                self.relisting = True
                self.runner.nursery.start_soon(self._relist)

    async def _relist(self) -> None:
        try:
            await trio.sleep(0.05)  # a burst of list_changed is one listing
            tools = await self.list_tools()
        except (WorkerFailure, ValueError) as exc:
            log("hosted_relist_failed", level="warning", plugin=self.runner.name, error=str(exc)[:300])
            return
        finally:
            self.relisting = False
        self.runner.tools_listed(tools)

    def _log_stray(self, event: str, data: bytes, why: str) -> None:
        if self.logged >= MAX_LOGGED:
            return
        self.logged += len(data)
        log(event, level="warning", plugin=self.runner.name, pid=self.server_pid, why=why,
            data=data[:2000].decode("utf-8", "replace"))
        if self.logged >= MAX_LOGGED:
            log("hosted_server_output_capped", level="warning", plugin=self.runner.name, cap_bytes=MAX_LOGGED)

    async def _pump_stderr(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stderr is not None
        logged = 0
        tails = self.runner.stderr_tail
        try:
            while True:
                chunk = await proc.stderr.receive_some(65536)
                if not chunk:
                    break
                tails[id(self)] = (tails.get(id(self), b"") + chunk)[-4096:]
                if logged < MAX_LOGGED:
                    logged += len(chunk)
                    log("plugin_output", plugin=self.runner.name, pid=self.server_pid,
                        output=chunk[:MAX_LOGGED].decode("utf-8", "replace").rstrip("\n"))
                    if logged >= MAX_LOGGED:
                        log("plugin_output_capped", plugin=self.runner.name, pid=self.server_pid, cap_bytes=MAX_LOGGED)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    # -- the end -------------------------------------------------------------------------------

    def _exit_failure(self) -> WorkerFailure:
        proc = self.proc
        code = proc.returncode if proc is not None else None
        limits = self.runner.limits
        try:
            events = cgroups.limit_events(self.pid)
        except Exception:  # noqa: BLE001 (best effort)
            events = {}
        if events.get("oom_kill"):
            return WorkerFailure("memory", f"the server ran out of memory (its limit is {limits.memory_mb} MB) "
                                           "and was killed; it is being restarted")
        if events.get("pids_max") and code is not None and code != 0:
            return WorkerFailure("processes", f"the server hit its limit of {limits.max_processes} processes and "
                                              "threads and was killed; it is being restarted")
        if code is None:
            what = "the server process stopped answering"
        elif code > 128 and code - 128 < 65:
            try:
                what = f"the server process was killed by {signal.Signals(code - 128).name}"
            except ValueError:
                what = f"the server process exited with status {code}"
        elif code < 0:
            try:
                what = f"the server process was killed by {signal.Signals(-code).name}"
            except ValueError:
                what = f"the server process exited with status {code}"
        else:
            what = f"the server process exited with status {code}"
        return WorkerFailure("crashed", f"{what}; it is being restarted")

    def fail(self, error: WorkerFailure) -> None:
        """End this instance: its running calls get ``error``; waiters wake; the process tree dies."""
        if self.dead:
            return
        self.dead = True
        self.failure = error
        self.kill()
        pending = list(self.pending.values())
        self.pending.clear()
        self.progress_tokens.clear()
        for slot in pending:
            slot.error = error
            self.runner.complete(slot)
        for waiter in list(self.waiters.values()):
            waiter(error)
        self.waiters.clear()
        self.out_wake.set()
        self.runner.instance_ended(self, error)

    def kill(self) -> None:
        self.dead = True
        self.stdin_fd = -1
        if self.pid:
            kill_tree(self.pid)
        LIVE_WORKER_TOKENS.discard(self.token)
        if self.egress is not None:
            self.egress.cancel()
        if self.ipc is not None:
            self.ipc.dead = True
            try:
                self.ipc.raw.close()
            except OSError:
                pass

    async def _watch(self) -> None:
        proc = self.proc
        assert proc is not None
        try:
            with trio.CancelScope(shield=True):
                await proc.wait()
        finally:
            self.exited.set()
            if not self.dead:
                with trio.move_on_after(0.5):
                    await trio.sleep(0.2)  # let the reader see EOF and the last answers first
                self.fail(self._exit_failure())
            LIVE_WORKER_PIDS.discard(self.pid)
            SPAWNED.pop(self.pid, None)
            sweep_orphans()
            self.runner.stderr_tail.pop(id(self), None)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(cgroups.cleanup, self.pid)
                for stream in (proc.stdin, proc.stdout, proc.stderr):
                    if stream is not None:
                        await stream.aclose()
            shutil.rmtree(self.scratch, ignore_errors=True)

    @property
    def load(self) -> int:
        return len(self.pending)


class Group:
    """The instances serving one principal (or everyone), and the calls waiting for them."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.instances: list[Instance] = []
        self.starting = 0
        self.queue: collections.deque[HostedSlot] = collections.deque()
        self.failures = 0
        self.last_used = time.monotonic()
        self.last_error = ""


class HostedRunner:
    """Runs the calls of one hosted server plugin (one version of it): see the module docstring."""

    def __init__(self, spec: PoolSpec, nursery: trio.Nursery, argv: list[str], command_read: list[str]) -> None:
        manifest = spec.manifest
        assert manifest.server is not None
        self.spec = spec
        self.server = manifest.server
        self.name = manifest.name
        self.limits = manifest.limits
        self.nursery = nursery
        self.argv = argv
        self.command_read = command_read
        self.grant = Grant.parse(manifest.permissions.network)
        #: Read by ``runtime.calls``: calls carry their principal here.
        self.per_principal = manifest.server.per_principal
        self.max_line_bytes = max(self.limits.max_output_bytes, self.limits.max_notification_bytes) + 65536
        self.groups: dict[str, Group] = {}
        self.closed = False
        self.retiring = False
        self.restarts = 0
        self.limit_kills = 0
        self.in_flight = 0
        self.layers: list[str] = []
        self.tools: list[wire.ToolSpec] = []
        self.stderr_tail: dict[int, bytes] = {}
        #: Set by the daemon: the server listed different tools (``list_changed``).
        self.on_tools_changed: Callable[[list[wire.ToolSpec]], None] | None = None
        self._drain: trio.Event | None = None
        self._watch_wake = trio.Event()
        self._watch_at = math.inf
        self._watchdog_started = False

    # -- the pool interface (``runtime.calls``) --------------------------------------------------

    @property
    def queue(self) -> list[HostedSlot]:
        return [s for g in self.groups.values() for s in g.queue]

    @property
    def workers(self) -> list[Instance]:
        return [i for g in self.groups.values() for i in g.instances if not i.dead]

    async def start(self) -> wire.Ready:
        """Start the shared group's first instance (it lists the tools), then the rest in the background."""
        group = self._group(None)
        assert group is not None
        first = Instance(self, group)
        self.tools = await first.start()
        group.instances.append(first)
        if not self._watchdog_started:
            self._watchdog_started = True
            self.nursery.start_soon(self._watchdog)
        if not self.spec.describe_only:
            for _ in range(self.server.instances - 1):
                self._spawn(group)
        return wire.Ready(first.server_pid, self.tools, layers=self.layers)

    def new_slot(self, tool: str, arguments: dict[str, Any], progress: bool, log_level: int,
                 on_event: Callable[[Any], None] | None, on_done: Callable[[Any], None] | None = None,
                 principal: str | None = None) -> HostedSlot:
        # ``arguments`` came from JSON and go back to JSON: nothing to check here.
        return HostedSlot(tool, arguments, progress, log_level, on_event, on_done, principal)

    def submit(self, slot: HostedSlot) -> None:
        if self.closed or self.retiring:
            raise WorkerFailure("unavailable", f"plugin {self.name} is shutting down")
        group = self._group(slot.principal)
        if group is None:
            raise PoolBusy(f"plugin {self.name} already serves {self.server.max_principals} principals; retry later")
        waiting = len(group.queue)
        if waiting >= self.limits.max_queue and not self._free(group):
            raise PoolBusy(f"plugin {self.name} is busy ({self.limits.max_queue} calls waiting); retry later")
        group.last_used = time.monotonic()
        self.in_flight += 1
        group.queue.append(slot)
        self._dispatch(group)

    def withdraw(self, slot: HostedSlot) -> None:
        """The client cancelled: nothing more is reported; a running call is cancelled at the server."""
        if slot.finished:
            return
        slot.on_done = None
        slot.on_event = None
        instance = slot.instance
        if instance is not None and not instance.dead and slot.request_id in instance.pending:
            instance.cancel(slot, "cancelled by the client")
        else:
            for group in self.groups.values():
                if slot in group.queue:
                    group.queue.remove(slot)
        self._release()
        slot.finish()
        if instance is not None:
            self._dispatch(instance.group)

    def abort_all(self, reason: str) -> None:
        error = WorkerFailure("unavailable", reason)
        for group in self.groups.values():
            while group.queue:
                slot = group.queue.popleft()
                slot.error = error
                self.complete(slot)
            for instance in list(group.instances):
                instance.fail(error)

    async def retire(self) -> None:
        self.retiring = True
        try:
            while self.in_flight:
                self._drain = trio.Event()
                await self._drain.wait()
        finally:
            with trio.CancelScope(shield=True):
                await self.aclose(grace_s=0)

    async def aclose(self, grace_s: float = 2.0) -> None:
        self.closed = True
        error = WorkerFailure("unavailable", f"plugin {self.name} was unloaded")
        for group in self.groups.values():
            while group.queue:
                slot = group.queue.popleft()
                slot.error = error
                self.complete(slot)
        with trio.move_on_after(grace_s):
            while self.in_flight:
                self._drain = trio.Event()
                await self._drain.wait()
        instances = [i for g in self.groups.values() for i in g.instances]
        for instance in instances:
            if not instance.dead:
                instance.fail(error)
        self._watch_wake.set()

    # -- scheduling ----------------------------------------------------------------------------

    def _group(self, principal: str | None) -> Group | None:
        key = (principal or "") if self.server.per_principal else ""
        group = self.groups.get(key)
        if group is None:
            if self.server.per_principal and len(self.groups) > self.server.max_principals:
                self._drop_idle_groups()
                if len(self.groups) > self.server.max_principals:
                    return None
            group = self.groups[key] = Group(key)
        return group

    def _drop_idle_groups(self) -> None:
        idle = sorted((g for k, g in self.groups.items() if k and not g.queue
                       and not any(i.pending for i in g.instances)), key=lambda g: g.last_used)
        for group in idle[: max(1, len(idle) // 2)]:
            del self.groups[group.key]
            for instance in group.instances:
                instance.fail(WorkerFailure("unavailable", "idle instance stopped"))

    def _free(self, group: Group) -> Instance | None:
        best: Instance | None = None
        for instance in group.instances:
            if instance.ready and not instance.dead and instance.load < self.limits.max_concurrency:
                if best is None or instance.load < best.load:
                    best = instance
        return best

    def _dispatch(self, group: Group) -> None:
        while group.queue:
            instance = self._free(group)
            if instance is None:
                break
            instance.call(group.queue.popleft())
        alive = sum(1 for i in group.instances if not i.dead)
        if group.queue and alive + group.starting < self.server.instances and not group.failures:
            self._spawn(group)
        elif group.queue and alive + group.starting == 0:
            self._spawn(group)

    def _spawn(self, group: Group) -> None:
        if self.closed:
            return
        group.starting += 1
        self.nursery.start_soon(self._start_instance, group)

    async def _start_instance(self, group: Group) -> None:
        delay = 0.0 if not group.failures else min(BACKOFF_MAX_S, 0.25 * 2 ** min(group.failures - 1, 8))
        try:
            if delay:
                await trio.sleep(delay)
            if self.closed:
                return
            instance = Instance(self, group)
            try:
                tools = await instance.start()
            except PluginLoadError as exc:
                group.failures += 1
                group.last_error = exc.message
                log("hosted_server_start_failed", level="error", plugin=self.name, stage=exc.stage,
                    error=exc.message, attempt=group.failures)
                if not any(not i.dead for i in group.instances):
                    error = WorkerFailure("unavailable", f"the server could not be started: {exc.message}")
                    while group.queue:
                        slot = group.queue.popleft()
                        slot.error = error
                        self.complete(slot)
                return
            if self.closed or (group.key and group.key not in self.groups):
                instance.fail(WorkerFailure("unavailable", f"plugin {self.name} was unloaded"))
                return
            group.instances = [i for i in group.instances if not i.dead]
            group.instances.append(instance)
            log("hosted_server_started", plugin=self.name, pid=instance.server_pid, principal=group.key or None,
                instances=len(group.instances))
            if tools != self.tools:
                self.tools_listed(tools)
        finally:
            group.starting -= 1
            self._dispatch(group)

    def instance_ended(self, instance: Instance, error: WorkerFailure) -> None:
        group = instance.group
        if instance in group.instances:
            group.instances.remove(instance)
        if self.closed or not instance.ready:
            return
        self.restarts += 1
        if error.kind in ("memory", "processes", "timeout", "output_cap"):
            self.limit_kills += 1
        up = time.monotonic() - instance.started_at
        group.failures = 0 if up >= STABLE_AFTER_S else group.failures + 1
        log("hosted_server_exited", level="warning", plugin=self.name, pid=instance.server_pid, kind=error.kind,
            reason=error.message, up_s=round(up, 1), restart_in_s=min(BACKOFF_MAX_S, 0.25 * 2 ** max(0, group.failures - 1))
            if group.failures else 0)
        if group.key and group.key not in self.groups:
            return
        # Keep the group at its size: a shared group always, a principal's while it has work.
        if not group.key or group.queue or self.server.per_principal:
            self._spawn(group)

    def complete(self, slot: HostedSlot) -> None:
        if slot.finished:
            return
        if slot.instance is not None:
            slot.instance.forget(slot)
        self._release()
        slot.finish()
        instance = slot.instance
        if instance is not None and not self.closed:
            self._dispatch(instance.group)

    def _release(self) -> None:
        self.in_flight -= 1
        if not self.in_flight and self._drain is not None:
            self._drain.set()

    def relay(self, slot: HostedSlot, frame: Any, size: int) -> None:
        """One progress or log notification of ``slot``, within the call's budget (as ``WorkerPool._relay``)."""
        try:
            if type(frame) is wire.Log:
                worker_frames.check_log(frame)
            else:
                worker_frames.check_progress(frame)
        except FrameRejected:
            return
        if slot.on_event is None:
            return
        limits = self.limits
        if size > limits.max_notification_bytes:
            if type(frame) is wire.Log:
                frame = worker_frames.truncate_log(frame, size, limits.max_notification_bytes)
            else:
                frame = worker_frames.truncate_progress(frame, limits.max_notification_bytes)
            size = limits.max_notification_bytes
        if slot.notes >= limits.max_notifications or slot.note_bytes + size > limits.max_output_bytes:
            if not slot.notes_dropped:
                log("notification_budget_exhausted", level="warning", plugin=self.name, tool=slot.tool,
                    relayed=slot.notes, note="later progress/log notifications of this call are dropped")
            slot.notes_dropped += 1
            return
        slot.notes += 1
        slot.note_bytes += size
        slot.on_event(frame)

    def tools_listed(self, tools: list[wire.ToolSpec]) -> None:
        if tools == self.tools:
            return
        self.tools = tools
        log("hosted_tools_changed", plugin=self.name, tools=len(tools))
        if self.on_tools_changed is not None:
            try:
                self.on_tools_changed(tools)
            except Exception as exc:  # our bug; the server keeps serving
                log("internal_error", level="error", where="hosted tools changed", error=f"{type(exc).__name__}: {exc}")

    # -- deadlines -----------------------------------------------------------------------------

    def wake_watchdog(self, deadline: float) -> None:
        if deadline < self._watch_at:
            self._watch_wake.set()

    async def _watchdog(self) -> None:
        while not self.closed:
            now = trio.current_time()
            nearest = math.inf
            for group in list(self.groups.values()):
                for instance in list(group.instances):
                    for slot in list(instance.pending.values()):
                        if slot.deadline <= now:
                            instance.cancel(slot, "timed out")
                            slot.error = WorkerFailure("timeout", f"timed out after {self.limits.timeout_s:g} s")
                            self.complete(slot)
                        else:
                            nearest = min(nearest, slot.deadline)
            self._watch_wake = trio.Event()
            self._watch_at = nearest
            with trio.move_on_at(nearest):
                await self._watch_wake.wait()


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        message = error.get("message")
        code = error.get("code")
        text = message if isinstance(message, str) else "(no message)"
        return _text(f"{text} (code {code})" if type(code) is int else text, 1000)
    return "(malformed error)"


def _version() -> str:
    from runtime import __version__

    return str(__version__)


async def spawn_piped(env: dict[str, str], cwd: str) -> tuple[trio.Process, socket.socket]:
    """Start a worker interpreter with its IPC socket on fd 3 and stdin, stdout, stderr as three pipes
    (``processes.spawn_process`` merges stderr into stdout and closes stdin: a plugin's prints; here
    stdin and stdout are the server's MCP channel)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = child.fileno()
    move = "" if fd == 3 else f"import os;os.dup2({fd},3);os.close({fd});"
    bootstrap = f"{move}import sys;sys.path[:0]={WORKER_SYS_PATH!r};from sandbox.worker import main;main(3)"
    try:
        proc = await trio.lowlevel.open_process(
            [_PYTHON, "-I", "-S", "-B", "-c", bootstrap],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=(fd,), start_new_session=True, env=env, cwd=cwd,
        )
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    SPAWNED[proc.pid] = proc
    parent.setblocking(False)
    return proc, parent
