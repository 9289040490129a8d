"""OAuth 2.1 resource server: access tokens from the operator's identity provider (MCP authorization).

How this works:

* The daemon is a *resource server* (MCP authorization, 2025-06-18 onwards; RFC 9728 metadata at
  ``/.well-known/oauth-protected-resource[/path]``). It never issues tokens and never passes a
  client's token on to anything (no token passthrough): a token is only checked.
* A JWT access token is checked against the issuer's JWKS: the signing algorithm must be on the
  allowed list (asymmetric only: never ``none``, never HMAC, so a public key can never be used as a
  shared secret), the key is the JWKS key named by ``kid`` and of the algorithm's type, ``iss`` is
  the configured issuer, ``aud`` names this server's canonical resource URI (RFC 8707: a token
  minted for another resource is refused), ``exp``/``nbf`` hold within a small skew.
* The JWKS is fetched over HTTPS (from ``jwks_uri``, or discovered from the issuer's RFC 8414 /
  OpenID metadata), cached, refreshed when a token names an unknown ``kid`` (at most once per
  ``jwks_refresh_min_s``: a stream of made-up ``kid``s cannot make the daemon hammer the issuer),
  and re-read after ``jwks_max_age_s``. Concurrent refreshes share one fetch.
* An opaque token (not a JWT) is checked by RFC 7662 introspection when an endpoint is configured.
* A checked token becomes a :class:`~runtime.auth.Principal` named ``principal_prefix`` + the
  ``principal_claim`` (``oauth:`` + ``sub`` by default: an identity provider's user can never take
  the name of a static-token principal), with the token's scopes (``scope`` or ``scp``; only those
  starting with ``scope_prefix``, which is stripped) read exactly like a static token's scopes:
  ``*``, ``plugin:NAME`` or a glob on the tool name. So rate limits, session caps, tasks and
  ``requestState`` ownership work per principal, unchanged.
* A checked token is remembered (by the token, however the header spaces it; at most ``CACHE_MAX``, never
  past its ``exp``) so that a client's every request does not verify a signature again.
* Checking a token not seen before is the one costly thing an unauthenticated client can ask for (a
  signature check, an introspection request to the identity provider), so it is budgeted before
  anything is checked: ``new_tokens_per_address`` per client address (an IPv6 /64) and
  ``new_tokens_rate`` for all together (token buckets; over either: :class:`TooManyNewTokens`, 429
  with ``Retry-After``), and a refused token is answered from memory (by a hash, at most
  ``REFUSED_MAX``) for ``refused_memory_s`` unless time or a key rotation could change the answer.
  Tokens already checked never touch these budgets.
* Refusals are :class:`TokenRefused` (401 ``invalid_token`` / 403 ``insufficient_scope``, with the
  RFC 6750 ``WWW-Authenticate`` value) or :class:`AuthUnavailable` (503: the issuer's keys or the
  introspection endpoint cannot be reached). Tokens are never logged or quoted.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Hashable
from typing import Any

import jwt
import msgspec
import trio

from runtime import plugin_files
from runtime.auth import Principal
from runtime.http_config import OAuthConfig
from runtime.logs import log
from runtime.ratelimit import RateLimiter

#: Largest JWKS / metadata / introspection answer read (bytes).
MAX_DOCUMENT_BYTES = 1 << 20
#: Longest bearer token looked at (bytes).
MAX_TOKEN_BYTES = 8192
#: Fetches from the issuer (JWKS, metadata, introspection) running at once, abandoned ones included.
FETCH_THREADS = 8

#: A signing key from the JWKS: the public key, and the algorithm the JWKS pins it to (if it does).
_Key = tuple[Any, str | None]


class TokenRefused(Exception):
    """A token that does not grant access: 401 ``invalid_token`` or 403 ``insufficient_scope``."""

    def __init__(self, status: int, error: str, description: str, scope: str | None = None,
                 lasting: bool = True) -> None:
        super().__init__(description)
        self.status = status
        self.error = error
        self.description = description
        self.scope = scope
        #: The same token would be refused again later (remembered for ``refused_memory_s``); False for
        #: what time or the issuer may change (not valid *yet*, a key the JWKS may publish after a rotation).
        self.lasting = lasting


class TooManyNewTokens(Exception):
    """Too many tokens not seen before came from this client address (or from all together) to check
    them now: nothing was checked. 429, retry after ``retry_after_s``."""

    def __init__(self, retry_after_s: float, whose: str) -> None:
        super().__init__(f"too many new access tokens {whose}")
        self.retry_after_s = retry_after_s
        self.whose = whose


class AuthUnavailable(Exception):
    """The issuer's keys or the introspection endpoint cannot be reached: tokens cannot be checked now."""


