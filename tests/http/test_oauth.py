"""OAuth 2.1 resource server (MCP authorization): RFC 9728 metadata, RFC 6750 challenges, JWT access
tokens checked against a real issuer's JWKS over HTTPS, RFC 7662 introspection, scopes mapped onto
the principal model, and every way a token can be wrong — against a real ``toolcell serve --http``."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from http_harness import TOKENS, ServerProcess, sha, start_server, stop_server
from httpkit import LEGACY, initialize, legacy_headers, modern_post, rpc
from joserfc.jwk import RSAKey
from oauth_issuer import CLIENT_ID, CLIENT_SECRET, RESOURCE, Issuer, unsigned_token


@pytest.fixture(scope="module")
def issuer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Issuer]:
    it = Issuer(tmp_path_factory.mktemp("issuer"))
    try:
        yield it
    finally:
        it.close()


def _config(issuer: Issuer, tmp: Path, **extra: str) -> str:
    secret = tmp / "introspection-secret"
    secret.write_text(CLIENT_SECRET + "\n")
    # These tests send many tokens never seen before from one address: the budgets for those have
    # tests of their own (``test_new_tokens_*``), here they are out of the way unless a test sets them.
    extra = {"new_tokens_per_address": "{ per_s = 1000, burst = 1000 }",
             "new_tokens_rate": "{ per_s = 1000, burst = 1000 }", **extra}
    lines = "\n".join(f"{k} = {v}" for k, v in extra.items())
    return f'''
policy = "none"
min_workers = 1

[http]
audit_log = "AUDIT_PATH"

[[http.tokens]]
principal = "full"
sha256 = "{sha(TOKENS["full"])}"

[http.oauth]
resource = "{RESOURCE}"
issuer = "{issuer.url}"
ca_file = "{issuer.ca_file}"
scope_prefix = "toolcell:"
scopes_supported = ["toolcell:*", "toolcell:plugin:alpha", "toolcell:plugin:beta"]
jwks_refresh_min_s = 2
introspection_endpoint = "{issuer.url}/introspect"
introspection_client_id = "{CLIENT_ID}"
introspection_client_secret_file = "{secret}"
{lines}
'''


@pytest.fixture(scope="module")
def server(issuer: Issuer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("oauth-server")
    srv = start_server(tmp, _config(issuer, tmp))
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture
def client() -> Iterator[httpx2.Client]:
    with httpx2.Client(timeout=30) as c:
        yield c


def _tools(client: httpx2.Client, url: str, token: str) -> list[str]:
    r = modern_post(client, url, "tools/list", token=token)
    assert r.status_code == 200, r.text
    return sorted(t["name"] for t in r.json()["result"]["tools"])


def _challenge(r: httpx2.Response) -> dict[str, str]:
    value = r.headers["www-authenticate"]
    assert value.startswith("Bearer ")
    out = {}
    for part in value[len("Bearer "):].split(", "):
        key, _, quoted = part.partition("=")
        out[key] = quoted.strip('"')
    return out


# -- discovery ---------------------------------------------------------------------------------


def test_protected_resource_metadata_is_served_at_both_well_known_paths(server: ServerProcess, issuer: Issuer,
                                                                       client: httpx2.Client) -> None:
    for path in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"):
        r = client.get(server.base + path)
        assert r.status_code == 200, path
        doc = r.json()
        assert doc["resource"] == RESOURCE
        assert doc["authorization_servers"] == [issuer.url]
        assert doc["bearer_methods_supported"] == ["header"]
        assert "toolcell:plugin:alpha" in doc["scopes_supported"]
        assert r.headers["access-control-allow-origin"] == "*"


def test_no_token_gets_401_pointing_at_the_metadata(server: ServerProcess, client: httpx2.Client) -> None:
    r = modern_post(client, server.url, "tools/list")
    assert r.status_code == 401
    challenge = _challenge(r)
    assert challenge["resource_metadata"] == "https://mcp.example.test/.well-known/oauth-protected-resource/mcp"
    assert "error" not in challenge  # no token was sent: no error code (RFC 6750 §3.1)


# -- good tokens -------------------------------------------------------------------------------


def test_a_valid_jwt_is_served_in_both_eras_with_its_scopes(server: ServerProcess, issuer: Issuer,
                                                            client: httpx2.Client) -> None:
    everything = issuer.token(scope="toolcell:*")
    assert _tools(client, server.url, everything) == ["a_chatty", "a_echo", "a_progress", "a_routed", "a_sleep",
                                                      "b_limited", "b_secret"]
    alpha = issuer.token(alg="ES256", scope="toolcell:plugin:alpha openid")
    assert all(name.startswith("a_") for name in _tools(client, server.url, alpha))
    r = modern_post(client, server.url, "tools/call", {"name": "a_echo", "arguments": {"text": "hi"}}, token=alpha)
    assert r.json()["result"]["content"][0]["text"] == "hi"
    sid = initialize(client, server.url, alpha)  # legacy era: sessions belong to the OAuth principal
    r = client.post(server.url, json=rpc("tools/call", {"name": "a_echo", "arguments": {"text": "old"}}),
                    headers=legacy_headers(alpha, sid, LEGACY))
    assert r.json()["result"]["content"][0]["text"] == "old"


def test_static_tokens_keep_working_beside_oauth(server: ServerProcess, client: httpx2.Client) -> None:
    assert "b_secret" in _tools(client, server.url, TOKENS["full"])


def test_a_tool_outside_the_tokens_scopes_answers_403_insufficient_scope(server: ServerProcess, issuer: Issuer,
                                                                         client: httpx2.Client) -> None:
    alpha = issuer.token(scope="toolcell:plugin:alpha")
    r = modern_post(client, server.url, "tools/call", {"name": "b_secret", "arguments": {}}, token=alpha)
    assert r.status_code == 403
    challenge = _challenge(r)
    assert challenge["error"] == "insufficient_scope"
    assert challenge["scope"] == "toolcell:plugin:beta"
    assert challenge["resource_metadata"].endswith("/.well-known/oauth-protected-resource/mcp")
    # A tool that does not exist at all is answered as unknown, not as a scope problem.
    r = modern_post(client, server.url, "tools/call", {"name": "zz_nothing", "arguments": {}}, token=alpha)
    assert r.status_code != 403


def test_principals_are_the_subject_with_a_prefix_and_cannot_become_a_static_principal(
        server: ServerProcess, issuer: Issuer, client: httpx2.Client) -> None:
    token = issuer.token(sub="full", scope="toolcell:plugin:alpha")
    r = modern_post(client, server.url, "tools/call", {"name": "a_echo", "arguments": {"text": "x"}}, token=token)
    assert r.status_code == 200
    lines = [json.loads(line) for line in server.audit_path.read_text().splitlines() if line.strip()]
    principals = {line.get("principal") for line in lines}
    assert "oauth:full" in principals
    assert token not in server.audit_path.read_text()
    assert token not in server.stderr_path.read_text()  # tokens are never logged


def test_opaque_tokens_are_checked_by_introspection(server: ServerProcess, issuer: Issuer,
                                                    client: httpx2.Client) -> None:
    now = int(time.time())
    issuer.opaque["opaque-good-1"] = {"active": True, "sub": "bob", "aud": RESOURCE, "iss": issuer.url,
                                      "exp": now + 300, "scope": "toolcell:plugin:beta"}
    issuer.opaque["opaque-elsewhere"] = {"active": True, "sub": "bob", "aud": "https://other.example/mcp",
                                         "exp": now + 300, "scope": "toolcell:*"}
    assert all(name.startswith("b_") for name in _tools(client, server.url, "opaque-good-1"))
    assert issuer.introspection_auth[-1].startswith("Basic ")
    for bad in ("opaque-elsewhere", "opaque-unknown"):
        r = modern_post(client, server.url, "tools/list", token=bad)
        assert r.status_code == 401, bad
        assert _challenge(r)["error"] == "invalid_token"


# -- bad tokens --------------------------------------------------------------------------------


def _refused(client: httpx2.Client, server: ServerProcess, token: str) -> str:
    r = modern_post(client, server.url, "tools/list", token=token)
    assert r.status_code == 401, (r.status_code, r.text)
    challenge = _challenge(r)
    assert challenge["error"] == "invalid_token"
    assert token not in r.text and token not in r.headers["www-authenticate"]
    return challenge["error_description"]


def test_every_kind_of_bad_token_gets_401_invalid_token_with_the_reason(server: ServerProcess, issuer: Issuer,
                                                                        client: httpx2.Client) -> None:
    now = int(time.time())
    assert "expired" in _refused(client, server, issuer.token(exp=now - 120))
    assert "not valid yet" in _refused(client, server, issuer.token(nbf=now + 600))
    assert "not for this resource" in _refused(client, server, issuer.token(aud="https://other.example/mcp"))
    assert "another issuer" in _refused(client, server, issuer.token(iss="https://evil.example"))
    assert "exp" in _refused(client, server, issuer.token(exp=None))
    assert "aud" in _refused(client, server, issuer.token(aud=None))
    assert "well-formed" in _refused(client, server, "not.a.jwt")
    assert "algorithm" in _refused(client, server, unsigned_token(issuer.url, RESOURCE))
    assert "algorithm" in _refused(client, server, issuer.hmac_token_with_public_key())
    forged = RSAKey.generate_key(2048, parameters={"kid": "rsa-1"})  # the issuer's kid, someone else's key
    assert "signature" in _refused(client, server, issuer.token(key=forged))
    tampered = issuer.token(scope="toolcell:plugin:alpha").split(".")
    body = json.loads(base64.urlsafe_b64decode(tampered[1] + "=="))
    body["scope"] = "toolcell:*"
    tampered[1] = base64.urlsafe_b64encode(json.dumps(body).encode()).rstrip(b"=").decode()
    assert "signature" in _refused(client, server, ".".join(tampered))
    assert "sub" in _refused(client, server, issuer.token(sub=None))
    assert "does not match its key" in _refused(client, server, issuer.token(alg="RS256", header={"kid": "ec-1"}))


def test_a_token_missing_a_required_scope_gets_403(issuer: Issuer, tmp_path: Path, client: httpx2.Client) -> None:
    srv = start_server(tmp_path, _config(issuer, tmp_path, required_scopes='["toolcell:mcp"]'))
    try:
        r = modern_post(client, srv.url, "tools/list", token=issuer.token(scope="toolcell:*"))
        assert r.status_code == 403
        assert _challenge(r)["error"] == "insufficient_scope"
        assert _challenge(r)["scope"] == "toolcell:mcp"
        ok = modern_post(client, srv.url, "tools/list", token=issuer.token(scope="toolcell:mcp toolcell:*"))
        assert ok.status_code == 200
    finally:
        stop_server(srv)


# -- the issuer's keys -------------------------------------------------------------------------


def test_an_unknown_kid_refreshes_the_jwks_at_a_limited_rate_and_a_rotated_key_is_accepted(
        issuer: Issuer, tmp_path: Path, client: httpx2.Client) -> None:
    srv = start_server(tmp_path, _config(issuer, tmp_path))
    try:
        assert modern_post(client, srv.url, "tools/list", token=issuer.token()).status_code == 200
        fetched = issuer.hits["/jwks"]
        stranger = RSAKey.generate_key(2048, parameters={"kid": "nobody"})
        for _ in range(20):  # a stream of unknown kids: at most one refresh per jwks_refresh_min_s
            _refused(client, srv, issuer.token(key=stranger))
        assert issuer.hits["/jwks"] <= fetched + 1
        rotated = RSAKey.generate_key(2048, parameters={"kid": "rsa-2", "use": "sig"})
        issuer.published = [rotated, issuer.ec, issuer.rsa]
        time.sleep(2.2)  # past jwks_refresh_min_s: the next unknown kid may refresh
        assert modern_post(client, srv.url, "tools/list", token=issuer.token(key=rotated)).status_code == 200
    finally:
        issuer.published = [issuer.rsa, issuer.ec]
        stop_server(srv)


def test_an_unreachable_issuer_answers_503_and_the_daemon_keeps_serving(issuer: Issuer, tmp_path: Path,
                                                                        client: httpx2.Client) -> None:
    srv = start_server(tmp_path, _config(issuer, tmp_path))
    try:
        issuer.down = True
        r = modern_post(client, srv.url, "tools/list", token=issuer.token())
        assert r.status_code == 503
        assert "retry-after" in r.headers
        assert "cannot be checked" in r.json()["error"]["message"]
        r = modern_post(client, srv.url, "tools/list", token="opaque-while-down")
        assert r.status_code == 503
        assert modern_post(client, srv.url, "tools/list", token=TOKENS["full"]).status_code == 200
        issuer.down = False
        time.sleep(2.2)
        assert modern_post(client, srv.url, "tools/list", token=issuer.token()).status_code == 200
        assert srv.proc.poll() is None
    finally:
        issuer.down = False
        stop_server(srv)


def test_config_refuses_hmac_none_and_plain_http_issuers(tmp_path: Path) -> None:
    from runtime.http_config import HttpConfig, OAuthConfig, check_http_config

    bad = HttpConfig(oauth=OAuthConfig(resource="https://mcp.example/mcp", issuer="http://idp.example",
                                       algorithms=["HS256", "none", "RS256"]))
    problems = "\n".join(check_http_config(bad))
    assert "issuer must be an https" in problems
    assert "HS256" in problems and "none" in problems
    good = HttpConfig(oauth=OAuthConfig(resource="https://mcp.example/mcp", issuer="https://idp.example"))
    assert check_http_config(good) == []


# -- a real client's OAuth flow ----------------------------------------------------------------


class _Memory:
    """The SDK's token storage protocol, in memory."""

    def __init__(self) -> None:
        self.tokens: Any = None
        self.client_info: Any = None

    async def get_tokens(self) -> Any:
        return self.tokens

    async def set_tokens(self, tokens: Any) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> Any:
        return self.client_info

    async def set_client_info(self, client_info: Any) -> None:
        self.client_info = client_info


