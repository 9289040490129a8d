"""Sans-io pieces of the HTTP transport: token buckets (explicit clock), header/body checks,
listen-address parsing, token hashing and scopes, the HTTP config checks."""

from __future__ import annotations

import base64
import socket
from pathlib import Path
from typing import Any

import msgspec
import pytest

from runtime.auth import Authenticator, Principal, hash_token
from runtime.http_config import HttpConfig, RateLimit, Token, check_http_config, parse_listen
from runtime.protocol import jsonrpc as rpc
from runtime.protocol.catalog import Catalog
from runtime.protocol.core import ConnState, Core, Request
from runtime.protocol.errors import HeaderMismatch, RateLimited
from runtime.ratelimit import RateLimiter
from runtime.transports import mcp_headers as mh
from runtime.transports.asgi import RequestHeaders, accepts
from runtime.transports.h1 import source_of


def test_a_bucket_allows_its_burst_then_says_exactly_when_the_next_token_comes() -> None:
    limiter = RateLimiter()
    limit = RateLimit(per_s=2.0, burst=3)
    assert [limiter.take("k", limit, 100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.take("k", limit, 100.0) == pytest.approx(0.5)
    assert limiter.take("k", limit, 100.25) == pytest.approx(0.25)
    assert limiter.take("k", limit, 100.5) == 0.0
    # Refill is capped at the burst.
    assert [limiter.take("k", limit, 1000.0) for _ in range(4)][-1] > 0
    # Keys are independent.
    assert limiter.take("other", limit, 100.5) == 0.0


def test_the_limiter_forgets_the_least_recently_used_buckets() -> None:
    limiter = RateLimiter(max_keys=2)
    limit = RateLimit(per_s=1.0, burst=1)
    limiter.take("a", limit, 0.0)
    limiter.take("b", limit, 0.0)
    limiter.take("a", limit, 0.0)
    limiter.take("c", limit, 0.0)
    assert len(limiter) == 2
    assert limiter.take("b", limit, 0.0) == 0.0  # forgotten, so full again


def test_rate_limited_reports_milliseconds_rounded_up() -> None:
    exc = RateLimited("tool x", 0.0101)
    assert exc.data == {"retryAfterMs": 11, "limit": "tool x"}
    assert "retry in 0.01 s" in str(exc)


def _parse(method: str, params: Any, with_id: bool = True) -> Request:
    """A message as the core reads it once (params decoded, era chosen)."""
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    if with_id:
        message["id"] = 1
    env = rpc.decode_envelope(msgspec.json.encode(message))
    assert isinstance(env, rpc.Envelope)
    return Core(lambda: Catalog(0, [], 10)).parse(ConnState(), env)


def test_the_core_chooses_the_era_once_discover_or_a_protocol_version_in_meta_is_modern() -> None:
    assert _parse("server/discover", None).modern
    assert _parse("tools/list", {"_meta": {"io.modelcontextprotocol/protocolVersion": "x"}}).modern
    assert not _parse("tools/list", {"_meta": {"progressToken": 1}}).modern
    assert not _parse("tools/list", [1, 2]).modern  # not an object: the core answers -32602 itself
    assert _parse("tools/list", [1, 2]).early is not None


@pytest.mark.parametrize("raw, expected", [
    (b"plain", "plain"),
    (b"  spaced\t", "spaced"),
    (b"=?base64?" + base64.b64encode("Zürich".encode()) + b"?=", "Zürich"),
    (b"=?base64?abc", "=?base64?abc"),
    (b"=?BASE64?SGVsbG8=?=", "=?BASE64?SGVsbG8=?="),  # markers are lowercase only
])
def test_header_values_decode(raw: bytes, expected: str) -> None:
    assert mh.decode_value(raw, "H") == expected


@pytest.mark.parametrize("raw", [b"=?base64?SGVsbG8?=", b"=?base64?SGVs!!!bG8=?=", b"caf\xc3\xa9", b"a\x01b",
                                 b"=?base64?" + base64.b64encode(b"\xff\xfe") + b"?="])
def test_bad_header_values_are_mismatches(raw: bytes) -> None:
    with pytest.raises(HeaderMismatch):
        mh.decode_value(raw, "H")


def test_a_notification_needs_no_method_header_but_a_wrong_one_is_rejected() -> None:
    p = _parse("notifications/initialized", {"_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}},
               with_id=False)
    mh.check(p, b"2026-07-28", None, None, {}, lambda n: None)
    with pytest.raises(HeaderMismatch):
        mh.check(p, b"2026-07-28", b"other", None, {}, lambda n: None)


def test_request_headers_collect_what_the_transport_reads() -> None:
    h = RequestHeaders([(b"Host", b"localhost:1"), (b"mcp-param-region", b"eu"), (b"x-other", b"1"),
                        (b"mcp-name", b"a"), (b"MCP-NAME", b"b")])
    assert h.get(b"host") == b"localhost:1"
    assert h.params == {b"region": b"eu"}
    assert h.get(b"mcp-name") == b"a,b"  # repeated: joined, so it cannot match one body value
    assert h.duplicate == b"mcp-name"  # and remembered: the app refuses the request with 400
    assert h.size > 0


def test_only_list_headers_may_repeat_and_a_repeated_mcp_param_is_a_duplicate() -> None:
    listed = RequestHeaders([(b"accept", b"application/json"), (b"Accept", b"text/event-stream"),
                             (b"access-control-request-headers", b"a"), (b"access-control-request-headers", b"b"),
                             (b"x-other", b"1"), (b"x-other", b"2")])
    assert listed.duplicate is None and listed.get(b"accept") == b"application/json,text/event-stream"
    param = RequestHeaders([(b"mcp-param-region", b"eu"), (b"Mcp-Param-Region", b"us")])
    assert param.duplicate == b"mcp-param-region"


@pytest.mark.parametrize("accept, expected", [
    (None, (True, True)), (b"application/json", (True, False)), (b"text/event-stream", (False, True)),
    (b"application/json, text/event-stream", (True, True)), (b"*/*", (True, True)), (b"text/html", (False, False)),
])
def test_accept_is_lenient(accept: bytes | None, expected: tuple[bool, bool]) -> None:
    assert accepts(accept) == expected


@pytest.mark.parametrize("value, expected", [
    ("", ("127.0.0.1", 8765)), ("9000", ("127.0.0.1", 9000)), (":9000", ("127.0.0.1", 9000)),
    ("0.0.0.0:80", ("0.0.0.0", 80)), ("localhost", ("localhost", 8765)), ("[::1]:5", ("::1", 5)),
])
def test_listen_addresses_parse(value: str, expected: tuple[str, int]) -> None:
    assert parse_listen(value) == expected


@pytest.mark.parametrize("value", ["::1:80", "host:99999", "[::1", "host:port"])
def test_bad_listen_addresses_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        parse_listen(value)


def test_tokens_are_matched_by_hash_and_scopes_pick_tools() -> None:
    cfg = HttpConfig(tokens=[Token(principal="ci", sha256=hash_token("secret-1"), scopes=["plugin:mathkit", "text_*"])])
    auth = Authenticator(cfg)
    assert auth.enabled
    principal = auth.authenticate(b"Bearer secret-1")
    assert principal is not None and principal.name == "ci"
    assert auth.authenticate(b"bearer  secret-1") is not None
    assert auth.authenticate(b"Bearer secret-2") is None
    assert auth.authenticate(None) is None
    assert auth.authenticate(b"Basic secret-1") is None

    class Entry:
        def __init__(self, name: str, plugin: str) -> None:
            self.name, self.plugin = name, plugin

    assert principal.allows(Entry("math_eval", "mathkit"))  # type: ignore[arg-type]
    assert principal.allows(Entry("text_upper", "textkit"))  # type: ignore[arg-type]
    assert not principal.allows(Entry("json_query", "jsonkit"))  # type: ignore[arg-type]
    assert Principal("all").all_tools
    assert Authenticator(HttpConfig()).authenticate(None) is not None  # no tokens: authentication is off


def test_matched_authorization_values_are_remembered_but_only_matches_and_only_so_many() -> None:
    cfg = HttpConfig(tokens=[Token(principal="ci", sha256=hash_token("secret-1"), scopes=["*"])])
    auth = Authenticator(cfg)
    first = auth.authenticate(b"Bearer secret-1")
    assert first is not None and auth.authenticate(b"Bearer secret-1") is first  # served from memory
    # A wrong token is never remembered, so a stream of them cannot grow the memory or pass later.
    for i in range(3 * Authenticator.MATCHED_MAX):
        assert auth.authenticate(b"Bearer wrong-%d" % i) is None
    assert len(auth._matched) == 1
    # Many spellings of the right token (each one a match) stay within the bound, the oldest going first.
    for i in range(Authenticator.MATCHED_MAX + 10):
        assert auth.authenticate(b"Bearer " + b" " * i + b"secret-1") is first
    assert len(auth._matched) == Authenticator.MATCHED_MAX
    assert b"Bearer secret-1" not in auth._matched
    assert auth.authenticate(b"Bearer secret-1") is first and auth.authenticate(b"Bearer secret-2") is None


def test_catalog_views_per_scope_set_are_bounded() -> None:
    """OAuth scopes come from tokens: every distinct scope set (any subset of what the identity
    provider grants) made a catalog view that lived as long as the catalog."""
    catalog = Catalog(0, [], 10)
    bound = getattr(Catalog, "VIEWS_MAX", 1024)
    for i in range(3 * bound):
        Principal(f"oauth:u{i}", (f"plugin:p{i}",)).catalog(catalog)
    assert len(catalog._views) == bound


def test_the_http_config_is_checked_and_every_problem_is_reported_at_once() -> None:
    from runtime.config import ConfigError, load_config

    bad = {"path": "mcp", "tokens": [{"principal": "", "sha256": "nothex"}], "max_body_bytes": 0,
           "principal_rate": {"per_s": 0}, "metrics_listen": "::1:2", "engine": "nginx", "max_connections": 0}
    # Bounds and choices are declared on the fields and reported together, before the semantic checks.
    with pytest.raises(ConfigError) as declared:
        load_config(None, {"http": bad})
    for fragment in ("http.max_body_bytes = 0: must be > 0", "http.principal_rate.per_s = 0: must be > 0",
                     "http.engine 'nginx'", "http.max_connections = 0"):
        assert fragment in str(declared.value)
    semantic = {k: v for k, v in bad.items() if k in ("path", "tokens", "metrics_listen")}
    with pytest.raises(ConfigError) as checked:
        load_config(None, {"http": semantic})
    for fragment in ("http.path", "sha256", "principal must not be empty", "metrics_listen"):
        assert fragment in str(checked.value)
    assert check_http_config(HttpConfig()) == []


def test_the_unauthenticated_budget_defaults_to_a_quarter_and_must_leave_room_for_token_holders() -> None:
    assert HttpConfig().unauthenticated_budget == 1024
    assert HttpConfig(max_connections=10).unauthenticated_budget == 2
    assert HttpConfig(max_connections=10, max_unauthenticated_connections=9).unauthenticated_budget == 9
    problems = check_http_config(HttpConfig(max_connections=10, max_unauthenticated_connections=10))
    assert any("max_unauthenticated_connections must be less than http.max_connections" in p for p in problems)


def test_the_per_address_cap_counts_ipv4_clients_by_address_and_ipv6_clients_by_their_64() -> None:
    v6 = socket.AF_INET6
    assert source_of(socket.AF_INET, ("10.0.0.1", 5)) == "10.0.0.1"
    assert source_of(v6, ("2001:db8:1:2::1", 5, 0, 0)) == source_of(v6, ("2001:db8:1:2:ffff::9", 6, 0, 0))
    assert source_of(v6, ("2001:db8:1:2::1", 5, 0, 0)) != source_of(v6, ("2001:db8:1:3::1", 5, 0, 0))
    assert source_of(v6, ("::ffff:10.0.0.1", 5, 0, 0)) == "10.0.0.1"  # IPv4 on a dual-stack socket
    assert source_of(socket.AF_UNIX, "") is None


def test_tokens_from_a_tokens_file_are_added_to_those_in_the_config(tmp_path: Path) -> None:
    from runtime.config import ConfigError, load_config

    secret = tmp_path / "tokens.toml"
    secret.write_text(f'[[tokens]]\nprincipal = "ci"\nsha256 = "{"b" * 64}"\nscopes = ["plugin:mathkit"]\n')
    inline = {"principal": "ops", "sha256": "a" * 64}
    cfg = load_config(None, {"http": {"tokens": [inline], "tokens_file": str(secret)}})
    assert [(t.principal, t.scopes) for t in cfg.http.tokens] == [("ops", ["*"]), ("ci", ["plugin:mathkit"])]
    auth = Authenticator(cfg.http)
    assert auth.enabled
    secret.write_text('[[tokens]]\nprincipal = "ci"\nsha256 = "short"\n')
    with pytest.raises(ConfigError, match=r"http.tokens\[0\].sha256 must be 64 lowercase hex"):
        load_config(None, {"http": {"tokens_file": str(secret)}})
    secret.write_text('listen = "0.0.0.0:1"\n')
    with pytest.raises(ConfigError, match="expected only \\[\\[tokens\\]\\] tables"):
        load_config(None, {"http": {"tokens_file": str(secret)}})
    with pytest.raises(ConfigError, match="tokens_file .*missing.toml: No such file"):
        load_config(None, {"http": {"tokens_file": str(tmp_path / "missing.toml")}})
