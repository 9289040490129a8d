"""The Redis task store: tasks shared by several daemons, through redis-py's blocking client.

redis-py's asyncio client cannot run under trio, so the blocking client runs on one dedicated
thread (``BatchThread``); the commands that pile up while it waits on the server go out together
as one pipeline. Every write that must be atomic is one Lua script (the live-task cap, the
compare-and-set of a transition, a mailbox's cap, failing a dead owner's tasks), so two daemons
can never both pass the same check.

Keys, under ``<namespace>:`` (one Redis database may hold several namespaces):

- ``task:<id>``: the task, a hash (absent fields are None), expiring by itself at
  ``created + ttl`` (``PEXPIREAT``); ``mailbox:<id>``: its owner's messages, a list, expiring with it;
- ``principal:<p>`` and ``all``: sorted sets of ``<created, 16 digits>:<id>`` (all scores 0, so
  ordered by creation), for paging; ``live:<p>``: the principal's non-terminal task ids (the cap);
- ``owned:<owner>``: an owner's non-terminal task ids; ``owners``: owner -> last heartbeat (ms);
- ``catalogs``: owner -> ``<seen ms> <catalog fingerprint>`` (replicas compare their plugins);
- ``expiry``: a sorted set by deadline of what ``expire`` must clean from the indexes once the
  task's own key has gone.

Scripts build some key names themselves, so a Redis Cluster (which needs every key declared) is
not supported; one Redis server (with replicas, or Sentinel) is. Tasks are as durable as the
server is told to be (``appendonly yes`` to survive a Redis restart).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypeVar, cast

import msgspec
import outcome
import redis
import redis.exceptions

from runtime.batch_thread import BatchThread
from runtime.task_store import (
    UNSET,
    Limits,
    Mailboxes,
    OwnerVerdict,
    Page,
    TaskCapReached,
    TaskExists,
    TaskIds,
    TaskMailboxFull,
    TaskRecord,
    TaskStatus,
    TASK_ID_RE,
    CorruptTaskRecord,
    MAX_CATALOG_FIELD_CHARS,
    MAX_CATALOGS_COMPARED,
    _Unset,
    corrupt_record,
    decode_cursor,
    decode_record,
    encode_cursor,
    orphan_error,
    redact_store_url,
    report_corrupt,
    unavailable_error,
)

T = TypeVar("T")

# KEYS: task, principal index, all index, live set, owned set, owners, expiry.
# ARGV: cap, id, index member, deadline or "", expiry member, owner, created, key prefix, field/value pairs...
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return -1 end
local cap = tonumber(ARGV[1])
if redis.call('SCARD', KEYS[4]) >= cap then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[4])) do
    if redis.call('EXISTS', ARGV[8] .. 'task:' .. id) == 0 then redis.call('SREM', KEYS[4], id) end
  end
  local live = redis.call('SCARD', KEYS[4])
  if live >= cap then return live end
end
redis.call('HSET', KEYS[1], unpack(ARGV, 9))
redis.call('ZADD', KEYS[2], 0, ARGV[3])
redis.call('ZADD', KEYS[3], 0, ARGV[3])
redis.call('SADD', KEYS[4], ARGV[2])
redis.call('SADD', KEYS[5], ARGV[2])
local beat = redis.call('ZSCORE', KEYS[6], ARGV[6])
if not beat or tonumber(beat) < tonumber(ARGV[7]) then redis.call('ZADD', KEYS[6], ARGV[7], ARGV[6]) end
if ARGV[4] ~= '' then
  redis.call('PEXPIREAT', KEYS[1], ARGV[4])
  redis.call('ZADD', KEYS[7], ARGV[4], ARGV[5])
end
return 0
"""

# KEYS: task, mailbox. ARGV: id, status, updated, now (expiry), key prefix, n, n field/value pairs, fields to clear...
_TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'working' and status ~= 'input_required' then return false end
local deadline = redis.call('HGET', KEYS[1], 'expires_at_ms')
if deadline and tonumber(deadline) < tonumber(ARGV[4]) then return false end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'updated_at_ms', ARGV[3])
local n = tonumber(ARGV[6])
for i = 0, n - 1 do redis.call('HSET', KEYS[1], ARGV[7 + 2 * i], ARGV[8 + 2 * i]) end
for i = 7 + 2 * n, #ARGV do redis.call('HDEL', KEYS[1], ARGV[i]) end
if ARGV[2] ~= 'working' and ARGV[2] ~= 'input_required' then
  local who = redis.call('HMGET', KEYS[1], 'principal', 'owner')
  redis.call('SREM', ARGV[5] .. 'live:' .. who[1], ARGV[1])
  redis.call('SREM', ARGV[5] .. 'owned:' .. who[2], ARGV[1])
  redis.call('DEL', KEYS[2])