async def test_the_official_sdk_client_finds_the_issuer_gets_a_token_and_calls(issuer: Issuer, tmp_path: Path) -> None:
    """The MCP SDK's own OAuth client (client_credentials): 401 -> RFC 9728 metadata -> the issuer's
    RFC 8414 metadata -> a token for this resource (RFC 8707 ``resource``) -> the call succeeds."""
    import ssl
    import socket

    import trio
    from mcp.client.auth.extensions.client_credentials import ClientCredentialsOAuthProvider
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    with socket.socket() as probe:  # the resource URI must be the URL clients use: pick the port first
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/mcp"
    config = _config(issuer, tmp_path).replace(f'resource = "{RESOURCE}"', f'resource = "{url}"')
    srv = start_server(tmp_path, config.replace("[http]\n", f'[http]\nlisten = "127.0.0.1:{port}"\n'),
                       "--http", f"127.0.0.1:{port}")
    try:
        provider = ClientCredentialsOAuthProvider(url, _Memory(), CLIENT_ID, CLIENT_SECRET,
                                                  scope="toolcell:plugin:alpha", issuer=issuer.url)
        tls = ssl.create_default_context(cafile=str(issuer.ca_file))
        async with httpx2.AsyncClient(auth=provider, verify=tls, timeout=30) as http, \
                streamable_http_client(url, http_client=http) as (read, write), \
                ClientSession(read, write) as session:
            with trio.fail_after(60):
                await session.initialize()
                names = {t.name for t in (await session.list_tools()).tools}
                assert "a_echo" in names
                echoed = await session.call_tool("a_echo", {"text": "via oauth"})
                assert echoed.content[0].text == "via oauth"
        asked = issuer.token_requests[-1]
        assert asked["resource"] == url
        # The SDK asks for what the resource metadata lists (scopes_supported), as the spec says.
        assert set(asked["scope"].split()) == {"toolcell:*", "toolcell:plugin:alpha", "toolcell:plugin:beta"}
    finally:
        await trio.to_thread.run_sync(stop_server, srv)


