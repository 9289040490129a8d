"""State the HTTP transport keeps between requests: legacy sessions, running calls, push streams.

* A ``LegacySession`` is what one ``initialize`` created (2025-03-26 … 2025-11-25): its id
  (unguessable, visible ASCII), the negotiated ``ConnState``, the principal that owns it (another
  principal presenting the id gets 404, like an unknown id), its running calls (for
  ``notifications/cancelled``) and at most one GET stream.
* A ``CallBox`` is where one running call's notifications and final response land. The request
  handler owns it and waits on it; callbacks from the worker pool wake the handler by cancelling
  the scope it is parked in (no task per call).
* A ``PushStream`` is a long-lived SSE stream fed by catalog changes: a legacy session's GET
  stream or a modern ``subscriptions/listen``.
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import trio

from runtime.auth import Principal
from runtime.protocol.core import ConnState, Listen

#: Notifications a client that does not read its stream may leave queued before it is cut off.
MAX_PENDING = 1024


class Waker:
    """Something a request handler parks on; ``wake()`` (sync, from callbacks) unparks it.

    The handler parks either with ``park()`` (cheap: its task is simply rescheduled) or, when it
    must also notice the client going away, in ``receive()`` under ``scope``, which ``wake()``
    cancels. The handler checks for work before parking: a wake with nobody parked is not kept.
    """

    __slots__ = ("scope", "task", "woken")

    def __init__(self) -> None:
        self.scope: trio.CancelScope | None = None
        self.task: trio.lowlevel.Task | None = None
        self.woken = False

    def wake(self) -> None:
        self.woken = True
        if self.scope is not None:
            self.scope.cancel()
        self.unpark()

    def unpark(self) -> None:
        """End a ``park()`` without saying there is news (a timer ran out)."""
        task = self.task
        if task is not None:
            self.task = None
            trio.lowlevel.reschedule(task)

    async def park(self) -> None:
        """Sleep until ``wake()`` or ``unpark()`` (or a cancellation)."""
        self.task = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(self._abort)

    def _abort(self, _: Any) -> trio.lowlevel.Abort:
        self.task = None
        return trio.lowlevel.Abort.SUCCEEDED


class CallBox(Waker):
    __slots__ = ("final", "final_code", "is_cancelled", "overflow", "pending", "stream")

    def __init__(self, stream: bool) -> None:
        # ``Waker.__init__``, written out: one box per call.
        self.scope: trio.CancelScope | None = None
        self.task: trio.lowlevel.Task | None = None
        self.woken = False
        self.pending: list[bytes] = []
        self.final: bytes | None = None
        #: The final answer is a JSON-RPC error with this code (its HTTP status follows it).
        self.final_code: int | None = None
        self.is_cancelled = False
        self.overflow = False
        #: Notifications are wanted (the client accepts SSE); otherwise they are dropped.
        self.stream = stream

    @property
    def can_stream(self) -> bool:
        """Whether what ``emit`` takes reaches the client (it accepts an SSE answer)."""
        return self.stream

    def emit(self, data: bytes) -> None:
        if not self.stream or self.final is not None or self.is_cancelled:
            return
        if len(self.pending) >= MAX_PENDING:
            self.overflow = True
        else:
            self.pending.append(data)
        self.wake()

    def done(self, data: bytes, error_code: int | None = None) -> None:
        if not self.is_cancelled:
            self.final = data
            self.final_code = error_code
        self.wake()

    def cancelled(self) -> None:
        self.is_cancelled = True
        self.wake()


class PushStream(Waker):
    __slots__ = ("closed", "last", "listen", "overflow", "pending", "principal", "with_ids")

    def __init__(self, listen: Listen | None = None, with_ids: bool = False, principal: str = "") -> None:
        super().__init__()
        #: Who opened it: its stream ends if that principal's token is revoked (``HttpApp.reload_tokens``).
        self.principal = principal
        #: Messages to send; ``(event id, message)`` pairs when ``with_ids`` (a legacy GET stream).
        self.pending: deque[Any] = deque()
        self.with_ids = with_ids
        self.closed = False
        self.overflow = False
        #: A message to send before closing (the listen completion result on shutdown).
        self.last: bytes | None = None
        self.listen = listen

    def push(self, data: Any) -> None:
        if self.closed:
            return
        if len(self.pending) >= MAX_PENDING:
            self.overflow = True
            self.closed = True
        else:
            self.pending.append(data)
        self.wake()

    def push_event(self, event_id: int, data: bytes) -> None:
        self.push((event_id, data))

    def close(self, last: bytes | None = None) -> None:
        if not self.closed:
            self.closed = True
            self.last = last
        self.wake()

    # As a connection's sink (a listen subscription): events, then the completion result.
    def emit(self, data: bytes) -> None:
        self.push(data)

    def done(self, data: bytes, error_code: int | None = None) -> None:
        self.close(data)

    def cancelled(self) -> None:
        self.close()


@dataclass(eq=False)
class LegacySession:
    id: str
    principal: Principal
    state: ConnState
    last_seen: float
    #: The session's conversation (``runtime.connection.Connection``), set once ``initialize`` is answered.
    conn: Any = None
    stream: PushStream | None = None
    busy: int = 0  # requests being handled right now
    #: The last messages meant for the GET stream, with their event ids (replayed to a client that
    #: reconnects with ``Last-Event-ID``), bounded by ``http.sse_replay_events``.
    replay: deque[tuple[int, bytes]] = field(default_factory=deque)
    next_event_id: int = 1

    @property
    def inflight(self) -> dict[Any, Any]:
        """The session's requests in flight (its connection's)."""
        return self.conn.inflight if self.conn is not None else {}

    def record(self, data: bytes, keep: int) -> int:
        """Give ``data`` (a message for the GET stream) its event id and keep it for replay."""
        event_id = self.next_event_id
        self.next_event_id += 1
        self.replay.append((event_id, data))
        while len(self.replay) > keep:
            self.replay.popleft()
        return event_id

    def missed(self, last_event_id: bytes | None) -> list[tuple[int, bytes]]:
        """What a client that last saw ``last_event_id`` has not seen (all that is kept for an id this
        session never gave, or one older than what is kept)."""
        if last_event_id is None:
            return []
        try:
            last = int(last_event_id.strip())
        except ValueError:
            return []
        if not 0 < last < self.next_event_id:
            return []
        return [(i, d) for i, d in self.replay if i > last]


def new_session_id() -> str:
    """256 random bits, URL-safe base64: only visible ASCII (0x21-0x7E), as the spec requires."""
    return secrets.token_urlsafe(32)


class SessionTable:
    """Legacy sessions, capped in all (``max_sessions``) and per principal (``max_per_principal``).

    A principal at its own cap gives up its oldest idle session for a new one (or is refused when
    none is idle). When the whole table is full, the principal holding the most sessions gives up
    its oldest idle one: one client filling the table cannot lock everyone else out."""

    def __init__(self, max_sessions: int, idle_s: float, max_per_principal: int | None = None) -> None:
        self.sessions: dict[str, LegacySession] = {}
        self.max_sessions = max_sessions
        self.max_per_principal = max_per_principal or max_sessions
        self.idle_s = idle_s
        self.per_principal: dict[str, int] = {}
        #: Each principal's sessions: eviction looks at one principal's (at most its cap), not all.
        self._by_principal: dict[str, dict[str, LegacySession]] = {}

    def __len__(self) -> int:
        return len(self.sessions)

    def create(self, principal: Principal, state: ConnState, now: float) -> LegacySession | None:
        name = principal.name
        if self.per_principal.get(name, 0) >= self.max_per_principal:
            self.expire(now)
            if self.per_principal.get(name, 0) >= self.max_per_principal and not self._evict_idle_of(name):
                return None
        if len(self.sessions) >= self.max_sessions:
            self.expire(now)
            if len(self.sessions) >= self.max_sessions:
                offender = max(self.per_principal, key=lambda n: self.per_principal[n])
                if not self._evict_idle_of(offender) and not self._evict_idle_of(name):
                    return None
        session = LegacySession(new_session_id(), principal, state, now)
        self.sessions[session.id] = session
        self.per_principal[name] = self.per_principal.get(name, 0) + 1
        self._by_principal.setdefault(name, {})[session.id] = session
        return session

    @staticmethod
    def _idle(session: LegacySession) -> bool:
        return not session.inflight and session.stream is None and not session.busy

    def _evict_idle_of(self, name: str) -> bool:
        """Forget ``name``'s least recently used idle session; False if it has none."""
        candidates = [s for s in self._by_principal.get(name, {}).values() if self._idle(s)]
        if not candidates:
            return False
        victim = min(candidates, key=lambda s: s.last_seen)
        self.remove(victim)
        return True

    def get(self, session_id: bytes, principal: Principal) -> LegacySession | None:
        try:
            session = self.sessions.get(session_id.decode("ascii"))
        except UnicodeDecodeError:
            return None
        if session is None or session.principal.name != principal.name:
            return None
        return session

    def remove(self, session: LegacySession) -> None:
        if self.sessions.pop(session.id, None) is not None:
            name = session.principal.name
            left = self.per_principal.get(name, 1) - 1
            own = self._by_principal.get(name, {})
            own.pop(session.id, None)
            if left > 0:
                self.per_principal[name] = left
            else:
                self.per_principal.pop(name, None)
                self._by_principal.pop(name, None)
        if session.stream is not None:
            session.stream.close()
        if session.conn is not None:
            session.conn.close()  # what the session still runs is stopped; no more notifications

    def expire(self, now: float) -> list[LegacySession]:
        """Forget sessions idle for ``idle_s`` (no request, no running call, no open stream)."""
        gone = [s for s in self.sessions.values()
                if now - s.last_seen > self.idle_s and not s.inflight and s.stream is None and not s.busy]
        for session in gone:
            self.remove(session)
        return gone
