"""What a task store reads back is untrusted (another daemon version, a bug, anyone with access to
Redis or the file may have written it). Records are tampered with directly in each backend (SQL on
the file, a raw Redis client), then read through the daemon-side API: nothing raises, a corrupt
record reads as a failed task (by id) or not at all (listings), and no stored byte that is not one
JSON value of its shape, without raw line breaks, reaches a message."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
from store_harness import FakeClock, OpenStore, record

from runtime.protocol import task_shapes
from runtime.protocol.errors import INTERNAL_ERROR
from runtime.protocol.task_shapes import TaskView
from runtime.task_store import CORRUPT_MESSAGE, TaskRecord, TaskStore, local_owner_verdict, new_owner_id

#: Members a 2026-07-28 ``tasks/get`` answer may have.
DETAILED_KEYS = {"resultType", "taskId", "status", "statusMessage", "createdAt", "lastUpdatedAt", "ttlMs",
                 "pollIntervalMs", "result", "error", "inputRequests"}


class Tamper:
    """Writes to a test's store behind the daemon's back."""

    def __init__(self, url: str, namespace: str) -> None:
        self.sqlite: sqlite3.Connection | None = None
        self.redis: redis.Redis | None = None
        self.ns = namespace
        if url.startswith("sqlite://"):
            self.sqlite = sqlite3.connect(url[len("sqlite://"):], isolation_level=None, timeout=10)
        else:
            self.redis = redis.Redis.from_url(url)

    def set(self, tid: str, /, **fields: Any) -> None:
        if self.sqlite is not None:
            for name, value in fields.items():
                self.sqlite.execute(f"UPDATE tasks SET {name} = ? WHERE task_id = ?", (value, tid))
        else:
            assert self.redis is not None
            for name, value in fields.items():
                self.redis.hset(f"{self.ns}:task:{tid}", name, value)

    def close(self) -> None:
        if self.sqlite is not None:
            self.sqlite.close()
        if self.redis is not None:
            self.redis.close()


@pytest.fixture
async def tamper(open_store: OpenStore) -> AsyncIterator[Tamper]:
    t = Tamper(open_store.url, open_store.namespace)
    yield t
    t.close()


#: Tests of what only Redis can hold (a hash missing a field, index members, the expiry index): they
#: run on Redis alone rather than being skipped on SQLite, whose NOT NULL columns and single table
#: have no such states. (A skip inside a trio test also lost its reason: pytest printed "Skipped".)
REDIS_ONLY = pytest.mark.parametrize("store_url", ["redis"], indirect=True)


def backend(open_store: OpenStore) -> str:
    return "sqlite" if open_store.url.startswith("sqlite://") else "redis"


def view(rec: TaskRecord) -> TaskView:
    """As ``runtime.tasks`` shows a record on the wire."""
    return TaskView(task_id=rec.task_id, status=rec.status, status_message=rec.status_message,
                    created_at_ms=rec.created_at_ms, updated_at_ms=rec.updated_at_ms, ttl_ms=rec.ttl_ms,
                    poll_interval_ms=rec.poll_interval_ms, result=rec.result, error=rec.error,
                    input_requests=rec.input_requests)


def assert_renders_safely(rec: TaskRecord, task_id: str) -> None:
    """Every shape the daemon builds from a record is one line of one JSON object about this task."""
    shapes = [task_shapes.modern_detailed(view(rec)), task_shapes.modern_detailed(view(rec), result_type=False),
              task_shapes.legacy_task(view(rec))]
    if rec.result is not None:
        shapes.append(task_shapes.with_related_task(rec.result, rec.task_id))
    for body in shapes:
        assert b"\n" not in body and b"\r" not in body, body
        obj = json.loads(body)
        assert isinstance(obj, dict)
    detailed = json.loads(shapes[0])
    assert set(detailed) <= DETAILED_KEYS and detailed["taskId"] == task_id


def assert_corrupt(rec: TaskRecord | None, task_id: str) -> None:
    assert rec is not None and rec.task_id == task_id
    assert rec.status == "failed" and rec.terminal  # nobody polls it until its ttl
    assert rec.result is None and rec.input_requests is None
    assert json.loads(rec.error or b"") == {"code": INTERNAL_ERROR, "message": CORRUPT_MESSAGE}
    assert_renders_safely(rec, task_id)


async def finished_task(store: TaskStore, clock: FakeClock, **fields: Any) -> TaskRecord:
    rec = record(created_at_ms=clock.now_ms)
    await store.create(rec, 100)
    done = await store.transition(rec.task_id, now_ms=clock.now_ms, **fields)
    assert done is not None
    return done


# A newline between tokens is valid JSON, but over stdio it ends the message; a payload that closes its
# object early forges members (another id, say) of the message it is pasted into.
FORGED_LINE = b'{"content":[]}\n'
FORGED_MEMBERS = b'{"content":[]},"id":99,"x":{}'


@pytest.mark.parametrize("payload", [FORGED_LINE, FORGED_MEMBERS, b"[1, 2]", b"\xff", b'{"content":"\xff"}'],
                         ids=["raw-newline", "forged-members", "not-an-object", "not-json", "not-utf8"])
async def test_a_tampered_result_is_read_as_a_corrupt_failed_task_and_never_spliced(
        open_store: OpenStore, tamper: Tamper, payload: bytes) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    done = await finished_task(store, clock, status="completed", result=b'{"content":[],"isError":false}')
    tamper.set(done.task_id, result=payload)
    assert_corrupt(await store.get(done.task_id, "alice"), done.task_id)
    assert_corrupt(await store.inspect(done.task_id), done.task_id)
    assert await store.get(done.task_id, "bob") is None  # still scoped


@pytest.mark.parametrize("payload", [b'{"code": -32603,\r\n"message": "x"}', b'{"code": "1", "message": "x"}',
                                     b'{"code": 1}', b'{"code": true, "message": "x"}', b'{"code":1,"message":"x"},"id":2'],
                         ids=["raw-crlf", "code-not-int", "no-message", "code-bool", "forged-members"])
async def test_a_tampered_error_is_read_as_a_corrupt_failed_task(
        open_store: OpenStore, tamper: Tamper, payload: bytes) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    failed = await finished_task(store, clock, status="failed", error=b'{"code":-32602,"message":"bad"}')
    tamper.set(failed.task_id, error=payload)
    assert_corrupt(await store.get(failed.task_id, "alice"), failed.task_id)


@pytest.mark.parametrize("payload", [b'{"k": {"method": "elicitation/create",\n"params": {}}}', b"[1]",
                                     b'{"k": "x"}', b'{"k":{}},"id":1'],
                         ids=["raw-newline", "not-an-object", "not-objects", "forged-members"])
async def test_tampered_input_requests_are_corrupt_for_get_and_for_a_transition_reading_them_back(
        open_store: OpenStore, tamper: Tamper, payload: bytes) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    asking = await finished_task(store, clock, status="input_required",
                                 input_requests=b'{"k": {"method": "elicitation/create", "params": {}}}')
    tamper.set(asking.task_id, input_requests=payload)
    assert_corrupt(await store.get(asking.task_id, "alice"), asking.task_id)
    # The store's own compare-and-set still applies (the record is live underneath); what it reads back is checked.
    after = await store.transition(asking.task_id, status="input_required", now_ms=clock.now_ms + 1,
                                   status_message="still asking")
    assert_corrupt(after, asking.task_id)


async def test_a_good_payload_reads_back_byte_for_byte(open_store: OpenStore) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    exact = b'{"structuredContent": {"n": 123456789012345678901234567890, "f": 0.1}, "content": [ ]}'
    done = await finished_task(store, clock, status="completed", result=exact)
    got = await store.get(done.task_id, "alice")
    assert got == done and got.result == exact  # checked, not re-encoded
    assert_renders_safely(got, done.task_id)


def test_a_result_that_is_an_empty_object_with_whitespace_still_gets_its_related_task_meta() -> None:
    body = task_shapes.with_related_task(b"{ \t}", "task-id-0001")
    assert json.loads(body) == {"_meta": {task_shapes.RELATED_TASK: {"taskId": "task-id-0001"}}}


# (field, value) written over a good record: each makes it one no daemon writes.
BAD_FIELDS = [("status", "bogus"), ("status", "WORKING"), ("created_at_ms", "soon"), ("created_at_ms", 10**17),
              ("updated_at_ms", "later"), ("tool", b"\xff\xfe"), ("task_id", "not a task id!")]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
async def test_a_record_with_a_bad_field_is_corrupt_for_get_and_skipped_by_list_and_list_all(
        open_store: OpenStore, tamper: Tamper, field: str, value: Any) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    good = [record(created_at_ms=clock.now_ms + i) for i in range(5)]
    for rec in good:
        await store.create(rec, 100)
    bad = good.pop(2)
    tamper.set(bad.task_id, **{field: value})
    if field != "task_id" or backend(open_store) == "redis":  # SQLite finds a row by its task_id column
        assert_corrupt(await store.get(bad.task_id, "alice"), bad.task_id)
    for everyone in (False, True):
        seen: list[TaskRecord] = []
        cursor: str | None = None
        while True:
            page, cursor = await (store.list_all(cursor, 2) if everyone else store.list("alice", cursor, 2))
            for rec in page:
                assert_renders_safely(rec, rec.task_id)
            seen += page
            if cursor is None:
                break
        assert [r.task_id for r in seen] == [r.task_id for r in reversed(good)]


@REDIS_ONLY
async def test_a_redis_hash_missing_its_status_or_principal_breaks_no_read(open_store: OpenStore, tamper: Tamper) -> None:
    assert tamper.redis is not None
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    recs = [record(created_at_ms=clock.now_ms + i) for i in range(3)]
    for rec in recs:
        await store.create(rec, 100)
    tamper.redis.hdel(f"{tamper.ns}:task:{recs[0].task_id}", "status")
    tamper.redis.hdel(f"{tamper.ns}:task:{recs[1].task_id}", "principal")
    assert_corrupt(await store.get(recs[0].task_id, "alice"), recs[0].task_id)
    assert await store.get(recs[1].task_id, "alice") is None  # nobody's now
    assert_corrupt(await store.inspect(recs[1].task_id), recs[1].task_id)
    assert [r.task_id for r in (await store.list("alice", None, 10))[0]] == [recs[2].task_id]
    assert [r.task_id for r in (await store.list_all(None, 10))[0]] == [recs[2].task_id]


@REDIS_ONLY
async def test_redis_index_members_that_name_something_else_are_skipped(open_store: OpenStore, tamper: Tamper) -> None:
    r = tamper.redis
    assert r is not None
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    mine, bobs, moved = (record(created_at_ms=clock.now_ms), record(created_at_ms=clock.now_ms + 1, principal="bob"),
                         record(created_at_ms=clock.now_ms + 2))
    for rec in (mine, bobs, moved):
        await store.create(rec, 100)
    # Bob's task listed under alice; a member that is no member; a hash whose id is not its key's.
    planted: dict[bytes, float] = {f"{bobs.created_at_ms:016d}:{bobs.task_id}".encode(): 0, b"zz-no-colon": 0}
    r.zadd(f"{tamper.ns}:principal:alice", planted)
    r.zadd(f"{tamper.ns}:all", {b"zz-no-colon": 0, b"\xff:\xfe": 0})
    tamper.set(moved.task_id, task_id=mine.task_id)
    assert [t.task_id for t in (await store.list("alice", None, 10))[0]] == [mine.task_id]
    assert [t.task_id for t in (await store.list_all(None, 10))[0]] == [bobs.task_id, mine.task_id]
    assert_corrupt(await store.get(moved.task_id, "alice"), moved.task_id)


@REDIS_ONLY
async def test_a_malformed_redis_expiry_member_is_dropped_and_expiry_goes_on(open_store: OpenStore, tamper: Tamper) -> None:
    r = tamper.redis
    assert r is not None
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    short = record(created_at_ms=clock.now_ms, ttl_ms=1_000)
    await store.create(short, 100)
    r.zadd(f"{tamper.ns}:expiry", {b"not msgpack \xc1": 0, b"\x94\xa3bad\xa1p\xa1o\x00": 1})  # the second: a bad id
    assert await store.expire(clock.now_ms + 2_000) == 1
    assert r.zcard(f"{tamper.ns}:expiry") == 0
    assert await store.expire(clock.now_ms + 3_000) == 0  # every later sweep too


async def test_orphan_recovery_survives_an_owner_that_is_not_text(open_store: OpenStore, tamper: Tamper) -> None:
    clock = FakeClock()
    store = await open_store(clock_ms=clock)
    me = new_owner_id()
    kept, odd = record(created_at_ms=clock.now_ms, owner=me), record(created_at_ms=clock.now_ms)
    for rec in (kept, odd):
        await store.create(rec, 100)
    if tamper.sqlite is not None:
        tamper.set(odd.task_id, owner=b"\xff\xfe")  # a BLOB where text was written
    else:
        assert tamper.redis is not None
        tamper.redis.zadd(f"{tamper.ns}:owners", {b"\xff\xfe:1:x": 0})
    await store.recover_orphans(local_owner_verdict(me), clock.now_ms, "test")
    got = await store.get(kept.task_id, "alice")
    assert got is not None and got.status == "working"