# -- hostile tokens and a hostile issuer, checked in-process (review of issue 26) ------------------


def _verifier(issuer: Issuer, **extra: Any) -> Any:
    from runtime.http_config import OAuthConfig
    from runtime.oauth import OAuthVerifier

    return OAuthVerifier(OAuthConfig(resource=RESOURCE, issuer=issuer.url, ca_file=str(issuer.ca_file),
                                     scope_prefix="toolcell:", **extra))


async def test_an_exp_too_large_for_a_float_is_a_token_not_a_crash(issuer: Issuer) -> None:
    """JSON integers have no bound: ``exp = 10**400`` verifies (it is in the future) and must not
    raise OverflowError on its way into the cache (that was a 500)."""
    verifier = _verifier(issuer)
    principal = await verifier.verify(b"Bearer " + issuer.token(exp=10**400).encode())
    assert principal.name == "oauth:alice"


async def test_an_introspected_exp_too_large_for_a_float_is_a_token_not_a_crash(issuer: Issuer) -> None:
    verifier = _verifier(issuer, introspection_endpoint=issuer.url + "/introspect",
                         introspection_client_id=CLIENT_ID)
    verifier._secret = CLIENT_SECRET
    issuer.opaque["opaque-huge-exp"] = {"active": True, "sub": "bob", "aud": RESOURCE, "exp": 10**400,
                                        "scope": "toolcell:*"}
    assert (await verifier.verify(b"Bearer opaque-huge-exp")).name == "oauth:bob"


