"""A call on its way through a pool, and whoever hears what it sends.

``RunningCall`` is the one record of a running tool call that outlives the request which started
it: a 2026-07-28 call that asked something is parked (``runtime.mrtr``) and resumed by its
client's retry, a call that became a task reports to its task. Its ``owner`` (a ``CallOwner``: a
connection, the parking, a task) and ``sink`` (``Sink``: where the request's messages go) change
hands; the pool's callbacks always go through it. Trio-free types only; no daemon imports, so the
conversation layer and the modules it hands calls to can all name them.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from runtime.protocol.core import Outcome, ToolCall
from sandbox import wire


class Sink(Protocol):
    """Where one request's messages go."""

    def emit(self, data: bytes) -> None:
        """A notification about the request (progress, log, a listen's events)."""

    def done(self, data: bytes, error_code: int | None = None) -> None:
        """The request's final answer (``error_code``: it is a JSON-RPC error with that code)."""

    def cancelled(self) -> None:
        """The request was cancelled: nothing more comes."""


class _Nowhere:
    """A sink whose messages go nowhere: an action that sends nothing later (a reply, a cancel), or a
    call that became a task (its client polls instead)."""

    def emit(self, data: bytes) -> None:
        pass

    def done(self, data: bytes, error_code: int | None = None) -> None:
        pass

    def cancelled(self) -> None:
        pass


NOWHERE: Sink = _Nowhere()


class CallOwner(Protocol):
    """Whoever a running call reports to: the connection whose request it answers, or, while it
    waits for something other than a request, ``runtime.mrtr.Parking`` or a task."""

    def call_frame(self, running: RunningCall, frame: Any) -> None:
        """A progress, log or ``Ask`` frame of the call (checked by the pool)."""

    def call_outcome(self, running: RunningCall, outcome: Outcome) -> None:
        """How the call ended (exactly once, unless it was cancelled first)."""


class RunningCall(msgspec.Struct, eq=False):
    """A call on its way through a pool, and where what it sends goes. ``owner``, ``call`` (the
    request it answers: a 2026-07-28 retry brings a new id) and ``sink`` change when a waiting call
    is resumed by a later request. (A mutable Struct: one is made per call, in a third of a
    dataclass's time; compared by identity.)"""

    call: ToolCall
    sink: Sink
    owner: CallOwner
    principal: str | None = None
    handle: Any = None
    #: Legacy: the round of our requests the tool waits on (``runtime.connection.QuestionRound``).
    round: Any = None
    #: 2026-07-28: answers the client already gave (its ``inputResponses`` and earlier rounds'), by key,
    #: and the open round (what was answered already, and the requests still open).
    given: dict[str, Any] | None = None
    partial: list[wire.InputResponse] | None = None
    open: list[wire.InputRequest] | None = None

    def frame(self, frame: Any) -> None:
        """The pool's callback for a frame of the call: to whoever owns it now."""
        self.owner.call_frame(self, frame)

    def outcome(self, outcome: Outcome) -> None:
        """The pool's callback for how the call ended: to whoever owns it now."""
        self.owner.call_outcome(self, outcome)
