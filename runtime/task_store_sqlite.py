"""The SQLite task store: one file (WAL mode), the default, shareable by the daemons of one machine.

Every statement runs on one dedicated thread that owns the connection (``BatchThread``), so the
trio loop never blocks. The writes that arrive together are one ``BEGIN IMMEDIATE`` transaction
(group commit), each in a savepoint of its own: the transaction takes SQLite's write lock before
anything is read, so two daemons sharing the file cannot both pass the same check (the live-task
cap, the compare-and-set of a transition, a mailbox's cap). A write is committed before its call
returns; with ``synchronous=NORMAL`` in WAL mode a committed write survives the death of the
process (the power failing may lose the last moments).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import outcome

from runtime.batch_thread import BatchThread
from runtime.task_store import (
    MAX_CATALOG_FIELD_CHARS,
    MAX_CATALOGS_COMPARED,
    TERMINAL,
    UNSET,
    Limits,
    Mailboxes,
    OwnerVerdict,
    Page,
    TaskCapReached,
    TaskExists,
    TaskMailboxFull,
    TaskRecord,
    TaskIds,
    TaskStatus,
    CorruptTaskRecord,
    _Unset,
    corrupt_record,
    decode_cursor,
    decode_record,
    encode_cursor,
    orphan_error,
    report_corrupt,
    unavailable_error,
)

T = TypeVar("T")
SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tasks (
    task_id TEXT PRIMARY KEY,
    principal TEXT NOT NULL,
    tool TEXT NOT NULL,
    era TEXT NOT NULL,
    status TEXT NOT NULL,
    status_message TEXT,
    created_at_ms INTEGER NOT NULL,
    updated_at_ms INTEGER NOT NULL,
    ttl_ms INTEGER,
    expires_at_ms INTEGER,
    poll_interval_ms INTEGER,
    owner TEXT NOT NULL,
    result BLOB,
    error BLOB,
    input_requests BLOB
);
CREATE INDEX IF NOT EXISTS tasks_by_principal ON tasks (principal, created_at_ms, task_id);
CREATE INDEX IF NOT EXISTS tasks_by_created ON tasks (created_at_ms, task_id);
CREATE INDEX IF NOT EXISTS tasks_by_expiry ON tasks (expires_at_ms) WHERE expires_at_ms IS NOT NULL;
CREATE INDEX IF NOT EXISTS live_tasks_by_owner ON tasks (owner) WHERE status IN ('working', 'input_required');
CREATE INDEX IF NOT EXISTS live_tasks_by_principal ON tasks (principal, expires_at_ms, status)
    WHERE status IN ('working', 'input_required');
CREATE TABLE IF NOT EXISTS mailbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    task_id TEXT NOT NULL,
    message BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS mailbox_by_task ON mailbox (task_id, seq);
CREATE TABLE IF NOT EXISTS owners (
    owner TEXT PRIMARY KEY,
    heartbeat_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS catalogs (
    owner TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    seen_ms INTEGER NOT NULL
);
"""

_LIVE_SQL = "status IN ('working', 'input_required')"
_UNEXPIRED_SQL = "(expires_at_ms IS NULL OR expires_at_ms >= ?)"
_HEAD_COLUMNS = ("task_id, principal, tool, era, status, status_message, created_at_ms, updated_at_ms, ttl_ms, "
                 "poll_interval_ms, owner")
_COLUMNS = _HEAD_COLUMNS + ", result, error, input_requests"
_HEARTBEAT_SQL = ("INSERT INTO owners (owner, heartbeat_ms) VALUES (?, ?) ON CONFLICT (owner) DO UPDATE "
                  "SET heartbeat_ms = max(heartbeat_ms, excluded.heartbeat_ms)")
#: A job for the store's thread: a function of the connection, and whether it writes.
_Job = tuple[Callable[[sqlite3.Connection], Any], bool]
#: SQLite's default bound on ``?`` parameters in one statement is 999 in old builds.
_CHUNK = 500


def _record(row: Sequence[Any]) -> TaskRecord:
    """The record of a row (``_COLUMNS`` or ``_HEAD_COLUMNS``), checked; CorruptTaskRecord if it is not
    one a daemon writes (SQLite keeps whatever type it is given in any column)."""
    return decode_record(*row)