end
return redis.call('HGETALL', KEYS[1])
"""

# KEYS: task, mailbox. ARGV: message, cap, now (expiry).
_POST = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'working' and status ~= 'input_required' then return 0 end
local deadline = redis.call('HGET', KEYS[1], 'expires_at_ms')
if deadline and tonumber(deadline) < tonumber(ARGV[3]) then return 0 end
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[2]) then return -1 end
redis.call('RPUSH', KEYS[2], ARGV[1])
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
return 1
"""

# KEYS: mailboxes. Returns {index, messages, ...} for the keys that had any (empty is the common case,
# and a reply of 64 empty lists would cost more to parse than the script costs to run).
_TAKE = """
local out = {}
for i, key in ipairs(KEYS) do
  local messages = redis.call('LRANGE', key, 0, -1)
  if #messages > 0 then
    redis.call('DEL', key)
    out[#out + 1] = i
    out[#out + 1] = messages
  end
end
return out
"""

# KEYS: owners. ARGV: owner, ms.
_HEARTBEAT = """
local beat = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not beat or tonumber(beat) < tonumber(ARGV[2]) then redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1]) end
return 0
"""

# KEYS: owned set, owners. ARGV: owner, stale-before or "" (condemned regardless), key prefix, status message,
# error, now. Fails the owner's live tasks and forgets the owner, unless it heartbeated since it was judged.
_FAIL_OWNER = """
if ARGV[2] ~= '' then
  local beat = redis.call('ZSCORE', KEYS[2], ARGV[1])
  if beat and tonumber(beat) >= tonumber(ARGV[2]) then return -1 end
end
local failed = 0
for _, id in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local key = ARGV[3] .. 'task:' .. id
  local status = redis.call('HGET', key, 'status')
  if status == 'working' or status == 'input_required' then
    redis.call('HSET', key, 'status', 'failed', 'status_message', ARGV[4], 'error', ARGV[5], 'updated_at_ms', ARGV[6])
    redis.call('SREM', ARGV[3] .. 'live:' .. redis.call('HGET', key, 'principal'), id)
    redis.call('DEL', ARGV[3] .. 'mailbox:' .. id)
    failed = failed + 1
  end
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return failed
"""