@pytest.mark.parametrize("who", ["eve\r\nforged: line", "eve\x1b[2J", "eve\u2028", "eve\ud800"])
async def test_a_principal_claim_with_control_characters_or_lone_surrogates_is_refused(issuer: Issuer,
                                                                                       who: str) -> None:
    """A claim becomes the principal's name in logs, the audit log and task ownership keys. A lone
    surrogate (JSON allows ``\\ud800``) cannot even be encoded: the audit line was silently dropped."""
    from runtime.oauth import TokenRefused

    from joserfc import jws

    verifier = _verifier(issuer)
    claims = json.loads(base64.urlsafe_b64decode(issuer.token().split(".")[1] + "=="))
    claims["sub"] = who
    # Signed by hand: joserfc would refuse to encode a lone surrogate; json.dumps writes it as \ud800.
    token = jws.serialize_compact({"alg": "RS256", "kid": issuer.rsa.kid}, json.dumps(claims).encode(), issuer.rsa)
    with pytest.raises(TokenRefused) as refused:
        await verifier.verify(b"Bearer " + token.encode())
    assert refused.value.status == 401
    assert "sub" in refused.value.description


async def test_whitespace_variants_of_one_token_share_one_cache_entry(issuer: Issuer) -> None:
    """The cache was keyed by the raw Authorization value: one valid token padded with spaces made
    a new entry (up to the header size each) and a fresh signature check on every request."""
    verifier = _verifier(issuer)
    token = issuer.token().encode()
    await verifier.verify(b"Bearer " + token)
    for n in range(1, 50):
        variant = b"Bearer" + b" " * n + token
        assert verifier.cached(variant) is not None
        await verifier.verify(variant)
    assert len(verifier._cached) == 1


