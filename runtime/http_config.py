"""The ``[http]`` table of the daemon config: listeners, lock-down, limits, timeouts, observability.

Example::

    [http]
    listen = "127.0.0.1:8765"           # what `toolcell serve --http` binds when given no address
    allowed_hosts = ["mcp.internal"]    # Host names accepted besides the loopback names
    allowed_origins = ["https://app.example.com"]
    principal_rate = { per_s = 50, burst = 100 }
    tool_rate = { per_s = 200 }
    tool_rates = { "math_factor" = { per_s = 2, burst = 4 } }
    metrics_listen = "127.0.0.1:9464"
    audit_log = "/var/log/toolcell/audit.jsonl"   # or "-" for stderr

    tokens_file = "/run/secrets/toolcell/tokens.toml"   # more [[tokens]], from a secret store

    [[http.tokens]]
    principal = "ci-bot"
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    scopes = ["plugin:mathkit", "text_*"]

Tokens are stored only as SHA-256 hex digests (``python -m runtime.auth`` mints one). A scope is
``*`` (every tool), ``plugin:NAME`` (every tool of one plugin) or a glob on the public tool name.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

DEFAULT_PORT = 8765
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
#: Signing algorithms a token may use: asymmetric only.
ASYMMETRIC_ALGORITHMS = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512",
                                   "ES256", "ES384", "ES512", "EdDSA"})


class RateLimit(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A token bucket: ``per_s`` tokens added per second, at most ``burst`` saved up."""

    per_s: Annotated[float, Meta(gt=0)]
    burst: Annotated[float, Meta(ge=1)] | None = None

    @property
    def capacity(self) -> float:
        return self.burst if self.burst is not None else max(1.0, self.per_s)