def _record_by_id(row: Sequence[Any], task_id: str, principal: str | None) -> TaskRecord:
    """A row read by id: its record, or ``corrupt_record`` (``principal`` None: the row's, if text)."""
    try:
        return _record(row)
    except CorruptTaskRecord as exc:
        owner = principal if principal is not None else row[1] if type(row[1]) is str else ""
        return corrupt_record(task_id, owner, str(exc), row[6])


def _write(conn: sqlite3.Connection, body: Callable[[sqlite3.Connection], T]) -> T:
    """Run ``body`` in a ``BEGIN IMMEDIATE`` transaction: committed, or rolled back if it raises."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        value = body(conn)
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return value


class SqliteTaskStore:
    """A ``TaskStore`` in one SQLite file. Open it with ``SqliteTaskStore.open`` (or ``open_task_store``)."""

    def __init__(self, path: str, limits: Limits, clock_ms: Callable[[], int]) -> None:
        self.path = path
        self.limits = limits
        self._clock_ms = clock_ms
        self._conn: sqlite3.Connection | None = None
        self._thread: BatchThread[_Job] = BatchThread(
            f"task-store-sqlite:{os.path.basename(path)}", self._run_batch, on_close=self._close,
            translate=unavailable_error(path, (sqlite3.Error, OSError)))

    @classmethod
    async def open(cls, path: str, *, limits: Limits, clock_ms: Callable[[], int]) -> SqliteTaskStore:
        """Open (creating if needed, readable by this user only) the store file at ``path``."""
        store = cls(path, limits, clock_ms)
        try:
            await store._thread.run((store._connect, False))
        except BaseException:
            await store._thread.aclose()
            raise
        return store

    # -- the thread side ---------------------------------------------------------------------------

    def _connect(self, _: sqlite3.Connection) -> None:
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        # Results may be private: the file (and the -wal/-shm files SQLite gives the same mode) is ours only.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(f"{self.path}: task store schema {version} is newer than this toolcell "
                                   f"understands ({SCHEMA_VERSION})")

            def migrate(c: sqlite3.Connection) -> None:
                for statement in _SCHEMA.split(";"):  # not executescript: it would commit on its own
                    if statement.strip():
                        c.execute(statement)
                c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

            _write(conn, migrate)
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def _run_batch(self, jobs: Sequence[_Job]) -> list[outcome.Outcome[Any]]:
        """Reads run as they are; a batch with writes is one transaction (group commit), each write in a
        savepoint of its own, so one that raises is undone alone and the others still commit."""
        conn = cast(sqlite3.Connection, self._conn)
        if not any(write for _, write in jobs):
            return [outcome.capture(fn, conn) for fn, _ in jobs]
        try:
            conn.execute("BEGIN IMMEDIATE")
        except Exception as exc:
            return [outcome.Error(exc) for _ in jobs]
        results: list[outcome.Outcome[Any]] = []
        for fn, write in jobs:
            if not write:
                results.append(outcome.capture(fn, conn))
                continue
            conn.execute("SAVEPOINT job")
            result = outcome.capture(fn, conn)
            if isinstance(result, outcome.Error):
                conn.execute("ROLLBACK TO job")
            conn.execute("RELEASE job")
            results.append(result)
        try:
            conn.execute("COMMIT")
        except Exception as exc:  # nothing of the batch happened: every job hears so
            with contextlib.suppress(Exception):
                conn.execute("ROLLBACK")
            return [outcome.Error(exc) for _ in jobs]
        return results

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def _run(self, fn: Callable[[sqlite3.Connection], T], write: bool = False) -> T:
        """Run ``fn`` on the store's thread; ``write``: inside the batch's write transaction."""
        return cast(T, await self._thread.run((fn, write)))

    # -- the interface -----------------------------------------------------------------------------

    async def create(self, rec: TaskRecord, max_live_per_principal: int) -> None:
        self.limits.check_new(rec, max_live_per_principal)

        def body(conn: sqlite3.Connection) -> None:
            (live,) = conn.execute(f"SELECT count(*) FROM tasks WHERE principal = ? AND {_LIVE_SQL} AND {_UNEXPIRED_SQL}",
                                   (rec.principal, rec.created_at_ms)).fetchone()
            if live >= max_live_per_principal:
                raise TaskCapReached(f"this principal already has {live} unfinished tasks (the limit is "
                                     f"{max_live_per_principal})")
            try:
                conn.execute(f"INSERT INTO tasks ({_COLUMNS}, expires_at_ms) VALUES ({', '.join('?' * 15)})",
                             (rec.task_id, rec.principal, rec.tool, rec.era, rec.status, rec.status_message,
                              rec.created_at_ms, rec.updated_at_ms, rec.ttl_ms, rec.poll_interval_ms, rec.owner,
                              rec.result, rec.error, rec.input_requests, rec.expires_at_ms))
            except sqlite3.IntegrityError:
                raise TaskExists(f"task {rec.task_id} already exists") from None
            conn.execute(_HEARTBEAT_SQL, (rec.owner, rec.created_at_ms))

        await self._run(body, write=True)

    async def get(self, task_id: str, principal: str) -> TaskRecord | None:
        now_ms = self._clock_ms()

        def read(conn: sqlite3.Connection) -> TaskRecord | None:
            row = conn.execute(f"SELECT {_COLUMNS} FROM tasks WHERE task_id = ? AND principal = ? AND {_UNEXPIRED_SQL}",
                               (task_id, principal, now_ms)).fetchone()
            return None if row is None else _record_by_id(row, task_id, principal)

        return await self._run(read)

    async def inspect(self, task_id: str) -> TaskRecord | None:
        now_ms = self._clock_ms()

        def read(conn: sqlite3.Connection) -> TaskRecord | None:
            row = conn.execute(f"SELECT {_COLUMNS} FROM tasks WHERE task_id = ? AND {_UNEXPIRED_SQL}",
                               (task_id, now_ms)).fetchone()
            return None if row is None else _record_by_id(row, task_id, None)

        return await self._run(read)

    async def transition(self, task_id: str, *, status: TaskStatus, now_ms: int,
                         status_message: str | None | _Unset = UNSET, result: bytes | None | _Unset = UNSET,
                         error: bytes | None | _Unset = UNSET,
                         input_requests: bytes | None | _Unset = UNSET) -> TaskRecord | None:
        self.limits.check_transition(status, status_message, result, error, input_requests)
        sets = ["status = ?", "updated_at_ms = ?"]
        values: list[Any] = [status, now_ms]
        for column, value in (("status_message", status_message), ("result", result), ("error", error),
                              ("input_requests", input_requests)):
            if value is not UNSET:
                sets.append(f"{column} = ?")
                values.append(value)
        clock_now = self._clock_ms()

        def body(conn: sqlite3.Connection) -> TaskRecord | None:
            changed = conn.execute(f"UPDATE tasks SET {', '.join(sets)} WHERE task_id = ? AND {_LIVE_SQL} AND "
                                   f"{_UNEXPIRED_SQL}", (*values, task_id, clock_now)).rowcount
            if not changed:
                return None
            if status in TERMINAL:
                conn.execute("DELETE FROM mailbox WHERE task_id = ?", (task_id,))
            row = conn.execute(f"SELECT {_COLUMNS} FROM tasks WHERE task_id = ?", (task_id,)).fetchone()
            return _record_by_id(row, task_id, None)

        return await self._run(body, write=True)

    async def list(self, principal: str, cursor: str | None, limit: int) -> Page:
        return await self._page("principal = ? AND ", (principal,), cursor, limit)

    async def list_all(self, cursor: str | None, limit: int) -> Page:
        return await self._page("", (), cursor, limit)

    async def _page(self, where: str, args: tuple[Any, ...], cursor: str | None,
                    limit: int) -> Page:
        """Keyset pagination on (created_at_ms, task_id), newest first; payload columns are not read.
        Corrupt rows are skipped (logged once): reading goes on past them, from their raw key, until
        the page is full, so the cursor is always a good record's."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        after: tuple[Any, ...] | None = decode_cursor(cursor) if cursor is not None else None
        now_ms = self._clock_ms()
        head = f"SELECT {_HEAD_COLUMNS} FROM tasks WHERE {where}{_UNEXPIRED_SQL}"
        order = " ORDER BY created_at_ms DESC, task_id DESC LIMIT ?"

        def read(conn: sqlite3.Connection) -> list[TaskRecord]:
            found: list[TaskRecord] = []
            key = after
            while True:
                want = limit + 1 - len(found)
                if key is None:
                    rows = conn.execute(head + order, (*args, now_ms, want)).fetchall()
                else:
                    rows = conn.execute(head + " AND (created_at_ms, task_id) < (?, ?)" + order,
                                        (*args, now_ms, *key, want)).fetchall()
                for row in rows:
                    try:
                        found.append(_record(row))
                    except CorruptTaskRecord as exc:
                        report_corrupt(str(row[0]), str(exc))
                if len(rows) < want or len(found) > limit:
                    return found
                key = (rows[-1][6], rows[-1][0])

        rows = await self._run(read)
        page = rows[:limit]
        more = len(rows) > limit
        return page, encode_cursor(page[-1].created_at_ms, page[-1].task_id) if more else None

    async def post(self, task_id: str, message: bytes) -> bool:
        self.limits.check_payload("message", message)
        now_ms = self._clock_ms()
        cap = self.limits.mailbox_max_messages

        def body(conn: sqlite3.Connection) -> bool:
            row = conn.execute(f"SELECT 1 FROM tasks WHERE task_id = ? AND {_LIVE_SQL} AND {_UNEXPIRED_SQL}",
                               (task_id, now_ms)).fetchone()
            if row is None:
                return False
            (waiting,) = conn.execute("SELECT count(*) FROM mailbox WHERE task_id = ?", (task_id,)).fetchone()
            if waiting >= cap:
                raise TaskMailboxFull(f"task {task_id} has {waiting} messages its daemon has not taken yet")
            conn.execute("INSERT INTO mailbox (task_id, message) VALUES (?, ?)", (task_id, message))
            return True

        return await self._run(body, write=True)

    async def take(self, task_ids: TaskIds) -> Mailboxes:
        if not task_ids:
            return {}

        def select(conn: sqlite3.Connection, ids: Sequence[str]) -> list[tuple[int, str, bytes]]:
            return conn.execute(f"SELECT seq, task_id, message FROM mailbox WHERE task_id IN "
                                f"({', '.join('?' * len(ids))}) ORDER BY seq", list(ids)).fetchall()

        def waiting(conn: sqlite3.Connection) -> list[str]:
            found: list[str] = []
            for start in range(0, len(task_ids), _CHUNK):
                ids = task_ids[start:start + _CHUNK]
                found += [r[0] for r in conn.execute(f"SELECT DISTINCT task_id FROM mailbox WHERE task_id IN "
                                                     f"({', '.join('?' * len(ids))})", ids)]
            return found

        # The common case, nothing waiting, is answered by a read, without the write lock.
        ids = await self._run(waiting)
        if not ids:
            return {}

        def drain(conn: sqlite3.Connection) -> dict[str, list[bytes]]:
            taken: dict[str, list[bytes]] = {}
            for start in range(0, len(ids), _CHUNK):
                rows = select(conn, ids[start:start + _CHUNK])
                for _, task_id, message in rows:
                    taken.setdefault(task_id, []).append(message)
                seqs = [seq for seq, _, _ in rows]
                for i in range(0, len(seqs), _CHUNK):
                    chunk = seqs[i:i + _CHUNK]
                    conn.execute(f"DELETE FROM mailbox WHERE seq IN ({', '.join('?' * len(chunk))})", chunk)
            return taken

        return await self._run(drain, write=True)

    async def heartbeat(self, owner: str, now_ms: int) -> None:
        def beat(conn: sqlite3.Connection) -> None:
            conn.execute(_HEARTBEAT_SQL, (owner, now_ms))

        await self._run(beat, write=True)

    async def compare_catalogs(self, owner: str, fingerprint: str, now_ms: int) -> dict[str, str]:
        stale_before = now_ms - self.limits.orphan_after_ms

        def compare(conn: sqlite3.Connection) -> dict[str, str]:
            conn.execute("INSERT INTO catalogs (owner, fingerprint, seen_ms) VALUES (?, ?, ?) ON CONFLICT (owner) "
                         "DO UPDATE SET fingerprint = excluded.fingerprint, seen_ms = excluded.seen_ms",
                         (owner, fingerprint, now_ms))
            conn.execute("DELETE FROM catalogs WHERE seen_ms < ?", (stale_before,))
            rows = conn.execute("SELECT owner, fingerprint FROM catalogs WHERE owner != ? AND length(owner) <= ? "
                                "AND length(fingerprint) <= ? LIMIT ?",
                                (owner, MAX_CATALOG_FIELD_CHARS, MAX_CATALOG_FIELD_CHARS,
                                 MAX_CATALOGS_COMPARED)).fetchall()
            return {owner: fingerprint, **{o: f for o, f in rows if type(o) is str and type(f) is str}}

        return await self._run(compare, write=True)

    async def forget_catalog(self, owner: str) -> None:
        def forget(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM catalogs WHERE owner = ?", (owner,))

        await self._run(forget, write=True)

    async def recover_orphans(self, owner_alive: OwnerVerdict | None, now_ms: int, reason: str) -> int:
        stale_before = now_ms - self.limits.orphan_after_ms

        def owners(conn: sqlite3.Connection) -> list[tuple[str, int | None]]:
            return conn.execute(f"SELECT DISTINCT t.owner, o.heartbeat_ms FROM tasks AS t LEFT JOIN owners AS o "
                                f"ON o.owner = t.owner WHERE t.{_LIVE_SQL}").fetchall()

        condemned: list[tuple[str, bool]] = []  # (owner, judged by its heartbeat)
        for owner, beat in await self._run(owners):
            # Read back, so of any type: an owner not text is judged by its heartbeat, one not a number is stale.
            verdict = owner_alive(owner) if owner_alive is not None and type(owner) is str else None
            if verdict is False:
                condemned.append((owner, False))
            elif verdict is None and (type(beat) is not int or beat < stale_before):
                condemned.append((owner, True))
        message, error = orphan_error(reason)

        def body(conn: sqlite3.Connection) -> int:
            failed = 0
            for owner, by_heartbeat in condemned:
                if by_heartbeat:  # a heartbeat may have arrived since it was read: judge again under the lock
                    row = conn.execute("SELECT heartbeat_ms FROM owners WHERE owner = ?", (owner,)).fetchone()
                    if row is not None and type(row[0]) is int and row[0] >= stale_before:
                        continue
                ids = [r[0] for r in conn.execute(f"SELECT task_id FROM tasks WHERE owner = ? AND {_LIVE_SQL}",
                                                  (owner,))]
                for i in range(0, len(ids), _CHUNK):
                    chunk = ids[i:i + _CHUNK]
                    marks = ", ".join("?" * len(chunk))
                    failed += conn.execute(f"UPDATE tasks SET status = 'failed', status_message = ?, error = ?, "
                                           f"updated_at_ms = ? WHERE task_id IN ({marks}) AND {_LIVE_SQL}",
                                           (message, error, now_ms, *chunk)).rowcount
                    conn.execute(f"DELETE FROM mailbox WHERE task_id IN ({marks})", chunk)
            # Owners long silent with nothing left running are forgotten.
            conn.execute(f"DELETE FROM owners WHERE heartbeat_ms < ? AND NOT EXISTS (SELECT 1 FROM tasks WHERE "
                         f"tasks.owner = owners.owner AND tasks.{_LIVE_SQL})", (stale_before,))
            return failed

        return await self._run(body, write=True)

    async def expire(self, now_ms: int) -> int:
        def body(conn: sqlite3.Connection) -> int:
            conn.execute("DELETE FROM mailbox WHERE task_id IN (SELECT task_id FROM tasks WHERE expires_at_ms < ?)",
                         (now_ms,))
            return int(conn.execute("DELETE FROM tasks WHERE expires_at_ms < ?", (now_ms,)).rowcount)

        return await self._run(body, write=True)

    async def aclose(self) -> None:
        await self._thread.aclose()