async def test_a_jwks_outage_answers_unavailable_not_invalid_token_until_the_next_refresh(issuer: Issuer) -> None:
    """After a failed JWKS fetch the refresh is rate-limited; the requests in between were told
    ``invalid_token`` (so clients threw away good tokens) instead of "cannot check now"."""
    from runtime.oauth import AuthUnavailable

    verifier = _verifier(issuer, jwks_refresh_min_s=3600)
    issuer.down = True
    try:
        for _ in range(3):
            with pytest.raises(AuthUnavailable):
                await verifier.verify(b"Bearer " + issuer.token().encode())
    finally:
        issuer.down = False
    assert verifier.refreshes == 1  # still rate-limited


async def test_a_hung_issuer_cannot_take_the_daemons_worker_threads(issuer: Issuer) -> None:
    """Fetches run in threads abandoned when their deadline passes; a hung introspection endpoint
    (or a JWKS that drips) kept them in trio's *default* thread limiter, which cgroup cleanup,
    approvals and plugin file reads share: a stream of opaque tokens starved the whole daemon."""
    import socket

    import trio

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(128)  # accepts (in the kernel) and never answers
        url = f"https://127.0.0.1:{hung.getsockname()[1]}/introspect"
        verifier = _verifier(issuer, introspection_endpoint=url, fetch_timeout_s=30)
        default = trio.to_thread.current_default_thread_limiter()
        with trio.move_on_after(1):
            async with trio.open_nursery() as nursery:
                for i in range(60):
                    nursery.start_soon(verifier.verify, f"Bearer opaque-{i}".encode())
        assert default.borrowed_tokens == 0


