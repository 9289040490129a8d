"""2026-07-28 tools that ask: ``input_required`` results, the client's retry, and parked calls.

A 2026-07-28 client cannot be sent requests of ours. When a running call asks something
(``sandbox.asking``) the daemon answers the request with ``input_required``: the questions the
client declared the capability for, under their keys, and a sealed ``requestState``
(``runtime.protocol.request_state``). Questions the client cannot answer (it did not declare the
capability on this request) are answered "declined_capability" to the tool at once, and questions
the client already answered (``inputResponses`` of this request, or of earlier rounds carried in the
state) are answered from those, so only what is really open goes back to the client.

The retry (same tool and arguments, a new id, ``inputResponses`` and our ``requestState``) is taken
up in one of two ways:

* **resumed**: the call is still *parked* on this daemon (its worker blocked in the question); the
  answers go to it and it carries on, answering the retry. Parking is bounded: at most
  ``max_parked`` calls in the daemon and ``limits.max_parked`` per plugin (a parked call holds one of
  the plugin's workers), each for at most the plugin's ``limits.ask_timeout_s`` (then the question
  times out in the tool, whose outcome nobody hears).
* **run again**: otherwise (the daemon restarted, another daemon took the retry, parking was full
  or expired), the tool runs again from the start and each of its questions is answered from the
  answers the client gave, in order, by key. A stateless deployment therefore works. A parked call
  whose question already timed out in the tool (it went on, and may still be running) is no longer
  waiting for these answers: it is stopped and the tool runs again the same way (the answers go
  only to the round they answer, never to a later question).

Missing answers give another ``input_required``; answers of the wrong shape, and tampered, foreign
or expired state, are JSON-RPC errors (-32602). Keys the call did not ask are ignored.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile
import time
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from runtime.logs import log
from runtime.protocol import eras
from runtime.protocol.core import Outcome, ToolCall
from runtime.protocol.errors import InvalidParams
from runtime.protocol.request_state import RequestState, Sealer, StateRejected, digest_arguments
from runtime.running import RunningCall, Sink
from sandbox import wire

if TYPE_CHECKING:
    from runtime.calls import CallDispatcher
    from runtime.protocol.core import Core


class Conversation(Protocol):
    """What ``Mrtr`` needs of a connection (``runtime.connection.Connection``)."""

    principal: str | None

    def start(self, call: ToolCall, sink: Sink, given: dict[str, Any] | None = None) -> RunningCall: ...

    def adopt(self, running: RunningCall) -> None: ...

    def release(self, running: RunningCall) -> None: ...


def load_state_key(path: str) -> bytes:
    """The daemon's ``requestState`` key: 32 random bytes in ``path`` (created 0600 on first use).
    Daemons behind one balancer share the file (``state_key_file`` in the config). Daemons starting
    together on a fresh state dir agree on one key: it is written aside, then linked into place, and
    whoever loses that race reads the winner's."""
    for _ in range(3):
        try:
            return read_key_file(path)
        except FileNotFoundError:
            pass
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".request-state-", dir=os.path.dirname(path) or ".")
        try:
            os.write(fd, secrets.token_bytes(32))
            os.fchmod(fd, 0o600)
            os.close(fd)
            os.link(tmp, path)  # atomic, and never replaces a key another daemon put there first
        except FileExistsError:
            pass
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return read_key_file(path)


def read_key_file(path: str, what: str = "requestState key", least_bytes: int = 16) -> bytes:
    """The secret in a key file an operator provides (or the daemon made), checked like PostgreSQL
    checks its own: raises ``OSError`` when it cannot be read, ``ValueError`` when others may read it or
    it is too short."""
    # O_NONBLOCK: a FIFO put in its place is opened without waiting for a writer, then refused.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: the {what} must be a regular file")
        # PostgreSQL's rule for its key files: a key of our own is for us alone (0600); one that root
        # provides may also be read by its group (0640: a Kubernetes Secret mounted with fsGroup is
        # root's, 0440, in the pod's group). Nobody else may read it, and only its owner write it.
        shared_by_root = info.st_uid == 0 != os.geteuid()
        forbidden = (stat.S_IWGRP | stat.S_IXGRP | stat.S_IRWXO) if shared_by_root else (stat.S_IRWXG | stat.S_IRWXO)
        if info.st_mode & forbidden:
            raise ValueError(f"{path}: the {what} must not be readable by others (chmod 600; a key "
                             "owned by root may be 0640)")
        key = f.read(4096)
    if len(key) < least_bytes:
        raise ValueError(f"{path}: a {what} needs at least {least_bytes} bytes")
    return key


class SealFailed(Exception):
    """The answers so far cannot be sealed into a ``requestState``."""


