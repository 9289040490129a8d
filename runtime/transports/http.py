"""Streamable HTTP transport: one endpoint (``/mcp``) serving both protocol eras, locked down.

How this works (hypercorn parses HTTP and runs this raw ASGI app on trio):

* Every request to the endpoint passes, in order: the Host allowlist (403), the Origin allowlist
  (403), bearer-token authentication (401), then per method. A POST further passes the global
  concurrency cap (503), Content-Type (415) and Accept (406) checks, the body size cap (413) and
  deadline (408), JSON-RPC decoding (400), and the per-principal rate limit (429).
* The era is chosen per POST: a body with ``params._meta[protocolVersion]`` (or
  ``server/discover``), or an ``MCP-Protocol-Version: 2026-07-28`` header, is served statelessly
  under 2026-07-28 rules (headers checked against the body, -32020); anything else belongs to a
  legacy session that ``initialize`` created (``Mcp-Session-Id``; unknown id -> 404).
* A tool call runs on the worker pools without a task of its own; the request handler parks on a
  ``CallBox`` (waiting for the client's disconnect at the same time) and answers with JSON if the
  response comes first, or switches to SSE as soon as a progress or log notification must stream
  (only if the client accepts SSE). A modern client's disconnect cancels the call and stops its
  worker; a legacy client's does not (it cancels with ``notifications/cancelled``).
* ``list_changed`` goes to legacy GET streams and to modern ``subscriptions/listen`` streams
  that asked for it; each message goes on exactly one stream.
"""

from __future__ import annotations

import collections
import functools
import math
import socket
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import Any

import msgspec
import trio

from runtime.auth import Authenticator, Principal
from runtime.oauth import AuthUnavailable, OAuthVerifier, TokenRefused, TooManyNewTokens, client_secret, metadata_paths
from runtime.calls import TraceOrigin
from runtime.clock import clock_reader
from runtime.config import ConfigError, load_config
from runtime.daemon import Daemon
from runtime.http_config import HttpConfig
from runtime.logs import log
from runtime.protocol import eras
from runtime.protocol import jsonrpc as rpc
from runtime.connection import Answered, Connection, Deferred, Dispatched
from runtime.running import NOWHERE
from runtime.protocol.core import (
    Batch,
    ConnState,
    Listen,
    Reply,
    Request,
    TaskRequest,
    ToolCall,
    requested_tool,
    valid_traceparent,
    valid_tracestate,
)
from runtime.protocol.errors import (
    HeaderMismatch,
    HttpRefusal,
    InternalError,
    InvalidParams,
    InvalidRequest,
    McpError,
    RateLimited,
    ServerBusy,
    SessionNotFound,
    ShuttingDown,
    http_status,
    status_of_code,
)
from runtime.ratelimit import RateLimiter
from runtime.transports import mcp_headers
from runtime.transports.asgi import (
    BodyTooLarge,
    ClientGone,
    Exchange,
    Headers,
    Receive,
    RequestHeaders,
    Responder,
    Send,
    accepts,
    lifespan,
    read_body,
)
from runtime.transports.h1 import source_of
from runtime.transports.http_sessions import CallBox, LegacySession, PushStream, SessionTable

#: How long a call is awaited before its client's disconnect is watched for too.
QUICK_WAIT_S = 0.05
#: The quick waits' timer resolution (see ``wake_slow_calls``).
QUICK_TICK_S = 0.01

_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
_MODERN_HEADER_VALUES = frozenset(v.encode() for v in eras.MODERN_VERSIONS)
_LEGACY_HEADER_VALUES = frozenset(v.encode() for v in eras.LEGACY_VERSIONS)
_EXPOSE = b"mcp-session-id, mcp-protocol-version, retry-after, www-authenticate"
_ALLOW = b"GET, POST, DELETE, OPTIONS"
_RETRY_SOON: Headers = [(b"retry-after", b"1")]