# -- the budget of tokens never seen before (pre-auth cost: a signature check, an introspection) -------


def _limits(per_address: tuple[float, float] = (1000.0, 1000.0), total: tuple[float, float] = (1000.0, 1000.0),
            **extra: Any) -> dict[str, Any]:
    from runtime.http_config import RateLimit

    return {"new_tokens_per_address": RateLimit(per_s=per_address[0], burst=per_address[1]),
            "new_tokens_rate": RateLimit(per_s=total[0], burst=total[1]), **extra}


def _counting_checks(verifier: Any) -> list[str]:
    """Record every token the verifier really checks (its signature path)."""
    checked: list[str] = []
    real = verifier._check_jwt

    async def check(token: str) -> Any:
        checked.append(token)
        return await real(token)

    verifier._check_jwt = check
    return checked


async def test_new_tokens_from_one_address_past_its_budget_are_not_checked(issuer: Issuer,
                                                                          mock_clock: Any) -> None:
    from runtime.oauth import TokenRefused, TooManyNewTokens

    verifier = _verifier(issuer, **_limits(per_address=(1.0, 3.0)))
    checked = _counting_checks(verifier)
    tokens = [b"Bearer " + issuer.token(jti=f"a{i}").encode() for i in range(3)]
    for token in tokens:
        await verifier.verify(token, "203.0.113.7")
    forged = RSAKey.generate_key(2048, parameters={"kid": "rsa-1"})
    with pytest.raises(TooManyNewTokens) as limited:
        await verifier.verify(b"Bearer " + issuer.token(key=forged).encode(), "203.0.113.7")
    assert 0 < limited.value.retry_after_s <= 1.0 and "this address" in str(limited.value)
    assert len(checked) == 3 and verifier.limited == 1  # the forged token was never looked at
    # Another address has its own budget; a token already checked never needs one.
    assert (await verifier.verify(b"Bearer " + issuer.token(jti="b").encode(), "198.51.100.1")).name == "oauth:alice"
    assert all(verifier.cached(token) is not None for token in tokens)
    # The bucket refills at per_s: a second later the address may bring one new token again.
    mock_clock.jump(1.0)
    with pytest.raises(TokenRefused):
        await verifier.verify(b"Bearer " + issuer.token(key=forged).encode(), "203.0.113.7")


async def test_new_tokens_from_every_address_together_have_a_budget_too(issuer: Issuer, mock_clock: Any) -> None:
    from runtime.oauth import TooManyNewTokens

    verifier = _verifier(issuer, **_limits(total=(2.0, 4.0)))
    checked = _counting_checks(verifier)
    for i in range(4):
        await verifier.verify(b"Bearer " + issuer.token(jti=str(i)).encode(), f"192.0.2.{i}")
    with pytest.raises(TooManyNewTokens) as limited:
        await verifier.verify(b"Bearer " + issuer.token(jti="x").encode(), "192.0.2.99")
    assert "all clients" in str(limited.value) and len(checked) == 4
    with pytest.raises(TooManyNewTokens):  # no address known (a unix socket): the budget for all applies
        await verifier.verify(b"Bearer " + issuer.token(jti="y").encode())
    mock_clock.jump(0.5)
    await verifier.verify(b"Bearer " + issuer.token(jti="z").encode(), "192.0.2.99")


