"""One hosted server process and the daemon's MCP session with it (``runtime.execution.hosted`` runs the calls).

How this works:

* ``Instance.start`` starts a worker like any other (``Init`` over its IPC fd, every isolation layer,
  the egress proxy for a network grant), which then executes the server (``sandbox.hosted``) with its
  stdin and stdout piped here; then the MCP handshake and ``tools/list`` (all pages, bounded).
* One reader task per instance reads the server's stdout line by line. Every line is untrusted: capped
  (an overlong one ends the instance, as an over-size frame ends a worker), decoded strictly, checked
  for depth and size (``runtime.worker_frames``), and shaped field by field. A bad response fails its
  own call; a bad notification is dropped; what cannot be tied to a call is logged, capped. Any
  exception while handling a line ends that instance, never the daemon.
* Writes go straight to the pipe when it takes them (no task switch on the hot path), else to a writer
  task; input the server leaves unread beyond ``MAX_UNREAD_INPUT`` ends it.
* Responses are matched by id; progress by the token sent with the call; a log message goes to the
  call it belongs to when exactly one call is running here and no call cancelled here may still be
  running at the server (stdio carries no other link; ``Instance._owner``). Requests
  from the server: ``ping`` is answered; ``elicitation/create``, ``sampling/createMessage`` and
  ``roots/list`` made while exactly one call runs here (as above) are that call's questions, asked of its
  client like a plugin's (``runtime.execution.hosted.HostedRunner.ask``: to a legacy client as our requests,
  to a 2026-07-28 one as ``input_required``) and answered back; everything else "method not found".
* ``cancel`` sends ``notifications/cancelled`` and then requires a ``ping`` answer within the
  server's ``cancel_grace_s``, or ends the instance. The cancelled id is remembered (at most
  ``MAX_CANCELLED``) until its late answer comes or ``max(cancel_grace_s, 1 s)`` has passed.
* ``list_changed`` relists (``_relist``): a burst is one listing, relists at least ``RELIST_MIN_S``
  apart, the gap doubling to ``RELIST_MAX_S`` while the list keeps changing; each bounded by
  ``start_timeout_s``. Our own warnings about an instance (dropped tools: one line per listing; failed
  relists) count against its log budget (``log_capped``). ``fail`` ends it: its running calls get the error,
  the process tree is killed, and the runner decides about a restart.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Protocol, cast

import msgspec
import trio

from runtime import __version__, worker_frames
from runtime.egress_rules import Grant
from runtime.execution.child import ChildProcess, WriteQueue, explain_exit, spawn_child
from runtime.execution.runner import CallSlot, PluginLoadError
from runtime.logs import log
from runtime.processes import WORKER_SYS_PATH, PoolSpec
from runtime.protocol.errors import InternalError, InvalidParams, MethodNotFound, WorkerFailure, error_object
from runtime.server_spec import ServerSpec
from runtime.worker_frames import FrameRejected
from sandbox import wire

PROTOCOL_VERSION = "2025-11-25"
#: What toolcell, as the hosted server's client, offers it: its calls' questions are passed on to the
#: client that made the call (who may still lack the capability: the server then hears an error).
#: No roots: a server asks for those at start-up, when no call (and no client) is there to answer.
CLIENT_CAPABILITIES: dict[str, Any] = {"elicitation": {}, "sampling": {}}
KNOWN_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
#: Most tools a hosted server may list, and most pages it may take to list them.
MAX_TOOLS = 1000
MAX_PAGES = 50
#: Bytes of stderr (and of messages that belong to no call) logged per instance.
MAX_LOGGED = 256 * 1024
#: Input the server has not read yet; beyond it the server is considered stuck and restarted.
MAX_UNREAD_INPUT = 8 << 20
#: What one line of our own about an instance (a dropped tool, a failed relist) costs of ``MAX_LOGGED``
#: at least, so that the number of such lines is bounded too.
LOG_LINE_COST = 256
#: ``list_changed``: a burst within this is one listing; listings come at least ``RELIST_MIN_S`` apart,
#: the gap doubling up to ``RELIST_MAX_S`` while each listing finds the list changed again.
RELIST_SETTLE_S = 0.05
RELIST_MIN_S = 1.0
RELIST_MAX_S = 30.0
#: Cancelled calls remembered per instance (the server may still be running them), and for how long
#: at least after the cancellation (else ``cancel_grace_s``).
MAX_CANCELLED = 256
CANCELLED_MIN_S = 1.0
#: After the process exits, how long the reader has to see the last answers on its stdout.
EXIT_SETTLE_S = 0.2
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


class InstanceOwner(Protocol):
    """What an instance needs of the runner that owns it (``runtime.execution.hosted.HostedRunner``)."""

    spec: PoolSpec
    server: ServerSpec
    name: str
    limits: wire.Limits
    nursery: trio.Nursery
    argv: list[str]
    command_read: list[str]
    grant: Grant
    max_line_bytes: int
    layers: list[str]

    def complete(self, slot: CallSlot) -> None: ...
    def relay(self, slot: CallSlot, frame: Any, size: int) -> None: ...
    def instance_ended(self, instance: Instance, error: WorkerFailure) -> None: ...
    def tools_listed(self, instance: Instance, tools: list[wire.ToolSpec]) -> None: ...
    def wake_watchdog(self, deadline: float) -> None: ...
    def ask(self, slot: CallSlot, instance: Instance, server_id: Any, method: str, params: dict[str, Any]) -> None: ...


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

    def __init__(self, runner: InstanceOwner, group: Any) -> None:
        self.runner = runner
        self.group = group
        #: The sandboxed process (its supervisor's pid; the server inside has ``server_pid``).
        self.child: ChildProcess | None = None
        self.pid = 0
        self.server_pid = 0
        self.pending: dict[int, CallSlot] = {}
        self.progress_tokens: dict[int, CallSlot] = {}
        self.waiters: dict[int, Callable[[Any], None]] = {}
        self.next_id = 0
        self.dead = False
        self.ready = False
        self.started_at = 0.0
        #: Writes to the server's stdin (set up once the sandbox is Ready).
        self.stdin: WriteQueue | None = None
        self.exited = trio.Event()
        self.logged = 0
        self.checking = False
        self.relisting = False
        #: A ``list_changed`` came while a relist was under way: list once more after it.
        self.relist_again = False
        #: Earliest time (trio's clock) of the next relist, and the gap after the next one that changes.
        self.relist_at = -math.inf
        self.relist_gap = RELIST_MIN_S
        #: What this instance listed last.
        self.tools: list[wire.ToolSpec] = []
        #: Calls cancelled here that the server may still be running: request id -> when to forget it.
        self.cancelled: dict[int, float] = {}
        self.failure: WorkerFailure | None = None
        self.server_info: dict[str, Any] = {}

    # -- start-up ------------------------------------------------------------------------------

    async def start(self) -> list[wire.ToolSpec]:
        """Start the sandboxed process, do the MCP handshake and list the tools. Raises ``PluginLoadError``."""
        runner = self.runner
        child, env, _ = await spawn_child(runner.spec, piped=True, home=True)
        self.child = child
        self.pid = child.pid
        self.exited = child.exited
        proc = child.proc
        # The server's stderr is its log (capped); its stdout is the MCP channel (``_read_loop``).
        runner.nursery.start_soon(child.watch, proc.stderr, self._exited, EXIT_SETTLE_S)
        try:
            with trio.fail_after(runner.server.start_timeout_s):
                ready = await self._sandbox(env)
                self.server_pid = child.log_pid = ready.pid
                assert proc.stdin is not None
                stdin_fd = int(cast(Any, proc.stdin).fileno())  # a trio FdStream over the pipe (non-blocking)
                self.stdin = WriteQueue(stdin_fd, lambda data: os.write(stdin_fd, data), MAX_UNREAD_INPUT)
                runner.nursery.start_soon(self.stdin.serve, self._input_broken)
                runner.nursery.start_soon(self._read_loop)
                init = await self.request("initialize", {
                    "protocolVersion": PROTOCOL_VERSION, "capabilities": CLIENT_CAPABILITIES,
                    "clientInfo": {"name": "toolcell", "version": str(__version__)}})
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
        self.tools = tools
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
        tail = self.child.tail() if self.child is not None else ""
        return f"; it printed: {_text(tail[-1500:])}" if tail else ""

    async def _sandbox(self, env: dict[str, str]) -> wire.Ready:
        """Send ``Init`` and wait for the sandbox's ``Ready`` (with the egress socket, if granted)."""
        runner = self.runner
        child = self.child
        assert child is not None
        m = runner.spec.manifest
        init = wire.Init(plugin_name=m.name, plugin_dir=runner.spec.plugin_dir, entry="", sys_path=WORKER_SYS_PATH,
                         env=env, limits=m.limits, permissions=runner.spec.permissions(), policy=runner.spec.policy,
                         scratch_dir=child.scratch, command=list(runner.argv), command_read=list(runner.command_read))
        msg = await child.handshake(init, runner.nursery, runner.spec, runner.grant)
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
        problems: list[str] = []
        for raw in raw_tools:
            try:
                specs.append(_tool_spec(raw))
            except ValueError as exc:
                problems.append(str(exc))
        if problems:  # one line per listing (a server may list a thousand broken tools, again and again)
            self.log_capped("hosted_tool_dropped", dropped=len(problems), problems=problems[:5])
        return specs

    # -- talking to the server -----------------------------------------------------------------

    def send(self, obj: dict[str, Any]) -> None:
        """Write one message now if the pipe takes it (no task switch on the hot path), else queue it
        for the writer task."""
        stdin = self.stdin
        if self.dead or stdin is None:
            return
        if not stdin.write(_encode(obj) + b"\n"):
            if stdin.full:
                self.fail(WorkerFailure("unavailable", "the server stopped reading its input"))
            else:
                self._input_broken()

    def _input_broken(self) -> None:
        self.fail(WorkerFailure("crashed", "the server closed its input"))

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

    def call(self, slot: CallSlot) -> None:
        request_id = self._new_id()
        slot.request_id = request_id
        slot.instance = self
        self.pending[request_id] = slot
        call = slot.call
        params: dict[str, Any] = {"name": call.tool, "arguments": call.arguments}
        if call.progress:
            params["_meta"] = {"progressToken": request_id}
            self.progress_tokens[request_id] = slot
        if call.traceparent:  # the call's span: the server's own spans join the trace (MCP's _meta.traceparent)
            params.setdefault("_meta", {})["traceparent"] = call.traceparent
        slot.deadline = trio.current_time() + self.runner.limits.timeout_s
        self.runner.wake_watchdog(slot.deadline)
        self.send({"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params})

    def forget(self, slot: CallSlot) -> None:
        self.pending.pop(slot.request_id, None)
        self.progress_tokens.pop(slot.request_id, None)

    def cancel(self, slot: CallSlot, reason: str) -> None:
        """Stop ``slot`` at the server; the server must then show it is still responsive. Until its late
        answer comes (or a while passes), what the server asks or logs may still be that call's."""
        self.forget(slot)
        self.cancelled.pop(slot.request_id, None)
        self.cancelled[slot.request_id] = trio.current_time() + max(self.runner.server.cancel_grace_s,
                                                                    CANCELLED_MIN_S)
        while len(self.cancelled) > MAX_CANCELLED:
            del self.cancelled[next(iter(self.cancelled))]
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

    async def _read_loop(self) -> None:
        assert self.child is not None
        proc = self.child.proc
        assert proc.stdout is not None
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
            request_id = raw_id if type(raw_id) is int else -1  # not ``true``, which equals 1
            waiter = self.waiters.pop(request_id, None)
            if waiter is not None:  # our own request (``tools/list``, ...): it fails, its caller hears why
                waiter(WorkerFailure("garbage", f"the server sent a malformed answer: {exc}"))
                return
            slot = self.pending.pop(request_id, None)
            if slot is not None:
                self.progress_tokens.pop(request_id, None)
                slot.error = WorkerFailure("garbage", f"the server sent a malformed result: {exc}")
                self.runner.complete(slot)
                return
            self._log_stray("hosted_server_garbage", line[:2000], why=str(exc)[:200])
            server_id = msg.get("id") if isinstance(msg, dict) and isinstance(msg.get("method"), str) else None
            if _answerable_id(server_id):
                # A request of the server's own: it hears why, instead of waiting for an answer forever.
                self.send({"jsonrpc": "2.0", "id": server_id, "error": error_object(InvalidParams(str(exc)))})
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
            self.cancelled.pop(request_id, None)  # the answer to a call that was cancelled or timed out
            return
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
        if not _answerable_id(request_id):
            return
        if method == "ping":
            self.send({"jsonrpc": "2.0", "id": request_id, "result": {}})
        elif method in wire.INPUT_METHODS:
            owner = self._owner()
            params = msg.get("params")
            if owner is None or not isinstance(params, dict):
                # stdio carries no link from a server's request to a call: only one call can own it.
                self.send({"jsonrpc": "2.0", "id": request_id, "error": error_object(
                    InternalError("toolcell cannot tell which call this request belongs to"))})
                return
            params = {k: v for k, v in params.items() if k != "_meta"}
            try:
                worker_frames.check_value(params, f"the params of {method}")
            except FrameRejected as exc:
                self.send({"jsonrpc": "2.0", "id": request_id, "error": error_object(InvalidParams(str(exc)))})
                return
            self.runner.ask(owner, self, request_id, method, params)
        else:
            self.send({"jsonrpc": "2.0", "id": request_id,
                       "error": error_object(MethodNotFound(f"Method not found: {method[:100]}"))})

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
            owner = self._owner()
            if owner is not None:
                frame_log = wire.Log(owner.request_id, wire.LOG_LEVELS.index(level), params.get("data"),
                                     logger[:256] if isinstance(logger, str) else None)
                self.runner.relay(owner, frame_log, len(_encode(params)))
            else:
                self._log_stray("hosted_server_log", _encode(params)[:2000], why=str(level))
        elif method == "notifications/tools/list_changed":
            if not self.ready or self.dead:
                return
            if self.relisting:
                self.relist_again = True
            else:
                self.relisting = True
                self.runner.nursery.start_soon(self._relist)

    async def _relist(self) -> None:
        """List the tools again after ``list_changed``. A burst is one listing; listings are at least
        ``RELIST_MIN_S`` apart, the gap doubling (to ``RELIST_MAX_S``) while each one finds the list
        changed (or fails), back to the shortest when one finds it unchanged. A listing gets
        ``start_timeout_s`` to be answered. A ``list_changed`` during a listing makes one more."""
        timeout = self.runner.server.start_timeout_s
        try:
            while not self.dead:
                await trio.sleep_until(max(trio.current_time() + RELIST_SETTLE_S, self.relist_at))
                if self.dead:
                    return
                self.relist_again = False
                changed = True
                try:
                    with trio.fail_after(timeout):
                        tools = await self.list_tools()
                except trio.TooSlowError:
                    self.log_capped("hosted_relist_failed",
                                    error=f"the server did not answer tools/list within {timeout:g} s")
                except (WorkerFailure, ValueError) as exc:
                    if self.dead:
                        return
                    self.log_capped("hosted_relist_failed", error=str(exc)[:300])
                else:
                    changed = tools != self.tools
                    self.tools = tools
                    self.runner.tools_listed(self, tools)
                if changed:
                    self.relist_at = trio.current_time() + self.relist_gap
                    self.relist_gap = min(RELIST_MAX_S, self.relist_gap * 2)
                else:
                    self.relist_at = trio.current_time() + RELIST_MIN_S
                    self.relist_gap = RELIST_MIN_S
                if not self.relist_again:
                    return
        finally:
            self.relisting = False

    def log_capped(self, event: str, **fields: Any) -> None:
        """One warning of ours about this instance, counted against its log budget (``MAX_LOGGED``)."""
        self._budgeted(event, max(LOG_LINE_COST, len(_encode(fields))), fields)

    def _log_stray(self, event: str, data: bytes, why: str) -> None:
        """What the server wrote that belongs to no call, counted by its size against the same budget."""
        self._budgeted(event, len(data), {"why": why, "data": data[:2000].decode("utf-8", "replace")})

    def _budgeted(self, event: str, cost: int, fields: dict[str, Any]) -> None:
        if self.logged >= MAX_LOGGED:
            return
        self.logged += cost
        log(event, level="warning", plugin=self.runner.name, pid=self.server_pid, **fields)
        if self.logged >= MAX_LOGGED:
            log("hosted_server_output_capped", level="warning", plugin=self.runner.name, cap_bytes=MAX_LOGGED)

    # -- the end -------------------------------------------------------------------------------

    def _exit_failure(self) -> WorkerFailure:
        code = self.child.proc.returncode if self.child is not None else None
        # The supervisor (``sandbox.hosted``) exits with 128 + N when its server was killed by signal N.
        failure = explain_exit(code, self.pid, self.runner.limits, "the server process", shell_status=True)
        return WorkerFailure(failure.kind, f"the server {failure.message}; it is being restarted"
                             if failure.kind != "crashed" else f"{failure.message}; it is being restarted")

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
        self.runner.instance_ended(self, error)

    def kill(self) -> None:
        self.dead = True
        if self.stdin is not None:
            self.stdin.close()
        if self.child is not None:
            self.child.kill()

    def _exited(self) -> None:
        """The process exited (``ChildProcess.watch``): a live instance ends with the reason."""
        if not self.dead:
            self.fail(self._exit_failure())

    @property
    def load(self) -> int:
        return len(self.pending)

    def _owner(self) -> CallSlot | None:
        """The one call a server's request or log can belong to, or None: stdio carries no link, so only
        when exactly one call runs here and no cancelled call may still be running at the server."""
        if self.cancelled:
            now = trio.current_time()
            for request_id, until in list(self.cancelled.items()):
                if until > now:
                    break  # in order of cancellation, so of expiry (the window is the same for all)
                del self.cancelled[request_id]
        if len(self.pending) != 1 or self.cancelled:
            return None
        return next(iter(self.pending.values()))


def _answerable_id(request_id: Any) -> bool:
    """Whether a server's request id is one we answer (an integer, or a string of at most 256 characters)."""
    return type(request_id) is int or (type(request_id) is str and len(request_id) <= 256)


def _error_text(error: Any) -> str:
    if isinstance(error, dict):
        message = error.get("message")
        code = error.get("code")
        text = message if isinstance(message, str) else "(no message)"
        return _text(f"{text} (code {code})" if type(code) is int else text, 1000)
    return "(malformed error)"


