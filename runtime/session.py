"""Running the actions of one client connection (stdio, or a legacy HTTP session's messages).

The protocol core decides *what* to do; a ``Session`` does it with trio: each tool call in its own
task under its own cancel scope (so a slow call never holds up a fast one), cancellations by
request id, listen subscriptions, 2025-03-26 batches answered as one array once every member is
done. After a cancellation nothing more is sent for that request.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import trio

from runtime.logs import log
from runtime.protocol import jsonrpc as rpc
from runtime.daemon import Daemon
from runtime.protocol.core import Batch, Cancel, ConnState, Listen, Reply, ToolCall


class Session:
    def __init__(self, daemon: Daemon, state: ConnState, emit: Callable[[bytes], None], nursery: trio.Nursery,
                 principal: str | None = None, catalog_view: Callable[[], Any] | None = None) -> None:
        self.daemon = daemon
        self.core = daemon.core
        self.state = state
        self.emit = emit
        self.nursery = nursery
        self.principal = principal
        self.catalog_view = catalog_view
        #: request id -> (call, handle) of calls running for this connection.
        self.inflight: dict[Any, Any] = {}
        self.listens: dict[Any, Listen] = {}
        self._idle = trio.Event()
        self._idle.set()
        self._unsubscribe = daemon.subscribe(self._on_catalog_change)
        #: Shutting down: calls and subscriptions that arrive now are refused with ``SHUTTING_DOWN``.
        self.draining = False
        self._batch_scopes: set[trio.CancelScope] = set()

    def close(self) -> None:
        self._unsubscribe()
        for request_id in list(self.inflight):
            self._cancel(request_id)

    def receive(self, data: bytes | memoryview) -> None:
        catalog = self.catalog_view() if self.catalog_view is not None else None
        try:
            action = self.core.receive(self.state, data, catalog)
        except Exception as exc:  # our bug: answer -32603, log it, keep serving everyone else
            log("internal_error", level="error", error=f"{type(exc).__name__}: {exc}",
                traceback=traceback.format_exc(limit=15))
            self.emit(rpc.error_response(b"null", rpc.INTERNAL_ERROR, "Internal error"))
            return
        self.dispatch(action)

    def dispatch(self, action: Any) -> None:
        if self.draining and type(action) in (ToolCall, Listen, Batch):
            self._refuse(action)
            return
        if type(action) is ToolCall:
            self._start_call(action)
        elif type(action) is Reply:
            if action.refused is not None:
                self.daemon.record_refusal(action, self.principal)
            if action.data is not None:
                self.emit(action.data)
        elif type(action) is Cancel:
            self._cancel(action.request_id)
        elif type(action) is Listen:
            self.listens[action.request_id] = action
            self.emit(self.core.subscription_ack(action))
        elif type(action) is Batch:
            self.nursery.start_soon(self._run_batch, action)

    def _start_call(self, call: ToolCall) -> None:
        request_id = call.request_id
        if request_id in self.inflight:
            # A duplicate in-flight id is the client's bug; answer it without disturbing the other.
            self.emit(self.core.call_error(call, -32600, "Invalid Request: a request with this id is already in progress"))
            return
        self.inflight[request_id] = None  # placeholder: the call may finish synchronously
        if self._idle.is_set():
            self._idle = trio.Event()
        handle = self.daemon.start(call, self.emit, self.principal, self._call_done)
        if request_id in self.inflight:
            self.inflight[request_id] = (call, handle)

    def _call_done(self, call: ToolCall, data: bytes) -> None:
        if self.inflight.pop(call.request_id, 0) != 0:
            self.emit(data)
        if not self.inflight:
            self._idle.set()

    def _cancel(self, request_id: Any) -> None:
        if request_id in self.inflight:
            entry = self.inflight.pop(request_id)
            if entry is not None:
                call, handle = entry
                self.daemon.cancel(call, handle, self.principal)
            if not self.inflight:
                self._idle.set()
            return
        listen = self.listens.pop(request_id, None)
        if listen is not None:
            self.emit(self.core.subscription_end(listen))

    def _refuse(self, action: Any) -> None:
        """Answer what arrived during shutdown without running it."""
        message = "Server is shutting down; the request was not run"
        if type(action) is ToolCall:
            self.emit(self.core.call_error(action, rpc.SHUTTING_DOWN, message))
        elif type(action) is Listen:
            self.emit(rpc.error_response(rpc.encode_id(action.request_id), rpc.SHUTTING_DOWN, message))
        elif type(action) is Batch:
            parts = []
            for member in action.actions:
                if type(member) is ToolCall:
                    parts.append(self.core.call_error(member, rpc.SHUTTING_DOWN, message))
                elif type(member) is Reply and member.data is not None:
                    parts.append(member.data)
            if parts:
                self.emit(b"[" + b",".join(parts) + b"]")

    def abort(self, reason: str) -> None:
        """Shutdown's end: every call still running is answered with ``reason`` and stopped, every
        listen subscription ended; nothing is left without an answer."""
        for request_id in list(self.inflight):
            entry = self.inflight.pop(request_id)
            if entry is not None:
                call, handle = entry
                self.emit(self.core.call_failed(call, f"Tool {call.entry.name} was stopped: {reason}"))
                self.daemon.cancel(call, handle, self.principal)
        self._idle.set()
        for request_id in list(self.listens):
            self.emit(self.core.subscription_end(self.listens.pop(request_id)))
        for scope in list(self._batch_scopes):
            scope.cancel()

    async def _run_batch(self, batch: Batch) -> None:
        replies: list[bytes | None] = [None] * len(batch.actions)
        calls: dict[int, ToolCall] = {}

        async def run(i: int, call: ToolCall) -> None:
            replies[i] = await self.daemon.execute(call, self.emit, self.principal)

        scope = trio.CancelScope()
        self._batch_scopes.add(scope)
        try:
            with scope:
                async with trio.open_nursery() as n:
                    for i, action in enumerate(batch.actions):
                        if type(action) is ToolCall:
                            calls[i] = action
                            n.start_soon(run, i, action)
                        elif type(action) is Reply:
                            if action.refused is not None:
                                self.daemon.record_refusal(action, self.principal)
                            replies[i] = action.data
                        elif type(action) is Cancel:
                            self._cancel(action.request_id)
        finally:
            self._batch_scopes.discard(scope)
        if scope.cancelled_caught:  # aborted by shutdown: the unfinished members say so
            for i, call in calls.items():
                if replies[i] is None:
                    replies[i] = self.core.call_failed(call, f"Tool {call.entry.name} was stopped: the server is shutting down")
        parts = [r for r in replies if r is not None]
        if parts:
            self.emit(b"[" + b",".join(parts) + b"]")

    def _on_catalog_change(self) -> None:
        if self.state.legacy_version is not None:
            self.emit(self.core.list_changed())
        for listen in self.listens.values():
            if listen.tools_list_changed:
                self.emit(self.core.subscription_list_changed(listen))

    async def wait_idle(self) -> None:
        while self.inflight:
            await self._idle.wait()