async def test_a_refused_token_is_answered_from_memory_without_a_check_or_a_budget(issuer: Issuer,
                                                                                 mock_clock: Any) -> None:
    from runtime.oauth import TokenRefused

    verifier = _verifier(issuer, **_limits(per_address=(0.001, 2.0), refused_memory_s=60.0))
    checked = _counting_checks(verifier)
    forged = b"Bearer " + issuer.token(key=RSAKey.generate_key(2048, parameters={"kid": "rsa-1"})).encode()
    for _ in range(10):  # a client retrying its bad token: one check, one unit of its address's budget
        with pytest.raises(TokenRefused) as refused:
            await verifier.verify(forged, "203.0.113.9")
        assert "signature" in refused.value.description
    assert len(checked) == 1
    await verifier.verify(b"Bearer " + issuer.token(jti="still").encode(), "203.0.113.9")  # budget left: 1
    mock_clock.jump(61)  # forgotten: checked again (from another address: this one's budget is spent)
    with pytest.raises(TokenRefused):
        await verifier.verify(forged, "203.0.113.10")
    assert len(checked) == 3


async def test_a_token_refused_for_now_only_is_checked_again(issuer: Issuer, mock_clock: Any) -> None:
    """Not valid *yet* and a key the issuer may publish after a rotation are not remembered."""
    from runtime.oauth import TokenRefused

    verifier = _verifier(issuer, **_limits())
    checked = _counting_checks(verifier)
    early = b"Bearer " + issuer.token(nbf=int(time.time()) + 600).encode()
    unknown_kid = b"Bearer " + issuer.token(key=RSAKey.generate_key(2048, parameters={"kid": "later"})).encode()
    for token in (early, early, unknown_kid, unknown_kid):
        with pytest.raises(TokenRefused):
            await verifier.verify(token, "203.0.113.5")
    assert len(checked) == 4


def test_a_flood_of_made_up_tokens_gets_429_and_never_reaches_the_identity_provider(
        issuer: Issuer, tmp_path: Path, client: httpx2.Client) -> None:
    """Against a real daemon with the default budgets: made-up opaque tokens from one address reach the
    introspection endpoint at most the address's burst; the rest are answered 429 with Retry-After,
    and a token checked before and a static token are served throughout."""
    srv = start_server(tmp_path, _config(issuer, tmp_path, new_tokens_per_address="{ per_s = 5, burst = 20 }",
                                         new_tokens_rate="{ per_s = 100, burst = 200 }"))
    try:
        good = issuer.token(jti="good")
        assert modern_post(client, srv.url, "tools/list", token=good).status_code == 200
        before = issuer.hits["/introspect"]
        statuses = []
        for i in range(60):
            r = modern_post(client, srv.url, "tools/list", token=f"made-up-{i}-{time.time_ns()}")
            statuses.append(r.status_code)
            if r.status_code == 429:
                assert 1 <= int(r.headers["retry-after"]) <= 5 and "nothing was checked" in r.text
        assert statuses.count(429) >= 30, statuses
        assert set(statuses) == {401, 429}, statuses
        assert issuer.hits["/introspect"] - before <= 21 + 5  # the burst (20, the good one spent 1) + refill
        assert modern_post(client, srv.url, "tools/list", token=good).status_code == 200
        assert modern_post(client, srv.url, "tools/list", token=TOKENS["full"]).status_code == 200
    finally:
        stop_server(srv)


def test_the_hypercorn_engine_counts_new_tokens_by_the_same_client_address() -> None:
    from runtime.transports.http import _asgi_source

    assert _asgi_source({"client": ("203.0.113.7", 5000)}) == "203.0.113.7"
    assert _asgi_source({"client": ("::ffff:203.0.113.7", 5000)}) == "203.0.113.7"
    one, other = _asgi_source({"client": ("2001:db8:1:2::5", 1)}), _asgi_source({"client": ("2001:db8:1:2::9", 2)})
    assert one == other != _asgi_source({"client": ("2001:db8:1:3::5", 1)})  # one /64, one budget
    assert _asgi_source({"client": None}) is None and _asgi_source({}) is None