class Parking:
    """Calls waiting for their client's retry (a ``CallOwner`` while they wait)."""

    def __init__(self, calls: CallDispatcher, max_parked: int) -> None:
        self.calls = calls
        self.max_parked = max_parked
        self.parked: dict[str, RunningCall] = {}
        #: The round of questions each parked call waits on (its answers go to that round only).
        self.rounds: dict[str, wire.Ask] = {}
        self._per_plugin: dict[str, int] = {}

    @staticmethod
    def park_id() -> str:
        """A new park id (unguessable: it rides in the client's state, sealed)."""
        return secrets.token_urlsafe(12)

    def park(self, running: RunningCall, park_id: str, ask: wire.Ask | None = None) -> bool:
        """Hold ``running`` under ``park_id`` for its retry (waiting on the round ``ask``); False when
        there is no room."""
        entry = running.call.entry
        plugin = entry.plugin
        if len(self.parked) >= self.max_parked or self._per_plugin.get(plugin, 0) >= entry.runner.limits.max_parked:
            return False
        self.parked[park_id] = running
        if ask is not None:
            self.rounds[park_id] = ask
        self._per_plugin[plugin] = self._per_plugin.get(plugin, 0) + 1
        running.owner = self
        return True

    def take(self, park_id: str) -> tuple[RunningCall, wire.Ask | None] | None:
        """The call parked under ``park_id`` and the round it waits on; None if it is not parked."""
        running = self.parked.pop(park_id, None)
        ask = self.rounds.pop(park_id, None)
        if running is None:
            return None
        self._unpark(running)
        return running, ask

    def _unpark(self, running: RunningCall) -> None:
        plugin = running.call.entry.plugin
        left = self._per_plugin.get(plugin, 1) - 1
        if left > 0:
            self._per_plugin[plugin] = left
        else:
            self._per_plugin.pop(plugin, None)

    def call_frame(self, running: RunningCall, frame: Any) -> None:
        if type(frame) is wire.Ask:  # cannot happen while it waits; answer rather than hang
            self.calls.answer(running.call, running.handle, [], "cancelled", "nobody is waiting for this call")

    def call_outcome(self, running: RunningCall, outcome: Outcome) -> None:
        """A parked call ended (its question timed out, its worker died): its retry runs it again."""
        for park_id, parked in list(self.parked.items()):
            if parked is running:
                del self.parked[park_id]
                self.rounds.pop(park_id, None)
                self._unpark(running)
                log("parked_call_ended", tool=running.call.entry.name, note="a retry runs the tool again")


