"""Approvals shared through Redis (``[approvals] store`` + ``key_file``): one approval is read by every
replica; what is read back is checked, record by record (a bad one holds its plugin, with the reason,
never the daemon); an unreachable Redis or an unreadable key holds every plugin. A real redis-server,
no daemons (tests/replicas/test_replicas_behind_haproxy.py runs the cluster)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import redis
from replica_cluster import Redis

from runtime import approvals
from runtime.approvals_shared import RedisBook, _derived, book_for, signature
from runtime.config import ConfigError, load_config
from runtime.manifest import Manifest


def manifest(**fields: Any) -> Manifest:
    base: dict[str, Any] = {"name": "srv", "version": "1.0.0", "kind": "server", "prefix": "srv_",
                            "server": {"package": "npm:x@1.0.0"}}
    base.update(fields)
    return msgspec.convert(base, Manifest)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Redis]:
    server = Redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def url(redis_server: Redis) -> Iterator[str]:
    yield redis_server.url()
    redis.Redis(unix_socket_path=str(redis_server.socket)).flushdb()


def key_file(path: Path, data: bytes | None = None) -> str:
    path.write_bytes(os.urandom(32) if data is None else data)
    path.chmod(0o600)
    return str(path)


def test_an_approval_written_once_is_read_by_every_replica_and_bumps_the_version(url: str, tmp_path: Path) -> None:
    key = key_file(tmp_path / "approvals.key")
    folder = tmp_path / "plugins" / "srv"
    folder.mkdir(parents=True)
    here, there = RedisBook(url, key), RedisBook(url, key)  # two replicas' books: same URL, same key file
    assert approvals.check_in(there.read(), manifest(), folder) is None  # no record: served as placed
    before = there.version()
    m = manifest(permissions={"network": ["api.example.com:443"]}, env={"set": {"API_KEY": "s3cret"}})
    here.write(m, str(folder), "toolcell approve")
    assert there.version() != before
    seen = there.read()
    assert approvals.check_in(seen, m, folder) is None
    wider = manifest(permissions={"network": ["api.example.com:443", "evil.example:443"]},
                     env={"set": {"API_KEY": "s3cret"}})
    held = approvals.check_in(seen, wider, folder)
    assert held is not None and held.startswith(approvals.HELD) and "+ network evil.example:443" in held
    changed = approvals.check_in(seen, manifest(permissions={"network": ["api.example.com:443"]},
                                                env={"set": {"API_KEY": "other"}}), folder)
    assert changed is not None and "a different fixed value" in changed
    # The record is signed, and holds no fixed value in plaintext.
    raw = redis.Redis.from_url(url).hget("toolcell:approvals", os.path.realpath(folder))
    assert raw is not None and b"s3cret" not in raw and set(json.loads(raw)) == {"record", "mac"}
    # Another folder is not approved by it.
    assert approvals.check_in(seen, wider, tmp_path / "elsewhere") is None


@pytest.mark.parametrize("damage, why", [
    (lambda signed, key, folder: b"{not json", "not valid JSON"),
    (lambda signed, key, folder: json.dumps({"record": signed["record"]}).encode(), "not a signed approval record"),
    (lambda signed, key, folder: json.dumps({**signed, "record": {**signed["record"], "grants": {
        **signed["record"]["grants"], "network": ["*"]}}}).encode(), "signature does not match"),
    (lambda signed, key, folder: json.dumps({"record": {"grants": {"network": "*"}}, "mac": signature(
        key, folder, {"grants": {"network": "*"}})}).encode(), "network is not a list"),
    (lambda signed, key, folder: b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (lambda signed, key, folder: b" " * (2 << 20), "larger than"),
    # hmac.compare_digest raises TypeError on non-ASCII text: a bad record, not a daemon that stops.
    (lambda signed, key, folder: json.dumps({**signed, "mac": "\u00e9" * 64}).encode(), "signature does not match"),
])
def test_a_damaged_record_holds_only_its_plugin_with_the_reason(url: str, tmp_path: Path, damage: Any,
                                                                 why: str) -> None:
    key = key_file(tmp_path / "approvals.key")
    book = RedisBook(url, key)
    one, other = tmp_path / "one", tmp_path / "other"
    one.mkdir()
    other.mkdir()
    book.write(manifest(name="one"), str(one), "test")
    book.write(manifest(name="other"), str(other), "test")
    client = redis.Redis.from_url(url)
    folder = os.path.realpath(one)
    signed = json.loads(client.hget("toolcell:approvals", folder) or b"")
    client.hset("toolcell:approvals", folder, damage(signed, _derived(Path(key).read_bytes(), b"records"), folder))
    seen = book.read()
    held = approvals.check_in(seen, manifest(name="one"), one)
    assert held is not None and held.startswith(approvals.HELD) and why in held, held
    assert "toolcell approve one" in held
    assert approvals.check_in(seen, manifest(name="other"), other) is None
    # Approving it again writes a good record.
    book.write(manifest(name="one"), str(one), "toolcell approve")
    assert approvals.check_in(book.read(), manifest(name="one"), one) is None


def test_a_record_moved_to_another_folder_or_signed_with_another_key_is_not_trusted(url: str, tmp_path: Path) -> None:
    key = key_file(tmp_path / "approvals.key")
    book = RedisBook(url, key)
    approved, placed = tmp_path / "approved", tmp_path / "placed"
    approved.mkdir()
    placed.mkdir()
    wide = manifest(permissions={"write": ["/"]})
    book.write(wide, str(approved), "test")
    client = redis.Redis.from_url(url)
    client.hset("toolcell:approvals", os.path.realpath(placed),
                client.hget("toolcell:approvals", os.path.realpath(approved)) or b"")
    held = approvals.check_in(book.read(), wide, placed)
    assert held is not None and "signature does not match" in held
    # A replica given another key trusts none of them.
    stranger = RedisBook(url, key_file(tmp_path / "another.key"))
    held = approvals.check_in(stranger.read(), wide, approved)
    assert held is not None and "signature does not match" in held


def test_an_unreachable_redis_or_an_unreadable_key_holds_every_plugin(url: str, tmp_path: Path) -> None:
    folder = tmp_path / "p"
    folder.mkdir()
    gone = RedisBook(f"unix://{tmp_path}/no-such.sock?db=0", key_file(tmp_path / "approvals.key"))
    held = approvals.check_in(gone.read(), manifest(), folder)  # no record anywhere: still held
    assert held is not None and "cannot be read" in held
    with pytest.raises(approvals.ApprovalsError):
        gone.version()
    with pytest.raises(approvals.ApprovalsError):
        gone.write(manifest(), str(folder), "test")
    loose = key_file(tmp_path / "loose.key")
    os.chmod(loose, 0o644)
    for book in (RedisBook(url, loose), RedisBook(url, str(tmp_path / "missing.key")),
                 RedisBook(url, key_file(tmp_path / "short.key", b"short"))):
        held = approvals.check_in(book.read(), manifest(), folder)
        assert held is not None and "approvals.key_file" in held, held
        with pytest.raises(approvals.ApprovalsError):
            book.write(manifest(), str(folder), "test")


def test_the_approvals_table_is_checked_and_the_default_stays_the_state_dir(tmp_path: Path) -> None:
    def config(text: str) -> Any:
        path = tmp_path / "toolcell.toml"
        path.write_text(f'state_dir = "{tmp_path / "state"}"\n' + text)
        return load_config(str(path), {})

    assert isinstance(book_for(config("")), approvals.StateDirBook)
    shared = config('[approvals]\nstore = "redis://r:6379/0"\nkey_file = "/run/secrets/approvals.key"\n')
    assert isinstance(book_for(shared), RedisBook)
    for text, why in [('[approvals]\nstore = "redis://r:6379/0"\n', "needs approvals.key_file"),
                      ('[approvals]\nstore = "sqlite"\nkey_file = "/k"\n', "approvals.store 'sqlite'"),
                      ('[approvals]\nkey_file = "/k"\n', "only with approvals.store")]:
        with pytest.raises(ConfigError, match=why):
            config(text)


def test_what_anyone_with_redis_write_access_puts_there_is_read_within_bounds(url: str, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The version is logged and compared at every poll, the book read at every change: a huge version,
    thousands of junk records or a book of gigabytes are not read into each replica (and hold every
    plugin, as a book that cannot be read does: fail closed)."""
    from runtime import approvals_shared

    book = RedisBook(url, key_file(tmp_path / "approvals.key"))
    folder = tmp_path / "p"
    folder.mkdir()
    client = redis.Redis.from_url(url)
    client.set("toolcell:approvals:version", "\x1b[31m" + "9" * (8 << 20))
    version = book.version()
    assert version is not None and len(version) <= 64
    client.hset("toolcell:approvals", mapping={f"/junk/{i}": "x" for i in range(10_001)})
    held = approvals.check_in(book.read(), manifest(), folder)  # no record of its own: still held
    assert held is not None and "10001 records (at most 10000)" in held, held
    client.delete("toolcell:approvals")
    monkeypatch.setattr(approvals_shared, "MAX_BOOK_BYTES", 4096, raising=False)
    client.hset("toolcell:approvals", mapping={f"/junk/{i}": "x" * 1000 for i in range(5)})
    held = approvals.check_in(book.read(), manifest(), folder)
    assert held is not None and "more than 4096 bytes" in held, held
