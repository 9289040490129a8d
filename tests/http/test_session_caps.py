"""One principal cannot fill the legacy session table and lock every other principal out."""

from __future__ import annotations

from runtime.auth import Principal
from runtime.protocol.core import ConnState
from runtime.transports.http_sessions import SessionTable


def test_a_principal_at_its_cap_reuses_its_own_least_recently_used_idle_session() -> None:
    table = SessionTable(max_sessions=100, idle_s=3600, max_per_principal=3)
    greedy = Principal("greedy")
    first = [table.create(greedy, ConnState(), now=t) for t in range(3)]
    assert all(s is not None for s in first)
    fourth = table.create(greedy, ConnState(), now=10)
    assert fourth is not None and len(table) == 3
    assert first[0] is not None and first[0].id not in table.sessions  # the oldest idle one went


def test_a_principal_at_its_cap_with_no_idle_session_is_refused() -> None:
    table = SessionTable(max_sessions=100, idle_s=3600, max_per_principal=2)
    busy = Principal("busy")
    for t in range(2):
        session = table.create(busy, ConnState(), now=t)
        assert session is not None
        session.busy = 1
    assert table.create(busy, ConnState(), now=5) is None


def test_a_full_table_evicts_the_biggest_holders_idle_sessions_not_the_newcomer() -> None:
    table = SessionTable(max_sessions=10, idle_s=3600, max_per_principal=10)
    flood = Principal("flood")
    for t in range(10):
        assert table.create(flood, ConnState(), now=t) is not None
    polite = Principal("polite")
    for t in range(3):
        assert table.create(polite, ConnState(), now=20 + t) is not None
    assert len(table) == 10
    assert table.per_principal == {"flood": 7, "polite": 3}
    assert {n: len(v) for n, v in table._by_principal.items()} == table.per_principal  # the index stays exact
    assert sum(1 for s in table.sessions.values() if s.principal.name == "polite") == 3


def test_removal_keeps_the_per_principal_counts_exact() -> None:
    table = SessionTable(max_sessions=10, idle_s=1, max_per_principal=10)
    p = Principal("p")
    for t in range(4):
        table.create(p, ConnState(), now=t)
    table.expire(now=100)
    assert len(table) == 0 and table.per_principal == {}


def test_the_get_stream_replay_ring_is_bounded_and_ignores_ids_it_never_gave() -> None:
    table = SessionTable(max_sessions=10, idle_s=3600)
    session = table.create(Principal("p"), ConnState(), now=0)
    assert session is not None
    ids = [session.record(b"m%d" % i, keep=3) for i in range(5)]
    assert ids == [1, 2, 3, 4, 5]
    assert [i for i, _ in session.missed(b"3")] == [4, 5]
    assert [i for i, _ in session.missed(b"1")] == [3, 4, 5]  # older than what is kept: all that is kept
    for bogus in (None, b"", b"abc", b"0", b"-1", b"99", b"5"):
        assert session.missed(bogus) == [], bogus