class Mrtr:
    """The daemon's 2026-07-28 question-and-retry rules (see the module docstring)."""

    def __init__(self, core: Core, calls: CallDispatcher, key: bytes, *, max_parked: int = 64,
                 state_ttl_s: float = 600.0, instance: str | None = None) -> None:
        self.core = core
        self.calls = calls
        self.sealer = Sealer(key)
        self.parking = Parking(calls, max_parked)
        self.state_ttl_s = state_ttl_s
        #: This daemon's instance id: state naming another instance's park is run again here.
        self.instance = instance or secrets.token_hex(8)
        self.stats = {"input_required": 0, "resumed": 0, "rerun": 0, "rejected": 0}

    # -- a running 2026-07-28 call asks -------------------------------------------------------------

    def ask(self, conn: Conversation, running: RunningCall, ask: wire.Ask) -> None:
        call = running.call
        given = running.given or {}
        answered: list[wire.InputResponse] = []
        still_open: list[wire.InputRequest] = []
        for request in ask.requests:
            why = eras.input_refusal(call.version, call.client_caps, request.method, request.params)
            if why is not None:
                answered.append(wire.InputResponse(request.key, "declined_capability", message=why))
            elif request.key in given:
                problem = eras.input_response_problem(request.method, given[request.key])
                if problem is not None:
                    self._refuse(conn, running, f"Invalid params: inputResponses[{request.key!r}]: {problem}")
                    return
                answered.append(wire.InputResponse(request.key, "result", given[request.key]))
            else:
                still_open.append(request)
        if not still_open:
            self.calls.answer(call, running.handle, answered, to=ask)
            return
        running.partial = answered
        running.open = still_open
        park_id = self.parking.park_id()
        try:
            sealed = self._seal(running, park_id)
        except SealFailed as exc:
            self._refuse(conn, running, f"Invalid params: {exc}")
            return
        conn.release(running)
        if not self.parking.park(running, park_id, ask):
            # No room to hold it: stop it now; the retry runs the tool again from the start (the state
            # names a park that is not there).
            self.calls.cancel(call, running.handle, running.principal)
        self.stats["input_required"] += 1
        running.sink.done(self.core.input_required(call, still_open, sealed))

    def _seal(self, running: RunningCall, park_id: str) -> str:
        """Our sealed state for ``running``'s open round; ``SealFailed`` when the answers so far cannot
        travel in one (too big, or values msgpack cannot carry)."""
        call = running.call
        state = RequestState(
            principal=running.principal or "", tool=call.entry.name, arguments=digest_arguments(call.arguments),
            expires_ms=int(time.time() * 1000 + self.state_ttl_s * 1000), answers=dict(running.given or {}),
            asked=[r.key for r in running.open or ()], daemon=self.instance, park=park_id)
        try:
            return self.sealer.seal(state)
        except StateRejected as exc:
            raise SealFailed(str(exc)) from None
        except (OverflowError, TypeError, ValueError) as exc:
            raise SealFailed(f"the answers given cannot be carried in a requestState ({type(exc).__name__})") from None

    def _refuse(self, conn: Conversation, running: RunningCall, message: str) -> None:
        """A malformed answer: the request gets -32602 and the call stops."""
        call = running.call
        conn.release(running)
        self.stats["rejected"] += 1
        error = InvalidParams(message)
        running.sink.done(self.core.call_error(call, error), error.code)
        self.calls.cancel(call, running.handle, running.principal)

    # -- the retry ------------------------------------------------------------------------------

    def retry(self, conn: Conversation, call: ToolCall, sink: Sink) -> tuple[bytes, InvalidParams | None] | None:
        """Take up a retry: None when the call runs (resumed or again) and answers through ``sink``;
        else the answer now (another ``input_required``, or the error that refuses the retry)."""
        given = dict(call.input_responses or {})
        park_id = ""
        if call.request_state is not None:
            try:
                state = self.sealer.open(call.request_state, int(time.time() * 1000))
                if state.principal != (conn.principal or "") or state.tool != call.entry.name:
                    raise StateRejected("requestState belongs to another principal or tool")
                if state.arguments != digest_arguments(call.arguments):
                    raise StateRejected("requestState belongs to a call with other arguments")
            except StateRejected as exc:
                self.stats["rejected"] += 1
                error = InvalidParams(f"Invalid params: {exc}")
                return self.core.call_error(call, error), error
            given = {**state.answers, **given}
            if state.daemon == self.instance:
                park_id = state.park
        taken = self.parking.take(park_id) if park_id else None
        if taken is None:
            self.stats["rerun"] += 1
            conn.start(call, sink, given)
            return None
        running, ask = taken
        # Resume the parked call: the new request answers for it from now on.
        running.call, running.sink, running.given = _resumed_call(running.call, call), sink, given
        conn.adopt(running)
        self.stats["resumed"] += 1
        open_requests = running.open or []
        responses = list(running.partial or [])
        missing: list[wire.InputRequest] = []
        for request in open_requests:
            if request.key not in given:
                missing.append(request)
                continue
            problem = eras.input_response_problem(request.method, given[request.key])
            if problem is not None:
                self._refuse(conn, running, f"Invalid params: inputResponses[{request.key!r}]: {problem}")
                return None
            responses.append(wire.InputResponse(request.key, "result", given[request.key]))
        if missing:
            # Still not everything: ask again for what is missing; the call stays parked.
            running.partial, running.open = responses, missing
            new_park = self.parking.park_id()
            try:
                sealed = self._seal(running, new_park)
            except SealFailed as exc:
                self._refuse(conn, running, f"Invalid params: {exc}")
                return None
            conn.release(running)
            if not self.parking.park(running, new_park, ask):
                self.calls.cancel(running.call, running.handle, running.principal)
            return self.core.input_required(running.call, missing, sealed), None
        running.partial = running.open = None
        if self.calls.answer(running.call, running.handle, responses, to=ask):
            return None
        # It no longer waits on that round (the question timed out in the tool, which went on): these
        # answers are not for whatever it does now. Stop it; the tool runs again with the answers given.
        conn.release(running)
        self.calls.cancel(running.call, running.handle, running.principal)
        self.stats["resumed"] -= 1
        self.stats["rerun"] += 1
        log("parked_call_rerun", tool=call.entry.name, note="its question timed out before the retry; the tool runs again")
        conn.start(call, sink, given)
        return None


def _resumed_call(parked: ToolCall, retry: ToolCall) -> ToolCall:
    """The parked call, now answering the retry's request (its id, its progress token and log level)."""
    return msgspec.structs.replace(parked, id_bytes=retry.id_bytes, request_id=retry.request_id, progress_token=retry.progress_token,
                   log_level=retry.log_level, client_caps=retry.client_caps)