def _host_name(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[: end + 1] if end > 0 else value
    return value.rsplit(":", 1)[0] if ":" in value else value


def _trace_origin(headers: RequestHeaders, session_id: str | None) -> TraceOrigin:
    """A request's W3C trace context headers (a malformed ``traceparent`` is ignored, as W3C says)."""
    parent = headers.get(b"traceparent")
    text = parent.decode("latin-1").strip() if parent is not None else None
    if text is not None and not valid_traceparent(text):
        text = None
    raw = headers.get(b"tracestate") if text is not None else None
    state = raw.decode("latin-1") if raw is not None else None
    return TraceOrigin(text, state if valid_tracestate(state) else None, session_id, "tcp")


def _asgi_source(scope: dict[str, Any]) -> Hashable | None:
    """The client address of an ASGI request as the per-address limits count it (``source_of``)."""
    client = scope.get("client")
    if not client:
        return None
    host = str(client[0])
    return source_of(socket.AF_INET6 if ":" in host else socket.AF_INET, (host, 0))


def _header_title(name: bytes) -> str:
    """A lower-case header name as its specification writes it (``mcp-session-id`` -> ``Mcp-Session-Id``)."""
    text = name.decode("latin-1")
    return _HEADER_TITLES.get(text) or "-".join(part.capitalize() for part in text.split("-"))


_HEADER_TITLES = {"mcp-protocol-version": "MCP-Protocol-Version", "last-event-id": "Last-Event-ID"}


def _count_off(counts: dict[str, int], name: str) -> None:
    """One fewer for ``name`` (a principal's share of requests or streams); none left: no entry."""
    left = counts[name] - 1
    if left:
        counts[name] = left
    else:
        del counts[name]


class HttpApp:
    """The ASGI application. One per daemon; it may be served on several listeners."""

    #: It tells the server which connections passed authentication (the exchange's
    #: ``authenticated``), so that the server can keep unauthenticated ones to their own budget.
    vouches_for_connections = True

    def __init__(self, daemon: Daemon, cfg: HttpConfig, bound_hosts: Iterable[str] = ()) -> None:
        self.daemon = daemon
        self.core = daemon.core
        self.cfg = cfg
        self.path = cfg.path
        oauth = OAuthVerifier(cfg.oauth, secret=client_secret(cfg.oauth)) if cfg.oauth is not None else None
        self.auth = Authenticator(cfg, oauth)
        self.oauth = oauth
        #: Where the RFC 9728 resource metadata is served (with OAuth on).
        self._metadata_paths = frozenset(metadata_paths(cfg.oauth.resource)) if cfg.oauth is not None else frozenset()
        #: trio's clock, read in one call (``runtime.clock``).
        self._clock = clock_reader()
        self.hosts = set(_LOOPBACK_NAMES) | {_host_name(h) for h in cfg.allowed_hosts}
        self.hosts |= {_host_name(h) for h in bound_hosts}
        self.any_host = "*" in cfg.allowed_hosts
        self._hosts_seen: set[bytes] = set()
        self.origins = {o.strip().lower().rstrip("/") for o in cfg.allowed_origins}
        self.any_origin = "*" in self.origins
        self.sessions = SessionTable(cfg.max_sessions, cfg.session_idle_s, cfg.max_sessions_per_principal)
        self.listens: set[PushStream] = set()
        #: Token buckets by principal name, and by tool name.
        self.principal_limiter = RateLimiter()
        self.tool_limiter = RateLimiter()
        #: What each Accept value allows (JSON, SSE): a few distinct values, each parsed once.
        self._accept_verdicts: dict[bytes | None, tuple[bool, bool]] = {}
        self.max_body = min(cfg.max_body_bytes, daemon.config.max_message_bytes)
        self.active = 0
        self.streams = 0
        #: The same counts by principal (each principal's share is capped too: one cannot lock others out).
        self.active_by: dict[str, int] = {}
        self.streams_by: dict[str, int] = {}
        self.shutting_down = False
        self.status_counts: dict[int, int] = {}
        self.rate_limited = {"principal": 0, "tool": 0, "new_tokens": 0}
        self.audit: Any = None  # an AuditLog, for calls refused before they reach a pool
        #: trio's clock when the request being read arrived (limits of one request share one reading).
        self._now = 0.0
        #: Calls in their quick wait, oldest first, with the time it ends (see ``wake_slow_calls``).
        self._quick: collections.deque[tuple[float, CallBox]] = collections.deque()
        self._quick_lot = trio.lowlevel.ParkingLot()
        self._quick_sweeper = False

    async def reload_tokens(self) -> None:
        """``SIGHUP``: the bearer tokens (``[[http.tokens]]``, ``http.tokens_file``) read again from the
        configuration file the daemon was started with; a file that does not load keeps those in use.
        Nothing else of the file is applied (that takes a restart)."""
        path = self.daemon.scope.config if self.daemon.scope is not None else None
        if path is None:
            return  # no configuration file: no tokens to read again
        try:
            cfg = await trio.to_thread.run_sync(load_config, path, {})
        except ConfigError as exc:
            log("tokens_reload_failed", level="error", error=str(exc)[:2000], note="the tokens in use are kept")
            return
        before = self.auth.static_principals()
        why = self.auth.replace_tokens(cfg.http.tokens)
        if why is not None:
            log("tokens_reload_failed", level="error", error=why, note="the tokens in use are kept")
            return
        gone = before - self.auth.static_principals()
        # A principal no token names any more: what it opened ends (a request it sends is refused).
        ended = self._end_streams(lambda stream: stream.principal in gone)
        log("tokens_reloaded", tokens=len(cfg.http.tokens), principals_removed=sorted(gone)[:50], streams_ended=ended)

    # -- ASGI entry ----------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            ext = scope.get("extensions") or {}
            headers = ext.get("toolcell.headers")
            if headers is None:
                headers = RequestHeaders(scope["headers"])
            await self._serve(scope["method"], scope["path"], headers, receive, Responder(send, [], ext.get("toolcell.respond")),
                              ext.get("toolcell.take_body"), ext.get("toolcell.authenticated"), _asgi_source(scope))
        elif kind == "lifespan":
            await lifespan(receive, send)

    def serve_exchange(self, x: Exchange) -> Awaitable[None]:
        """toolcell's HTTP/1.1 server hands each request here directly (no ASGI scope to build and
        read back): the same request as ``__call__`` sees, from the exchange's own fields. (Not a
        coroutine itself: what it returns is awaited by the server, one frame fewer per wake.)"""
        return self._serve(x.method, x.path, x.headers, x.receive, Responder(x.send, [], x.respond, x.respond_json),
                           x.take_body, x.authenticated, x.source)

    async def _serve(self, method: str, path: str, headers: RequestHeaders, receive: Receive, r: Responder,
                     take_body: Callable[[], bytes | None] | None, vouch: Callable[[], None] | None = None,
                     source: Hashable | None = None) -> None:
        try:
            await self._http(method, path, headers, receive, r, take_body, vouch, source)
        except Exception as exc:  # noqa: BLE001 - our bug: answer 500 if we still can, never kill the server
            log("http_internal_error", level="error", error=f"{type(exc).__name__}: {exc}")
            if not r.started:
                await r.body(500, rpc.error_reply(None, InternalError()))
        status = r.status or 499  # 499: the client went away before an answer (nginx's convention)
        self.status_counts[status] = self.status_counts.get(status, 0) + 1

    def _http(self, method: str, path: str, headers: RequestHeaders, receive: Receive, r: Responder,
              take_body: Callable[[], bytes | None] | None, vouch: Callable[[], None] | None = None,
              source: Hashable | None = None) -> Awaitable[None]:
        """What to await to answer this request: the checks every request passes are plain calls, so
        a call's coroutine is awaited by ``_serve`` directly, not through one frame per check.
        ``take_body``: the whole body if the server already has it (else None: read ``receive``).
        ``vouch``: the server's word for "this connection passed authentication" (h1's budget).
        ``source``: the client's address as per-address limits count it (an IPv6 /64; None: unknown)."""
        if headers.duplicate is not None:
            # RFC 9112 3.2 (Host), and the same for every header a decision here reads: which of two
            # values would count is exactly what an attacker would like to choose.
            return self._plain_error(r, 400, f"Bad Request: the {_header_title(headers.duplicate)} header "
                                     "appears more than once; send it once", [(b"connection", b"close")])
        if path != self.path:
            if method in ("GET", "HEAD"):
                if path == "/healthz":
                    return self._healthz(r, headers.get(b"authorization"))
                if path == "/readyz":
                    return self._readyz(r)
                if path == "/livez":
                    return r.body(200, b'{"status":"alive"}', headers=[(b"cache-control", b"no-store")])
            if path in self._metadata_paths and method in ("GET", "HEAD", "OPTIONS"):
                return self._resource_metadata(r, method)
            return r.body(404, b"Not Found\n", b"text/plain")
        if headers.size > self.cfg.max_header_bytes:
            # hypercorn caps only heads that arrive in pieces; this catches one that came whole.
            return self._plain_error(r, 431, "Request Header Fields Too Large", [(b"connection", b"close")])
        host = headers.get(b"host")
        if host is not None and not self.any_host and host not in self._hosts_seen:
            if _host_name(host.decode("latin-1")) not in self.hosts:
                return self._plain_error(r, 403, "Forbidden: Host header not allowed")
            if len(self._hosts_seen) < 256:  # allowed Host values as sent (only allowed ones: bounded)
                self._hosts_seen.add(host)
        origin = headers.get(b"origin")
        if origin is not None:
            if not self._origin_ok(origin.decode("latin-1")):
                return self._plain_error(r, 403, "Forbidden: Origin not allowed")
            r.extra = [(b"access-control-allow-origin", origin), (b"vary", b"origin"),
                       (b"access-control-expose-headers", _EXPOSE)]
        if method == "OPTIONS":
            requested = headers.get(b"access-control-request-headers") or b"content-type"
            return r.body(204, b"", None, [(b"access-control-allow-methods", _ALLOW),
                                                 (b"access-control-allow-headers", requested),
                                                 (b"access-control-max-age", b"600")])
        authorization = headers.get(b"authorization")
        principal = self.auth.authenticate(authorization)
        if principal is None:
            if authorization and self.oauth is not None:
                return self._oauth_then(method, headers, receive, r, take_body, authorization, self.oauth, vouch,
                                        source)
            return self._unauthorized(r)
        return self._route(method, headers, principal, receive, r, take_body, vouch)

    def _route(self, method: str, headers: RequestHeaders, principal: Principal, receive: Receive, r: Responder,
               take_body: Callable[[], bytes | None] | None, vouch: Callable[[], None] | None = None) -> Awaitable[None]:
        if vouch is not None:
            vouch()  # authenticated: the connection leaves the server's unauthenticated budget
        if method == "POST":
            return self._post(r, headers, principal, receive, take_body() if take_body is not None else None)
        if method == "GET":
            return self._get(r, headers, principal, receive)
        if method == "DELETE":
            return self._delete(r, headers, principal)
        return self._plain_error(r, 405, f"Method Not Allowed: {method}", [(b"allow", _ALLOW)])

    def _unauthorized(self, r: Responder, refused: TokenRefused | None = None) -> Awaitable[None]:
        oauth = self.oauth
        if oauth is None:
            return self._plain_error(r, 401, "Unauthorized: a valid bearer token is required",
                                     [(b"www-authenticate", b'Bearer realm="toolcell"')])
        status = refused.status if refused is not None else 401
        why = f": {refused.description}" if refused is not None else ": a bearer token is required"
        return self._plain_error(r, status, ("Forbidden" if status == 403 else "Unauthorized") + why,
                                 [(b"www-authenticate", oauth.challenge(refused))])

    async def _oauth_then(self, method: str, headers: RequestHeaders, receive: Receive, r: Responder,
                          take_body: Callable[[], bytes | None] | None, authorization: bytes,
                          oauth: OAuthVerifier, vouch: Callable[[], None] | None = None,
                          source: Hashable | None = None) -> None:
        """A token not seen before: check it with the issuer's keys (or introspection), then go on."""
        try:
            principal = await oauth.verify(authorization, source)
        except TokenRefused as refused:
            return await self._unauthorized(r, refused)
        except TooManyNewTokens as exc:
            self.rate_limited["new_tokens"] += 1  # toolcell_http_rate_limited{limit="new_tokens"}
            retry = max(1, math.ceil(exc.retry_after_s))
            return await self._plain_error(r, 429, f"Too Many Requests: {exc}; nothing was checked, retry in "
                                           f"{retry} s (a client keeps using the token it has)",
                                           [(b"retry-after", str(retry).encode())])
        except AuthUnavailable as exc:
            log("oauth_unavailable", level="warning", error=str(exc))
            return await self._plain_error(r, 503, "Service Unavailable: access tokens cannot be checked now "
                                           f"({exc}); retry later", [(b"retry-after", b"5")])
        await self._route(method, headers, principal, receive, r, take_body, vouch)

    async def _resource_metadata(self, r: Responder, method: str) -> None:
        """RFC 9728 protected resource metadata (public: clients read it before they have a token)."""
        oauth = self.oauth
        assert oauth is not None
        cors = [(b"access-control-allow-origin", b"*"), (b"cache-control", b"max-age=300")]
        if method == "OPTIONS":
            return await r.body(204, b"", None, [*cors, (b"access-control-allow-methods", b"GET, HEAD, OPTIONS"),
                                                 (b"access-control-allow-headers", b"mcp-protocol-version")])
        await r.body(200, oauth.metadata, headers=cors)

    def _scope_refusal(self, r: Responder, principal: Principal, env: rpc.Envelope) -> Awaitable[None] | None:
        """An OAuth principal calling a tool outside its scopes is told which scope to ask for (403
        ``insufficient_scope``, RFC 6750), so that its client can step up; None when the tool is in
        scope or does not exist (then it is answered like any unknown tool)."""
        oauth = self.oauth
        if oauth is None:
            return None
        name = requested_tool(env.params)
        entry = self.daemon.catalog.get(name) if name else None
        if entry is None or principal.allows(entry):
            return None
        refused = TokenRefused(403, "insufficient_scope", f"calling {name} needs scope plugin:{entry.plugin}",
                               oauth.scope_for_plugin(entry.plugin))
        self._audit_refused(env, principal, "insufficient_scope")
        return self._unauthorized(r, refused)

    def winding_down(self) -> bool:
        """Draining (SIGTERM with ``http.drain_s``): the server closes each connection after its
        response, so a balancer keeps none to this replica (``H1Server.winding_down``)."""
        return self.daemon.draining

    def _origin_ok(self, origin: str) -> bool:
        o = origin.strip().lower().rstrip("/")
        if self.any_origin or o in self.origins:
            return True
        scheme, sep, rest = o.partition("://")
        if not sep or scheme not in ("http", "https") or "/" in rest:
            return False
        return self.any_host or _host_name(rest) in self.hosts

    @property
    def ready(self) -> bool:
        """Whether a balancer should send this daemon requests: its catalog is loaded and it is not
        draining (SIGTERM with ``http.drain_s``: still serving) or shutting down. The one flag
        ``/readyz`` and ``/healthz`` report."""
        return self.daemon.ready and not self.daemon.draining and not self.shutting_down

    async def _readyz(self, r: Responder) -> None:
        """Readiness (Kubernetes' readinessProbe, a balancer's check): 200 while ``ready``, else 503.
        Liveness is ``/livez``: 200 whenever the server answers, starting and draining included."""
        ready = self.ready
        await r.body(200 if ready else 503, b'{"ready":true}' if ready else b'{"ready":false}',
                     headers=[(b"cache-control", b"no-store")])

    async def _healthz(self, r: Responder, authorization: bytes | None = None) -> None:
        """Readiness: 200 only while this daemon wants requests. On SIGTERM it says "draining" for
        ``http.drain_s`` while it still serves, so a balancer stops sending before the listener closes;
        then "stopping" (503). Draining answers 404, which HAProxy's ``http-check disable-on-404`` reads as
        "no new clients, but keep sending the sticky ones" (legacy sessions finish on this replica);
        any other balancer reads it as down, like a 503.

        Anyone who reaches the port gets ``{"status": ...}``, all a balancer or a probe reads. The
        details are for a request with a token the daemon accepts (or a daemon without tokens):
        ``catalog`` (the fingerprint of the tools it serves: which plugin set), ``catalog_differs``
        (the daemons sharing its task store that serve another catalog, as ``host:pid:nonce``), counts
        of tools, plugins, refused plugins, sessions and calls in flight."""
        daemon = self.daemon
        ready = self.ready
        status = "ready" if ready else ("stopping" if self.shutting_down else
                                        "draining" if daemon.draining else "starting")
        tasks = daemon.tasks
        if self.auth.authenticate(authorization) is None:
            body = rpc.encode({"status": status})
        else:
            body = rpc.encode({"status": status, "tools": len(daemon.catalog), "plugins": len(daemon.plugins),
                               "refused": len(daemon.failed), "sessions": len(self.sessions),
                               "inflight": daemon.inflight, "catalog": daemon.catalog.fingerprint,
                               "catalog_differs": tasks.catalogs_differing() if tasks is not None else []})
        await r.body(200 if ready else 404 if status == "draining" else 503, body,
                     headers=[(b"cache-control", b"no-store")])

    async def _plain_error(self, r: Responder, status: int, message: str, headers: Headers | None = None,
                           id_bytes: bytes | None = None) -> None:
        """Refuse at the HTTP layer (before JSON-RPC is read): the status says why; the code is -32600."""
        await self._refuse(r, HttpRefusal(status, message), id_bytes, headers)

    async def _refuse(self, r: Responder, error: McpError, id_bytes: bytes | None = None,
                      headers: Headers | None = None, modern: bool = True) -> None:
        """Answer a POST with ``error`` alone; the status comes from the error table."""
        if isinstance(error, RateLimited):
            headers = [*(headers or []), (b"retry-after", str(max(1, math.ceil(error.retry_after_s))).encode())]
        await r.body(http_status(error, modern), rpc.error_reply(id_bytes, error), headers=headers)

    # -- POST ----------------------------------------------------------------------------------

    async def _too_large(self, r: Responder) -> None:
        await self._plain_error(r, 413, f"Payload Too Large: the limit is {self.max_body} bytes",
                                [(b"connection", b"close")])

    async def _post(self, r: Responder, headers: RequestHeaders, principal: Principal, receive: Receive,
                    body: bytes | None = None) -> None:
        """``body``: the whole body when the server already has it (no deadline needed to read it)."""
        cfg = self.cfg
        if self.shutting_down:
            return await self._refuse(r, ShuttingDown("Service Unavailable: shutting down"), None,
                                      [(b"connection", b"close")])
        name = principal.name
        held = self.active_by.get(name, 0)
        if self.active >= cfg.max_concurrent_requests or held >= cfg.max_requests_per_principal:
            whose = "" if self.active >= cfg.max_concurrent_requests else f" for principal {name}"
            return await self._refuse(r, ServerBusy(f"Service Unavailable: too many requests in progress{whose}; "
                                                    "retry later", None), None, [(b"retry-after", b"1")])
        ctype = headers.get(b"content-type")
        if ctype is not None and ctype != b"application/json" and \
                ctype.split(b";", 1)[0].strip().lower() != b"application/json":
            return await self._plain_error(r, 415, "Unsupported Media Type: send application/json")
        accept = headers.get(b"accept")
        verdict = self._accept_verdicts.get(accept)  # a client sends the same Accept every time
        if verdict is None:
            verdict = accepts(accept)
            if len(self._accept_verdicts) < 64:
                self._accept_verdicts[accept] = verdict
        can_json, can_sse = verdict
        if not (can_json or can_sse):
            return await self._plain_error(r, 406, "Not Acceptable: accept application/json or text/event-stream")
        if body is not None:
            if len(body) > self.max_body:  # the whole body is here: its length is what counts
                return await self._too_large(r)
        else:
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.max_body:
                return await self._too_large(r)
        self.active += 1
        self.active_by[name] = held + 1
        try:
            if body is None:
                with trio.move_on_after(cfg.body_timeout_s) as deadline:
                    try:
                        body = await read_body(receive, self.max_body)
                    except BodyTooLarge:
                        return await self._too_large(r)
                    except ClientGone:
                        return
                if deadline.cancelled_caught:
                    return await self._plain_error(r, 408, "Request Timeout: the body took too long",
                                                   [(b"connection", b"close")])
            assert body is not None
            await self._message(r, headers, principal, body, can_json, can_sse, receive)
        finally:
            self.active -= 1
            left = self.active_by[name] - 1  # ``_count_off``, written out: once per request
            if left:
                self.active_by[name] = left
            else:
                del self.active_by[name]

    def _message(self, r: Responder, headers: RequestHeaders, principal: Principal, body: bytes,
                 can_json: bool, can_sse: bool, receive: Receive) -> Awaitable[None]:
        # The body is decoded once here; the core reads each params once (``parse``) and chooses the era.
        try:
            env = rpc.decode_envelope(body)
        except McpError as exc:
            return self._refuse(r, exc, modern=False)
        id_bytes = None
        if isinstance(env, list):
            count = len(env)  # a batch costs a token per message (below)
        else:
            count = 1
            request_id = env.id
            if type(request_id) is int or type(request_id) is str:  # rpc.valid_id, inline
                id_bytes = rpc.encode_id(request_id)
        rate = principal.rate or self.cfg.principal_rate
        # One reading of the clock for this request's limits (a tool's limit is taken in this same tick).
        self._now = now = self._clock()
        if rate is not None:
            # A batch costs a token per message: one POST must not run more calls than the limit allows.
            if count > 1:
                if count > rate.capacity:
                    return self._refuse(r, InvalidRequest(
                        f"Invalid Request: a batch of {count} messages is more than principal {principal.name}'s "
                        f"rate limit allows at once ({rate.capacity:g}); send fewer at a time"), None, modern=False)
            wait = self.principal_limiter.take(principal.name, rate, now, count)
            if wait > 0:
                self.rate_limited["principal"] += 1
                self._audit_refused(env, principal, "rate_limited")
                return self._refuse(r, RateLimited(f"principal {principal.name}", wait), id_bytes)
        if isinstance(env, list):
            return self._legacy_batch(r, headers, principal, env)
        if principal.oauth and not principal.all_tools and env.method == "tools/call":
            refusal = self._scope_refusal(r, principal, env)
            if refusal is not None:
                return refusal
        req = self.core.parse(ConnState(), env)
        version = headers.get(b"mcp-protocol-version")
        if req.modern or (version is not None and version.strip() in _MODERN_HEADER_VALUES):
            return self._modern(r, headers, principal, req, id_bytes, can_sse, receive)
        return self._legacy(r, headers, principal, env, id_bytes, can_sse, receive, req)

    def _connection(self, principal: Principal, state: ConnState | None = None,
                    push: Callable[[bytes], None] | None = None) -> Connection:
        limited = self.cfg.tool_rate is not None or bool(self.cfg.tool_rates)
        # A principal with every tool sees the whole catalog: no view to compute on each request.
        return Connection(self.daemon, state, principal.name, push=push,
                          admit=functools.partial(self._tool_limited, principal=principal) if limited else None,
                          catalog_view=None if principal.all_tools else
                          (lambda: principal.catalog(self.daemon.catalog)))

    async def _answer(self, r: Responder, done: Dispatched, modern: bool) -> None:
        """Send what dispatching a non-call action came to."""
        if type(done) is Deferred:  # a trip to the task store
            data, code = await done.work()
            if data is None:
                return await r.body(202, b"", None)
            status = status_of_code(code, modern) if code is not None else 200
            # 503 here is the task store being unavailable (a Redis restart): retryable, and said so.
            return await r.body(status, data, headers=_RETRY_SOON if status == 503 else None)
        if type(done) is not Answered or done.data is None:
            return await r.body(202, b"", None)  # a notification, or a cancel (on HTTP, closing the stream cancels)
        status = status_of_code(done.error_code, modern) if done.error_code is not None else 200
        await r.body(status, done.data)

    @staticmethod
    async def _stream_pending(r: Responder, box: CallBox) -> None:
        """Send what ``box`` holds as SSE events, switching the response to SSE first if needed."""
        batch, box.pending = box.pending, []
        if not r.started:
            await r.start_sse()
        await r.events(batch)

    async def _streamed(self, r: Responder, done: Dispatched, box: CallBox) -> None:
        """Send what a legacy request that waits on the task store came to, streaming what it emits
        meanwhile (our requests to the client) as SSE before its answer."""
        if type(done) is not Deferred:
            return await self._answer(r, done, modern=False)
        outcome: list[tuple[bytes | None, int | None]] = []

        async def work() -> None:
            outcome.append(await done.work())
            box.wake()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(work)
            while True:
                if box.pending:
                    await self._stream_pending(r, box)
                    continue
                if outcome:
                    break
                await box.park()
        data, code = outcome[0]
        if data is None:
            return await (r.end() if r.started else r.body(202, b"", None))
        if r.sse:
            await r.events([data])
            return await r.end()
        return await r.body(status_of_code(code, modern=False) if code is not None else 200, data)

    # -- modern (2026-07-28) ---------------------------------------------------------------------

    async def _modern(self, r: Responder, headers: RequestHeaders, principal: Principal, req: Request,
                      id_bytes: bytes | None, can_sse: bool, receive: Receive) -> None:
        conn = self._connection(principal)
        if self.daemon.calls.tracer is not None:
            conn.origin = _trace_origin(headers, None)
        if req.method:
            if req.is_request and not req.modern:
                return await self._refuse(r, InvalidParams(
                    f"Invalid params: params._meta must carry {eras.META_VERSION} and {eras.META_CLIENT_CAPS}"), id_bytes)
            try:
                mcp_headers.check(req, headers.get(b"mcp-protocol-version"), headers.get(b"mcp-method"),
                                  headers.get(b"mcp-name"), headers.params, (conn.catalog() or self.daemon.catalog).get)
            except HeaderMismatch as exc:
                self._audit_refused(req.env, principal, "header_mismatch")
                return await self._refuse(r, exc, id_bytes)
        action = conn.run(req)
        match action:
            case ToolCall():
                return await self._call(r, conn, action, can_sse, receive, None)
            case Listen():
                return await self._listen(r, principal, conn, action, can_sse, receive)
            case _:
                return await self._answer(r, conn.dispatch(action, NOWHERE), modern=True)

    async def _listen(self, r: Responder, principal: Principal, conn: Connection, listen: Listen, can_sse: bool,
                      receive: Receive) -> None:
        if not can_sse:
            return await self._plain_error(r, 406, "Not Acceptable: subscriptions/listen answers with text/event-stream",
                                           id_bytes=listen.id_bytes)
        refusal = self._no_stream_for(principal.name)
        if refusal is not None:
            return await self._refuse(r, refusal, listen.id_bytes, [(b"retry-after", b"5")])
        stream = PushStream(listen, principal=principal.name)
        self.listens.add(stream)
        # A listen is a stream, not a request in progress: it leaves the POST budget (``_post`` holds
        # it for the request) and counts against the stream budget instead.
        self.active -= 1
        self.active_by[principal.name] -= 1
        self._stream_opened(principal.name)
        try:
            conn.dispatch(listen, stream)  # the acknowledgement is the stream's first event
            await r.start_sse()
            await self._pump(r, stream, receive)
        finally:
            conn.close()
            self.listens.discard(stream)
            self._stream_closed(principal.name)
            self.active += 1
            self.active_by[principal.name] = self.active_by.get(principal.name, 0) + 1

    def _no_stream_for(self, name: str) -> ServerBusy | None:
        """Why ``name`` may not open another long-lived stream now (None: it may)."""
        if self.streams >= self.cfg.max_streams:
            return ServerBusy("Service Unavailable: too many open streams; retry later", None)
        if self.streams_by.get(name, 0) >= self.cfg.max_streams_per_principal:
            return ServerBusy(f"Service Unavailable: principal {name} has {self.cfg.max_streams_per_principal} "
                              "streams open; close one or retry later", None)
        return None

    def _stream_opened(self, name: str) -> None:
        self.streams += 1
        self.streams_by[name] = self.streams_by.get(name, 0) + 1

    def _stream_closed(self, name: str) -> None:
        self.streams -= 1
        _count_off(self.streams_by, name)

    # -- legacy (2025-03-26 … 2025-11-25) ------------------------------------------------------

    def _session_or_refusal(self, headers: RequestHeaders, principal: Principal,
                            id_bytes: bytes | None) -> LegacySession | McpError:
        sid = headers.get(b"mcp-session-id")
        if sid is None:
            return HttpRefusal(400, "Bad Request: Mcp-Session-Id header is required (send initialize first), or use "
                               f"protocol 2026-07-28 with {eras.META_VERSION} in params._meta")
        session = self.sessions.get(sid, principal)
        if session is None:
            return SessionNotFound("Session not found: initialize a new session")
        version = headers.get(b"mcp-protocol-version")
        if version is not None and version.strip() not in _LEGACY_HEADER_VALUES:
            return HttpRefusal(400, f"Bad Request: unsupported MCP-Protocol-Version {version.decode('latin-1')!r}; "
                               "supported: " + ", ".join(eras.LEGACY_VERSIONS))
        return session

    def _legacy(self, r: Responder, headers: RequestHeaders, principal: Principal, env: rpc.Envelope,
                id_bytes: bytes | None, can_sse: bool, receive: Receive, req: Request | None = None) -> Awaitable[None]:
        if headers.get(b"mcp-session-id") is None and env.method == "initialize" and env.id is not msgspec.UNSET:
            return self._initialize(r, principal, env)
        session = self._session_or_refusal(headers, principal, id_bytes)
        if isinstance(session, McpError):
            return self._refuse(r, session, id_bytes, modern=False)
        conn = session.conn
        if self.daemon.calls.tracer is not None:  # this request's trace context (read when a call starts, now)
            conn.origin = _trace_origin(headers, session.id)
        # Read once: the era choice already parsed it; only an early answer (an error, whose id
        # rule depends on the session's revision) is worded again for this session.
        if req is None or req.early is not None:
            req = conn.parse(env)
        action = conn.run(req)
        if type(action) is ToolCall:
            return self._call(r, conn, action, can_sse, receive, session)
        if type(action) is TaskRequest:
            # A 2025-11-25 tasks/result may ask the task's questions on its own stream.
            box = CallBox(stream=can_sse)
            return self._in_session(session, self._streamed(r, conn.dispatch(action, box), box))
        return self._in_session(session, self._answer(r, conn.dispatch(action, NOWHERE), modern=False))

    async def _in_session(self, session: LegacySession, answering: Awaitable[None]) -> None:
        """Await ``answering`` with ``session`` marked busy: a busy session never expires, and its idle
        time starts when the request ends. (Nothing runs between the sync part that built
        ``answering`` and this, so the mark covers the whole request.)"""
        session.busy += 1
        try:
            await answering
        finally:
            session.busy -= 1
            session.last_seen = self._clock()

    async def _initialize(self, r: Responder, principal: Principal, env: rpc.Envelope) -> None:
        state = ConnState()
        action = self.core.handle(state, env, principal.catalog(self.daemon.catalog))
        assert type(action) is Reply
        if action.error_code is not None or action.data is None:
            status = status_of_code(action.error_code, modern=False) if action.error_code is not None else 200
            return await r.body(status, action.data or b"")
        session = self.sessions.create(principal, state, trio.current_time())
        if session is None:
            return await self._refuse(r, ServerBusy("Service Unavailable: too many sessions; retry later", None),
                                      rpc.encode_id(env.id), [(b"retry-after", b"5")], modern=False)
        keep = self.cfg.sse_replay_events

        def push(note: bytes, session: LegacySession = session) -> None:  # the GET stream's messages
            event_id = session.record(note, keep)
            if session.stream is not None:
                session.stream.push_event(event_id, note)

        session.conn = self._connection(principal, state, push)
        log("http_session_opened", principal=principal.name, version=state.legacy_version)
        await r.body(200, action.data, headers=[(b"mcp-session-id", session.id.encode())])

    async def _legacy_batch(self, r: Responder, headers: RequestHeaders, principal: Principal,
                            items: list[msgspec.Raw]) -> None:
        if headers.get(b"mcp-session-id") is None:
            return await self._plain_error(r, 400, "Bad Request: a batch needs an Mcp-Session-Id (initialize is never batched)")
        session = self._session_or_refusal(headers, principal, None)
        if isinstance(session, McpError):
            return await self._refuse(r, session, modern=False)
        conn = session.conn
        session.busy += 1
        try:
            action = conn.handle_batch(items)
            if type(action) is not Batch:  # the batch as a whole was refused
                return await self._answer(r, conn.dispatch(action, NOWHERE), modern=False)
            data = await conn.run_batch(action)
            if data is None:
                return await r.body(202, b"", None)
            await r.body(200, data)
        finally:
            session.busy -= 1
            session.last_seen = self._clock()

    # -- tool calls (both eras) ----------------------------------------------------------------

    def _audit_refused(self, env: Any, principal: Principal, outcome: str) -> None:
        """One audit line for a ``tools/call`` (or each in a batch) refused before the core saw it."""
        if self.audit is None:
            return
        items = env if isinstance(env, list) else [env]
        for item in items:
            if isinstance(item, msgspec.Raw):
                try:
                    item = rpc.envelope_from_raw(item)
                except McpError:
                    continue
            if getattr(item, "method", None) != "tools/call":
                continue
            self.audit.write(principal.name, requested_tool(item.params), None, None, outcome, 0.0)

    def _tool_limited(self, call: ToolCall, principal: Principal) -> RateLimited | None:
        cfg = self.cfg
        rate = cfg.tool_rates.get(call.entry.name) or cfg.tool_rate
        if rate is None:
            return None
        wait = self.tool_limiter.take(call.entry.name, rate, self._now)
        if wait <= 0:
            return None
        self.rate_limited["tool"] += 1
        if self.audit is not None:
            self.audit.write(principal.name, call.entry.name, call.entry.plugin, len(rpc.encode(call.arguments)),
                             "rate_limited", 0.0)
        return RateLimited(f"tool {call.entry.name}", wait)

    async def _call(self, r: Responder, conn: Connection, call: ToolCall, can_sse: bool, receive: Receive,
                    session: LegacySession | None) -> None:
        """Run a tool call and answer it (a legacy ``session`` is marked busy meanwhile, like
        ``_in_session``)."""
        if session is not None:
            session.busy += 1
        try:
            box = CallBox(stream=can_sse)
            started = conn.dispatch(call, box)
            if type(started) is Deferred:  # it runs as a task: the answer is the task, once stored
                try:
                    return await self._answer(r, started, call.modern)
                finally:
                    if session is None:
                        conn.close()
            if type(started) is Answered:  # answered before it ran (a rate limit, a duplicate id, input_required)
                assert started.data is not None
                if started.error is not None and isinstance(started.error, RateLimited):
                    return await self._refuse(r, started.error, call.id_bytes)
                status = 200
                if call.modern and started.error_code is not None:
                    status = status_of_code(started.error_code, modern=True)
                return await r.body(status, started.data)
            request_id = call.request_id
            detached = False  # True once the call no longer needs cancelling by us
            quick = True
            try:
                while True:
                    if box.final is None and not box.pending and not box.is_cancelled:
                        if quick:
                            # Most calls finish within milliseconds: wait for them on an event, and only
                            # then start watching for a disconnect (which costs a cancellation to undo).
                            # ``wake_slow_calls`` ends the wait after QUICK_WAIT_S (no timer per call).
                            quick = False
                            if self._quick_sweeper:
                                if not self._quick:
                                    self._quick_lot.unpark()
                                # ``_now``: this request's clock reading (nothing awaited since it was taken).
                                self._quick.append((self._now + QUICK_WAIT_S, box))
                                await box.park()
                            else:
                                with trio.move_on_after(QUICK_WAIT_S):
                                    await box.park()
                            continue
                        with trio.CancelScope() as parked:
                            box.scope = parked
                            message = await receive()
                        box.scope = None
                        if not parked.cancelled_caught:
                            if message["type"] != "http.disconnect":
                                continue
                            r.gone = True
                    if r.gone:
                        # Modern: the disconnect is the cancellation. Legacy: it is not; the call
                        # runs on (a later notifications/cancelled or DELETE can still stop it).
                        detached = session is not None
                        return
                    if box.is_cancelled:
                        detached = True
                        return await (r.end() if r.started else r.body(202, b"", None))
                    if box.overflow:
                        r.gone = True
                        continue
                    if box.pending:
                        await self._stream_pending(r, box)
                        continue
                    if box.final is not None:
                        detached = True
                        if r.sse:
                            await r.events([box.final])
                            return await r.end()
                        status = 200
                        if call.modern and box.final_code is not None:
                            status = status_of_code(box.final_code, modern=True)
                        return await r.body(status, box.final)
            finally:
                if not detached and box.final is None and not box.is_cancelled:
                    conn.cancel(request_id)
                if session is None:
                    conn.close()
        finally:
            if session is not None:
                session.busy -= 1
                session.last_seen = self._clock()

    # -- GET and DELETE (legacy sessions only) -------------------------------------------------

    def _session_for(self, headers: RequestHeaders, principal: Principal) -> LegacySession | None | bool:
        """The legacy session a GET/DELETE names; False when the request is not legacy session traffic."""
        sid = headers.get(b"mcp-session-id")
        version = headers.get(b"mcp-protocol-version")
        if sid is None or (version is not None and version.strip() in _MODERN_HEADER_VALUES):
            return False
        return self.sessions.get(sid, principal)

    async def _get(self, r: Responder, headers: RequestHeaders, principal: Principal, receive: Receive) -> None:
        session = self._session_for(headers, principal)
        if session is False:
            return await self._plain_error(r, 405, "Method Not Allowed: GET streams belong to legacy sessions "
                                           "(send Mcp-Session-Id); 2026-07-28 clients POST only", [(b"allow", b"POST")])
        if session is None:
            return await self._refuse(r, SessionNotFound("Session not found: initialize a new session"), modern=False)
        assert isinstance(session, LegacySession)
        if not accepts(headers.get(b"accept"))[1]:
            return await self._plain_error(r, 406, "Not Acceptable: the GET stream is text/event-stream")
        resume_from = headers.get(b"last-event-id")
        if session.stream is not None:
            if resume_from is None:
                return await self._plain_error(r, 409, "Conflict: this session already has an open GET stream")
            # A client resuming: its old stream is gone even if we have not noticed yet. It ends here
            # and the new one continues after the client's Last-Event-ID.
            session.stream.close()
            session.stream = None
        refusal = ServerBusy("Service Unavailable: shutting down", None) if self.shutting_down \
            else self._no_stream_for(principal.name)
        if refusal is not None:
            return await self._refuse(r, refusal, None, [(b"retry-after", b"5")], modern=False)
        stream = session.stream = PushStream(with_ids=True, principal=session.principal.name)
        for event_id, data in session.missed(resume_from):
            stream.push_event(event_id, data)  # what the client missed while it was away
        self._stream_opened(principal.name)
        try:
            await r.start_sse()
            await self._pump(r, stream, receive)
        finally:
            self._stream_closed(principal.name)
            if session.stream is stream:
                session.stream = None
            session.last_seen = self._clock()

    async def _delete(self, r: Responder, headers: RequestHeaders, principal: Principal) -> None:
        session = self._session_for(headers, principal)
        if session is False:
            return await self._plain_error(r, 405, "Method Not Allowed: DELETE ends a legacy session "
                                           "(send Mcp-Session-Id); 2026-07-28 has no sessions", [(b"allow", b"POST")])
        if session is None:
            return await self._refuse(r, SessionNotFound("Session not found"), modern=False)
        assert isinstance(session, LegacySession)
        self.sessions.remove(session)  # its connection closes: what it still runs is stopped
        log("http_session_closed", principal=principal.name)
        await r.body(200, b"", None)

    # -- long-lived streams --------------------------------------------------------------------

    async def _pump(self, r: Responder, stream: PushStream, receive: Receive) -> None:
        """Feed ``stream`` to the client until it disconnects or the stream is closed."""
        keepalive = self.cfg.keepalive_s
        while True:
            if not stream.pending and not stream.closed:
                stream.woken = False
                with trio.CancelScope(deadline=trio.current_time() + keepalive) as parked:
                    stream.scope = parked
                    message = await receive()
                stream.scope = None
                if not parked.cancelled_caught:
                    if message["type"] == "http.disconnect":
                        stream.closed = True
                        return
                    continue
                if not stream.woken:
                    await r.comment()
                    if r.gone:
                        return
                    continue
            if stream.pending:
                batch = list(stream.pending)
                stream.pending.clear()
                if stream.with_ids:
                    await r.events_with_ids(batch)
                else:
                    await r.events(batch)
                if r.gone:
                    stream.closed = True
                    return
                continue
            if stream.closed:
                if stream.last is not None:
                    await r.events([stream.last])
                return await r.end()

    # -- lifecycle -----------------------------------------------------------------------------

    def begin_shutdown(self) -> None:
        """Stop taking requests; end long-lived streams (listens get their completion result)."""
        self.shutting_down = True
        self._end_streams(lambda _stream: True)

    def _end_streams(self, which: Callable[[PushStream], bool]) -> int:
        """End the open long-lived streams ``which`` picks (listens get their completion result);
        how many it ended."""
        ended = 0
        for stream in list(self.listens) + [s.stream for s in self.sessions.sessions.values() if s.stream is not None]:
            if not stream.closed and which(stream):
                stream.close(self.core.subscription_end(stream.listen) if stream.listen is not None else None)
                ended += 1
        return ended

    async def wake_slow_calls(self) -> None:
        """End the quick wait of calls still running after QUICK_WAIT_S, so that they start
        watching for their client's disconnect; one task for all calls instead of a timer each.
        It wakes at most every QUICK_TICK_S (a quick wait may last that much longer): under load
        the next deadline is always a fraction of a millisecond away, and waking for each one
        cost a scheduler step every few requests."""
        self._quick_sweeper = True
        quick = self._quick
        try:
            while True:
                if not quick:
                    await self._quick_lot.park()
                    continue
                now = trio.current_time()
                while quick and quick[0][0] <= now:
                    quick.popleft()[1].unpark()
                if quick:
                    await trio.sleep(max(QUICK_TICK_S, quick[0][0] - now))
        finally:
            self._quick_sweeper = False
            while quick:
                quick.popleft()[1].unpark()

    async def housekeeping(self) -> None:
        period = max(0.05, min(60.0, self.cfg.session_idle_s / 4))
        while True:
            await trio.sleep(period)
            for session in self.sessions.expire(trio.current_time()):
                log("http_session_expired", principal=session.principal.name)

    def close(self) -> None:
        for session in list(self.sessions.sessions.values()):
            self.sessions.remove(session)
