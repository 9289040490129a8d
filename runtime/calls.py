"""Running tool calls: admission (the daemon-wide cap on calls in flight), handing a call to its
plugin's pool, cancelling it, and reporting how it ended as an ``Outcome`` (``Completed``,
``Failed``, ``Refused``, ``Stopped``). No bytes and no JSON-RPC here: the protocol core turns
outcomes into responses (``Core.answer``), the connection layer sends them.

Every call, wherever it came from, passes through ``CallDispatcher.start`` exactly once and ends in
exactly one ``on_outcome`` (or a ``cancel``), which is where the call hooks (audit log, metrics)
see it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec

import trio

from runtime.execution.runner import CallSlot
from runtime.logs import log
from runtime.protocol import jsonrpc as rpc
from runtime.protocol.core import Completed, Failed, Outcome, Refused, Reply, ToolCall
from runtime.protocol.catalog import Catalog
from runtime.protocol.errors import InternalError, InvalidParams, ServerBusy, WorkerFailure
from sandbox import wire

CallHook = Callable[[dict[str, Any]], None]


class TraceOrigin(msgspec.Struct, frozen=True):
    """Where a connection's calls come from, for their trace spans (``runtime.tracing``): the HTTP
    request's W3C trace context headers, the legacy session, the transport."""

    traceparent: str | None = None
    tracestate: str | None = None
    session_id: str | None = None
    transport: str = "pipe"


class CallTracer(Protocol):
    """What the dispatcher asks of ``runtime.tracing.Tracing`` (imported only when traces are on)."""

    def started(self, call: ToolCall, principal: str | None, origin: TraceOrigin | None) -> Any: ...
    def asked(self, call_span: Any, questions: int) -> None: ...
    def answered(self, call_span: Any, outcome: str) -> None: ...
    def event(self, call_span: Any, name: str, attributes: dict[str, Any]) -> None: ...
    def ended(self, call_span: Any, slot: CallSlot | None, error_type: str | None) -> None: ...
    def refused(self, requested: str, outcome: str, principal: str | None) -> None: ...
#: A progress or log frame of a running call, as the worker sent it (checked).
FrameSink = Callable[[Any], None]
OutcomeSink = Callable[[Outcome], None]


