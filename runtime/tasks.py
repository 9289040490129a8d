"""Tasks: tool calls that run long, polled by their client, kept durably (both eras).

How this works:

* A task is created by a ``tools/call`` the core marked ``task_mode`` (``runtime.protocol.core``:
  a 2025-11-25 client asked with ``params.task``; a 2026-07-28 client declared the tasks extension
  and the tool's policy says so). ``TaskManager.create`` writes the record to the task store
  (``runtime.task_store``: SQLite by default, Redis to share tasks between daemons) *before* the
  client hears the task id, then runs the call with the task as its owner (``TaskRun``). With
  ``task_after_ms`` the call starts inline and becomes a task only if it is still running then
  (``promote_later``); questions it asks before that are asked inline.
* A ``TaskRun`` turns what its call does into store transitions: a question round makes the task
  ``input_required`` (its open requests stored as ``inputRequests``; answers go to that round only,
  and once it times out in the tool, after ``limits.ask_timeout_s``, the task is ``working`` again
  and its requests are gone, so a late answer lands nowhere), the outcome makes it
  ``completed`` or ``failed`` (2026-07-28: a tool's ``isError`` result is ``completed``; 2025-11-25:
  ``failed``). Transitions are compare-and-set, so a cancelled task stays cancelled.
* ``tasks/get``, ``tasks/list``, ``tasks/result`` read the store, scoped to the caller's principal
  (another principal's task reads as unknown). ``tasks/cancel`` and ``tasks/update`` act on the
  call directly when this daemon runs it, and otherwise leave a message in the task's mailbox for
  the daemon that does (``serve`` takes them), so any daemon sharing the store can serve any task.
* A 2025-11-25 task's questions go to the client through a connection that called ``tasks/result``
  on it (server->client requests carrying the related-task ``_meta``); a 2026-07-28 client answers
  with ``tasks/update``. ``notifications/tasks`` (2026-07-28 ``subscriptions/listen`` with
  ``taskIds``) and ``notifications/tasks/status`` (2025-11-25, to the connection that created the
  task) report transitions of the tasks this daemon runs; a listen naming a task another daemon
  runs (replicas behind a balancer) is served from the store: ``serve`` reads such tasks every
  ``MAILBOX_POLL_S`` and reports each transition made since the listen began (``_watch_remote``).
* ``serve`` heartbeats for this daemon, fails the tasks of daemons that died (``recover_orphans``:
  a task is never left ``working``), expires old tasks and drains the mailboxes of local tasks.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import trio

from runtime.logs import log
from runtime.protocol import eras, task_shapes
from runtime.protocol import jsonrpc as rpc
from runtime.protocol.core import Core, Outcome, TaskRequest, ToolCall
from runtime.protocol.errors import INTERNAL_ERROR, InternalError, InvalidParams, McpError, ServerBusy, error_object
from runtime.protocol.task_shapes import TaskView
from runtime.running import NOWHERE, RunningCall, Sink
from runtime.task_store import (
    TaskCapReached,
    TaskRecord,
    TaskStore,
    local_owner_verdict,
    new_owner_id,
    new_task_id,
    wall_clock_ms,
)
from sandbox import wire

if TYPE_CHECKING:
    from runtime.calls import CallDispatcher
    from runtime.config import TasksConfig

_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder()
#: How often the mailboxes of local tasks are read (cancels and answers from other daemons).
MAILBOX_POLL_S = 0.1
#: How long a daemon that took a cancel for another daemon's task waits for that daemon to record it.
CANCEL_WAIT_S = 2.0


class TaskConversation(Protocol):
    """What the task manager needs of a connection (``runtime.connection.Connection``)."""

    principal: str | None
    push: Callable[[bytes], None] | None

    def start(self, call: ToolCall, sink: Sink, given: dict[str, Any] | None = None,
              owner: Any = None) -> RunningCall: ...

    def release(self, running: RunningCall) -> None: ...

    def ask_client(self, requests: list[wire.InputRequest], version: str, caps: dict[str, Any] | None, sink: Sink,
                   deliver: Callable[[list[wire.InputResponse]], None],
                   meta: dict[str, Any] | None = None) -> Any: ...


class _PushSink:
    """A connection's own channel (stdio, a legacy session's GET stream) as a sink."""

    def __init__(self, push: Callable[[bytes], None]) -> None:
        self.emit = push

    def done(self, data: bytes, error_code: int | None = None) -> None:
        self.emit(data)

    def cancelled(self) -> None:
        pass


class TaskRun:
    """A task this daemon runs: the owner of its call (``CallOwner``)."""

    def __init__(self, manager: TaskManager, record: TaskRecord, call: ToolCall, principal: str) -> None:
        self.manager = manager
        self.task_id = record.task_id
        self.record = record
        self.call = call
        self.principal = principal
        self.running: RunningCall | None = None
        self.lock = trio.Lock()
        self.finished = trio.Event()
        #: The open round of questions: answers so far, the requests still open.
        self.partial: dict[str, wire.InputResponse] = {}
        self.open: list[wire.InputRequest] = []
        #: The round those answer (``wire.Ask``), and the wait that ends it at ``ask_timeout_s``.
        self.round: wire.Ask | None = None
        self._expiry: trio.CancelScope | None = None
        #: 2025-11-25: requests waiting in ``tasks/result`` (their streams carry the questions).
        self.result_waiters: list[tuple[TaskConversation, Sink]] = []
        #: 2025-11-25: where ``notifications/tasks/status`` go (the connection that created the task).
        self.status_push: Callable[[bytes], None] | None = None

    # -- CallOwner -----------------------------------------------------------------------------

    def call_frame(self, running: RunningCall, frame: Any) -> None:
        if type(frame) is wire.Ask:
            self.manager.nursery.start_soon(self.manager.guarded, self._ask(frame), self.task_id)
        # Progress and log messages of a task have no request to travel with: dropped.

    def call_outcome(self, running: RunningCall, outcome: Outcome) -> None:
        self.manager.nursery.start_soon(self.manager.guarded, self._finish(outcome), self.task_id)

    # -- questions -----------------------------------------------------------------------------

    async def _ask(self, ask: wire.Ask) -> None:
        call = self.call
        answered: dict[str, wire.InputResponse] = {}
        still_open: list[wire.InputRequest] = []
        for request in ask.requests:
            why = eras.input_refusal(call.version, call.client_caps, request.method, request.params)
            if why is not None:
                answered[request.key] = wire.InputResponse(request.key, "declined_capability", message=why)
            else:
                still_open.append(request)
        if not still_open:
            self._answer(list(answered.values()), ask)
            return
        async with self.lock:
            self._end_round()
            self.partial, self.open, self.round = answered, still_open, ask
            self._expiry = trio.CancelScope()
            self.manager.nursery.start_soon(self.manager.guarded, self._expire(ask, self._expiry), self.task_id)
            await self.manager.transition(self, "input_required", input_requests=_input_requests(still_open))
        for conn, sink in list(self.result_waiters):
            self.relay(conn, sink)

    def _answer(self, responses: list[wire.InputResponse], to: wire.Ask | None) -> bool:
        """Answer the round ``to`` (False: the call no longer waits on it; nothing is sent)."""
        running = self.running
        if running is None or to is None:
            return False
        return self.manager.calls.answer(running.call, running.handle, responses, to=to)

    def _end_round(self) -> None:
        """Forget the open round (answered, timed out, or the call ended)."""
        self.partial, self.open, self.round = {}, [], None
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None

    async def _expire(self, ask: wire.Ask, scope: trio.CancelScope) -> None:
        """The pool answers the tool "timeout" ``ask_timeout_s`` after it asked (it goes on): then this
        round is over here too: the task is ``working`` and lists no requests, so an answer that comes
        later is ignored rather than taken for a later round."""
        with scope:
            await trio.sleep(self.call.entry.runner.limits.ask_timeout_s)
        if scope.cancel_called:
            return
        async with self.lock:
            if self.round is not ask or self.finished.is_set():
                return
            self._expiry = None
            self._end_round()
            await self.manager.transition(self, "working", input_requests=None)

    def relay(self, conn: TaskConversation, sink: Sink) -> None:
        """2025-11-25: ask the open questions on ``sink``, the stream of a ``tasks/result`` waiting on
        ``conn`` (stdout; the POST's SSE stream)."""
        if not self.open or not getattr(sink, "can_stream", True):
            return
        meta = {task_shapes.RELATED_TASK: {"taskId": self.task_id}}

        def deliver(responses: list[wire.InputResponse]) -> None:
            answers = {r.key: r for r in responses if r.outcome == "result"}
            self.manager.nursery.start_soon(self.manager.guarded, self.take_answers(answers), self.task_id)

        conn.ask_client(list(self.open), self.call.version, self.call.client_caps, sink, deliver, meta)

    async def take_answers(self, given: dict[str, wire.InputResponse]) -> None:
        """Answers to the open round (from ``tasks/update`` or a relayed request); the call goes on
        once every open question has one. Unknown or already answered keys are ignored."""
        async with self.lock:
            if not self.open:
                return
            for request in self.open:
                if request.key in given:
                    self.partial[request.key] = given[request.key]
            remaining = [r for r in self.open if r.key not in self.partial]
            if remaining:
                self.open = remaining
                await self.manager.transition(self, "input_required", input_requests=_input_requests(remaining))
                return
            responses, ask = list(self.partial.values()), self.round
            self._end_round()
            if await self.manager.transition(self, "working", input_requests=None) is not None:
                self._answer(responses, ask)

    # -- the end -------------------------------------------------------------------------------

    async def _finish(self, outcome: Outcome) -> None:
        manager = self.manager
        call = self.call
        try:
            body, error, bug = manager.core.outcome_body(call, outcome, call.entry.runner.limits.max_output_bytes)
            if bug is not None:
                log("plugin_bug", level="error", tool=call.entry.name, plugin=call.entry.plugin, problem=bug)
            async with self.lock:
                self._end_round()
                if error is not None:
                    await manager.transition(self, "failed", error=_error_object(error),
                                             status_message=error.message[:500], input_requests=None)
                elif body is not None and not call.modern and b'"isError":true' in body:
                    await manager.transition(self, "failed", result=body, input_requests=None,
                                             status_message="the tool reported an error")
                else:
                    await manager.transition(self, "completed", result=body, input_requests=None)
        except Exception as exc:  # the store failed (or our bug): the task says so if it still can
            message = f"the task's result could not be stored: {type(exc).__name__}: {str(exc)[:200]}"
            log("task_store_failed", level="error", task=self.task_id, error=str(exc)[:300])
            try:
                await manager.transition(self, "failed", status_message=message[:500],
                                         error=_enc.encode(error_object(InternalError(message))))
            except Exception:  # noqa: BLE001 (logged above; the store is down)
                pass
        finally:
            self.finished.set()
            manager.running.pop(self.task_id, None)

    def stop(self) -> None:
        """Stop the call (the task was cancelled)."""
        running = self.running
        if running is not None and not self.finished.is_set():
            self._end_round()
            self.manager.calls.cancel(running.call, running.handle, self.principal or None)
            self.finished.set()
            self.manager.running.pop(self.task_id, None)


def _input_requests(requests: list[wire.InputRequest]) -> bytes:
    return _enc.encode({r.key: {"method": r.method, "params": r.params} for r in requests})


def _error_object(error: McpError) -> bytes:
    obj: dict[str, Any] = {"code": error.code, "message": error.message}
    if error.data is not msgspec.UNSET:
        obj["data"] = error.data
    return _enc.encode(obj)


def _view(record: TaskRecord) -> TaskView:
    return TaskView(task_id=record.task_id, status=record.status, status_message=record.status_message,
                    created_at_ms=record.created_at_ms, updated_at_ms=record.updated_at_ms, ttl_ms=record.ttl_ms,
                    poll_interval_ms=record.poll_interval_ms, result=record.result, error=record.error,
                    input_requests=record.input_requests)


class TaskManager:
    """Every task this daemon creates, runs or answers for (see the module docstring)."""

    def __init__(self, core: Core, calls: CallDispatcher, store: TaskStore, config: TasksConfig,
                 nursery: trio.Nursery, owner: str | None = None,
                 catalog_fingerprint: Callable[[], str] | None = None) -> None:
        self.core = core
        self.calls = calls
        self.store = store
        self.config = config
        self.nursery = nursery
        self.owner = owner or new_owner_id()
        self.running: dict[str, TaskRun] = {}
        #: ``notifications/tasks`` subscriptions: task id -> (principal, sink, subscription id bytes).
        self.listeners: dict[str, list[tuple[str, Sink, bytes]]] = {}
        #: Listened tasks: the ``updated_at_ms`` of the last transition reported (at first, when the
        #: listen began), and those reported finished (nothing more will change).
        self._reported: dict[str, int] = {}
        self._reported_final: set[str] = set()
        self.stats = {"created": 0, "completed": 0, "failed": 0, "cancelled": 0, "recovered": 0}
        #: The fingerprint of the catalog this daemon serves, compared at each heartbeat with those of
        #: the other daemons sharing the store (``catalogs``: owner -> fingerprint, this one included).
        self._catalog_fingerprint = catalog_fingerprint
        self.catalogs: dict[str, str] = {}

    async def guarded(self, work: Awaitable[Any], task_id: str = "") -> None:
        """Run background work of a task: a failure (the store is down, our bug) is logged, and never
        reaches the daemon's nursery."""
        try:
            await work
        except Exception as exc:
            log("task_error", level="error", task=task_id, error=f"{type(exc).__name__}: {str(exc)[:300]}")

    # -- creating ------------------------------------------------------------------------------

    def _ttl(self, requested: int | None) -> int:
        cfg = self.config
        return cfg.default_ttl_ms if requested is None else max(1_000, min(requested, cfg.max_ttl_ms))

    async def _new_record(self, call: ToolCall, principal: str) -> TaskRecord:
        now = wall_clock_ms()
        record = TaskRecord(task_id=new_task_id(), principal=principal, tool=call.entry.name,
                            era=eras.V2026_07_28 if call.modern else eras.V2025_11_25, status="working",
                            created_at_ms=now, updated_at_ms=now, ttl_ms=self._ttl(call.task_ttl_ms),
                            poll_interval_ms=self.config.poll_interval_ms, owner=self.owner)
        try:
            await self.store.create(record, self.config.max_live_per_principal)
        except TaskCapReached:
            raise ServerBusy(f"Too many live tasks for this principal (at most "
                             f"{self.config.max_live_per_principal}); wait for some to finish", 1000) from None
        self.stats["created"] += 1
        return record

    async def create(self, conn: TaskConversation, call: ToolCall) -> tuple[bytes, int | None]:
        """A ``tools/call`` that runs as a task from the start: the answer is its ``CreateTaskResult``,
        sent only once the task is stored (so ``tasks/get`` finds it)."""
        principal = conn.principal or ""
        try:
            record = await self._new_record(call, principal)
        except Exception as exc:  # the store refused or is down: this request fails, nothing else
            error = exc if isinstance(exc, McpError) else ServerBusy(
                f"The task store is unavailable: {type(exc).__name__}: {str(exc)[:200]}")
            if not isinstance(exc, McpError):
                log("task_store_failed", level="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
            return self.core.call_error(call, error), error.code
        run = TaskRun(self, record, call, principal)
        run.status_push = conn.push if not call.modern else None
        self.running[record.task_id] = run
        run.running = conn.start(call, NOWHERE, None, owner=run)
        if self.calls.tracer is not None:
            self.calls.trace_event(run.running.handle, "task.created", {"mcp.task.id": record.task_id})
        log("task_created", task=record.task_id, tool=call.entry.name, principal=principal, era=record.era)
        return self.core.task_created(call, _view(record)), None

    def promote_later(self, conn: TaskConversation, running: RunningCall, after_ms: int) -> None:
        """Make ``running`` a task if it is still running inline after ``after_ms``."""
        self.nursery.start_soon(self._promote, conn, running, after_ms)

    async def _promote(self, conn: TaskConversation, running: RunningCall, after_ms: int) -> None:
        await trio.sleep(after_ms / 1000)
        me: object = conn
        if running.owner is not me or running.handle is None or running.handle.finished:
            return  # finished, parked for a retry, or cancelled meanwhile
        call = running.call
        principal = conn.principal or ""
        try:
            record = await self._new_record(call, principal)
        except Exception as exc:  # noqa: BLE001 (the store refused or is down)
            log("task_promotion_failed", level="warning", tool=call.entry.name, error=str(exc)[:300])
            return  # it goes on inline
        if running.owner is not me or running.handle.finished:
            # It finished (inline) while the task was being stored: the client never hears of it.
            await self.guarded(self.store.transition(record.task_id, status="cancelled", now_ms=wall_clock_ms(),
                                                     status_message="finished before it became a task"))
            return
        run = TaskRun(self, record, call, principal)
        run.running = running
        self.running[record.task_id] = run
        conn.release(running)
        sink = running.sink
        running.owner = run
        running.sink = NOWHERE
        sink.done(self.core.task_created(call, _view(record)))
        if self.calls.tracer is not None:
            self.calls.trace_event(running.handle, "task.created", {"mcp.task.id": record.task_id})
        log("task_created", task=record.task_id, tool=call.entry.name, principal=principal, era=record.era,
            after_ms=after_ms)

    # -- transitions ---------------------------------------------------------------------------

    async def transition(self, run: TaskRun, status: str, **fields: Any) -> TaskRecord | None:
        record = await self.store.transition(run.task_id, status=status, now_ms=wall_clock_ms(),  # type: ignore[arg-type]
                                             **fields)
        if record is None:
            return None
        run.record = record
        if self.calls.tracer is not None and run.running is not None:
            self.calls.trace_event(run.running.handle, "task." + status, {"mcp.task.id": run.task_id})
        if status in task_shapes.TERMINAL:
            self.stats[status] = self.stats.get(status, 0) + 1
            log("task_" + status, task=run.task_id, tool=run.call.entry.name)
        self._notify(record, run)
        return record

    def _notify(self, record: TaskRecord, run: TaskRun | None) -> None:
        view = _view(record)
        if record.task_id in self.listeners:
            self._reported[record.task_id] = max(self._reported.get(record.task_id, 0), record.updated_at_ms)
            if record.terminal:
                self._reported_final.add(record.task_id)
        for principal, sink, sub_id in self.listeners.get(record.task_id, ()):
            if principal == record.principal:
                params = task_shapes.modern_detailed(view, result_type=False)
                meta = b'"_meta":{"' + eras.META_SUBSCRIPTION_ID.encode() + b'":' + sub_id + b"}"
                sink.emit(b'{"jsonrpc":"2.0","method":"notifications/tasks","params":' + params[:-1] + b"," + meta + b"}}")
        if run is not None and run.status_push is not None:
            run.status_push(rpc.notification("notifications/tasks/status",
                                             msgspec.json.decode(task_shapes.legacy_task(view))))

    def subscribe(self, principal: str, task_ids: tuple[str, ...], sink: Sink, sub_id: bytes) -> Callable[[], None]:
        """``notifications/tasks`` for ``task_ids`` on ``sink``; returns the unsubscribe function."""
        entry = (principal, sink, sub_id)
        since = wall_clock_ms() - 1
        for task_id in task_ids:
            self.listeners.setdefault(task_id, []).append(entry)
            self._reported.setdefault(task_id, since)

        def unsubscribe() -> None:
            for task_id in task_ids:
                entries = self.listeners.get(task_id)
                if entries and entry in entries:
                    entries.remove(entry)
                    if not entries:
                        del self.listeners[task_id]
                        self._reported.pop(task_id, None)
                        self._reported_final.discard(task_id)

        return unsubscribe

    # -- tasks/* requests ------------------------------------------------------------------------

    async def handle(self, conn: TaskConversation, req: TaskRequest, sink: Sink) -> tuple[bytes, int | None]:
        """Answer one tasks/* request (bytes and the JSON-RPC error code, if it is an error); ``sink``
        is the request's own stream (a 2025-11-25 ``tasks/result`` asks the task's questions there)."""
        try:
            return await self._handle(conn, req, sink), None
        except McpError as exc:
            return rpc.error_reply(req.id_bytes, exc), exc.code
        except Exception as exc:  # the store is down (or our bug): this request fails, nothing else
            log("task_store_failed", level="error", method=req.method, error=f"{type(exc).__name__}: {str(exc)[:300]}")
            error = ServerBusy(f"The task store is unavailable: {type(exc).__name__}")
            return rpc.error_reply(req.id_bytes, error), error.code

    async def _get(self, req: TaskRequest, principal: str) -> TaskRecord:
        assert req.task_id is not None
        record = await self.store.get(req.task_id, principal)
        if record is None:
            raise InvalidParams(f"Invalid params: unknown task {req.task_id[:64]!r}")
        return record

    async def _handle(self, conn: TaskConversation, req: TaskRequest, sink: Sink) -> bytes:
        principal = conn.principal or ""
        core = self.core
        match req.method:
            case "tasks/get":
                record = await self._get(req, principal)
                body = task_shapes.modern_detailed(_view(record)) if req.modern else task_shapes.legacy_task(_view(record))
                return core.task_reply(req, body)
            case "tasks/list":
                try:
                    records, cursor = await self.store.list(principal, req.cursor, 100)
                except ValueError:
                    raise InvalidParams("Invalid params: invalid cursor") from None
                body = b'{"tasks":[' + b",".join(task_shapes.legacy_task(_view(r)) for r in records) + b"]"
                if cursor is not None:
                    body += b',"nextCursor":' + _enc.encode(cursor)
                return core.task_reply(req, body + b"}")
            case "tasks/cancel":
                return await self._cancel(req, principal)
            case "tasks/update":
                return await self._update(req, principal)
            case "tasks/result":
                return await self._result(conn, req, principal, sink)
        raise InvalidParams(f"Invalid params: {req.method} is not served")

    async def _cancel(self, req: TaskRequest, principal: str) -> bytes:
        record = await self._get(req, principal)
        if record.terminal:
            if req.modern:
                return self.core.task_reply(req, task_shapes.ACK)  # idempotent in 2026-07-28
            raise InvalidParams(f"Invalid params: task {record.task_id} is already {record.status}")
        run = self.running.get(record.task_id)
        updated: TaskRecord | None
        if run is None:
            # Run by another daemon: it stops the worker and records the cancel when it reads the
            # task's mailbox (every MAILBOX_POLL_S); we wait a little for that, then record it
            # ourselves (an owner that does not answer is stopped anyway: orphans are failed).
            delivered = await self.store.post(record.task_id, b'{"cancel":true}')
            deadline = trio.current_time() + CANCEL_WAIT_S
            while delivered and trio.current_time() < deadline and not record.terminal:
                await trio.sleep(MAILBOX_POLL_S / 2)
                record = await self._get(req, principal)
            updated = record if record.terminal else await self.store.transition(
                record.task_id, status="cancelled", now_ms=wall_clock_ms(), status_message="cancelled by the client",
                input_requests=None)
        else:
            updated = await self.store.transition(record.task_id, status="cancelled", now_ms=wall_clock_ms(),
                                                  status_message="cancelled by the client", input_requests=None)
            run.stop()
            if updated is not None:
                run.record = updated
                self.stats["cancelled"] += 1
                self._notify(updated, run)
        if req.modern:
            return self.core.task_reply(req, task_shapes.ACK)
        final = updated or await self._get(req, principal)
        return self.core.task_reply(req, task_shapes.legacy_task(_view(final)))

    async def _update(self, req: TaskRequest, principal: str) -> bytes:
        record = await self._get(req, principal)
        responses = req.input_responses or {}
        if record.status == "input_required" and responses:
            run = self.running.get(record.task_id)
            if run is not None:
                await run.take_answers(_checked_answers(run.open, responses))
            else:
                # Another daemon runs it: check the answers against the open questions it stored, so a
                # malformed one is refused here too, then pass on what is for them.
                checked = _checked_answers(_stored_requests(record.input_requests), responses)
                if checked:
                    await self.store.post(record.task_id, _enc.encode({"update": {k: r.result for k, r in checked.items()}}))
        return self.core.task_reply(req, task_shapes.ACK)

    async def _result(self, conn: TaskConversation, req: TaskRequest, principal: str, sink: Sink) -> bytes:
        """2025-11-25 ``tasks/result``: wait for the task to end; meanwhile its questions are asked on
        this request's own stream, whichever daemon runs the task."""
        record = await self._get(req, principal)
        run = self.running.get(record.task_id)
        if run is not None and not record.terminal:
            waiter = (conn, sink)
            run.result_waiters.append(waiter)
            try:
                run.relay(conn, sink)
                await run.finished.wait()
            finally:
                if waiter in run.result_waiters:
                    run.result_waiters.remove(waiter)
            record = await self._get(req, principal)
        relayed_at = -1
        while not record.terminal:  # run by another daemon: poll the store
            if record.status == "input_required" and record.input_requests and record.updated_at_ms != relayed_at:
                relayed_at = record.updated_at_ms
                self._relay_remote(conn, sink, record)
            await trio.sleep(max(0.05, min(1.0, (record.poll_interval_ms or 1000) / 1000)))
            record = await self._get(req, principal)
        record = await self._get(req, principal)
        if record.status == "cancelled":
            raise InvalidParams(f"Invalid params: task {record.task_id} was cancelled")
        if record.result is not None:
            return rpc.response(req.id_bytes, task_shapes.with_related_task(record.result, record.task_id))
        error = _dec.decode(record.error) if record.error is not None else None
        if not isinstance(error, dict):
            error = error_object(InternalError("the task ended without a result"))
        code = error.get("code")
        return rpc.error_response(req.id_bytes, code if type(code) is int else INTERNAL_ERROR, str(error.get("message", "")),
                                  error.get("data", msgspec.UNSET))

    def _relay_remote(self, conn: TaskConversation, sink: Sink, record: TaskRecord) -> None:
        """Ask another daemon's task's open questions on ``sink``; the answers go to its mailbox."""
        if not getattr(sink, "can_stream", True) or record.input_requests is None:
            return
        requests = _stored_requests(record.input_requests)
        if not requests:
            return
        task_id = record.task_id
        meta = {task_shapes.RELATED_TASK: {"taskId": task_id}}
        version = eras.V2025_11_25

        def deliver(responses: list[wire.InputResponse]) -> None:
            answers = {r.key: r.result for r in responses if r.outcome == "result"}
            if answers:
                self.nursery.start_soon(self.guarded, self.store.post(task_id, _enc.encode({"update": answers})), task_id)

        conn.ask_client(requests, version, self._caps_of(conn), sink, deliver, meta)

    @staticmethod
    def _caps_of(conn: TaskConversation) -> dict[str, Any] | None:
        state = getattr(conn, "state", None)
        caps = getattr(state, "client_capabilities", None)
        return caps if isinstance(caps, dict) else None

    # -- the background work -----------------------------------------------------------------------

    def catalogs_differing(self) -> list[str]:
        """The daemons sharing the store whose catalog is not this one's (as of the last heartbeat)."""
        mine = self.catalogs.get(self.owner)
        return sorted(o for o, f in self.catalogs.items() if mine is not None and f != mine)

    async def _beat(self) -> None:
        now_ms = wall_clock_ms()
        await self.store.heartbeat(self.owner, now_ms)
        if self._catalog_fingerprint is not None:
            before = self.catalogs_differing()
            self.catalogs = await self.store.compare_catalogs(self.owner, self._catalog_fingerprint(), now_ms)
            differing = self.catalogs_differing()
            if differing and differing != before:  # said once per change, not at every heartbeat
                log("catalog_differs", level="warning", replicas=differing,
                    note="daemons sharing this task store serve different plugins")

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Heartbeats, recovery of dead daemons' tasks, expiry, and the mailboxes of local tasks."""
        cfg = self.config
        try:
            recovered = await self.store.recover_orphans(local_owner_verdict(self.owner), wall_clock_ms(),
                                                         "the daemon restarted or died")
            if recovered:
                self.stats["recovered"] += recovered
                log("tasks_recovered", level="warning", count=recovered,
                    note="tasks left running by a daemon that is gone are failed")
            await self._beat()
        except Exception as exc:  # noqa: BLE001 (the loop below retries; tools are served meanwhile)
            log("task_store_failed", level="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
        task_status.started()
        next_beat = next_sweep = time.monotonic()
        while True:
            await trio.sleep(MAILBOX_POLL_S)
            try:
                if self.running:
                    await self._read_mailboxes()
                if len(self._reported) > len(self._reported_final):
                    await self._watch_remote()
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + cfg.heartbeat_s
                    await self._beat()
                if now >= next_sweep:
                    next_sweep = now + max(5.0, cfg.heartbeat_s)
                    count = await self.store.recover_orphans(local_owner_verdict(self.owner), wall_clock_ms(),
                                                             "its daemon stopped answering")
                    self.stats["recovered"] += count
                    await self.store.expire(wall_clock_ms())
            except Exception as exc:  # the store is down (or our bug): log, try again, keep serving
                log("task_store_failed", level="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
                await trio.sleep(1.0)

    async def _watch_remote(self) -> None:
        """Report the transitions of listened tasks that another daemon runs (or ran): read from the
        store, each one newer than the last reported; the reads go out together (one pipeline)."""
        watched = [t for t in self._reported if t not in self.running and t not in self._reported_final]
        found: dict[str, TaskRecord | None] = {}

        async def read(task_id: str) -> None:
            found[task_id] = await self.store.inspect(task_id)

        async with trio.open_nursery() as nursery:
            for task_id in watched:
                nursery.start_soon(read, task_id)
        for task_id, record in found.items():
            if record is None and task_id in self._reported:
                # No such task (ids are the server's: a task is in the store before anyone learns its
                # id), or it expired: nothing will ever change, so it is not read again.
                self._reported_final.add(task_id)
            if record is None or task_id in self.running or task_id not in self._reported:
                continue
            if record.updated_at_ms > self._reported[task_id]:
                self._notify(record, None)
            elif record.terminal:  # it ended before the listen began: nothing more to report
                self._reported_final.add(task_id)

    async def _read_mailboxes(self) -> None:
        mail = await self.store.take(list(self.running))
        for task_id, messages in mail.items():
            run = self.running.get(task_id)
            if run is None:
                continue
            for message in messages:
                try:
                    note = _dec.decode(message)
                except (msgspec.DecodeError, RecursionError, ValueError):
                    continue
                if not isinstance(note, dict):
                    continue
                if note.get("cancel"):
                    # Another daemon took the client's cancel: stop the call, then record it.
                    run.stop()
                    await self.transition(run, "cancelled", status_message="cancelled by the client",
                                          input_requests=None)
                elif isinstance(note.get("update"), dict):
                    try:
                        answers = _checked_answers(run.open, note["update"])
                    except InvalidParams:
                        continue
                    await run.take_answers(answers)


def _stored_requests(stored: bytes | None) -> list[wire.InputRequest]:
    """The open questions a task's record holds (``inputRequests`` as stored)."""
    try:
        items = _dec.decode(stored) if stored is not None else {}
        return [wire.InputRequest(key, item["method"], item["params"]) for key, item in items.items()
                if isinstance(item, dict) and isinstance(item.get("params"), dict)
                and item.get("method") in wire.INPUT_METHODS]
    except (msgspec.DecodeError, AttributeError, KeyError, TypeError, ValueError):
        return []


def _checked_answers(open_requests: list[wire.InputRequest], responses: dict[str, Any]) -> dict[str, wire.InputResponse]:
    """The client's answers to the open questions, shape-checked (-32602 for a malformed one)."""
    methods = {r.key: r.method for r in open_requests}
    out: dict[str, wire.InputResponse] = {}
    for key, value in responses.items():
        method = methods.get(key)
        if method is None:
            continue  # unknown or already answered: ignored
        problem = eras.input_response_problem(method, value)
        if problem is not None:
            raise InvalidParams(f"Invalid params: inputResponses[{key[:64]!r}]: {problem}")
        out[key] = wire.InputResponse(key, "result", value)
    return out


Deferred = Callable[[], Awaitable[tuple[bytes | None, int | None]]]
