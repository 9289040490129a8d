"""One client's conversation, on any transport: the rules of MCP that are not about bytes.

A ``Connection`` is what one stdio client, one legacy HTTP session (2024-11-05 … 2025-11-25) or
one modern HTTP request (2026-07-28, a short-lived connection) talks to. It holds the requests in
flight and applies, in this one place, every conversation rule:

* a duplicate in-flight request id is refused without disturbing the running one;
* ``notifications/cancelled`` stops that request's call (its worker) or ends that listen
  subscription, and nothing more is sent for it;
* 2025-03-26 batches run their members concurrently and are answered as one array;
* ``subscriptions/listen`` subscriptions and legacy ``notifications/tools/list_changed`` get the
  catalog's changes;
* a tool that asks its client something (``sandbox.asking``) is heard through its call's sink:
  a legacy client gets our requests there (only those it declared the capability for; the others
  are answered "declined_capability" to the tool at once), and its responses, which arrive as
  messages on this connection, go back to the waiting tool; a 2026-07-28 call is handed to
  ``runtime.mrtr`` instead, which answers ``input_required``;
* a ``tools/call`` answered without running is recorded for the audit log and metrics;
* during shutdown new calls, listens and batches are refused (``ShuttingDown``), and at its end
  what is still running is answered with why it stopped.

A transport owns only framing and delivery. It feeds messages in (``receive`` for raw bytes, or
``handle`` for an envelope it decoded itself), passes each action to ``dispatch`` with a ``Sink``
(where that request's notifications and final answer go) and delivers what the sink receives:
stdio writes every sink to stdout; HTTP gives each POST a sink of its own and chooses JSON or SSE.
"""

from __future__ import annotations

import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, assert_never

import msgspec
import trio

from runtime.calls import TraceOrigin
from runtime.daemon import Daemon
from runtime.logs import log
from runtime.protocol import eras
from runtime.protocol import jsonrpc as rpc
from runtime.protocol.catalog import Catalog
from runtime.protocol.core import (
    Action,
    Batch,
    Cancel,
    ClientResponse,
    Completed,
    ConnState,
    Listen,
    Outcome,
    Reply,
    Request,
    Stopped,
    TaskRequest,
    ToolCall,
)
from runtime.protocol.errors import InternalError, InvalidRequest, McpError, ShuttingDown
from runtime.running import CallOwner, RunningCall, Sink
from sandbox import wire


class LineSink:
    """A sink for a transport where everything goes down one stream (stdio): notifications and
    answers alike are ``write(data)``; an answer's error code changes nothing on the line."""

    __slots__ = ("emit", "done")

    def __init__(self, write: Callable[..., None]) -> None:
        #: ``write(data)``, and ``write(data, error_code)`` for an answer: it must take and ignore the code.
        self.emit = write
        self.done = write

    def cancelled(self) -> None:
        pass


class _BatchSink:
    """Where a batch's calls answer: one reply slot each, and an event when none is still running.
    Notifications are dropped and a call cannot ask its client anything (a batch is answered as one
    JSON array)."""

    def __init__(self, size: int) -> None:
        self.replies: list[bytes | None] = [None] * size
        self.members: dict[int, _BatchMember] = {}
        self.cancelled: set[int] = set()
        self.waiting = 0
        self._event = trio.Event()

    def member(self, i: int) -> _BatchMember:
        member = self.members[i] = _BatchMember(self, i)
        return member

    def _settled(self) -> None:
        self.waiting -= 1
        if self.waiting <= 0:
            self._event.set()

    async def wait(self) -> None:
        if self.waiting > 0:
            await self._event.wait()


class _BatchMember:
    __slots__ = ("batch", "i", "over")

    #: ``ask_client`` reads this: a batch member's questions are declined with this reason.
    can_stream = False
    no_questions = "this call cannot ask its client anything (it is part of a batch)"

    def __init__(self, batch: _BatchSink, i: int) -> None:
        self.batch = batch
        self.i = i
        self.over = False

    def emit(self, data: bytes) -> None:
        pass

    def done(self, data: bytes, error_code: int | None = None) -> None:
        if not self.over:
            self.over = True
            self.batch.replies[self.i] = data
            self.batch._settled()

    def cancelled(self) -> None:
        if not self.over:
            self.over = True
            self.batch.cancelled.add(self.i)
            self.batch._settled()


# -- what dispatching an action came to (for the transport) ----------------------------------------