class CallDispatcher:
    """Starts, cancels and accounts for every tool call of one daemon."""

    def __init__(self, max_inflight: int) -> None:
        self.max_inflight = max_inflight
        self.inflight = 0
        self.stats = {"calls": 0, "errors": 0, "busy": 0}
        self.hooks: list[CallHook] = []
        self._idle: trio.Event | None = None
        #: Traces (``runtime.tracing``), None when off: then a call pays one ``is None`` test.
        self.tracer: CallTracer | None = None
        #: The open span of each running call, by its handle's id (only while traces are on).
        self._spans: dict[int, Any] = {}

    def _release(self) -> None:
        self.inflight -= 1
        if not self.inflight and self._idle is not None:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Wait until no call is in flight."""
        while self.inflight:
            self._idle = trio.Event()
            await self._idle.wait()

    def start(self, call: ToolCall, principal: str | None, on_frame: FrameSink, on_outcome: OutcomeSink,
              origin: TraceOrigin | None = None) -> CallSlot | None:
        """Start ``call`` without a task of its own; ``on_outcome`` runs once with how it ended
        (possibly before this returns). Returns a handle for ``cancel``, or None."""
        if self.tracer is not None:
            return self._start_traced(self.tracer, call, principal, on_frame, on_outcome, origin)
        return self._start(call, principal, on_frame, on_outcome)

    def _start_traced(self, tracer: CallTracer, call: ToolCall, principal: str | None, on_frame: FrameSink,
                      on_outcome: OutcomeSink, origin: TraceOrigin | None) -> CallSlot | None:
        """``_start`` inside a span: the span ends with the outcome; questions are child spans.
        The tracer failing never fails the call (every tracer call goes through ``_untrusted``)."""
        span = _untrusted(tracer.started, call, principal, origin)
        if span is None:
            return self._start(call, principal, on_frame, on_outcome)
        handles: list[CallSlot] = []

        def frame(item: Any) -> None:
            if type(item) is wire.Ask:
                _untrusted(tracer.asked, span, len(item.requests))
            on_frame(item)

        def outcome(result: Outcome) -> None:
            if handles:
                self._spans.pop(id(handles[0]), None)
            _untrusted(tracer.ended, span, handles[0] if handles else None, _error_type(result))
            on_outcome(result)

        handle = self._start(call, principal, frame, outcome, span.traceparent)
        if handle is not None and not handle.finished:
            handles.append(handle)
            self._spans[id(handle)] = span
        return handle

    def trace_event(self, handle: CallSlot | None, name: str, attributes: dict[str, Any]) -> None:
        """An event on a running call's span (a task's state), when traces are on."""
        if self.tracer is not None and handle is not None:
            span = self._spans.get(id(handle))
            if span is not None:
                _untrusted(self.tracer.event, span, name, attributes)

    def _start(self, call: ToolCall, principal: str | None, on_frame: FrameSink, on_outcome: OutcomeSink,
               traceparent: str = "") -> CallSlot | None:
        entry = call.entry
        pool = entry.runner
        started = time.perf_counter()

        def done(slot: CallSlot) -> None:
            self.inflight -= 1
            if not self.inflight and self._idle is not None:
                self._idle.set()
            try:
                outcome = self._finish(call, slot, principal, started)
            except Exception as exc:  # our bug: the call is answered -32603 rather than left hanging
                log("internal_error", level="error", tool=entry.name, error=f"{type(exc).__name__}: {exc}")
                outcome = Refused(InternalError())
            on_outcome(outcome)

        if self.inflight >= self.max_inflight:
            self._refuse_busy(call, principal, started, on_outcome, "too many calls in flight")
            return None
        try:
            slot = pool.new_slot(entry.local_name, call.arguments, call.progress_token is not None,
                                 call.log_level, on_frame, done, principal=principal, trace=traceparent)
        except (OverflowError, TypeError, ValueError) as exc:
            on_outcome(Refused(InvalidParams("Invalid params: arguments cannot be passed to a worker "
                                             f"({type(exc).__name__}: {str(exc)[:100]})")))
            return None
        try:
            pool.submit(slot)
        except ServerBusy as exc:
            self.stats["busy"] += 1
            self._hook(call, principal, "busy", started)
            on_outcome(Refused(exc))
            return None
        except WorkerFailure as exc:
            on_outcome(Failed(exc))
            return None
        except Exception as exc:  # our bug: this call gets -32603, every other call keeps going
            log("internal_error", level="error", tool=entry.name, error=f"{type(exc).__name__}: {exc}")
            on_outcome(Refused(InternalError()))
            return None
        self.inflight += 1
        return slot

    def _refuse_busy(self, call: ToolCall, principal: str | None, started: float, on_outcome: OutcomeSink,
                     why: str) -> None:
        self.stats["busy"] += 1
        self._hook(call, principal, "busy", started)
        on_outcome(Refused(ServerBusy(f"Server busy: {why}; retry later")))

    def cancel(self, call: ToolCall, handle: CallSlot | None, principal: str | None = None) -> None:
        """The client cancelled: no outcome follows for ``call``; its worker is stopped."""
        if handle is None or handle.finished:
            return
        self._release()
        self.stats["calls"] += 1
        self._hook(call, principal, "cancelled", time.perf_counter())
        if self.tracer is not None:
            span = self._spans.pop(id(handle), None)
            if span is not None:
                _untrusted(self.tracer.ended, span, handle, "cancelled")
        call.entry.runner.withdraw(handle)

    def answer(self, call: ToolCall, handle: CallSlot | None, responses: list[wire.InputResponse], missing: str = "error",
               why: str = "the client gave no answer", to: wire.Ask | None = None) -> bool:
        """Give a running call that asked its client something the answers (see ``WorkerPool.answer``;
        ``to``: the round they answer)."""
        if handle is None or handle.finished:
            return False
        answered = call.entry.runner.answer(handle, responses, missing, why, to)
        if self.tracer is not None and answered:
            span = self._spans.get(id(handle))
            if span is not None:
                _untrusted(self.tracer.answered, span, "answered" if responses else missing)
        return answered

    def _finish(self, call: ToolCall, slot: CallSlot, principal: str | None, started: float) -> Outcome:
        entry = call.entry
        self.stats["calls"] += 1
        error = slot.error
        if error is not None:
            self.stats["errors"] += 1
            self._hook(call, principal, error.kind, started)
            log("call_failed", level="warning", tool=entry.name, plugin=entry.plugin, kind=error.kind,
                fault=error.fault, error=error.message)
            return Failed(error)
        result = slot.result
        assert result is not None  # a slot ends with an error or a result
        if result.traceback:
            log("tool_raised", level="warning", tool=entry.name, plugin=entry.plugin, traceback=result.traceback)
        if self.hooks:
            self._hook(call, principal, "tool_error" if result.is_error else "ok", started)
        return Completed(result)

    async def execute(self, call: ToolCall, principal: str | None = None,
                      on_frame: FrameSink | None = None) -> Outcome:
        """Run ``call`` and wait for its outcome. Honours cancellation (the worker is stopped)."""
        box: list[Outcome] = []
        event = trio.Event()

        def on_outcome(outcome: Outcome) -> None:
            box.append(outcome)
            event.set()

        handles: list[CallSlot | None] = []

        def relay(frame: Any) -> None:
            if type(frame) is wire.Ask:
                # Nobody here can carry a question to the client (a batch member, ``toolcell call``).
                self.answer(call, handles[0] if handles else None, [], "declined_capability",
                            "this call cannot ask its client anything (it is part of a batch, or has no client)")
            elif on_frame is not None:
                on_frame(frame)

        handle = self.start(call, principal, relay, on_outcome)
        handles.append(handle)
        try:
            await event.wait()
        except trio.Cancelled:
            self.cancel(call, handle, principal)
            raise
        return box[0]

    def record_refusal(self, reply: Reply, principal: str | None, catalog: Catalog) -> None:
        """A ``tools/call`` answered without running (unknown or out-of-scope tool, invalid params or
        arguments, a rate limit, headers that contradict it): one audit/metrics event like every other."""
        if reply.refused is None:
            return
        requested, outcome = reply.refused
        self.record_refused_name(requested, outcome, principal, catalog)

    def record_refused_name(self, requested: str, outcome: str, principal: str | None, catalog: Catalog,
                            argument_bytes: int | None = None) -> None:
        if self.tracer is not None:
            _untrusted(self.tracer.refused, requested, outcome, principal)
        if not self.hooks:
            return
        entry = catalog.get(requested) if requested else None
        # Metrics label by tool: a name the client made up never becomes a label of its own.
        event = {"tool": entry.name if entry is not None else "(unknown)", "requested": requested,
                 "plugin": entry.plugin if entry is not None else None, "principal": principal, "outcome": outcome,
                 "duration_s": 0.0, "argument_keys": None, "argument_bytes": argument_bytes}
        self._emit_hook(event)

    def _hook(self, call: ToolCall, principal: str | None, outcome: str, started: float) -> None:
        if not self.hooks:
            return
        event = {"tool": call.entry.name, "plugin": call.entry.plugin, "principal": principal, "outcome": outcome,
                 "duration_s": time.perf_counter() - started, "argument_keys": len(call.arguments),
                 "argument_bytes": len(rpc.encode(call.arguments))}
        self._emit_hook(event)

    def _emit_hook(self, event: dict[str, Any]) -> None:
        for hook in self.hooks:
            try:
                hook(event)
            except Exception as exc:  # a hook's failure never fails the call
                log("internal_error", level="error", where="call hook", error=f"{type(exc).__name__}: {exc}")



def _untrusted(method: Callable[..., Any], *args: Any) -> Any:
    """A tracer call: whatever it raises is logged, never passed on (traces must not fail a call)."""
    try:
        return method(*args)
    except Exception as exc:  # noqa: BLE001 - the SDK, its processors and exporters are not ours
        log("tracing_error", level="warning", error=f"{type(exc).__name__}: {str(exc)[:200]}")
        return None


def _error_type(outcome: Outcome) -> str | None:
    """A call's ``error.type`` for its span: None when it succeeded."""
    if type(outcome) is Completed:
        return "tool_error" if outcome.result.is_error else None
    if type(outcome) is Failed:
        return outcome.failure.kind
    if type(outcome) is Refused:
        error = outcome.error
        return "busy" if isinstance(error, ServerBusy) else \
            "invalid_params" if isinstance(error, InvalidParams) else type(error).__name__
    return type(outcome).__name__.lower()
