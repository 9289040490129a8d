"""Approvals shared by replicas: one record per plugin folder in Redis, signed with a key file the
operator provides (``[approvals] store`` and ``key_file``).

How this works:

* ``toolcell approve NAME`` (or ``add``, ``import``) run with a replica's config writes the record to
  the hash ``<namespace>:approvals`` (field: the plugin folder's real path, the same on every
  replica) and bumps ``<namespace>:approvals:version`` in one transaction. Every replica reads the
  version every ``approvals.poll_s``; when it changed (or Redis came back) the replica reloads:
  the plugins held for approval load, and its clients get ``list_changed``.
* Each record carries an HMAC-SHA256 over its folder and its canonical JSON, under a key derived
  from ``approvals.key_file``: whoever can write to Redis but lacks the key can neither forge an
  approval nor move one to another folder. Fixed environment values (``env.set``) are recorded as
  HMACs under another key derived from the same file (``runtime.approvals``).
* What is read back is trusted-side data that is checked anyway: a record that is not JSON, too
  large, badly signed or of the wrong shape holds its plugin with the reason (approving it again
  writes a good one); the others are unaffected. A Redis that cannot be reached, or a key file that
  cannot be read, holds every plugin (what is approved is unknown: fail closed) until it can be.
* A plugin with no record is served as placed, as in the state dir's file. Removing a record
  therefore needs Redis write access *and* a changed plugin folder to widen anything; restrict both.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import TYPE_CHECKING, Any

from runtime.approvals import ApprovalsError, Book, Snapshot, StateDirBook, checked_record, key, new_record
from runtime.manifest import Manifest
from runtime.mrtr import read_key_file
from runtime.task_store import redact_store_url

if TYPE_CHECKING:
    import redis

#: A record larger than this is not read (a real one is a few kB).
MAX_RECORD_BYTES = 1 << 20
#: A book with more records, or more bytes in all, than this is not read at all (every plugin held):
#: whoever can write to Redis must not make each replica read gigabytes at every change.
MAX_RECORDS = 10_000
MAX_BOOK_BYTES = 64 << 20
#: The version is a counter; only this many bytes of it are read (and logged).
MAX_VERSION_BYTES = 64
#: Reads the book within those bounds, on the server: an oversized record comes back as its size,
#: a book over the bounds as ``[-1, records]`` or ``[-2, bytes]``.
# KEYS: the hash. ARGV: max records, max record bytes, max book bytes.
_READ_BOUNDED = """
local fields = redis.call('HKEYS', KEYS[1])
if #fields > tonumber(ARGV[1]) then return {-1, #fields} end
local total, out = 0, {}
for _, f in ipairs(fields) do
  local n = redis.call('HSTRLEN', KEYS[1], f)
  total = total + #f + math.min(n, 64)
  if n <= tonumber(ARGV[2]) then total = total + n end
  if total > tonumber(ARGV[3]) then return {-2, total} end
  out[#out + 1] = f
  if n > tonumber(ARGV[2]) then out[#out + 1] = n else out[#out + 1] = redis.call('HGET', KEYS[1], f) end
end
return out
"""
KEY_BYTES = 32
#: How long one Redis command may take before the book counts as unreachable.
TIMEOUT_S = 5.0


def _derived(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"toolcell approvals: " + purpose, hashlib.sha256).digest()


def canonical(record: dict[str, Any]) -> bytes:
    """The bytes a record's signature covers (what it is written as, too)."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def signature(mac_key: bytes, folder: str, record: dict[str, Any]) -> str:
    return hmac.new(mac_key, folder.encode("utf-8", "surrogateescape") + b"\0" + canonical(record),
                    hashlib.sha256).hexdigest()


class RedisBook:
    """Approvals in a Redis every replica reaches, signed under ``key_file`` (see the module's text)."""

    def __init__(self, url: str, key_file: str, namespace: str = "toolcell") -> None:
        self.url = url
        self.key_file = key_file
        self.where = f"{redact_store_url(url)} ({namespace}:approvals)"
        self._hash = f"{namespace}:approvals"
        self._version = f"{namespace}:approvals:version"
        # Lazy: redis-py takes about 0.2 s to import (measured after runtime.cli), which a daemon or CLI
        # command without a shared approvals store never pays (this module loads with every command).
        import redis
        import redis.exceptions  # lazy: as redis above

        self._errors = (redis.exceptions.RedisError, OSError)
        self._client: redis.Redis = redis.Redis.from_url(url, socket_timeout=TIMEOUT_S,
                                                         socket_connect_timeout=TIMEOUT_S)
        self._read_bounded = self._client.register_script(_READ_BOUNDED)

    def _keys(self) -> tuple[bytes, bytes]:
        """(the key that signs records, the key of fixed environment values). Raises ``ApprovalsError``."""
        try:
            secret = read_key_file(self.key_file, "approvals key", KEY_BYTES)
        except (OSError, ValueError) as exc:
            raise ApprovalsError(f"approvals.key_file: {exc}") from None
        return _derived(secret, b"records"), _derived(secret, b"env values")

    def read(self) -> Snapshot:
        try:
            mac_key, env_key = self._keys()
        except ApprovalsError as exc:
            return Snapshot(problem=str(exc))
        try:
            found = self._read_bounded(keys=[self._hash], args=[MAX_RECORDS, MAX_RECORD_BYTES, MAX_BOOK_BYTES])
        except self._errors as exc:
            return Snapshot(problem=f"the approvals in {self.where} cannot be read: {type(exc).__name__}: {exc}")
        if found and isinstance(found[0], int):
            what = f"{found[1]} records (at most {MAX_RECORDS})" if found[0] == -1 else \
                f"more than {MAX_BOOK_BYTES} bytes"
            return Snapshot(problem=f"the approvals in {self.where} hold {what}: not read")
        records: dict[str, Any] = {}
        untrusted: dict[str, str] = {}
        for name, value in zip(found[::2], found[1::2], strict=True):
            folder = name.decode("utf-8", "surrogateescape")
            try:
                records[folder] = self._checked(mac_key, folder, value)
            except ApprovalsError as exc:
                untrusted[folder] = f"its approval in {self.where} cannot be trusted: {exc}"
        return Snapshot(records, untrusted, secret=env_key, secret_where=self.key_file)

    @staticmethod
    def _checked(mac_key: bytes, folder: str, value: bytes | int) -> dict[str, Any]:
        if isinstance(value, int) or len(value) > MAX_RECORD_BYTES:  # an int: its size (not read)
            raise ApprovalsError(f"larger than {MAX_RECORD_BYTES} bytes")
        try:
            signed = json.loads(value)
        except (ValueError, RecursionError) as exc:
            raise ApprovalsError(f"not valid JSON: {exc}") from None
        if not isinstance(signed, dict) or set(signed) != {"record", "mac"} or not isinstance(signed["mac"], str) \
                or not isinstance(signed["record"], dict):
            raise ApprovalsError("not a signed approval record")
        # Compared as bytes: ``compare_digest`` raises TypeError for text that is not ASCII.
        if not hmac.compare_digest(signed["mac"].encode("utf-8", "surrogatepass"),
                                   signature(mac_key, folder, signed["record"]).encode()):
            raise ApprovalsError("its signature does not match approvals.key_file (written with another key, "
                                 "changed, or copied from another folder)")
        return checked_record(signed["record"])

    def write(self, manifest: Manifest, plugin_dir: str, how: str) -> None:
        mac_key, env_key = self._keys()
        folder = key(plugin_dir)
        record = new_record(manifest, env_key, how)
        value = json.dumps({"record": record, "mac": signature(mac_key, folder, record)}, sort_keys=True)
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.hset(self._hash, folder, value)
                pipe.incr(self._version)
                pipe.execute()
        except self._errors as exc:
            raise ApprovalsError(f"{self.where}: {type(exc).__name__}: {exc}") from None

    def version(self) -> str | None:
        try:
            # A counter: its first bytes are enough to see a change (GETRANGE of no key is b"").
            found = self._client.getrange(self._version, 0, MAX_VERSION_BYTES - 1)
        except self._errors as exc:
            raise ApprovalsError(f"{self.where}: {type(exc).__name__}: {exc}") from None
        return found.decode("ascii", "replace") if isinstance(found, bytes) and found else "0"


def book_for(config: Any) -> Book:
    """Where ``config`` (a ``runtime.config.Config``) keeps approvals: its ``[approvals] store``, else the
    state dir."""
    shared = config.approvals
    if shared.store is None:
        return StateDirBook(config.state_dir)
    assert shared.key_file is not None  # ``runtime.config.check_approvals_config`` requires it
    return RedisBook(shared.store, shared.key_file)