class Answered(msgspec.Struct, frozen=True):
    """Answer now with ``data`` (``None``: a notification was taken, nothing to send)."""

    data: bytes | None
    error_code: int | None = None
    modern: bool = False
    #: The error, when the answer refuses a call this connection's rules stopped (a rate limit, ...).
    error: McpError | None = None


class Started(msgspec.Struct, frozen=True):
    """A call is running; its sink gets the notifications and, once, the answer."""

    call: ToolCall


class Subscribed(msgspec.Struct, frozen=True):
    """A listen subscription is open; its sink got the acknowledgement and gets the events."""

    listen: Listen


class BatchStarted(msgspec.Struct, frozen=True):
    """A batch must be run: ``await Connection.run_batch(batch)`` gives its one answer."""

    batch: Batch


class Deferred(msgspec.Struct, frozen=True):
    """An answer that takes a trip to the task store (creating a task, a tasks/* request):
    ``await work()`` gives the bytes to send and the JSON-RPC error code, if it is an error."""

    work: Callable[[], Awaitable[tuple[bytes | None, int | None]]]
    modern: bool


Dispatched = Answered | Started | Subscribed | BatchStarted | Deferred


@dataclass(slots=True, eq=False)
class QuestionRound:
    """Our requests to a legacy client for one round of a tool's questions: the answers so far,
    the keys still open, and who gets them all."""

    answers: dict[str, wire.InputResponse]
    waiting: set[str]
    deliver: Callable[[list[wire.InputResponse]], None]
    done: bool = False


@dataclass(frozen=True, slots=True)
class _Outgoing:
    """A request of ours to the client: which round, and which of its questions."""

    round: QuestionRound
    key: str


