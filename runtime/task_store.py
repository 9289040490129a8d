"""The durable task store: where MCP tasks (long-running tool calls) live between polls.

One small async interface, :class:`TaskStore`, with two backends:

- SQLite (``runtime.task_store_sqlite``), the default: one file in the daemon's state dir, which
  several daemons on one machine may share;
- Redis (``runtime.task_store_redis``), shared by daemons on several machines.

The rules both keep:

- A task belongs to the principal that created it. Every client-facing read (``get``, ``list``)
  is scoped by principal; another principal's task reads exactly like an unknown one.
- Terminal states (completed, failed, cancelled) never change: ``transition`` is a compare-and-set
  that applies only to a task that exists and is not terminal, so of two racing transitions
  exactly one wins.
- A principal holds at most ``max_live_per_principal`` non-terminal tasks (checked and inserted
  atomically).
- A task lives ``ttl_ms`` after its creation; after that it reads as unknown and ``expire``
  deletes it with its result and mailbox.
- Each task is run by one daemon, its *owner*, which heartbeats. A non-terminal task whose owner
  is gone (no heartbeat for ``orphan_after_ms``, or known dead) is made ``failed`` by
  ``recover_orphans``, run by any daemon at start-up and periodically, so a task never stays
  ``working`` after its daemon died.
- Other daemons reach a task's owner through the task's mailbox (``post``; the owner ``take``s):
  cancel requests and input responses may arrive at any daemon.
- What is read back is not trusted (another daemon version, a bug, or anyone with access to Redis
  or the file may have written it): every record goes through ``decode_record``, which checks each
  field's type and range, the status, and that each JSON payload is one value of its shape with no
  raw line break (the daemon splices payloads into its messages, and over stdio a line is a
  message). A record that fails is *corrupt*: reads by id (``get``, ``inspect``, ``transition``)
  answer ``corrupt_record``, a failed task whose error says so; listings skip it.

``runtime.task_store_open`` opens the backend a ``tasks.store`` URL names.

Times are wall-clock milliseconds since the epoch (``createdAt`` is a date on the wire) and are
passed in by the caller where a write depends on them; reads compare with the store's
``clock_ms``, which tests replace.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import os
import re
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any, Final, Literal, Protocol, cast

import msgspec

from runtime.logs import log
from runtime.protocol.errors import INTERNAL_ERROR

TaskStatus = Literal["working", "input_required", "completed", "failed", "cancelled"]
TERMINAL: Final = frozenset({"completed", "failed", "cancelled"})
LIVE: Final = frozenset({"working", "input_required"})
STATUSES: Final = LIVE | TERMINAL

#: Task ids are 24 URL-safe characters from 18 random bytes; the store accepts any id of this shape.
TASK_ID_RE: Final = re.compile(r"^[A-Za-z0-9_-]{8,128}$")
DEFAULT_MAX_PAYLOAD_BYTES: Final = 8 * 1024 * 1024
DEFAULT_ORPHAN_AFTER_MS: Final = 20_000
DEFAULT_MAILBOX_MAX_MESSAGES: Final = 256
SQLITE_FILE_NAME: Final = "tasks.sqlite3"
#: A task whose daemon stopped ends failed with the table's internal-error code.
ORPHAN_ERROR_CODE: Final = INTERNAL_ERROR


class TaskRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One task as stored. JSON payloads are kept as the bytes the daemon encoded."""

    task_id: str
    #: Who created it ("" = anonymous or local); every client-facing read is scoped by it.
    principal: str
    tool: str
    #: The protocol revision it was created under: "2025-11-25" or "2026-07-28".
    era: str
    status: TaskStatus
    status_message: str | None = None
    created_at_ms: int
    updated_at_ms: int
    #: Lifetime after creation; None = unlimited (the daemon caps what clients ask for).
    ttl_ms: int | None
    poll_interval_ms: int | None = None
    #: The id of the daemon instance running it (see ``new_owner_id`` and ``recover_orphans``).
    owner: str
    #: JSON of the final result (completed, or failed with a result).
    result: bytes | None = None
    #: JSON of a JSON-RPC error object (failed).
    error: bytes | None = None
    #: JSON of the pending input requests (input_required).
    input_requests: bytes | None = None

    @property
    def expires_at_ms(self) -> int | None:
        """When it stops existing: ``created_at_ms + ttl_ms``, or None if unlimited."""
        return None if self.ttl_ms is None else self.created_at_ms + self.ttl_ms

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


class TaskStoreError(Exception):
    """A task store refused an operation; the message says why, for the log or the client."""