def client_secret(cfg: OAuthConfig) -> str | None:
    """The introspection client secret, from a file or the daemon's environment (never the config)."""
    if cfg.introspection_client_secret_file is not None:
        path = cfg.introspection_client_secret_file
        try:  # a regular file only (a FIFO would block the daemon), capped
            data = plugin_files.read_named(path, 64 * 1024)
        except plugin_files.PluginFileError as exc:
            raise OSError(exc.reason) from None
        if data is None:
            raise FileNotFoundError(f"{path}: no such file")
        return data.decode("utf-8").strip()
    if cfg.introspection_client_secret_env is not None:
        return os.environ.get(cfg.introspection_client_secret_env)
    return None


def metadata_paths(resource: str) -> tuple[str, str]:
    """The two paths RFC 9728 metadata is served at: the bare well-known path and the one with the
    resource's path appended (``/.well-known/oauth-protected-resource/mcp``)."""
    path = urllib.parse.urlsplit(resource).path.rstrip("/")
    base = "/.well-known/oauth-protected-resource"
    return base, base + path if path else base


def metadata_url(resource: str) -> str:
    parts = urllib.parse.urlsplit(resource)
    return f"{parts.scheme}://{parts.netloc}{metadata_paths(resource)[1]}"


class _Fetched(msgspec.Struct):
    status: int
    body: bytes