class Connection:
    """One client's conversation (see the module docstring).

    ``push`` receives connection-wide notifications (legacy ``list_changed``); without it the
    connection takes none (a modern request). ``admit`` may refuse a call before it runs (HTTP's
    per-tool rate limit) by returning the error to answer with. ``catalog_view`` narrows the catalog
    to what the principal may see."""

    def __init__(self, daemon: Daemon, state: ConnState | None = None, principal: str | None = None, *,
                 push: Callable[[bytes], None] | None = None,
                 admit: Callable[[ToolCall], McpError | None] | None = None,
                 catalog_view: Callable[[], Catalog | None] | None = None,
                 origin: TraceOrigin | None = None) -> None:
        self.daemon = daemon
        #: Where this connection's calls come from, for their trace spans (None: not traced, or stdio).
        self.origin = origin
        self.core = daemon.core
        self.calls = daemon.calls
        self.state = state if state is not None else ConnState()
        self.principal = principal
        self.push = push
        self.admit = admit
        self.catalog_view = catalog_view
        self.inflight: dict[Any, RunningCall] = {}
        #: 2026-07-28 questions and retries (``runtime.mrtr``), shared by every connection of the daemon.
        self.mrtr = daemon.mrtr
        #: Tasks (``runtime.tasks``): None where the daemon keeps none (``toolcell call``).
        self.tasks = daemon.tasks
        self._task_unsubscribes: dict[Any, Callable[[], None]] = {}
        self.listens: dict[Any, tuple[Listen, Sink]] = {}
        #: Our requests to the client that await its response, by the id we gave them.
        self.outgoing: dict[str, _Outgoing] = {}
        self._next_server_id = 0
        #: Set when the client can no longer answer our requests (why).
        self.answers_closed: str | None = None
        #: Shutting down: calls, listens and batches that arrive now are refused (``ShuttingDown``).
        self.draining = False
        #: Set when ``inflight`` empties, for ``wait_idle``; made only while someone waits (a call
        #: starting or ending then costs no event).
        self._idle: trio.Event | None = None
        self._batch_scopes: set[trio.CancelScope] = set()
        self._unsubscribe: Callable[[], None] | None = None
        if push is not None:
            self._unsubscribe = daemon.subscribe(self._on_catalog_change)

    # -- messages in -------------------------------------------------------------------------

    def catalog(self) -> Catalog | None:
        return self.catalog_view() if self.catalog_view is not None else None

    def receive(self, data: bytes | memoryview) -> Action:
        """Decode and handle one raw message (or batch)."""
        try:
            return self.core.receive(self.state, data, self.catalog_view() if self.catalog_view is not None else None)
        except Exception as exc:  # our bug: answer -32603, log it, keep serving everyone else
            return self._internal_error(exc)

    def parse(self, env: rpc.Envelope) -> Request:
        """Read an envelope the transport decoded (its params once, its era chosen by the core)."""
        return self.core.parse(self.state, env)

    def run(self, req: Request) -> Action:
        try:
            return self.core.run(self.state, req, self.catalog())
        except Exception as exc:  # our bug
            return self._internal_error(exc)

    def handle_batch(self, items: list[Any]) -> Action:
        try:
            return self.core.handle_decoded(self.state, items, self.catalog())
        except Exception as exc:  # our bug
            return self._internal_error(exc)

    @staticmethod
    def _internal_error(exc: Exception) -> Reply:
        log("internal_error", level="error", error=f"{type(exc).__name__}: {exc}",
            traceback=traceback.format_exc(limit=15))
        error = InternalError()
        return Reply(rpc.error_reply(b"null", error), error.code)

    # -- the rules -----------------------------------------------------------------------------

    def dispatch(self, action: Action, sink: Sink) -> Dispatched:
        """Apply the conversation's rules to one action; ``sink`` is where its messages go. Our bug
        while doing so answers that request -32603 and nothing else."""
        try:
            if (type(action) is ToolCall and not action.task_mode and action.request_state is None
                    and action.input_responses is None and not self.draining):
                # The hot path (a plain call): the rules below, without the pattern machinery.
                if self.admit is None and action.request_id not in self.inflight:
                    self.start(action, sink)
                    return Started(action)
                refusal = self._refuse_call(action)
                if refusal is None:
                    self.start(action, sink)
                    return Started(action)
                error, refused = refusal
                return Answered(refused, error.code, action.modern, error)
            return self._dispatch(action, sink)
        except Exception as exc:  # our bug: this request fails, the connection and the daemon go on
            reply = self._internal_error(exc)
            request_id = getattr(action, "request_id", None)
            data = reply.data
            if rpc.valid_id(request_id):
                data = rpc.error_reply(rpc.encode_id(request_id), InternalError())
            return Answered(data, reply.error_code, getattr(action, "modern", False))

    def _dispatch(self, action: Action, sink: Sink) -> Dispatched:
        if self.draining and type(action) in (ToolCall, Listen, Batch, TaskRequest):
            return Answered(self._refusal_while_draining(action))
        match action:
            case Reply():
                if action.refused is not None:
                    self.calls.record_refusal(action, self.principal, self.daemon.catalog)
                return Answered(action.data, action.error_code, action.modern)
            case ToolCall():
                refusal = self._refuse_call(action)
                if refusal is not None:
                    error, data = refusal
                    return Answered(data, error.code, action.modern, error)
                if action.modern and (action.request_state is not None or action.input_responses is not None):
                    now = self.mrtr.retry(self, action, sink)
                    if now is None:
                        return Started(action)
                    answer, refused = now
                    if refused is not None:  # tampered, expired or foreign state: audited like any refusal
                        self.calls.record_refused_name(action.entry.name, "invalid_params", self.principal,
                                                       self.daemon.catalog)
                    return Answered(answer, refused.code if refused is not None else None, True, refused)
                if action.task_mode == "now" and self.tasks is not None:
                    tasks, call = self.tasks, action
                    return Deferred(lambda: tasks.create(self, call), action.modern)
                self.start(action, sink)
                return Started(action)
            case TaskRequest():
                if self.tasks is None:
                    error = InvalidRequest("Invalid Request: this server keeps no tasks here")
                    return Answered(rpc.error_reply(action.id_bytes, error), error.code, action.modern, error)
                tasks, request = self.tasks, action
                return Deferred(lambda: tasks.handle(self, request, sink), action.modern)
            case Cancel():
                self.cancel(action.request_id)
                return Answered(None)
            case Listen():
                self.listens[action.request_id] = (action, sink)
                if action.task_ids and self.tasks is not None:
                    self._task_unsubscribes[action.request_id] = self.tasks.subscribe(
                        self.principal or "", action.task_ids, sink, action.id_bytes)
                if self._unsubscribe is None:
                    self._unsubscribe = self.daemon.subscribe(self._on_catalog_change)
                sink.emit(self.core.subscription_ack(action))
                return Subscribed(action)
            case Batch():
                return BatchStarted(action)
            case ClientResponse():
                self._client_response(action)
                return Answered(None)
            case _:
                assert_never(action)

    def _refuse_call(self, call: ToolCall) -> tuple[McpError, bytes] | None:
        """The rules a call must pass before it runs: a fresh id, and the transport's admission."""
        error: McpError | None = None
        if call.request_id in self.inflight:
            # A duplicate in-flight id is the client's bug; answer it without disturbing the other.
            error = InvalidRequest("Invalid Request: a request with this id is already in progress")
        elif self.admit is not None:
            error = self.admit(call)
        return None if error is None else (error, self.core.call_error(call, error))

    def start(self, call: ToolCall, sink: Sink, given: dict[str, Any] | None = None,
              owner: CallOwner | None = None) -> RunningCall:
        """Run ``call``; its messages go to ``sink`` for as long as this connection owns it. ``given``:
        answers the client gave before being asked (a 2026-07-28 call run again from the start).
        ``owner``: someone else hears it from the start (a task)."""
        running = RunningCall(call, sink, owner or self, self.principal, given=given)
        if owner is None:
            self.inflight[call.request_id] = running
        running.handle = self.calls.start(call, self.principal, running.frame, running.outcome, self.origin)
        if call.task_mode and owner is None and self.tasks is not None:
            self.tasks.promote_later(self, running, call.task_after_ms)
        return running

    def adopt(self, running: RunningCall) -> None:
        """Take over a call that waited elsewhere (a parked 2026-07-28 call resumed by a retry)."""
        running.owner = self
        self.inflight[running.call.request_id] = running
        if running.call.task_mode == "after" and self.tasks is not None:
            self.tasks.promote_later(self, running, running.call.task_after_ms)

    def release(self, running: RunningCall) -> None:
        """Hand ``running`` to another owner: this connection forgets it without stopping it."""
        if self.inflight.get(running.call.request_id) is running:
            del self.inflight[running.call.request_id]
        if not self.inflight:
            self._now_idle()

    # -- what a running call sends (CallOwner) -------------------------------------------------

    def call_frame(self, running: RunningCall, frame: Any) -> None:
        call = running.call
        kind = type(frame)
        if kind is wire.Progress:
            data = self.core.progress_notification(call, frame)
        elif kind is wire.Log:
            data = self.core.log_notification(call, frame)
        else:
            self._ask(running, frame)
            return
        if data is not None and self.inflight.get(call.request_id) is running:
            running.sink.emit(data)

    def call_outcome(self, running: RunningCall, outcome: Outcome) -> None:
        call = running.call
        inflight = self.inflight
        if inflight.get(call.request_id) is running:
            del inflight[call.request_id]
            if running.round is not None:
                self._forget_questions(running)
            entry = call.entry
            data, bug = self.core.answer(call, outcome, entry.runner.limits.max_output_bytes)
            if bug is not None:
                log("plugin_bug", level="error", tool=entry.name, plugin=entry.plugin, problem=bug)
            code = None if type(outcome) is Completed and outcome.result.is_error is False else \
                self.core.error_code(call, outcome)
            running.sink.done(data, code)
        if not inflight and self._idle is not None:
            self._now_idle()

    def answer(self, call: ToolCall, outcome: Outcome) -> bytes:
        """The bytes for a call's outcome (a plugin's invalid output is logged as its bug)."""
        entry = call.entry
        data, bug = self.core.answer(call, outcome, entry.runner.limits.max_output_bytes)
        if bug is not None:
            log("plugin_bug", level="error", tool=entry.name, plugin=entry.plugin, problem=bug)
        return data

    # -- a tool asks its client ---------------------------------------------------------------

    def _ask(self, running: RunningCall, ask: wire.Ask) -> None:
        """A running call's round of questions (the pool stopped its deadline until it is answered)."""
        call = running.call
        if self.inflight.get(call.request_id) is not running:
            self.calls.answer(call, running.handle, [], "cancelled", "the request was cancelled")
            return
        if call.modern:
            # 2026-07-28 has no server->client requests: the call ends in ``input_required``.
            self.mrtr.ask(self, running, ask)
            return

        def deliver(responses: list[wire.InputResponse]) -> None:
            if running.round is round_:
                running.round = None
            # Bound to this round: answers that come after it timed out cannot answer a later one.
            self.calls.answer(call, running.handle, responses, to=ask)

        round_: QuestionRound | None = None
        round_ = self.ask_client(ask.requests, self.state.legacy_version or call.version, call.client_caps,
                                 running.sink, deliver)
        old, running.round = running.round, round_
        if old is not None:
            self._forget_round(old)  # an earlier round (it timed out in the pool): its late answers go nowhere

    def ask_client(self, requests: list[wire.InputRequest], version: str, caps: dict[str, Any] | None, sink: Sink,
                   deliver: Callable[[list[wire.InputResponse]], None],
                   meta: dict[str, Any] | None = None) -> QuestionRound | None:
        """Send a legacy client our requests for ``requests`` on ``sink`` (only those it declared the
        capability for; the others are answered "declined_capability" at once). ``deliver`` gets every
        answer, once, when the last one is in; the round is returned (None: delivered already)."""
        answers: dict[str, wire.InputResponse] = {}
        waiting: set[str] = set()
        can_stream = getattr(sink, "can_stream", True)
        round_ = QuestionRound(answers, waiting, deliver)
        for request in requests:
            why = self.answers_closed or eras.input_refusal(version, caps, request.method, request.params)
            if why is None and not can_stream:
                why = getattr(sink, "no_questions",
                              "the client's request cannot carry our requests (it does not accept text/event-stream)")
            if why is not None:
                outcome = "cancelled" if why == self.answers_closed else "declined_capability"
                answers[request.key] = wire.InputResponse(request.key, outcome, message=why)
                continue
            self._next_server_id += 1
            server_id = f"toolcell-{self._next_server_id}"
            self.outgoing[server_id] = _Outgoing(round_, request.key)
            waiting.add(request.key)
            sink.emit(self.core.server_request(server_id, request, version, meta))
        if not waiting:
            deliver(list(answers.values()))
            return None
        return round_

    def _client_response(self, response: ClientResponse) -> None:
        """The client answered one of our requests: give the answer to whoever asked."""
        if not isinstance(response.request_id, str):
            return
        outgoing = self.outgoing.pop(response.request_id, None)
        if outgoing is None:
            return  # not ours, or late (the question timed out, the call ended): ignored
        round_ = outgoing.round
        if round_.done or outgoing.key not in round_.waiting:
            return
        round_.answers[outgoing.key] = self.core.read_client_response(response, outgoing.key)
        round_.waiting.discard(outgoing.key)
        if not round_.waiting:
            round_.done = True
            round_.deliver(list(round_.answers.values()))

    def stop_asking(self, reason: str) -> None:
        """The client can no longer answer (its input ended): every question waiting on it is
        answered "cancelled" now, instead of at its timeout, and so is every later one."""
        self.answers_closed = reason
        rounds = {id(o.round): o.round for o in self.outgoing.values()}
        self.outgoing.clear()
        for round_ in rounds.values():
            self._close_round(round_, reason)

    def _close_round(self, round_: QuestionRound, reason: str) -> None:
        if round_.done:
            return
        round_.done = True
        for key in round_.waiting:
            round_.answers[key] = wire.InputResponse(key, "cancelled", message=reason)
        round_.deliver(list(round_.answers.values()))

    def _forget_questions(self, running: RunningCall) -> None:
        round_ = running.round
        if round_ is None:
            return
        running.round = None
        self._forget_round(round_)

    def _forget_round(self, round_: QuestionRound) -> None:
        round_.done = True
        for server_id in [k for k, v in self.outgoing.items() if v.round is round_]:
            del self.outgoing[server_id]

    def cancel(self, request_id: Any) -> None:
        """The client cancelled ``request_id``: its call stops (worker included) or its listen ends."""
        running = self.inflight.pop(request_id, None)
        if running is not None:
            self._forget_questions(running)
            self.calls.cancel(running.call, running.handle, self.principal)
            running.sink.cancelled()
            if not self.inflight:
                self._now_idle()
            return
        entry = self.listens.pop(request_id, None)
        if entry is not None:
            listen, sink = entry
            self._unsubscribe_tasks(request_id)
            sink.done(self.core.subscription_end(listen))

    def end_listen(self, request_id: Any) -> None:
        """The transport's stream for a listen is gone: forget it without answering."""
        self.listens.pop(request_id, None)
        self._unsubscribe_tasks(request_id)

    def _unsubscribe_tasks(self, request_id: Any) -> None:
        unsubscribe = self._task_unsubscribes.pop(request_id, None)
        if unsubscribe is not None:
            unsubscribe()

    async def run_batch(self, batch: Batch) -> bytes | None:
        """Run a batch's members concurrently; the one array answer (None: nothing to answer).

        Each call goes the way a single one does (``_refuse_call``, then ``start``): it is in
        ``inflight`` while it runs, so a duplicate id is refused, ``notifications/cancelled`` and
        ``close`` stop it, and shutdown answers it. A member cancelled by the client is not answered."""
        sink = _BatchSink(len(batch.actions))
        calls: dict[int, ToolCall] = {}
        for i, action in enumerate(batch.actions):
            match action:
                case ToolCall():
                    refusal = self._refuse_call(action)
                    if refusal is not None:
                        sink.replies[i] = refusal[1]
                        continue
                    calls[i] = action
                    sink.waiting += 1
                    self.start(action, sink.member(i))
                case Reply():
                    if action.refused is not None:
                        self.calls.record_refusal(action, self.principal, self.daemon.catalog)
                    sink.replies[i] = action.data
                case Cancel():
                    self.cancel(action.request_id)
                case ClientResponse():
                    self._client_response(action)
                case Listen() | Batch() | TaskRequest():  # the core never puts these in a batch
                    pass
                case _:
                    assert_never(action)
        scope = trio.CancelScope()
        self._batch_scopes.add(scope)
        try:
            with scope:
                await sink.wait()
        finally:
            self._batch_scopes.discard(scope)
            if sink.waiting:  # aborted (shutdown) or cancelled from outside: stop what still runs
                for i, call in calls.items():
                    running = self.inflight.get(call.request_id)
                    if running is not None and running.sink is sink.members.get(i):
                        self.cancel(call.request_id)
        if scope.cancelled_caught:  # aborted by shutdown: the unfinished members say so
            for i, call in calls.items():
                if sink.replies[i] is None and i not in sink.cancelled:
                    sink.replies[i] = self.answer(call, Stopped("the server is shutting down"))
        parts = [r for r in sink.replies if r is not None]
        return b"[" + b",".join(parts) + b"]" if parts else None

    # -- shutdown and the end ------------------------------------------------------------------

    def _refusal_while_draining(self, action: Action) -> bytes | None:
        error = ShuttingDown()
        match action:
            case ToolCall():
                return self.core.call_error(action, error)
            case Listen() | TaskRequest():
                return rpc.error_reply(action.id_bytes, error)
            case Batch():
                parts = []
                for member in action.actions:
                    if type(member) is ToolCall:
                        parts.append(self.core.call_error(member, error))
                    elif type(member) is Reply and member.data is not None:
                        parts.append(member.data)
                return b"[" + b",".join(parts) + b"]" if parts else None
            case _:
                return None

    def abort(self, reason: str) -> None:
        """Shutdown's end: every call still running is answered with ``reason`` and stopped, every
        listen subscription ended; nothing is left without an answer."""
        for request_id in list(self.inflight):
            running = self.inflight.pop(request_id)
            running.sink.done(self.answer(running.call, Stopped(reason)))
            self.calls.cancel(running.call, running.handle, self.principal)
        self._now_idle()
        for request_id in list(self.listens):
            listen, sink = self.listens.pop(request_id)
            sink.done(self.core.subscription_end(listen))
        for scope in list(self._batch_scopes):
            scope.cancel()

    def close(self) -> None:
        """The client is gone: stop what it still runs; take no more notifications."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        for request_id in list(self.inflight):
            self.cancel(request_id)
        self.listens.clear()
        for unsubscribe in self._task_unsubscribes.values():
            unsubscribe()
        self._task_unsubscribes.clear()

    def _now_idle(self) -> None:
        if self._idle is not None:
            self._idle.set()
            self._idle = None

    async def wait_idle(self) -> None:
        while self.inflight:
            if self._idle is None:
                self._idle = trio.Event()
            await self._idle.wait()

    def _on_catalog_change(self) -> None:
        if self.push is not None and self.state.legacy_version is not None:
            self.push(self.core.list_changed())
        for listen, sink in list(self.listens.values()):
            if listen.tools_list_changed:
                sink.emit(self.core.subscription_list_changed(listen))


async def run_call(daemon: Daemon, call: ToolCall, principal: str | None = None,
                   emit: Callable[[bytes], None] | None = None) -> bytes:
    """Run one call outside any conversation (``toolcell call``, tests) and return its response."""
    conn = Connection(daemon, principal=principal)
    box: list[bytes] = []
    done = trio.Event()

    class _Once:
        def emit(self, data: bytes) -> None:
            if emit is not None:
                emit(data)

        def done(self, data: bytes, error_code: int | None = None) -> None:
            box.append(data)
            done.set()

        def cancelled(self) -> None:
            done.set()

    conn.dispatch(call, _Once())
    try:
        await done.wait()
    finally:
        conn.close()
    return box[0]
