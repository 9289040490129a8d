"""OpenTelemetry traces of tool calls, following the MCP semantic conventions (``toolcell[otel]``).

How this works:

* Off unless the standard ``OTEL_*`` environment asks for traces (``OTEL_TRACES_EXPORTER`` naming
  an exporter, or ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set), and
  never with ``OTEL_SDK_DISABLED=true``. Off, nothing of OpenTelemetry is imported and the call path
  pays one ``is None`` test per call (``CallDispatcher.tracer``).
* On, the official ``opentelemetry-sdk`` exports over OTLP/HTTP with a batch processor (its own
  thread: the daemon's loop never waits on the collector); service name, endpoint, headers,
  sampler and batch sizes come from the usual ``OTEL_*`` variables.
* Every ``tools/call`` that reaches the dispatcher is one SERVER span ``tools/call {tool}`` with
  ``mcp.method.name``, ``gen_ai.tool.name``, ``gen_ai.operation.name``, ``jsonrpc.request.id``,
  ``mcp.protocol.version``, ``mcp.session.id`` (legacy HTTP sessions), ``toolcell.plugin``,
  ``toolcell.principal`` and, when it fails, ``error.type``. Its children: ``queue`` (waiting for a
  worker) and ``worker`` (the round trip to the worker), drawn from the pool's own timestamps when
  the call ends, ``ask`` from each question to its answer, and events for a task's states.
* Its parent is the caller's: ``params._meta.traceparent`` (MCP's convention) or the HTTP
  ``traceparent`` header. The call's own span context goes to the worker (``wire.Call.traceparent``;
  ``current().traceparent`` in plugin code) and to a hosted server (``_meta.traceparent``), so
  their spans join the same trace.
* A ``tools/call`` refused before it runs (unknown tool, bad arguments, a rate limit, busy) is a
  span of its own with ``error.type`` set to the refusal.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from runtime.logs import log
from runtime.protocol.core import ToolCall

_PROPAGATOR = TraceContextTextMapPropagator()
#: A client's JSON-RPC id as a span attribute, at most this long (an id may be as long as a body).
MAX_ID_CHARS = 256


def _ns_at(perf: float, now_perf: float, now_ns: int) -> int:
    """A ``perf_counter()`` reading as wall-clock nanoseconds (OpenTelemetry's time base)."""
    return now_ns - int((now_perf - perf) * 1e9)


class CallSpan:
    """One ``tools/call`` span and its open ``ask`` child, while the call runs."""

    __slots__ = ("span", "context", "ask_span", "traceparent")

    def __init__(self, span: Any, context: Any) -> None:
        self.span = span
        self.context = context
        self.ask_span: Any = None
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=context)
        self.traceparent = carrier.get("traceparent", "")


class Tracing:
    """The daemon's tracer (``CallDispatcher.tracer`` when traces are on)."""

    def __init__(self, provider: Any = None) -> None:
        if provider is None:
            provider = _provider()
        self.provider = provider
        self.tracer = provider.get_tracer("toolcell")
        # The API warns through Python's logging about each tracestate it cannot parse, quoting it:
        # a client's text, raw on the daemon's stderr once per request. A bad one is just dropped.
        logging.getLogger("opentelemetry.trace.span").setLevel(logging.ERROR)

    def shutdown(self) -> None:
        try:
            self.provider.shutdown()
        except Exception as exc:  # noqa: BLE001 - a collector's failure never fails the daemon
            log("tracing_error", level="warning", error=f"{type(exc).__name__}: {exc}")

    # -- a call --------------------------------------------------------------------------------

    def _parent(self, traceparent: str | None, tracestate: str | None) -> Any:
        if not traceparent:
            return None
        carrier = {"traceparent": traceparent}
        if tracestate:
            carrier["tracestate"] = tracestate
        return _PROPAGATOR.extract(carrier)

    def started(self, call: ToolCall, principal: str | None, origin: Any) -> CallSpan:
        traceparent = call.traceparent or (origin.traceparent if origin is not None else None)
        tracestate = call.tracestate if call.traceparent else (origin.tracestate if origin is not None else None)
        attributes: dict[str, Any] = {
            "mcp.method.name": "tools/call", "gen_ai.tool.name": call.entry.name,
            "gen_ai.operation.name": "execute_tool", "mcp.protocol.version": call.version,
            "jsonrpc.request.id": str(call.request_id)[:MAX_ID_CHARS], "toolcell.plugin": call.entry.plugin,
        }
        if principal:
            attributes["toolcell.principal"] = principal
        if origin is not None:
            if origin.session_id:
                attributes["mcp.session.id"] = origin.session_id
            attributes["network.transport"] = origin.transport
        span = self.tracer.start_span(f"tools/call {call.entry.name}", context=self._parent(traceparent, tracestate),
                                      kind=SpanKind.SERVER, attributes=attributes)
        return CallSpan(span, trace.set_span_in_context(span))

    def asked(self, call_span: CallSpan, questions: int) -> None:
        if call_span.ask_span is None:
            call_span.ask_span = self.tracer.start_span("ask", context=call_span.context,
                                                        attributes={"toolcell.questions": questions})

    def answered(self, call_span: CallSpan, outcome: str) -> None:
        ask = call_span.ask_span
        if ask is not None:
            call_span.ask_span = None
            ask.set_attribute("toolcell.answer", outcome)
            ask.end()

    def event(self, call_span: CallSpan, name: str, attributes: dict[str, Any]) -> None:
        call_span.span.add_event(name, attributes)

    def ended(self, call_span: CallSpan, slot: Any, error_type: str | None) -> None:
        now_perf, now_ns = time.perf_counter(), time.time_ns()
        queued = getattr(slot, "queued_at", 0.0) if slot is not None else 0.0
        started = getattr(slot, "started_at", 0.0) if slot is not None else 0.0
        if queued and started:
            self.tracer.start_span("queue", context=call_span.context,
                                   start_time=_ns_at(queued, now_perf, now_ns)).end(_ns_at(started, now_perf, now_ns))
        if started:
            self.tracer.start_span("worker", context=call_span.context,
                                   start_time=_ns_at(started, now_perf, now_ns)).end(now_ns)
        self.answered(call_span, "ended")
        span = call_span.span
        if error_type is not None:
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR, error_type))
        span.end(now_ns)

    def refused(self, requested: str, outcome: str, principal: str | None) -> None:
        attributes: dict[str, Any] = {"mcp.method.name": "tools/call", "gen_ai.tool.name": requested[:200],
                                      "gen_ai.operation.name": "execute_tool", "error.type": outcome}
        if principal:
            attributes["toolcell.principal"] = principal
        span = self.tracer.start_span(f"tools/call {requested[:200]}".rstrip(), kind=SpanKind.SERVER,
                                      attributes=attributes)
        span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()


def _provider() -> Any:
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "toolcell")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
