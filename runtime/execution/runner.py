"""The seam between the call dispatcher (``runtime.calls``) and what runs calls: the ``Runner`` protocol,
which a plugin's ``WorkerPool`` (``runtime.execution.pool``) and a hosted server's ``HostedRunner``
(``runtime.execution.hosted``) both implement, and ``CallSlot``, one call on its way through either.

The dispatcher makes a slot with ``new_slot`` (callbacks for the call's progress/log/questions and for
its end), hands it over with ``submit``, and holds it as the call's handle: ``withdraw`` when the client
cancels, ``answer`` when the client answers a question the call asked. ``on_done(slot)`` runs exactly once,
with ``slot.result`` or ``slot.error`` set.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import msgspec
import trio

from runtime import worker_frames
from runtime.logs import log
from runtime.protocol.errors import WorkerFailure
from sandbox import wire

#: What a running call sends its client on the way: ``wire.Progress``, ``wire.Log`` or ``wire.Ask``.
EventSink = Callable[[Any], None]


class PluginLoadError(Exception):
    """The plugin's first worker (or the hosted server) could not start or load the plugin."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


class CallSlot(msgspec.Struct, eq=False):
    """One call on its way through a runner. ``on_done(slot)`` runs once, when it has an outcome.

    Made by the runner's ``new_slot`` (one per call: a Struct fills its defaults in C, in half the time
    of a class's ``__init__``; compared by identity)."""

    call: wire.Call
    #: The encoded Call frame (a worker's; a hosted server is sent JSON made from ``call``).
    frame: bytes = b""
    on_event: EventSink | None = None
    on_done: Callable[[CallSlot], None] | None = None
    #: Set when the call ends, for a caller that waits on it (``WorkerPool.run``).
    event: trio.Event | None = None
    result: wire.Result | None = None
    error: WorkerFailure | None = None
    #: trio time by which the running call must end (or, while it asks, be answered).
    deadline: float = float("inf")
    abandoned: bool = False
    finished: bool = False
    #: Progress/log notifications relayed so far, their bytes, and how many were dropped.
    notes: int = 0
    note_bytes: int = 0
    notes_dropped: int = 0
    #: The round of questions the call waits on, until the runner sends its answer.
    asking: wire.Ask | None = None
    #: What was left of the call's deadline when it asked (the deadline does not run meanwhile).
    run_left_s: float = 0.0
    #: Questions asked so far (``limits.max_asks``).
    asks: int = 0
    #: perf_counter() when the pool took the call, and when a worker started on it.
    queued_at: float = 0.0
    started_at: float = 0.0
    #: Whose call it is (a hosted server with instances per principal runs it on that principal's).
    principal: str | None = None
    #: Hosted: the request id of the call at its server, the instance running it, and the server's own
    #: request that ``asking`` stands for.
    request_id: int = 0
    instance: Any = None
    server_request: Any = None

    def abandon(self) -> bool:
        """Its client cancelled: nothing more is reported for it. False if it had ended already."""
        if self.finished:
            return False
        self.on_done = None
        self.on_event = None
        self.abandoned = True
        return True

    def relay(self, frame: Any, size: int, limits: wire.Limits, plugin: str) -> None:
        """Pass one checked progress/log frame to the call's client, within the call's budget
        (``runtime.worker_frames.within_budget``: the call counts what it relayed)."""
        if self.on_event is None:
            return
        frame = worker_frames.within_budget(self, frame, size, limits, plugin, self.call.tool)
        if frame is not None:
            self.on_event(frame)

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        # Dropped once used: the callbacks belong to whoever owns the call (a ``RunningCall``, which
        # holds this slot), and a cycle between them would leave both to the cyclic collector.
        on_done, self.on_done, self.on_event = self.on_done, None, None
        try:
            if on_done is not None:
                on_done(self)
        except Exception as exc:  # our bug; the runner must keep running
            log("internal_error", level="error", where="call completion", error=f"{type(exc).__name__}: {exc}")
        if self.event is not None:
            self.event.set()


class CallsInFlight:
    """The count of calls a runner was given and has not ended (queued, sent or running), and
    ``retire``, which waits for it to reach zero. Shared by both kinds of runner."""

    in_flight: int = 0
    #: Set when a newer version replaced this runner: no new calls; queued and running ones finish.
    retiring: bool = False
    _drain_event: trio.Event | None = None

    def _release(self) -> None:
        self.in_flight -= 1
        if not self.in_flight and self._drain_event is not None:
            self._drain_event.set()

    async def _drained(self) -> None:
        """Wait until no call given to this runner is left."""
        while self.in_flight:
            self._drain_event = trio.Event()
            await self._drain_event.wait()

    async def aclose(self, grace_s: float = 2.0) -> None:
        raise NotImplementedError

    async def retire(self) -> None:
        """Let every call already given finish (each within its deadline), then close."""
        self.retiring = True
        try:
            await self._drained()
        finally:
            with trio.CancelScope(shield=True):
                await self.aclose(grace_s=0)


class Runner(Protocol):
    """What runs the calls of one plugin version: a ``WorkerPool`` or a ``HostedRunner``."""

    name: str
    limits: wire.Limits
    restarts: int
    limit_kills: int
    in_flight: int

    def new_slot(self, tool: str, arguments: dict[str, Any], progress: bool, log_level: int,
                 on_event: EventSink | None, on_done: Callable[[CallSlot], None] | None = None,
                 principal: str | None = None, trace: str = "") -> CallSlot:
        """A slot for one call, ``trace`` its W3C traceparent when traces are on (raises ``OverflowError``/``TypeError``/``ValueError`` for arguments
        that cannot travel)."""

    def submit(self, slot: CallSlot) -> None:
        """Run ``slot`` or queue it. Raises ``PoolBusy`` / ``WorkerFailure``."""

    def withdraw(self, slot: CallSlot) -> None:
        """The client cancelled: nothing more is reported for ``slot``; a running call is stopped."""

    def answer(self, slot: CallSlot, responses: list[wire.InputResponse], missing: str = "error",
               why: str = "the client gave no answer", to: wire.Ask | None = None) -> bool:
        """The client's answers to the round ``slot`` asks; False if it no longer waits on them."""

    async def start(self) -> wire.Ready:
        """Start serving; the ``Ready`` lists the tools. Raises ``PluginLoadError``."""

    def abort_all(self, reason: str) -> None:
        """Every call given to this runner fails now with ``reason``."""

    async def retire(self) -> None:
        """Let every call already given finish (within its deadline), then close."""

    async def aclose(self, grace_s: float = 2.0) -> None:
        """Stop taking calls, let running ones finish for up to ``grace_s``, then stop everything."""

    def queued(self) -> int:
        """Calls waiting to run."""

    def alive(self) -> int:
        """Processes serving calls now."""