# KEYS: catalogs. ARGV: owner, "<now> <fingerprint>", stale before, max others, max field bytes.
# Read on the server: only bounded, fresh entries come back (stale ones are deleted).
_CATALOGS = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
local out, stale = {ARGV[1], ARGV[2]}, {}
local all = redis.call('HGETALL', KEYS[1])
local limit, most = tonumber(ARGV[5]), 2 + 2 * tonumber(ARGV[4])
for i = 1, #all, 2 do
  local owner, value = all[i], all[i + 1]
  local seen = tonumber(string.match(value, '^(%d+) '))
  if not seen or seen < tonumber(ARGV[3]) then
    stale[#stale + 1] = owner
  elseif owner ~= ARGV[1] and #out < most and #owner <= limit and #value <= limit + 20 then
    out[#out + 1] = owner
    out[#out + 1] = value
  end
end
for _, owner in ipairs(stale) do redis.call('HDEL', KEYS[1], owner) end
return out
"""


class _Script:
    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


_SCRIPTS = {name: _Script(src) for name, src in (("create", _CREATE), ("transition", _TRANSITION), ("post", _POST),
                                                 ("take", _TAKE), ("heartbeat", _HEARTBEAT),
                                                 ("fail_owner", _FAIL_OWNER), ("catalogs", _CATALOGS))}


class _Cmd(NamedTuple):
    """One Redis command (pipelined with its neighbours) and what to make of its reply."""

    args: tuple[Any, ...]
    then: Callable[[Any], Any]
    #: For EVALSHA: the script to send in full if the server has forgotten it (restarted, SCRIPT FLUSH).
    script: _Script | None = None


class _Call(NamedTuple):
    """A job that needs several round trips; it runs alone with the client."""

    fn: Callable[[redis.Redis], Any]


class _Expiring(msgspec.Struct, array_like=True, frozen=True):
    """An ``expiry`` member: what ``expire`` needs to clean once the task's own key has gone."""

    task_id: str
    principal: str
    owner: str
    created_at_ms: int


_encode_expiring = msgspec.msgpack.Encoder().encode
_decode_expiring = msgspec.msgpack.Decoder(_Expiring).decode
_HEAD_FIELDS = (b"task_id", b"principal", b"tool", b"era", b"status", b"status_message", b"created_at_ms",
                b"updated_at_ms", b"ttl_ms", b"poll_interval_ms", b"owner")


def _member(created_at_ms: int, task_id: str) -> bytes:
    return f"{created_at_ms:016d}:{task_id}".encode()


#: An index member as ``_member`` writes it: ``<created, 16 digits>:<id>``.
_MEMBER_RE = re.compile(rb"^([0-9]{16}):([A-Za-z0-9_-]{8,128})$")


def _int(h: dict[bytes, bytes], name: bytes) -> int | None:
    """A number field as redis-py writes one (ASCII digits); None if absent, CorruptTaskRecord if not one."""
    value = h.get(name)
    if value is None:
        return None
    if not value.isdigit() or len(value) > 19:
        raise CorruptTaskRecord(f"{name.decode()}: not an integer in range")
    return int(value)


def _text(h: dict[bytes, bytes], name: bytes) -> str | None:
    value = h.get(name)
    if value is None:
        return None
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise CorruptTaskRecord(f"{name.decode()}: not UTF-8") from None


def _record(h: dict[bytes, bytes]) -> TaskRecord:
    """The task a hash holds, checked by ``decode_record`` (absent fields are None); CorruptTaskRecord."""
    return decode_record(_text(h, b"task_id"), _text(h, b"principal"), _text(h, b"tool"), _text(h, b"era"),
                         _text(h, b"status"), _text(h, b"status_message"), _int(h, b"created_at_ms"),
                         _int(h, b"updated_at_ms"), _int(h, b"ttl_ms"), _int(h, b"poll_interval_ms"),
                         _text(h, b"owner"), h.get(b"result"), h.get(b"error"), h.get(b"input_requests"))


def _corrupt(h: dict[bytes, bytes], task_id: str, principal: str | None, exc: CorruptTaskRecord) -> TaskRecord:
    """What a read by id answers for a corrupt hash (``principal`` None: the hash's, if readable)."""
    if principal is None:
        try:
            principal = _text(h, b"principal") or ""
        except CorruptTaskRecord:
            principal = ""
    try:
        created: int | None = _int(h, b"created_at_ms")
    except CorruptTaskRecord:
        created = None
    return corrupt_record(task_id, principal, str(exc), created or 0)


def _pairs(flat: Sequence[bytes]) -> dict[bytes, bytes]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


class RedisTaskStore:
    """A ``TaskStore`` on one Redis server. Open it with ``RedisTaskStore.open`` (or ``open_task_store``)."""

    def __init__(self, url: str, limits: Limits, clock_ms: Callable[[], int], namespace: str) -> None:
        self.url = url
        self.limits = limits
        self._clock_ms = clock_ms
        self._p = f"{namespace}:"
        self._client: redis.Redis = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10)
        self._thread: BatchThread[_Cmd | _Call] = BatchThread(
            "task-store-redis", self._run_batch, on_close=self._client.close,
            translate=unavailable_error(redact_store_url(url), (redis.exceptions.RedisError, OSError)))

    @classmethod
    async def open(cls, url: str, *, limits: Limits, clock_ms: Callable[[], int],
                   namespace: str = "toolcell") -> RedisTaskStore:
        """Connect to the server at ``url`` (redis-py's URL forms) and load the scripts."""
        store = cls(url, limits, clock_ms, namespace)

        def load(client: redis.Redis) -> None:
            for script in _SCRIPTS.values():
                client.script_load(script.source)

        try:
            await store._thread.run(_Call(load))
        except BaseException:
            await store._thread.aclose()
            raise
        return store

    # -- the thread side ---------------------------------------------------------------------------

    def _run_batch(self, jobs: Sequence[_Cmd | _Call]) -> list[outcome.Outcome[Any]]:
        results: list[outcome.Outcome[Any]] = []
        i = 0
        while i < len(jobs):
            job = jobs[i]
            if isinstance(job, _Call):
                results.append(outcome.capture(job.fn, self._client))
                i += 1
                continue
            j = i
            while j < len(jobs) and isinstance(jobs[j], _Cmd):
                j += 1
            group = cast(Sequence[_Cmd], jobs[i:j])
            replies: list[Any]
            try:
                if len(group) == 1:
                    replies = [self._client.execute_command(*group[0].args)]  # type: ignore[no-untyped-call]
                else:
                    pipe = self._client.pipeline(transaction=False)
                    for cmd in group:
                        pipe.execute_command(*cmd.args)  # type: ignore[no-untyped-call]
                    replies = pipe.execute(raise_on_error=False)
            except redis.exceptions.NoScriptError as exc:  # only raised for a group of one
                replies = [exc]
            except Exception as exc:
                replies = [exc] * len(group)
            for cmd, reply in zip(group, replies, strict=True):
                if isinstance(reply, redis.exceptions.NoScriptError) and cmd.script is not None:
                    reply = outcome.capture(self._client.execute_command, "EVAL", cmd.script.source, *cmd.args[2:])
                    if isinstance(reply, outcome.Error):
                        results.append(reply)
                        continue
                    reply = reply.value
                if isinstance(reply, Exception):
                    results.append(outcome.Error(reply))
                else:
                    results.append(outcome.capture(cmd.then, reply))
            i = j
        return results

    async def _cmd(self, then: Callable[[Any], T], *args: Any) -> T:
        return cast(T, await self._thread.run(_Cmd(args, then)))

    async def _script(self, name: str, keys: Sequence[str | bytes], argv: Sequence[Any], then: Callable[[Any], T]) -> T:
        script = _SCRIPTS[name]
        return cast(T, await self._thread.run(_Cmd(("EVALSHA", script.sha, len(keys), *keys, *argv), then, script)))

    async def _call(self, fn: Callable[[redis.Redis], T]) -> T:
        return cast(T, await self._thread.run(_Call(fn)))

    def _key(self, kind: str, name: str) -> str:
        return f"{self._p}{kind}:{name}"

    # -- the interface -----------------------------------------------------------------------------

    async def create(self, rec: TaskRecord, max_live_per_principal: int) -> None:
        self.limits.check_new(rec, max_live_per_principal)
        fields: list[Any] = []
        for name in TaskRecord.__struct_fields__:
            value = getattr(rec, name)
            if value is not None:
                fields += [name, value]
        deadline = rec.expires_at_ms
        if deadline is not None:
            fields += ["expires_at_ms", deadline]
        member = _member(rec.created_at_ms, rec.task_id)
        expiring = _encode_expiring(_Expiring(rec.task_id, rec.principal, rec.owner, rec.created_at_ms))
        keys = [self._key("task", rec.task_id), self._key("principal", rec.principal), f"{self._p}all",
                self._key("live", rec.principal), self._key("owned", rec.owner), f"{self._p}owners",
                f"{self._p}expiry"]
        argv = [max_live_per_principal, rec.task_id, member, "" if deadline is None else deadline, expiring,
                rec.owner, rec.created_at_ms, self._p, *fields]
        answer = await self._script("create", keys, argv, int)
        if answer == -1:
            raise TaskExists(f"task {rec.task_id} already exists")
        if answer > 0:
            raise TaskCapReached(f"this principal already has {answer} unfinished tasks (the limit is "
                                 f"{max_live_per_principal})")

    def _alive(self, h: dict[bytes, bytes], now_ms: int) -> bool:
        """Whether a hash holds an unexpired task; CorruptTaskRecord if its deadline is not a number."""
        deadline = _int(h, b"expires_at_ms")
        return bool(h) and (deadline is None or deadline >= now_ms)

    def _read(self, h: dict[bytes, bytes], task_id: str, principal: str | None, now_ms: int) -> TaskRecord | None:
        """The task a hash read by id holds: None if absent or expired, ``corrupt_record`` if corrupt."""
        if not h:
            return None
        try:
            if not self._alive(h, now_ms):
                return None
            rec = _record(h)
            if rec.task_id != task_id:
                raise CorruptTaskRecord("task_id: not the one its key names")
            return rec
        except CorruptTaskRecord as exc:
            return _corrupt(h, task_id, principal, exc)

    async def get(self, task_id: str, principal: str) -> TaskRecord | None:
        now_ms = self._clock_ms()
        wanted = principal.encode()

        def then(h: dict[bytes, bytes]) -> TaskRecord | None:
            return self._read(h, task_id, principal, now_ms) if h.get(b"principal") == wanted else None

        return await self._cmd(then, "HGETALL", self._key("task", task_id))

    async def inspect(self, task_id: str) -> TaskRecord | None:
        now_ms = self._clock_ms()
        return await self._cmd(lambda h: self._read(h, task_id, None, now_ms), "HGETALL", self._key("task", task_id))

    async def transition(self, task_id: str, *, status: TaskStatus, now_ms: int,
                         status_message: str | None | _Unset = UNSET, result: bytes | None | _Unset = UNSET,
                         error: bytes | None | _Unset = UNSET,
                         input_requests: bytes | None | _Unset = UNSET) -> TaskRecord | None:
        self.limits.check_transition(status, status_message, result, error, input_requests)
        sets: list[Any] = []
        clears: list[str] = []
        for name, value in (("status_message", status_message), ("result", result), ("error", error),
                            ("input_requests", input_requests)):
            if value is None:
                clears.append(name)
            elif not isinstance(value, _Unset):
                sets += [name, value]
        argv = [task_id, status, now_ms, self._clock_ms(), self._p, len(sets) // 2, *sets, *clears]
        return await self._script("transition", [self._key("task", task_id), self._key("mailbox", task_id)], argv,
                                  lambda flat: None if flat is None else self._read(_pairs(flat), task_id, None, 0))

    async def list(self, principal: str, cursor: str | None, limit: int) -> Page:
        return await self._page(self._key("principal", principal), cursor, limit, principal)

    async def list_all(self, cursor: str | None, limit: int) -> Page:
        return await self._page(f"{self._p}all", cursor, limit, None)

    async def _page(self, index: str, cursor: str | None, limit: int, principal: str | None) -> Page:
        """Newest first from an index; a malformed member or a corrupt task is skipped (logged once), as
        is a task that is not the member's (another id, creation time or, for ``list``, principal)."""
        if limit < 1:
            raise ValueError("limit must be >= 1")
        start: bytes = b"+" if cursor is None else b"(" + _member(*decode_cursor(cursor))
        now_ms = self._clock_ms()

        def read(client: redis.Redis) -> list[TaskRecord]:
            found: list[TaskRecord] = []
            upper = start
            while len(found) <= limit:
                members = cast(list[bytes], client.zrevrangebylex(index, upper, b"-", 0, limit + 1 - len(found)))
                if not members:
                    break
                keys: list[tuple[int, str]] = []
                for m in members:
                    match = _MEMBER_RE.match(m)
                    if match is None:
                        report_corrupt(f"{index}:{m[:160]!r}", "index member: malformed")
                    else:
                        keys.append((int(match[1]), match[2].decode()))
                pipe = client.pipeline(transaction=False)
                for _, task_id in keys:
                    pipe.hmget(self._key("task", task_id), [*_HEAD_FIELDS, b"expires_at_ms"])
                for (created, task_id), values in zip(keys, pipe.execute(), strict=True):
                    h = {k: v for k, v in zip(_HEAD_FIELDS + (b"expires_at_ms",), values, strict=True)
                         if v is not None}
                    try:
                        if not self._alive(h, now_ms):
                            continue
                        rec = _record(h)
                        if (rec.task_id, rec.created_at_ms) != (task_id, created) or (
                                principal is not None and rec.principal != principal):
                            raise CorruptTaskRecord("not the task its index member names")
                    except CorruptTaskRecord as exc:
                        report_corrupt(task_id, str(exc))
                        continue
                    found.append(rec)
                upper = b"(" + members[-1]
            return found

        rows = await self._call(read)
        page = rows[:limit]
        return page, encode_cursor(page[-1].created_at_ms, page[-1].task_id) if len(rows) > limit else None

    async def post(self, task_id: str, message: bytes) -> bool:
        self.limits.check_payload("message", message)
        answer = await self._script("post", [self._key("task", task_id), self._key("mailbox", task_id)],
                                    [message, self.limits.mailbox_max_messages, self._clock_ms()], int)
        if answer == -1:
            raise TaskMailboxFull(f"task {task_id} has {self.limits.mailbox_max_messages} messages its daemon "
                                  "has not taken yet")
        return answer == 1

    async def take(self, task_ids: TaskIds) -> Mailboxes:
        if not task_ids:
            return {}

        def then(found: list[Any]) -> Mailboxes:
            return {task_ids[int(i) - 1]: list(messages) for i, messages in zip(found[::2], found[1::2], strict=True)}

        return await self._script("take", [self._key("mailbox", t) for t in task_ids], [], then)

    async def heartbeat(self, owner: str, now_ms: int) -> None:
        await self._script("heartbeat", [f"{self._p}owners"], [owner, now_ms], lambda _: None)

    async def compare_catalogs(self, owner: str, fingerprint: str, now_ms: int) -> dict[str, str]:
        stale_before = now_ms - self.limits.orphan_after_ms

        def then(found: list[bytes]) -> dict[str, str]:
            out: dict[str, str] = {}
            for raw_owner, value in zip(found[::2], found[1::2], strict=True):
                found_print = value.decode(errors="replace").partition(" ")[2]
                if len(found_print) <= MAX_CATALOG_FIELD_CHARS:
                    out[raw_owner.decode(errors="replace")[:MAX_CATALOG_FIELD_CHARS]] = found_print
            return out

        # One hash field per daemon: "<seen ms> <fingerprint>"; fields of silent daemons are dropped.
        return await self._script("catalogs", [f"{self._p}catalogs"],
                                  [owner, f"{now_ms} {fingerprint}", stale_before, MAX_CATALOGS_COMPARED,
                                   MAX_CATALOG_FIELD_CHARS], then)

    async def forget_catalog(self, owner: str) -> None:
        key = f"{self._p}catalogs"

        def forget(client: redis.Redis) -> None:
            client.hdel(key, owner)

        await self._call(forget)

    async def recover_orphans(self, owner_alive: OwnerVerdict | None, now_ms: int, reason: str) -> int:
        stale_before = now_ms - self.limits.orphan_after_ms

        def owners(client: redis.Redis) -> list[tuple[bytes, float]]:
            return cast(list[tuple[bytes, float]], client.zrange(f"{self._p}owners", 0, -1, withscores=True))

        message, error = orphan_error(reason)
        failed = 0
        for raw, beat in await self._call(owners):
            # Read back, so any bytes: the keys and the script take them as they are.
            verdict = owner_alive(raw.decode(errors="replace")) if owner_alive is not None else None
            if verdict is True or (verdict is None and beat >= stale_before):
                continue
            keys: list[str | bytes] = [self._p.encode() + b"owned:" + raw, f"{self._p}owners"]
            argv = [raw, stale_before if verdict is None else "", self._p, message, error, now_ms]
            failed += max(0, await self._script("fail_owner", keys, argv, int))
        return failed

    async def expire(self, now_ms: int) -> int:
        def sweep(client: redis.Redis) -> int:
            removed = 0
            while True:
                members = cast(list[bytes], client.zrangebyscore(f"{self._p}expiry", "-inf", f"({now_ms}", 0, 500))
                if not members:
                    return removed
                pipe = client.pipeline(transaction=True)
                for m in members:
                    pipe.zrem(f"{self._p}expiry", m)
                    try:
                        e = _decode_expiring(m)
                        if not TASK_ID_RE.match(e.task_id) or e.created_at_ms < 0:
                            raise ValueError("not a task's")
                    except (msgspec.DecodeError, ValueError):  # removed above, never swept again
                        report_corrupt(f"expiry:{m[:160]!r}", "expiry member: malformed")
                        removed -= 1
                        continue
                    member = _member(e.created_at_ms, e.task_id)
                    pipe.delete(self._key("task", e.task_id), self._key("mailbox", e.task_id))
                    pipe.zrem(self._key("principal", e.principal), member)
                    pipe.zrem(f"{self._p}all", member)
                    pipe.srem(self._key("live", e.principal), e.task_id)
                    pipe.srem(self._key("owned", e.owner), e.task_id)
                pipe.execute()
                removed += len(members)

        return await self._call(sweep)

    async def aclose(self) -> None:
        await self._thread.aclose()