class Token(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    principal: str
    #: Lowercase hex SHA-256 of the bearer token; the token itself is never stored.
    sha256: str
    scopes: list[str] = msgspec.field(default_factory=lambda: ["*"])
    #: Overrides ``principal_rate`` for this principal.
    rate: RateLimit | None = None


class OAuthConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """``[http.oauth]``: access tokens from an OAuth 2.1 authorization server (``runtime/oauth.py``)."""

    #: This server's canonical URI as clients reach it (RFC 8707); a token's ``aud`` must name it.
    resource: str
    #: The authorization server (its ``iss``); its keys are found from its metadata unless ``jwks_uri``.
    issuer: str
    jwks_uri: str | None = None
    #: Audiences accepted besides ``resource`` (default: ``resource`` only).
    audience: list[str] | None = None
    algorithms: list[str] = msgspec.field(default_factory=lambda: ["RS256", "PS256", "ES256", "EdDSA"])
    #: Clock skew allowed on ``exp``/``nbf``.
    leeway_s: Annotated[float, Meta(ge=0, le=300)] = 30.0
    #: The claim that names the caller, and what is put before it to make the principal's name.
    principal_claim: str = "sub"
    principal_prefix: str = "oauth:"
    #: Only the token's scopes that start with this count, with it stripped (e.g. "toolcell:").
    scope_prefix: str = ""
    #: Scopes every token must carry (as the identity provider writes them, prefix included).
    required_scopes: list[str] = msgspec.field(default_factory=list)
    #: Published in the resource metadata (RFC 9728 ``scopes_supported``).
    scopes_supported: list[str] | None = None
    resource_name: str | None = None
    #: A CA bundle (PEM) to trust for the issuer besides the system's (a private PKI).
    ca_file: str | None = None
    #: An unknown ``kid`` re-reads the JWKS at most this often; any JWKS is re-read after ``jwks_max_age_s``.
    jwks_refresh_min_s: Annotated[float, Meta(ge=0)] = 30.0
    jwks_max_age_s: Annotated[float, Meta(gt=0)] = 600.0
    fetch_timeout_s: Annotated[float, Meta(gt=0, le=60)] = 5.0
    #: RFC 7662 introspection for opaque (non-JWT) tokens; the client secret comes from a file or the
    #: daemon's environment, never from this config.
    introspection_endpoint: str | None = None
    introspection_client_id: str | None = None
    introspection_client_secret_file: str | None = None
    introspection_client_secret_env: str | None = None
    #: Rate limit of every OAuth principal (default: ``principal_rate``).
    rate: RateLimit | None = None
    #: Tokens not seen before (not remembered as checked or refused) that one client address (an IPv6
    #: /64) may have checked: each costs a signature check or an introspection request, before
    #: anyone is authenticated. A client sends the same token until it expires, so a few a second
    #: is plenty; past it the request gets 429 with ``Retry-After`` and nothing is checked.
    new_tokens_per_address: RateLimit = msgspec.field(default_factory=lambda: RateLimit(per_s=5.0, burst=20.0))
    #: The same for every address together: the most unknown tokens checked per second, so that
    #: requests from many addresses cannot spend the daemon's CPU (or the identity provider's
    #: introspection endpoint) on made-up tokens. Tokens already checked are never limited by this.
    new_tokens_rate: RateLimit = msgspec.field(default_factory=lambda: RateLimit(per_s=100.0, burst=200.0))
    #: A refused token is answered from memory (the same 401, nothing checked again) for this long.
    refused_memory_s: Annotated[float, Meta(ge=0, le=3600)] = 60.0


class HttpConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    listen: str | None = None
    unix: str | None = None
    path: str = "/mcp"
    allowed_hosts: list[str] = msgspec.field(default_factory=list)
    allowed_origins: list[str] = msgspec.field(default_factory=list)
    tokens: list[Token] = msgspec.field(default_factory=list)
    #: A TOML file of more ``[[tokens]]`` tables (same fields), kept apart from the config so that it
    #: can come from a secret store (a Kubernetes Secret, a systemd credential); read at start.
    tokens_file: str | None = None
    #: Access tokens from an OAuth authorization server, beside (or instead of) the static tokens.
    oauth: OAuthConfig | None = None
    #: Serve a non-loopback address without tokens (refused unless set).
    allow_unauthenticated: bool = False
    principal_rate: RateLimit | None = None
    tool_rate: RateLimit | None = None
    tool_rates: dict[str, RateLimit] = msgspec.field(default_factory=dict)
    #: Request bodies above this are refused with 413 (also capped by ``max_message_bytes``).
    max_body_bytes: Annotated[int, Meta(gt=0)] = 4 * 1024 * 1024
    #: Request line plus headers; above it the connection gets 431.
    max_header_bytes: Annotated[int, Meta(ge=1024)] = 16 * 1024
    #: POST requests being handled at once across all clients (long-lived streams not counted).
    max_concurrent_requests: Annotated[int, Meta(gt=0)] = 1024
    #: Of those, what one principal may hold: the rest stays for the others.
    max_requests_per_principal: Annotated[int, Meta(gt=0)] = 512
    #: Open client connections at once; more are answered 503 and closed.
    max_connections: Annotated[int, Meta(gt=0)] = 4096
    #: Of those, how many may be unauthenticated (no request on them has passed authentication
    #: yet: new, in their first head, or refused 401). Unset: a quarter of ``max_connections``.
    #: The rest is kept for token holders; a new connection over this budget evicts the oldest
    #: unauthenticated one, so a client with no token cannot lock token holders out.
    max_unauthenticated_connections: Annotated[int, Meta(gt=0)] | None = None
    #: Unauthenticated connections one client address (an IPv6 /64) may hold; past it, its own
    #: oldest one is evicted.
    max_unauthenticated_per_address: Annotated[int, Meta(gt=0)] = 32
    #: Time an unauthenticated connection has, from its accept (or the end of its last
    #: response), to send a whole request head; else 408 and close.
    head_timeout_s: Annotated[float, Meta(gt=0)] = 10.0
    #: The HTTP server: "h1" (toolcell's lean HTTP/1.1 loop around the httptools/llhttp parser,
    #: the default and the fast path) or "hypercorn" (adds HTTP/2; ~10x the CPU per request).
    engine: Literal["h1", "hypercorn"] = "h1"
    #: Concurrent streams on one HTTP/2 connection (HTTP/1.1 is one at a time by nature).
    max_requests_per_connection: Annotated[int, Meta(gt=0)] = 32
    max_sessions: Annotated[int, Meta(gt=0)] = 10_000
    #: Legacy sessions one principal may hold; at the cap its least recently used idle one is reused.
    max_sessions_per_principal: Annotated[int, Meta(gt=0)] = 1_000
    #: Messages of a legacy session's GET stream kept for a client that reconnects (Last-Event-ID).
    sse_replay_events: Annotated[int, Meta(gt=0)] = 64
    #: Long-lived SSE streams (legacy GET streams, subscriptions/listen) open at once.
    max_streams: Annotated[int, Meta(gt=0)] = 1_000
    #: Of those, what one principal may hold open.
    max_streams_per_principal: Annotated[int, Meta(gt=0)] = 100
    #: Keep-alive idle time, and the time a client has to finish sending request headers.
    idle_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    #: Time a client has to finish sending a request body.
    body_timeout_s: Annotated[float, Meta(gt=0)] = 30.0
    #: Unacknowledged response data older than this aborts the connection (TCP_USER_TIMEOUT).
    write_timeout_s: Annotated[float, Meta(gt=0)] = 60.0
    #: A legacy session with no request and no open stream for this long is forgotten.
    session_idle_s: Annotated[float, Meta(gt=0)] = 3600.0
    #: SSE comment keep-alives on long-lived streams.
    keepalive_s: Annotated[float, Meta(gt=0)] = 15.0
    #: On SIGTERM: time in-flight requests get to finish before they are cancelled.
    shutdown_grace_s: Annotated[float, Meta(ge=0)] = 10.0
    #: On SIGTERM, before that: time ``/healthz`` says "draining" (404) while requests are still
    #: served, so a balancer's health check takes this replica out before its listener closes (HAProxy
    #: with ``disable-on-404`` keeps sending it the sticky legacy sessions meanwhile). Set it above the
    #: balancer's detection time (HAProxy: ``inter`` x ``fall``); 0 (one daemon) stops at once.
    drain_s: Annotated[float, Meta(ge=0, le=600)] = 0.0
    metrics_listen: str | None = None
    audit_log: str | None = None

    @property
    def unauthenticated_budget(self) -> int:
        """``max_unauthenticated_connections``, or its default: a quarter of ``max_connections``."""
        if self.max_unauthenticated_connections is not None:
            return self.max_unauthenticated_connections
        return max(1, self.max_connections // 4)


def check_http_config(cfg: HttpConfig) -> list[str]:
    problems: list[str] = []
    if not cfg.path.startswith("/") or any(c in cfg.path for c in "?# "):
        problems.append("http.path must be an absolute path like /mcp")
    seen: set[str] = set()
    for i, tok in enumerate(cfg.tokens):
        if not _HEX64.match(tok.sha256):
            problems.append(f"http.tokens[{i}].sha256 must be 64 lowercase hex digits (the token's SHA-256)")
        elif tok.sha256 in seen:
            problems.append(f"http.tokens[{i}]: the same token hash appears twice")
        seen.add(tok.sha256)
        if not tok.principal.strip():
            problems.append(f"http.tokens[{i}].principal must not be empty")
    if cfg.max_connections > 1 and cfg.unauthenticated_budget >= cfg.max_connections:
        problems.append("http.max_unauthenticated_connections must be less than http.max_connections "
                        "(the rest is what token holders are sure to get)")
    if cfg.oauth is not None:
        problems.extend(check_oauth_config(cfg.oauth))
    for field_name, address in (("listen", cfg.listen), ("metrics_listen", cfg.metrics_listen)):
        if address is not None:
            try:
                parse_listen(address)
            except ValueError as exc:
                problems.append(f"http.{field_name}: {exc}")
    return problems


def _is_loopback_host(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_oauth_config(cfg: OAuthConfig) -> list[str]:
    """What is wrong with ``[http.oauth]`` (empty: nothing)."""
    problems: list[str] = []
    res = urllib.parse.urlsplit(cfg.resource)
    if res.scheme not in ("https", "http") or not res.netloc or res.fragment:
        problems.append("http.oauth.resource must be this server's absolute URI, e.g. https://mcp.example.com/mcp "
                        "(no fragment)")
    elif res.scheme == "http" and not _is_loopback_host(res.hostname):
        problems.append("http.oauth.resource must use https (http only for a loopback address)")
    for name, url in (("issuer", cfg.issuer), ("jwks_uri", cfg.jwks_uri),
                      ("introspection_endpoint", cfg.introspection_endpoint)):
        if url is not None:
            parts = urllib.parse.urlsplit(url)
            if parts.scheme != "https" or not parts.netloc:
                problems.append(f"http.oauth.{name} must be an https:// URL (keys and token checks are never "
                                "fetched in the clear)")
    bad = sorted(set(cfg.algorithms) - ASYMMETRIC_ALGORITHMS)
    if bad:
        problems.append(f"http.oauth.algorithms: {', '.join(bad)} not allowed (asymmetric algorithms only: "
                        f"{', '.join(sorted(ASYMMETRIC_ALGORITHMS))})")
    if not cfg.algorithms:
        problems.append("http.oauth.algorithms must name at least one algorithm")
    if cfg.introspection_endpoint is not None and cfg.introspection_client_id is None:
        problems.append("http.oauth.introspection_client_id is needed with introspection_endpoint")
    return problems


def parse_listen(value: str, default_host: str = "127.0.0.1", default_port: int = DEFAULT_PORT) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT``, ``PORT``, ``HOST`` or ``[v6]:PORT`` -> (host, port)."""
    value = value.strip()
    if not value:
        return default_host, default_port
    host, port_text = value, ""
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            raise ValueError(f"{value!r}: unclosed [ in an IPv6 address")
        host, rest = value[1:end], value[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"{value!r}: expected [ADDRESS]:PORT")
            port_text = rest[1:]
    elif value.isdigit():
        host, port_text = "", value
    elif value.count(":") == 1:
        host, port_text = value.split(":")
    elif ":" in value:
        raise ValueError(f"{value!r}: write IPv6 addresses as [ADDRESS]:PORT")
    host = host or default_host
    if not port_text:
        return host, default_port
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"{value!r}: the port must be a number from 0 to 65535")
    return host, int(port_text)