class TaskCapReached(TaskStoreError):
    """The principal already has as many non-terminal tasks as it may."""


class TaskPayloadTooLarge(TaskStoreError, ValueError):
    """A result, error, input-request set or mailbox message is over the store's size limit."""


class TaskMailboxFull(TaskStoreError):
    """The task's owner has not taken its messages and the mailbox is at its cap."""


class TaskExists(TaskStoreError):
    """``create`` was given an id that is already stored."""


class CorruptTaskRecord(ValueError):
    """A record read back from the store is not one a daemon writes; the message says which field
    (never its content, which may be anything)."""


class TaskStoreUnavailable(TaskStoreError):
    """The backend failed (Redis unreachable, the SQLite file locked too long or damaged): the
    operation did not happen, or its outcome is unknown; try again later. The cause is chained."""


def unavailable_error(where: str, kinds: tuple[type[Exception], ...]) -> Callable[[Exception], Exception]:
    """A ``translate`` for a backend's thread: its client's errors (``kinds``) become TaskStoreUnavailable."""

    def translate(exc: Exception) -> Exception:
        if isinstance(exc, TaskStoreError) or not isinstance(exc, kinds):
            return exc
        err = TaskStoreUnavailable(f"the task store ({where}) failed: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        return err

    return translate


class _Unset:
    """A keyword argument that was not given (None means "clear the field")."""

    _instance: _Unset | None = None

    def __new__(cls) -> _Unset:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()
OwnerVerdict = Callable[[str], bool | None]
#: (In aliases because ``TaskStore.list`` shadows the builtin inside the class.)
Page = tuple[list[TaskRecord], str | None]
TaskIds = list[str]
Mailboxes = dict[str, list[bytes]]


class TaskStore(Protocol):
    """A durable task store. All methods are trio-async and safe to call concurrently, from one
    daemon or from several sharing the backend."""

    async def create(self, rec: TaskRecord, max_live_per_principal: int) -> None:
        """Store a new non-terminal task, durably, before returning (so ``get`` resolves it).

        Raises TaskCapReached if its principal already has ``max_live_per_principal`` non-terminal
        tasks (checked and inserted atomically), TaskExists for a duplicate id, TaskPayloadTooLarge,
        and ValueError for a malformed record. Creating a task also counts as its owner's heartbeat.
        """
        ...

    async def get(self, task_id: str, principal: str) -> TaskRecord | None:
        """The task, or None if it is unknown, expired, or another principal's."""
        ...

    async def transition(self, task_id: str, *, status: TaskStatus, now_ms: int,
                         status_message: str | None | _Unset = UNSET, result: bytes | None | _Unset = UNSET,
                         error: bytes | None | _Unset = UNSET,
                         input_requests: bytes | None | _Unset = UNSET) -> TaskRecord | None:
        """Compare-and-set: apply the new status (and the fields given; None clears one) only if the
        task exists, has not expired and is not terminal. Returns the new record, or None when
        nothing changed. A terminal status also empties the task's mailbox."""
        ...

    async def list(self, principal: str, cursor: str | None, limit: int) -> Page:
        """One page of the principal's live (unexpired) tasks, newest first, and the cursor of the next
        page (None at the end). Cursors are opaque; a malformed one raises ValueError."""
        ...

    async def post(self, task_id: str, message: bytes) -> bool:
        """Leave a message (a cancel request, input responses) for the task's owner, from any daemon.
        False if the task is unknown or terminal (nothing is delivered). Raises TaskMailboxFull,
        TaskPayloadTooLarge."""
        ...

    async def take(self, task_ids: TaskIds) -> Mailboxes:
        """Drain the mailboxes of these tasks (the owner's call; non-blocking): id -> messages in the
        order posted, only for ids that had any. Each message is taken exactly once."""
        ...

    async def recover_orphans(self, owner_alive: OwnerVerdict | None, now_ms: int, reason: str) -> int:
        """Fail the non-terminal tasks whose owner is gone; return how many.

        For each owner that has such tasks, ``owner_alive(owner)`` is asked first: True spares it,
        False condemns it, None (or no callable) leaves it to the heartbeat: gone if its last
        heartbeat is older than ``now_ms - orphan_after_ms``. A failed orphan carries the JSON-RPC
        error ``{"code": -32603, "message": "the daemon running this task stopped before it
        finished (<reason>)"}``.
        """
        ...

    async def expire(self, now_ms: int) -> int:
        """Delete the tasks (and their mailboxes) with ``created_at_ms + ttl_ms < now_ms``; return how many."""
        ...

    async def heartbeat(self, owner: str, now_ms: int) -> None:
        """The owner says it is alive."""
        ...

    async def compare_catalogs(self, owner: str, fingerprint: str, now_ms: int) -> dict[str, str]:
        """Record the fingerprint of the catalog ``owner`` serves; return the fingerprints of every
        daemon sharing the store that heartbeated within ``orphan_after_ms`` (``owner`` included), so
        that replicas behind one balancer can tell when their plugins differ. What others wrote is read
        back within bounds: at most ``MAX_CATALOGS_COMPARED`` others, each owner id and fingerprint at
        most ``MAX_CATALOG_FIELD_CHARS`` (longer ones are not a daemon's: skipped)."""
        ...

    async def forget_catalog(self, owner: str) -> None:
        """``owner`` stops serving (a clean exit): its fingerprint goes at once, so that the daemons
        still serving do not count it as a replica with another catalog until it falls silent."""
        ...

    async def inspect(self, task_id: str) -> TaskRecord | None:
        """Operator view (``toolcell tasks show``): the task whatever its principal, unless expired.
        Never reachable from a client request."""
        ...

    async def list_all(self, cursor: str | None, limit: int) -> Page:
        """Operator view (``toolcell tasks``): every principal's unexpired tasks, newest first."""
        ...

    async def aclose(self) -> None:
        """Release the connection (and thread); the store is unusable afterwards."""
        ...


# -- helpers the backends share --------------------------------------------------------------------


def wall_clock_ms() -> int:
    """Milliseconds since the epoch (the default ``clock_ms`` of a store)."""
    return time.time_ns() // 1_000_000


def new_task_id() -> str:
    """An unguessable task id: 18 random bytes, 24 URL-safe characters, never beginning with ``-``
    (on a command line, ``toolcell tasks show -abc`` would read as an option)."""
    while True:
        task_id = secrets.token_urlsafe(18)
        if task_id[0] != "-":
            return task_id


#: ``compare_catalogs``: how many other daemons' fingerprints are read back, and how long an owner id or
#: a fingerprint may be (a real one: ``host:pid:nonce`` and 64 hex digits). Whoever can write to the store
#: must not make every replica read, log and show (``/healthz``) megabytes at every heartbeat.
MAX_CATALOGS_COMPARED = 256
MAX_CATALOG_FIELD_CHARS = 300


def new_owner_id() -> str:
    """This daemon instance's owner id, ``host:pid:nonce`` (``local_owner_verdict`` reads it back)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def local_owner_verdict(me: str) -> OwnerVerdict:
    """An ``owner_alive`` for ``recover_orphans``: ``me`` is alive; an owner on this host whose pid is
    gone is dead at once (a restart after a crash need not wait for its heartbeat to go stale);
    anything else (another host, a pid that exists, perhaps reused) is left to the heartbeat. Daemons
    that share a host name must share a pid namespace (containers have host names of their own)."""
    host = socket.gethostname()

    def verdict(owner: str) -> bool | None:
        if owner == me:
            return True
        parts = owner.rsplit(":", 2)
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            return None
        try:
            os.kill(int(parts[1]), 0)
        except ProcessLookupError:
            return False
        except (OSError, OverflowError):  # not ours to judge; a pid beyond the range (a tampered owner)
            return None
        return None

    return verdict


def orphan_error(reason: str) -> tuple[str, bytes]:
    """The status message and JSON-RPC error object given to a task whose daemon stopped."""
    message = "the daemon running this task stopped before it finished"
    if reason:
        message += f" ({reason})"
    return message, msgspec.json.encode({"code": ORPHAN_ERROR_CODE, "message": message})


# -- reading records back (untrusted) ---------------------------------------------------------------

CORRUPT_MESSAGE: Final = "the stored task record is corrupt"
_MAX_INT: Final = 2**63 - 1
#: 9999-12-31T23:59:59.999Z: the last instant an ISO date (``createdAt``) can show.
_MAX_TIME_MS: Final = 253_402_300_799_999


class _StoredError(msgspec.Struct):
    """A JSON-RPC error object as stored (other members, ``data`` included, are skipped but must parse)."""

    code: int
    message: str


#: One decoder per payload; ``Raw`` leaves are syntax-checked without building their objects.
_PAYLOAD_DECODERS: Final[dict[str, msgspec.json.Decoder[Any]]] = {
    "result": msgspec.json.Decoder(dict[str, msgspec.Raw]),
    "error": msgspec.json.Decoder(_StoredError),
    # ``{key: {"method", "params"}}`` as ``runtime.tasks`` writes it; it reads each question defensively
    # (``_stored_requests`` drops one it cannot ask), so an object of objects is all that is required.
    "input_requests": msgspec.json.Decoder(dict[str, dict[str, msgspec.Raw]]),
}


def check_stored_payload(what: str, data: object) -> bytes | None:
    """``data`` if it is None or one JSON value of the shape ``what`` (result, error, input_requests)
    has, in UTF-8, with no raw CR or LF (insignificant whitespace could hold them, and the daemon
    pastes these bytes into its messages); CorruptTaskRecord otherwise. Costs one decode."""
    if data is None:
        return None
    if type(data) is not bytes:
        raise CorruptTaskRecord(f"{what}: not bytes")
    if b"\n" in data or b"\r" in data:
        raise CorruptTaskRecord(f"{what}: a raw line break")
    try:
        _PAYLOAD_DECODERS[what].decode(data)
        data.decode("utf-8")  # msgspec does not check the bytes of a Raw value
    except (msgspec.DecodeError, RecursionError, ValueError):
        raise CorruptTaskRecord(f"{what}: not JSON of the expected shape") from None
    return data


def _text(what: str, value: object, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if type(value) is not str:
        raise CorruptTaskRecord(f"{what}: not text")
    return value


def _number(what: str, value: object, top: int = _MAX_INT, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if type(value) is not int or not 0 <= value <= top:
        raise CorruptTaskRecord(f"{what}: not an integer in range")
    return value


def decode_record(task_id: object, principal: object, tool: object, era: object, status: object,
                  status_message: object, created_at_ms: object, updated_at_ms: object, ttl_ms: object,
                  poll_interval_ms: object, owner: object, result: object = None, error: object = None,
                  input_requests: object = None) -> TaskRecord:
    """A record from the values a backend read (Python values, SQLite's column order), checked: every
    field of its type and range, a known status, each payload by ``check_stored_payload``. Raises
    CorruptTaskRecord. The bytes are kept as stored (not re-encoded: large numbers stay exact)."""
    checked_id = _text("task_id", task_id)
    if not TASK_ID_RE.match(cast(str, checked_id)):
        raise CorruptTaskRecord("task_id: not a task id")
    if status not in STATUSES:
        raise CorruptTaskRecord("status: not a known status")
    return TaskRecord(
        task_id=cast(str, checked_id), principal=cast(str, _text("principal", principal)),
        tool=cast(str, _text("tool", tool)), era=cast(str, _text("era", era)), status=cast(TaskStatus, status),
        status_message=_text("status_message", status_message, optional=True),
        created_at_ms=cast(int, _number("created_at_ms", created_at_ms, _MAX_TIME_MS)),
        updated_at_ms=cast(int, _number("updated_at_ms", updated_at_ms, _MAX_TIME_MS)),
        ttl_ms=_number("ttl_ms", ttl_ms, optional=True),
        poll_interval_ms=_number("poll_interval_ms", poll_interval_ms, optional=True),
        owner=cast(str, _text("owner", owner)),
        result=check_stored_payload("result", result), error=check_stored_payload("error", error),
        input_requests=check_stored_payload("input_requests", input_requests))


_reported: set[str] = set()


def report_corrupt(task_id: str, problem: str) -> None:
    """Log a corrupt record once per task (per process; the set is bounded)."""
    if task_id in _reported:
        return
    if len(_reported) >= 4096:
        _reported.clear()
    _reported.add(task_id)
    log("task_record_corrupt", level="error", task=task_id[:128], problem=problem[:200])


def corrupt_record(task_id: str, principal: str, problem: str, created_at_ms: object = 0) -> TaskRecord:
    """What a read by id answers for a corrupt record: a failed task (terminal, so nobody polls it until
    its ttl) with the internal error ``CORRUPT_MESSAGE``, keeping only the id and principal asked for.
    Logged once."""
    report_corrupt(task_id, problem)
    created = 0
    with contextlib.suppress(CorruptTaskRecord):
        created = cast(int, _number("created_at_ms", created_at_ms, _MAX_TIME_MS))
    return TaskRecord(task_id=task_id, principal=principal, tool="", era="", status="failed",
                      status_message=CORRUPT_MESSAGE, created_at_ms=created, updated_at_ms=created, ttl_ms=None,
                      owner="", error=msgspec.json.encode({"code": INTERNAL_ERROR, "message": CORRUPT_MESSAGE}))


class _Cursor(msgspec.Struct, array_like=True, frozen=True):
    created_at_ms: int
    task_id: str


_encode_cursor = msgspec.msgpack.Encoder().encode
_decode_cursor = msgspec.msgpack.Decoder(_Cursor).decode


def encode_cursor(created_at_ms: int, task_id: str) -> str:
    """An opaque cursor: the (created, id) key of the last task on a page."""
    return base64.urlsafe_b64encode(_encode_cursor(_Cursor(created_at_ms, task_id))).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[int, str]:
    """The key inside a cursor; ValueError if it is not one of ours (a client sends it back: it may
    be anything, of any type or size)."""
    if not isinstance(cursor, str) or len(cursor) > 512:
        raise ValueError("invalid cursor")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        key = _decode_cursor(raw)
    except (binascii.Error, ValueError, msgspec.DecodeError):
        raise ValueError("invalid cursor") from None
    if key.created_at_ms < 0 or not TASK_ID_RE.match(key.task_id):
        raise ValueError("invalid cursor")
    return key.created_at_ms, key.task_id


class Limits(msgspec.Struct, frozen=True, kw_only=True):
    """Sizes and times a store enforces, the same for both backends."""

    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    orphan_after_ms: int = DEFAULT_ORPHAN_AFTER_MS
    mailbox_max_messages: int = DEFAULT_MAILBOX_MAX_MESSAGES

    def check_payload(self, what: str, data: bytes | str | None | _Unset) -> None:
        """Raise TaskPayloadTooLarge if ``data`` is over ``max_payload_bytes``."""
        if isinstance(data, (bytes, str)) and len(data) > self.max_payload_bytes:
            raise TaskPayloadTooLarge(f"the task's {what} is {len(data)} bytes, over the store's limit of "
                                      f"{self.max_payload_bytes} bytes (tasks.max_payload_bytes)")

    def check_new(self, rec: TaskRecord, max_live_per_principal: int) -> None:
        """Raise ValueError (or TaskPayloadTooLarge) for a record ``create`` must refuse."""
        if not TASK_ID_RE.match(rec.task_id):
            raise ValueError(f"task id {rec.task_id!r} is not 8-128 URL-safe characters")
        if rec.status not in LIVE:
            raise ValueError(f"a task is created working or input_required, not {rec.status}")
        if rec.ttl_ms is not None and rec.ttl_ms < 0:
            raise ValueError("ttl_ms must be >= 0 or None")
        if max_live_per_principal < 1:
            raise ValueError("max_live_per_principal must be >= 1")
        for what, data in (("status message", rec.status_message), ("result", rec.result), ("error", rec.error),
                           ("input requests", rec.input_requests)):
            self.check_payload(what, data)

    def check_transition(self, status: str, status_message: str | None | _Unset, result: bytes | None | _Unset,
                         error: bytes | None | _Unset, input_requests: bytes | None | _Unset) -> None:
        if status not in STATUSES:
            raise ValueError(f"unknown task status {status!r}")
        for what, data in (("status message", status_message), ("result", result), ("error", error),
                           ("input requests", input_requests)):
            self.check_payload(what, data)


# -- opening a store ---------------------------------------------------------------------------------


class StoreUrl(msgspec.Struct, frozen=True):
    """A parsed ``tasks.store`` setting: which backend, and where."""

    kind: Literal["sqlite", "redis"]
    #: The SQLite file, or the URL handed to redis-py.
    target: str


def redact_store_url(url: str) -> str:
    """A store URL as it may appear in a log or an error: no user, password or query (which may hold one)."""
    scheme, sep, rest = url.partition("://")
    rest = rest.split("?", 1)[0]
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


def parse_store_url(url: str | None, state_dir: str) -> StoreUrl:
    """Read a ``tasks.store`` value: None or "sqlite" -> ``tasks.sqlite3`` in ``state_dir``;
    ``sqlite:///abs/path``; ``redis://``, ``rediss://`` or ``unix://`` (redis-py's forms). ValueError otherwise."""
    if url is None or url == "sqlite":
        return StoreUrl("sqlite", os.path.join(state_dir, SQLITE_FILE_NAME))
    if url.startswith("sqlite://"):
        path = url[len("sqlite://"):]
        if not path.startswith("/") or path == "/":
            raise ValueError(f"task store {url!r}: write sqlite:///absolute/path/tasks.sqlite3")
        return StoreUrl("sqlite", path)
    if url.startswith(("redis://", "rediss://")):
        return StoreUrl("redis", url)
    if url.startswith("unix://"):
        if not url[len("unix://"):].startswith("/"):
            raise ValueError(f"task store {url!r}: write unix:///absolute/path/redis.sock")
        return StoreUrl("redis", url)
    raise ValueError(f"task store {url!r}: use sqlite, sqlite:///PATH, redis://HOST:PORT/DB, rediss://… "
                     "or unix:///PATH/redis.sock")