class OAuthVerifier:
    """Checks access tokens for one resource (see the module's comment). One per HTTP app."""

    CACHE_MAX = 4096
    #: Refused tokens remembered (by a 16-byte hash), oldest forgotten first.
    REFUSED_MAX = 4096

    def __init__(self, cfg: OAuthConfig, *, wall_clock: Callable[[], float] = time.time,
                 secret: str | None = None) -> None:
        self.cfg = cfg
        self.audience = list(cfg.audience) if cfg.audience else [cfg.resource]
        self.algorithms = list(cfg.algorithms)
        self._wall = wall_clock
        self._keys: dict[str, _Key] = {}
        self._keys_fetched_at: float | None = None  # trio clock
        self._refreshing: trio.Event | None = None
        #: Why the last JWKS fetch failed (None: it did not): an unknown key is then "cannot check
        #: now" (503), not "invalid token" (401, which makes clients throw good tokens away).
        self._keys_failed: str | None = None
        self._jwks_uri = cfg.jwks_uri
        self._secret = secret
        #: Token (as sent after "Bearer", whatever the spacing) -> (principal, expiry on the wall clock).
        self._cached: dict[bytes, tuple[Principal, float]] = {}
        self._principals: dict[tuple[str, tuple[str, ...]], Principal] = {}
        self._ssl = ssl.create_default_context(cafile=cfg.ca_file) if cfg.ca_file else ssl.create_default_context()
        self.metadata = msgspec.json.encode(self._metadata())
        self.metadata_url = metadata_url(cfg.resource)
        self.refreshes = 0
        self.refused = 0
        #: Requests answered 429 because they brought too many tokens not seen before.
        self.limited = 0
        #: Hash of a refused token -> (the refusal, until when it is repeated without a check; trio clock).
        self._refused: dict[bytes, tuple[TokenRefused, float]] = {}
        #: Buckets of new-token checks: one per client address, and one for all (``new_tokens_*``).
        self._new_tokens = RateLimiter(max_keys=65_536)
        #: Fetch threads are abandoned at their deadline but run on until their socket times out: they
        #: count against this limiter, never trio's default one (which cgroup cleanup, approvals and
        #: plugin file reads share), so a hung issuer cannot starve the rest of the daemon.
        self._fetch_threads = trio.CapacityLimiter(FETCH_THREADS)

    def _metadata(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"resource": self.cfg.resource, "authorization_servers": [self.cfg.issuer],
                               "bearer_methods_supported": ["header"]}
        if self.cfg.scopes_supported is not None:
            doc["scopes_supported"] = list(self.cfg.scopes_supported)
        if self.cfg.resource_name:
            doc["resource_name"] = self.cfg.resource_name
        return doc

    # -- the hot path: a token checked before ---------------------------------------------------

    def cached(self, authorization: bytes) -> Principal | None:
        token = _bearer(authorization)
        if token is None:
            return None
        hit = self._cached.get(token)
        if hit is None:
            return None
        principal, expires = hit
        if self._wall() >= expires:
            del self._cached[token]
            return None
        return principal

    def _remember(self, token: bytes, principal: Principal, expires: float) -> None:
        if len(self._cached) >= self.CACHE_MAX:
            del self._cached[next(iter(self._cached))]
        self._cached[token] = (principal, expires)

    # -- WWW-Authenticate ----------------------------------------------------------------------

    def challenge(self, refused: TokenRefused | None = None) -> bytes:
        """The ``WWW-Authenticate`` value for a 401/403 (RFC 6750 §3, RFC 9728 §5.1)."""
        parts = [f'resource_metadata="{self.metadata_url}"']
        if refused is not None:
            parts.append(f'error="{refused.error}"')
            parts.append(f'error_description="{_quoted(refused.description)}"')
            if refused.scope:
                parts.append(f'scope="{_quoted(refused.scope)}"')
        elif self.cfg.required_scopes:
            parts.append(f'scope="{_quoted(" ".join(self.cfg.required_scopes))}"')
        return ("Bearer " + ", ".join(parts)).encode("latin-1", "replace")

    def scope_for_plugin(self, plugin: str) -> str:
        return " ".join([*self.cfg.required_scopes, f"{self.cfg.scope_prefix}plugin:{plugin}"])

    # -- checking a token ----------------------------------------------------------------------

    async def verify(self, authorization: bytes, source: Hashable | None = None) -> Principal:
        """The principal for ``authorization`` (``Bearer TOKEN``), or TokenRefused / AuthUnavailable /
        TooManyNewTokens. ``source``: the client's address as the per-address limits count it (None:
        not known, e.g. a unix socket; only the limit for all applies)."""
        scheme, _, raw = authorization.partition(b" ")
        token = raw.strip()
        if scheme.lower() != b"bearer" or not token:
            raise TokenRefused(401, "invalid_request", "send the access token as Authorization: Bearer TOKEN")
        if len(token) > MAX_TOKEN_BYTES:
            raise TokenRefused(401, "invalid_token", "the token is too long")
        try:
            text = token.decode("ascii")
        except UnicodeDecodeError:
            raise TokenRefused(401, "invalid_token", "the token is not ASCII") from None
        digest = hashlib.blake2b(token, digest_size=16).digest()
        now = trio.current_time()
        known = self._refused.get(digest)
        if known is not None:
            refusal, until = known
            if now < until:
                self.refused += 1
                raise refusal
            del self._refused[digest]
        self._admit_new_token(source, now)
        try:
            if text.count(".") == 2:
                claims = await self._check_jwt(text)
            elif self.cfg.introspection_endpoint is not None:
                claims = await self._introspect(text)
            else:
                raise TokenRefused(401, "invalid_token", "the token is not a JWT, and no introspection endpoint "
                                                         "is configured")
            principal = self._principal(claims)
        except TokenRefused as refusal:
            self.refused += 1
            if refusal.lasting and self.cfg.refused_memory_s > 0:
                if len(self._refused) >= self.REFUSED_MAX:
                    del self._refused[next(iter(self._refused))]
                self._refused[digest] = (refusal, now + self.cfg.refused_memory_s)
            raise
        expires = _seconds(claims.get("exp"))
        self._remember(token, principal, min(expires if expires is not None else self._wall() + 60.0,
                                             self._wall() + 3600.0))
        return principal

    def _admit_new_token(self, source: Hashable | None, now: float) -> None:
        """Take one check of a token not seen before from the client address's bucket and from the
        bucket of all; raise ``TooManyNewTokens`` (nothing checked) when either is empty."""
        cfg = self.cfg
        if source is not None:
            wait = self._new_tokens.take(("address", source), cfg.new_tokens_per_address, now)
            if wait > 0:
                self.limited += 1
                raise TooManyNewTokens(wait, "from this address")
        wait = self._new_tokens.take("all", cfg.new_tokens_rate, now)
        if wait > 0:
            self.limited += 1
            raise TooManyNewTokens(wait, "from all clients together")

    async def _check_jwt(self, token: str) -> dict[str, Any]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise TokenRefused(401, "invalid_token", "the token is not a well-formed JWT") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.algorithms:
            raise TokenRefused(401, "invalid_token", "the token's signing algorithm is not allowed")
        kid = header.get("kid")
        if kid is not None and not isinstance(kid, str):
            raise TokenRefused(401, "invalid_token", "the token's kid is not a string")
        key = await self._key(kid)
        if key is None:
            raise TokenRefused(401, "invalid_token", "the token is signed by a key the issuer does not publish",
                               lasting=False)
        public_key, key_alg = key
        if key_alg not in (None, alg):
            raise TokenRefused(401, "invalid_token", "the token's algorithm does not match its key")
        try:
            prepared = jwt.get_algorithm_by_name(alg).prepare_key(public_key)
        except (jwt.PyJWTError, ValueError, TypeError):
            raise TokenRefused(401, "invalid_token", "the token's algorithm does not match its key") from None
        try:
            claims: dict[str, Any] = jwt.decode(
                token, prepared, algorithms=[alg], audience=self.audience, issuer=self.cfg.issuer,
                leeway=self.cfg.leeway_s, options={"require": ["exp", "iss", "aud"]})
        except jwt.ExpiredSignatureError:
            raise TokenRefused(401, "invalid_token", "the token has expired") from None
        except jwt.ImmatureSignatureError:
            raise TokenRefused(401, "invalid_token", "the token is not valid yet (nbf/iat in the future)",
                               lasting=False) from None
        except jwt.InvalidAudienceError:
            raise TokenRefused(401, "invalid_token", f"the token is not for this resource ({self.cfg.resource})") \
                from None
        except jwt.InvalidIssuerError:
            raise TokenRefused(401, "invalid_token", "the token is from another issuer") from None
        except jwt.MissingRequiredClaimError as exc:
            raise TokenRefused(401, "invalid_token", f"the token lacks the {exc.claim} claim") from None
        except jwt.InvalidSignatureError:
            raise TokenRefused(401, "invalid_token", "the token's signature does not verify") from None
        except (jwt.PyJWTError, ValueError, TypeError, OverflowError):
            raise TokenRefused(401, "invalid_token", "the token is malformed") from None
        return claims

    async def _introspect(self, token: str) -> dict[str, Any]:
        cfg = self.cfg
        assert cfg.introspection_endpoint is not None
        form = urllib.parse.urlencode({"token": token, "token_type_hint": "access_token"}).encode()
        headers = {"content-type": "application/x-www-form-urlencoded", "accept": "application/json"}
        if cfg.introspection_client_id is not None:
            pair = f"{urllib.parse.quote(cfg.introspection_client_id)}:{urllib.parse.quote(self._secret or '')}"
            headers["authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        try:
            got = await self._fetch(cfg.introspection_endpoint, form, headers)
        except AuthUnavailable:
            raise
        if got.status != 200:
            raise AuthUnavailable(f"the introspection endpoint answered HTTP {got.status}")
        try:
            answer = json.loads(got.body)
        except ValueError:
            raise AuthUnavailable("the introspection endpoint answered something that is not JSON") from None
        if not isinstance(answer, dict):
            raise AuthUnavailable("the introspection endpoint answered something that is not a JSON object")
        if answer.get("active") is not True:
            raise TokenRefused(401, "invalid_token", "the token is not active")
        now = self._wall()
        exp = _seconds(answer.get("exp"))
        if exp is not None and exp + cfg.leeway_s <= now:
            raise TokenRefused(401, "invalid_token", "the token has expired")
        iss = answer.get("iss")
        if iss is not None and iss != cfg.issuer:
            raise TokenRefused(401, "invalid_token", "the token is from another issuer")
        aud = answer.get("aud")
        auds = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
        if not any(a in self.audience for a in auds if isinstance(a, str)):
            raise TokenRefused(401, "invalid_token", f"the token is not for this resource ({cfg.resource})")
        # Introspection answers are remembered briefly: a revoked token stops working within a minute.
        answer["exp"] = min(exp, now + 60.0) if exp is not None else now + 60.0
        return answer

    def _principal(self, claims: dict[str, Any]) -> Principal:
        cfg = self.cfg
        who = claims.get(cfg.principal_claim)
        # Printable only: the name reaches logs, the audit log and task ownership (a lone surrogate,
        # which JSON allows, cannot even be encoded there: its audit lines were dropped).
        if not isinstance(who, str) or not who or len(who) > 256 or not who.isprintable():
            raise TokenRefused(401, "invalid_token", f"the token has no usable {cfg.principal_claim} claim")
        granted = _scopes(claims)
        missing = [s for s in cfg.required_scopes if s not in granted]
        if missing:
            raise TokenRefused(403, "insufficient_scope", "the token lacks a scope this server requires",
                               " ".join(cfg.required_scopes))
        prefix = cfg.scope_prefix
        scopes = tuple(sorted({s[len(prefix):] for s in granted if s.startswith(prefix) and len(s) > len(prefix)}))
        key = (cfg.principal_prefix + who, scopes)
        principal = self._principals.get(key)
        if principal is None:
            if len(self._principals) >= self.CACHE_MAX:
                del self._principals[next(iter(self._principals))]
            principal = self._principals[key] = Principal(key[0], scopes, cfg.rate, oauth=True)
        return principal

    # -- the issuer's keys ---------------------------------------------------------------------

    async def _key(self, kid: str | None) -> _Key | None:
        now = trio.current_time()
        stale = self._keys_fetched_at is None or now - self._keys_fetched_at >= self.cfg.jwks_max_age_s
        key = self._lookup(kid)
        if key is not None and not stale:
            return key
        may_refresh = (self._keys_fetched_at is None or stale
                       or now - self._keys_fetched_at >= self.cfg.jwks_refresh_min_s)
        if may_refresh:
            try:
                await self._refresh()
            except AuthUnavailable:
                if not self._keys:
                    raise
                # Keys we already hold stay good while the issuer is unreachable.
        key = self._lookup(kid)
        if key is None and self._keys_failed is not None:
            raise AuthUnavailable(self._keys_failed)
        return key

    def _lookup(self, kid: str | None) -> _Key | None:
        if kid is not None:
            return self._keys.get(kid)
        return next(iter(self._keys.values())) if len(self._keys) == 1 else None

    async def _refresh(self) -> None:
        if self._refreshing is not None:  # someone else is fetching: share their answer
            await self._refreshing.wait()
            return
        self._refreshing = done = trio.Event()
        try:
            self._keys_fetched_at = trio.current_time()  # also when it fails: the rate limit holds
            self.refreshes += 1
            try:
                self._keys = await self._fetch_keys()
            except AuthUnavailable as exc:
                self._keys_failed = str(exc)
                raise
            self._keys_failed = None
        finally:
            self._refreshing = None
            done.set()

    async def _fetch_keys(self) -> dict[str, _Key]:
        if self._jwks_uri is None:
            self._jwks_uri = await self._discover_jwks_uri()
        got = await self._fetch(self._jwks_uri)
        if got.status != 200:
            raise AuthUnavailable(f"the issuer's JWKS answered HTTP {got.status}")
        try:
            doc = json.loads(got.body)
        except ValueError:
            raise AuthUnavailable("the issuer's JWKS is not JSON") from None
        raw_keys = doc.get("keys") if isinstance(doc, dict) else None
        if not isinstance(raw_keys, list):
            raise AuthUnavailable("the issuer's JWKS has no keys list")
        keys: dict[str, _Key] = {}
        for i, raw in enumerate(raw_keys[:100]):
            if not isinstance(raw, dict) or raw.get("use", "sig") != "sig" or raw.get("kty") == "oct":
                continue  # encryption keys and shared secrets are never signing keys here
            try:
                public_key = jwt.PyJWK(raw).key
            except (jwt.PyJWTError, ValueError, TypeError, KeyError):
                continue
            kid, pinned = raw.get("kid"), raw.get("alg")
            keys[kid if isinstance(kid, str) else f"#{i}"] = (public_key, pinned if isinstance(pinned, str) else None)
        log("oauth_keys_fetched", keys=len(keys), jwks_uri=self._jwks_uri)
        return keys

    async def _discover_jwks_uri(self) -> str:
        issuer = self.cfg.issuer.rstrip("/")
        parts = urllib.parse.urlsplit(issuer)
        candidates = [f"{parts.scheme}://{parts.netloc}/.well-known/oauth-authorization-server{parts.path}",
                      f"{issuer}/.well-known/openid-configuration"]
        for url in candidates:
            got = await self._fetch(url)
            if got.status != 200:
                continue
            try:
                doc = json.loads(got.body)
            except ValueError:
                continue
            if not isinstance(doc, dict) or doc.get("issuer", "").rstrip("/") != issuer:
                continue
            uri = doc.get("jwks_uri")
            if isinstance(uri, str) and urllib.parse.urlsplit(uri).scheme == "https":
                return uri
        raise AuthUnavailable(f"no https jwks_uri in the metadata of issuer {self.cfg.issuer}")

    async def _fetch(self, url: str, data: bytes | None = None, headers: dict[str, str] | None = None) -> _Fetched:
        timeout = self.cfg.fetch_timeout_s
        with trio.move_on_after(timeout + 1.0):
            return await trio.to_thread.run_sync(self._fetch_blocking, url, data, headers or {}, timeout,
                                                 abandon_on_cancel=True, limiter=self._fetch_threads)
        raise AuthUnavailable(f"{_origin(url)} did not answer within {timeout:g} s")

    def _fetch_blocking(self, url: str, data: bytes | None, headers: dict[str, str], timeout: float) -> _Fetched:
        request = urllib.request.Request(url, data=data, headers={"user-agent": "toolcell", **headers})
        opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=self._ssl), _NoRedirect())
        try:
            with opener.open(request, timeout=timeout) as response:
                body = response.read(MAX_DOCUMENT_BYTES + 1)
                status = response.status
        except urllib.error.HTTPError as exc:
            return _Fetched(exc.code, b"")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise AuthUnavailable(f"{_origin(url)} cannot be reached: {type(reason).__name__}") from None
        if len(body) > MAX_DOCUMENT_BYTES:
            raise AuthUnavailable(f"{_origin(url)} answered more than {MAX_DOCUMENT_BYTES} bytes")
        return _Fetched(status, body)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Keys are read from the URL configured, never from wherever a redirect points."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def _bearer(authorization: bytes) -> bytes | None:
    """The token of a ``Bearer`` Authorization value, however it is spaced (None: another scheme)."""
    scheme, _, raw = authorization.partition(b" ")
    return raw.strip() or None if scheme.lower() == b"bearer" else None


def _seconds(value: Any) -> float | None:
    """A NumericDate claim as a float (None: absent or not a number, NaN included); one too large for a
    float is +inf, not an error."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        return None
    try:
        return float(value)
    except OverflowError:
        return float("inf") if value > 0 else float("-inf")


def _quoted(text: str) -> str:
    return "".join(c for c in text if c not in '"\\' and 0x20 <= ord(c) < 0x7F)


def _scopes(claims: dict[str, Any]) -> set[str]:
    found: set[str] = set()
    scope = claims.get("scope")
    if isinstance(scope, str):
        found.update(scope.split())
    for name in ("scp", "scopes"):
        listed = claims.get(name)
        if isinstance(listed, str):
            found.update(listed.split())
        elif isinstance(listed, list):
            found.update(s for s in listed if isinstance(s, str))
    return {s for s in found if 0 < len(s) <= 256}

