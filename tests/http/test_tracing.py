"""OpenTelemetry traces (``toolcell[otel]``), seen by a real OTLP/HTTP receiver: a real
``toolcell serve --http`` exports with the official SDK, set up only by the standard ``OTEL_*``
environment; the receiver decodes each export with ``opentelemetry-proto``.

Checked: span names and the MCP semantic-convention attributes, parentage (the caller's
``traceparent`` header or ``_meta.traceparent``; the ``queue`` and ``worker`` children; the context
the worker's plugin code sees), ``error.type`` of a failed and of a refused call, an ``ask`` span
from the question to its answer, and a task's events."""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx2
import pytest
from http_harness import TOKENS, ServerProcess, sha, start_server, stop_server, write_plugin
from httpkit import LEGACY, MODERN, initialize, legacy_headers, meta, modern_headers, rpc
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

TRACED = '''
import time

import msgspec

from sandbox import current, tool


class Confirm(msgspec.Struct):
    ok: bool


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@tool
def parent() -> str:
    """The trace context this call's code was given."""
    return current().traceparent


@tool
def broken() -> str:
    """Raise."""
    raise RuntimeError("boom")


@tool
def confirm() -> str:
    """Ask the client to confirm."""
    answer = current().elicit("Proceed?", Confirm, key="ok")
    return f"{answer.action}:{answer.content.ok if answer.accepted else None}"


@tool(task_support="optional")
def slow(seconds: float = 0.2) -> str:
    """Sleep, then finish (may run as a task)."""
    time.sleep(seconds)
    return "slept"
'''

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class Receiver:
    """An OTLP/HTTP trace receiver (``POST /v1/traces``, protobuf), keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                with receiver.lock:
                    for resource_spans in request.resource_spans:
                        service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                        for scope_spans in resource_spans.scope_spans:
                            for span in scope_spans.spans:
                                receiver.spans.append((service, span))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, predicate: Any, timeout: float = 20.0) -> list[Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = [span for _, span in self.spans if predicate(span)]
            if found:
                return found
            time.sleep(0.05)
        with self.lock:
            names = sorted({span.name for _, span in self.spans})
        raise AssertionError(f"no such span within {timeout} s; spans so far: {names}")

    def children(self, parent: Any) -> dict[str, Any]:
        with self.lock:
            return {span.name: span for _, span in self.spans
                    if span.parent_span_id == parent.span_id and span.trace_id == parent.trace_id}


def attrs(span: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        value = a.value
        out[a.key] = value.string_value if value.HasField("string_value") else \
            value.int_value if value.HasField("int_value") else value.bool_value
    return out


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    it = Receiver()
    try:
        yield it
    finally:
        it.server.shutdown()
        it.server.server_close()


@pytest.fixture(scope="module")
def server(receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("traced")
    config = f'''
policy = "none"
min_workers = 1

[http]

[[http.tokens]]
principal = "full"
sha256 = "{sha(TOKENS["full"])}"
'''
    saved = dict(os.environ)
    os.environ.update({"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "50",
                       "OTEL_SERVICE_NAME": "toolcell-under-test"})
    try:
        srv = start_server(tmp, config)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    write_plugin(srv.plugins, "traced", TRACED, "t_")
    deadline = time.monotonic() + 30
    with httpx2.Client(timeout=10) as client:
        while time.monotonic() < deadline:  # hot reload picks the plugin up
            r = client.post(srv.url, content=json.dumps(rpc("tools/list", {"_meta": meta()})).encode(),
                            headers=modern_headers("tools/list", token=TOKENS["full"]))
            if any(t["name"] == "t_echo" for t in r.json()["result"]["tools"]):
                break
            time.sleep(0.2)
    try:
        yield srv
    finally:
        stop_server(srv)


def _modern_call(client: httpx2.Client, url: str, name: str, arguments: dict[str, Any] | None = None, *,
                 headers: dict[str, str] | None = None, caps: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None, id: int = 1, **meta_extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"name": name, "arguments": arguments or {}, **(extra or {})}
    params["_meta"] = meta(**meta_extra) | ({"io.modelcontextprotocol/clientCapabilities": caps} if caps else {})
    r = client.post(url, content=json.dumps(rpc("tools/call", params, id)).encode(),
                    headers={**modern_headers("tools/call", name, TOKENS["full"]), **(headers or {})})
    return dict(r.json())


@pytest.fixture
def client() -> Iterator[httpx2.Client]:
    with httpx2.Client(timeout=30) as c:
        yield c


def test_a_call_continues_the_callers_trace_from_the_http_header(server: ServerProcess, receiver: Receiver,
                                                                 client: httpx2.Client) -> None:
    answer = _modern_call(client, server.url, "t_echo", {"text": "traced"}, id=41,
                          headers={"traceparent": TRACEPARENT})
    assert answer["result"]["content"][0]["text"] == "traced"
    (span,) = receiver.wait_for(lambda s: s.name == "tools/call t_echo" and s.trace_id.hex() == TRACE_ID)
    assert span.parent_span_id.hex() == PARENT_ID
    assert span.kind == span.SPAN_KIND_SERVER
    a = attrs(span)
    assert a["mcp.method.name"] == "tools/call"
    assert a["gen_ai.tool.name"] == "t_echo"
    assert a["gen_ai.operation.name"] == "execute_tool"
    assert a["jsonrpc.request.id"] == "41"
    assert a["mcp.protocol.version"] == MODERN
    assert a["toolcell.principal"] == "full"
    assert "error.type" not in a
    receiver.wait_for(lambda s: s.name == "worker" and s.parent_span_id == span.span_id)
    children = receiver.children(span)
    assert {"queue", "worker"} <= set(children)
    worker = children["worker"]
    assert span.start_time_unix_nano <= worker.start_time_unix_nano <= worker.end_time_unix_nano \
        <= span.end_time_unix_nano
    services = {service.get("service.name") for service, _ in receiver.spans}
    assert services == {"toolcell-under-test"}


def test_meta_traceparent_is_continued_and_the_plugin_code_sees_its_calls_span(
        server: ServerProcess, receiver: Receiver, client: httpx2.Client) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    answer = _modern_call(client, server.url, "t_parent", traceparent=f"00-{trace_id}-b7ad6b7169203331-01")
    seen = answer["result"]["content"][0]["text"]
    (span,) = receiver.wait_for(lambda s: s.name == "tools/call t_parent" and s.trace_id.hex() == trace_id)
    assert span.parent_span_id.hex() == "b7ad6b7169203331"
    assert seen == f"00-{trace_id}-{span.span_id.hex()}-01"


def test_a_malformed_traceparent_starts_a_new_trace_and_the_call_still_runs(
        server: ServerProcess, receiver: Receiver, client: httpx2.Client) -> None:
    answer = _modern_call(client, server.url, "t_echo", {"text": "fresh"}, id=77,
                          headers={"traceparent": "00-zz-not-a-trace-context"})
    assert answer["result"]["content"][0]["text"] == "fresh"
    (span,) = receiver.wait_for(lambda s: s.name == "tools/call t_echo" and attrs(s)["jsonrpc.request.id"] == "77")
    assert span.parent_span_id == b""


def test_a_failed_and_a_refused_call_carry_error_type(server: ServerProcess, receiver: Receiver,
                                                      client: httpx2.Client) -> None:
    answer = _modern_call(client, server.url, "t_broken", id=5)
    assert answer["result"]["isError"] is True
    (failed,) = receiver.wait_for(lambda s: s.name == "tools/call t_broken")
    assert attrs(failed)["error.type"] == "tool_error"
    assert failed.status.code == failed.status.STATUS_CODE_ERROR
    _modern_call(client, server.url, "t_nothing_like_it", id=6)
    (refused,) = receiver.wait_for(lambda s: s.name == "tools/call t_nothing_like_it")
    assert attrs(refused)["error.type"] == "invalid_params"


def test_an_ask_is_a_child_span_from_question_to_answer(server: ServerProcess, receiver: Receiver,
                                                        client: httpx2.Client) -> None:
    caps = {"elicitation": {}}
    first = _modern_call(client, server.url, "t_confirm", caps=caps, id=9)
    assert first["result"]["resultType"] == "input_required", first
    state = first["result"]["requestState"]
    done = _modern_call(client, server.url, "t_confirm", caps=caps, id=10,
                        extra={"inputResponses": {"ok": {"action": "accept", "content": {"ok": True}}},
                               "requestState": state})
    assert done["result"]["content"][0]["text"] == "accept:True", done
    (ask,) = receiver.wait_for(lambda s: s.name == "ask")
    call_spans = receiver.wait_for(lambda s: s.name == "tools/call t_confirm" and s.span_id == ask.parent_span_id)
    assert attrs(ask)["toolcell.questions"] == 1
    assert attrs(ask)["toolcell.answer"] == "answered"
    assert call_spans[0].start_time_unix_nano <= ask.start_time_unix_nano <= ask.end_time_unix_nano


def test_a_task_records_its_creation_on_the_calls_span(server: ServerProcess, receiver: Receiver,
                                                       client: httpx2.Client) -> None:
    sid = initialize(client, server.url, TOKENS["full"])
    r = client.post(server.url, json=rpc("tools/call", {"name": "t_slow", "arguments": {"seconds": 0.3}, "task": {}}),
                    headers=legacy_headers(TOKENS["full"], sid, LEGACY))
    task_id = r.json()["result"]["task"]["taskId"]
    (span,) = receiver.wait_for(lambda s: s.name == "tools/call t_slow")
    events = {event.name: {a.key: a.value.string_value for a in event.attributes} for event in span.events}
    assert events["task.created"]["mcp.task.id"] == task_id
    assert attrs(span)["mcp.session.id"] == sid


def test_tracing_off_costs_no_import(tmp_path: Path) -> None:
    """Without OTEL_* the daemon never imports OpenTelemetry (the extra may not even be installed)."""
    import subprocess
    import sys

    code = ("import os, sys; [os.environ.pop(k) for k in list(os.environ) if k.startswith('OTEL_')]; "
            "from runtime.serve import tracing_wanted, _tracing; assert not tracing_wanted(); "
            "assert _tracing() is None; assert not any(m.startswith('opentelemetry') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


# -- a tracer that fails never fails a call (in-process, no daemon) --------------------------------


class _RaisingTracer:
    """Its methods raise (but those in ``working``): an SDK bug, a span processor that throws."""

    def __init__(self, working: tuple[str, ...]) -> None:
        self.working = working

    def __getattr__(self, name: str) -> Any:
        def boom(*args: Any) -> Any:
            if name in self.working:
                from types import SimpleNamespace

                return SimpleNamespace(traceparent="")
            raise RuntimeError(f"tracer.{name} is broken")
        return boom


class _FakePool:
    """Runs nothing: keeps each slot so the test can finish it (as a worker's answer would)."""

    def __init__(self) -> None:
        self.slots: list[Any] = []

    def new_slot(self, name: str, arguments: Any, progress: bool, log_level: int, on_frame: Any, done: Any,
                 **extra: Any) -> Any:
        from types import SimpleNamespace

        return SimpleNamespace(finished=False, error=None, result=None, on_frame=on_frame, done=done,
                               queued_at=0.0, started_at=0.0)

    def submit(self, slot: Any) -> None:
        self.slots.append(slot)

    def answer(self, *args: Any) -> bool:
        return True

    def withdraw(self, slot: Any) -> None:
        slot.finished = True


@pytest.mark.parametrize("working", [(), ("started",)])
def test_a_tracer_that_raises_never_fails_a_call(working: tuple[str, ...]) -> None:
    from runtime.calls import CallDispatcher
    from runtime.protocol.catalog import Catalog, ToolEntry
    from runtime.protocol.core import Completed, ToolCall
    from runtime.protocol.schemas import check_tool
    from sandbox import wire
    from sandbox.wire import ToolSpec

    checked, problems = check_tool(ToolSpec(name="echo", description="echo", input_schema={"type": "object"}),
                                   "echo")
    assert checked is not None, problems
    pool = _FakePool()
    entry = ToolEntry("p_echo", "p", "echo", checked, runner=pool)
    dispatcher = CallDispatcher(max_inflight=10)
    dispatcher.tracer = _RaisingTracer(working)
    call = ToolCall(b"1", 1, entry, {}, "2025-06-18", None, -1, False)
    outcomes: list[Any] = []
    handle = dispatcher.start(call, "alice", lambda frame: None, outcomes.append)
    assert handle is not None
    handle.on_frame(wire.Ask(1, []))  # a question: the tracer's ask span fails, the frame goes on
    dispatcher.answer(call, handle, [])
    dispatcher.trace_event(handle, "task", {"status": "working"})
    handle.result = wire.Result(1, [{"type": "text", "text": "hi"}])
    handle.done(handle)
    assert len(outcomes) == 1 and type(outcomes[0]) is Completed
    assert dispatcher.inflight == 0
    # A refused call and a cancelled one: recorded, not raised.
    dispatcher.record_refused_name("nope", "unknown_tool", "alice", Catalog(0, [entry]))
    second = dispatcher.start(call, "alice", lambda frame: None, outcomes.append)
    dispatcher.cancel(call, second, "alice")
    assert second.finished and dispatcher.inflight == 0


def _memory_tracing() -> tuple[Any, Any]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from runtime.tracing import Tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def _call(request_id: Any, tracestate: str | None = None) -> Any:
    from runtime.protocol.catalog import ToolEntry
    from runtime.protocol.core import ToolCall
    from runtime.protocol.schemas import check_tool
    from sandbox.wire import ToolSpec

    checked, _ = check_tool(ToolSpec(name="echo", description="echo", input_schema={"type": "object"}), "echo")
    assert checked is not None
    return ToolCall(b"1", request_id, ToolEntry("p_echo", "p", "echo", checked), {}, "2025-06-18", None, -1, False,
                    traceparent=TRACEPARENT, tracestate=tracestate)


def test_span_attributes_from_the_client_are_bounded() -> None:
    """A JSON-RPC id may be a string as long as the body: as a span attribute it was kept whole in
    the exporter's queue (up to 2048 spans) and sent to the collector."""
    tracing, exporter = _memory_tracing()
    tracing.ended(tracing.started(_call("x" * 100_000), "alice", None), None, None)
    (span,) = exporter.get_finished_spans()
    assert len(span.attributes["jsonrpc.request.id"]) <= 256


def test_a_malformed_tracestate_is_not_written_to_the_daemons_log_by_the_sdk(caplog: Any) -> None:
    """OpenTelemetry warns through Python's logging about a tracestate it cannot parse, quoting it:
    a client's text on the daemon's stderr, raw, once per request."""
    import logging

    tracing, exporter = _memory_tracing()
    with caplog.at_level(logging.DEBUG):
        tracing.ended(tracing.started(_call(1, "a=b,bad member forged"), None, None), None, None)
    assert "forged" not in caplog.text
    assert exporter.get_finished_spans()[0].parent.trace_id == int(TRACE_ID, 16)  # the parent still counts
