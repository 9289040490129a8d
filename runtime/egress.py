"""The egress proxy: the only way from a plugin to the network, enforced in the daemon.

How this works:

* A worker whose plugin holds a network grant lives in an empty network namespace with only ``lo``
  up. Before any plugin code runs it listens on ``127.0.0.1:<ephemeral>`` there, hands the listening
  socket to the daemon over its IPC channel (``SCM_RIGHTS`` with a ``wire.EgressListener`` frame) and
  closes its own copy; ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` point at it. A socket keeps the
  namespace it was made in, so the daemon accepts, here, what the plugin dials in its namespace;
  nothing of the proxy runs in the worker, and there is nothing else to reach in there.
* ``serve_proxy`` accepts on that socket until the worker is discarded. Each connection carries one
  request, parsed by h11: ``CONNECT host:port`` (a byte tunnel: https, or any TCP), or a plain-HTTP
  request in absolute form (``GET http://host:port/path``), forwarded with ``Connection: close``.
* ``runtime.egress_rules`` decides; this module resolves the name (the plugin has no DNS) and dials a
  vetted address, never the name again. Answers: 200 tunnel open, 400 malformed, 403 refused (with the
  reason), 408 head too slow, 502 unresolvable or unreachable, 503 too many connections.
* A ``CONNECT`` to a host one of the plugin's secrets is bound to (``runtime.plugin_secrets``) is not a
  byte tunnel: the proxy checks the real host's certificate first (502 if it fails), then answers 200,
  terminates the plugin's TLS with a leaf of the daemon's egress CA (``runtime.egress_tls``) and relays
  HTTP/1.1, putting the values in (``runtime.egress_relay``). Plain-HTTP requests never get a value.
* Tunnels end on an idle timeout or a byte cap per direction. Every connection is one ``egress`` log
  line (plugin, host, port, address, outcome, bytes each way). A connection's failure, whatever it is,
  ends that connection only; the accept loop and the daemon go on.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import ssl
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import h11
import psutil
import trio

from runtime.egress_rules import (
    LOOPBACK,
    Entry,
    Grant,
    IPAddress,
    Own,
    Refused,
    normalize_host,
    split_host_port,
    vet,
)
from runtime.egress_relay import Prefixed, relay
from runtime.egress_tls import EgressTLSError
from runtime.logs import log
from runtime.plugin_secrets import Binding, PluginSecrets
from runtime.protocol.errors import WorkerFailure

HEAD_TIMEOUT_S = 10.0
RESOLVE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 120.0
ANSWER_TIMEOUT_S = 2.0
MAX_HEAD_BYTES = 16 * 1024
#: Per direction and connection.
MAX_TUNNEL_BYTES = 1 << 30
#: Open connections per worker; more are answered 503.
MAX_CONNECTIONS = 32
#: Resolved addresses tried per request, in order.
MAX_ADDRESSES = 4
RECV_BYTES = 256 * 1024
OWN_TTL_S = 1.0

_PHRASES = {200: b"Connection established", 400: b"Bad Request", 403: b"Forbidden", 408: b"Request Timeout",
            431: b"Request Header Fields Too Large", 502: b"Bad Gateway", 503: b"Service Unavailable"}
_OUTCOMES = {400: "bad_request", 403: "refused", 408: "timeout", 431: "bad_request", 502: "unreachable",
             503: "busy"}
_HOP_BY_HOP = frozenset({b"connection", b"proxy-connection", b"keep-alive", b"proxy-authorization",
                         b"proxy-authenticate", b"te", b"trailer", b"upgrade", b"host"})


# -- the listening socket a worker hands over -------------------------------------------------------


def adopt_listener(fds: list[int], port: int) -> socket.socket:
    """The first of ``fds`` as the worker's proxy listener, checked; raises ``ValueError``.

    It must be a listening IPv4 TCP socket bound to ``127.0.0.1:port``. The fd is consumed either way."""
    if not fds:
        raise ValueError("the egress frame came without a socket")
    fd = fds.pop(0)
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        os.close(fd)
        raise ValueError("the egress frame carried something that is not a socket") from None
    try:
        bound = sock.getsockname() if sock.family == socket.AF_INET else None
        listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    except OSError:
        bound, listening = None, False
    if sock.type != socket.SOCK_STREAM or not listening or bound != ("127.0.0.1", port):
        sock.close()
        raise ValueError(f"the egress socket is not a TCP listener on 127.0.0.1:{port}")
    return sock


# -- the daemon's own sockets ------------------------------------------------------------------------


def _scan_own() -> Own:
    listening: set[tuple[IPAddress, int]] = set()
    local: set[IPAddress] = set()
    try:
        for c in psutil.Process().net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr:
                try:
                    listening.add((ipaddress.ip_address(c.laddr.ip.split("%")[0]), c.laddr.port))
                except ValueError:
                    pass
        for addrs in psutil.net_if_addrs().values():
            for a in addrs:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    try:
                        local.add(ipaddress.ip_address(a.address.split("%")[0]))
                    except ValueError:
                        pass
    except (psutil.Error, OSError) as exc:
        log("egress_scan_failed", level="warning", error=f"{type(exc).__name__}: {exc}")
    return Own(frozenset(listening), frozenset(local))


class _OwnCache:
    at = -float("inf")
    value = Own()


async def own_sockets() -> Own:
    """The daemon's listening sockets and local addresses (rescanned at most every ``OWN_TTL_S``)."""
    if time.monotonic() - _OwnCache.at > OWN_TTL_S:
        # A burst of requests may scan more than once; harmless, and no lock outlives a trio run.
        _OwnCache.value = await trio.to_thread.run_sync(_scan_own)
        _OwnCache.at = time.monotonic()
    return _OwnCache.value


# -- one connection -----------------------------------------------------------------------------------


@dataclass
class _Record:
    plugin: str
    pid: int
    host: str = ""
    port: int = 0
    address: str = ""
    kind: str = ""
    outcome: str = "closed"
    reason: str = ""
    bytes_up: int = 0
    bytes_down: int = 0
    #: Names of the secrets put into this connection's requests (never their values).
    secrets: set[str] = field(default_factory=set)


async def _answer(stream: trio.SocketStream, conn: h11.Connection, status: int, text: str,
                  rec: _Record | None = None) -> None:
    """Send a short plain-text answer (the connection is closed afterwards)."""
    if rec is not None:
        rec.outcome = "ok" if status == 200 else _OUTCOMES.get(status, "error")
        rec.reason = text
    body = (text + "\n").encode("utf-8", "replace") if status != 200 else b""
    headers = [] if status == 200 else [("content-type", "text/plain; charset=utf-8"),
                                         ("content-length", str(len(body))), ("connection", "close")]
    try:
        data = conn.send(h11.Response(status_code=status, reason=_PHRASES.get(status, b""), headers=headers))
        if status != 200:
            data = (data or b"") + (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b"")
    except h11.LocalProtocolError:
        return
    with trio.move_on_after(ANSWER_TIMEOUT_S):
        await stream.send_all(data or b"")
        if status != 200:
            # Lingering close: closing with unread request bytes would reset the connection and
            # could destroy the answer before the plugin reads it.
            await stream.send_eof()
            drained = 0
            while drained < MAX_HEAD_BYTES * 64 and (chunk := await stream.receive_some(RECV_BYTES)):
                drained += len(chunk)


async def _next_event(conn: h11.Connection, stream: trio.SocketStream) -> object:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        # Small reads: a head over MAX_HEAD_BYTES is refused (431) before much of it is buffered.
        conn.receive_data(await stream.receive_some(MAX_HEAD_BYTES))


def _absolute_http(target: bytes) -> tuple[str, int, bytes, str]:
    """``http://host[:port]/path?q`` -> (host, port, origin-form target, Host header). Raises ``Refused``."""
    try:
        parts = urllib.parse.urlsplit(target.decode("ascii"))
        port = parts.port or 80
    except (UnicodeDecodeError, ValueError) as exc:
        raise Refused(f"bad request target: {exc}", 400) from None
    if parts.scheme.lower() != "http" or not parts.hostname:
        raise Refused("only absolute http:// URLs are forwarded; use CONNECT host:port for https and other TCP",
                      400)
    if parts.username is not None or parts.password is not None:
        raise Refused("credentials in the URL are not forwarded", 400)
    origin = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, port, origin.encode("ascii"), parts.netloc


async def _resolve(entry: Entry, host: str, port: int) -> list[IPAddress]:
    if entry.ip is not None:
        return [entry.ip]
    if entry.kind == "localhost":
        return list(LOOPBACK)
    try:
        with trio.fail_after(RESOLVE_TIMEOUT_S):
            infos = await trio.socket.getaddrinfo(normalize_host(host), port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError, trio.TooSlowError) as exc:
        raise Refused(f"cannot resolve {host}: {exc or type(exc).__name__}", 502) from None
    out: list[IPAddress] = []
    for info in infos:
        try:
            out.append(ipaddress.ip_address(str(info[4][0])))
        except ValueError:
            continue
    return out


async def _dial(addresses: list[IPAddress], port: int) -> tuple[trio.SocketStream, IPAddress]:
    errors = []
    for ip in addresses[:MAX_ADDRESSES]:
        sock = trio.socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM)
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                await sock.connect((str(ip), port))
        except (OSError, trio.TooSlowError) as exc:
            sock.close()
            errors.append(f"{ip}: {getattr(exc, 'strerror', None) or type(exc).__name__}")
            continue
        return trio.SocketStream(sock), ip
    raise Refused(f"cannot reach port {port}: " + "; ".join(errors), 502)


async def _splice(client: trio.SocketStream, upstream: trio.SocketStream, rec: _Record, first_up: bytes = b"",
                  forward_request: Callable[[list[float]], Awaitable[None]] | None = None) -> None:
    """Copy bytes both ways until both sides are done, a side breaks, the idle timeout or a byte cap."""
    last = [trio.current_time()]

    async with trio.open_nursery() as nursery:
        pumps = [2]

        def done() -> None:
            pumps[0] -= 1
            if pumps[0] == 0:
                nursery.cancel_scope.cancel()

        async def pump(src: trio.SocketStream, dst: trio.SocketStream, up: bool, first: bytes) -> None:
            try:
                total = 0
                data = first
                while True:
                    if data:
                        total += len(data)
                        if total > MAX_TUNNEL_BYTES:
                            rec.outcome, rec.reason = "byte_cap", f"more than {MAX_TUNNEL_BYTES} bytes one way"
                            nursery.cancel_scope.cancel()
                            return
                        await dst.send_all(data)
                        if up:
                            rec.bytes_up += len(data)
                        else:
                            rec.bytes_down += len(data)
                        last[0] = trio.current_time()
                    data = await src.receive_some(RECV_BYTES)
                    if not data:
                        break
                try:
                    await dst.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                nursery.cancel_scope.cancel()  # a reset on either side ends both directions
                return
            if not up and forward_request is not None:
                nursery.cancel_scope.cancel()  # plain HTTP: the response is complete at upstream EOF
                return
            done()

        async def watchdog() -> None:
            while True:
                await trio.sleep_until(last[0] + IDLE_TIMEOUT_S)
                if trio.current_time() >= last[0] + IDLE_TIMEOUT_S:
                    rec.outcome, rec.reason = "idle_timeout", f"no bytes for {IDLE_TIMEOUT_S:g} s"
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watchdog)
        if forward_request is None:
            nursery.start_soon(pump, client, upstream, True, first_up)
        else:
            nursery.start_soon(forward_request, last)
        nursery.start_soon(pump, upstream, client, False, b"")


def _forward_headers(headers: list[tuple[bytes, bytes]], host: str) -> list[tuple[bytes, bytes]]:
    named = {token.strip().lower() for name, value in headers if name == b"connection" for token in value.split(b",")}
    out = [(b"host", host.encode("ascii"))]
    out += [(n, v) for n, v in headers if n not in _HOP_BY_HOP and n not in named and not n.startswith(b"proxy-")]
    out.append((b"connection", b"close"))
    return out


async def _serve_one(stream: trio.SocketStream, grant: Grant, rec: _Record, secrets: PluginSecrets | None) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    try:
        with trio.fail_after(HEAD_TIMEOUT_S):
            request = await _next_event(conn, stream)
            if isinstance(request, h11.Request) and request.method == b"CONNECT":
                end = await _next_event(conn, stream)
                if not isinstance(end, h11.EndOfMessage):
                    await _answer(stream, conn, 400, "a CONNECT request has no body", rec)
                    return
    except trio.TooSlowError:
        await _answer(stream, conn, 408, f"no complete request head within {HEAD_TIMEOUT_S:g} s", rec)
        return
    except h11.RemoteProtocolError as exc:
        await _answer(stream, conn, exc.error_status_hint, f"malformed request: {exc}", rec)
        return
    if not isinstance(request, h11.Request):
        return  # closed before a request
    tunnel = request.method == b"CONNECT"
    rec.kind = "connect" if tunnel else "http"
    try:
        if tunnel:
            try:
                host, port = split_host_port(request.target.decode("ascii"))
            except (UnicodeDecodeError, ValueError) as exc:
                raise Refused(f"CONNECT needs host:port: {exc}", 400) from None
            origin, host_header = b"", ""
        else:
            host, port, origin, host_header = _absolute_http(request.target)
        rec.host, rec.port = host, port
        entry = grant.match(host, port)
        addresses = vet(entry, await _resolve(entry, host, port), await own_sockets())
        upstream, ip = await _dial(addresses, port)
    except Refused as exc:
        await _answer(stream, conn, exc.status, exc.reason, rec)
        return
    rec.address = str(ip)
    rec.outcome = "ok"
    bindings = secrets.for_host(host) if tunnel and secrets is not None else ()
    if bindings:
        assert secrets is not None
        await _serve_bound(stream, conn, upstream, host, secrets, bindings, rec)
        return
    async with upstream:
        if tunnel:
            await _answer(stream, conn, 200, "", rec)
            early, _closed = conn.trailing_data
            await _splice(stream, upstream, rec, bytes(early))
            return
        out = h11.Connection(h11.CLIENT)
        head = out.send(h11.Request(method=request.method, target=origin,
                                    headers=_forward_headers(list(request.headers), host_header)))

        async def forward_request(last: list[float]) -> None:
            # The request body, re-framed by h11; then nothing more is read from the plugin.
            try:
                await upstream.send_all(head or b"")
                rec.bytes_up += len(head or b"")
                while True:
                    event = await _next_event(conn, stream)
                    if isinstance(event, h11.Data):
                        data = out.send(h11.Data(data=bytes(event.data))) or b""
                    elif isinstance(event, h11.EndOfMessage):
                        await upstream.send_all(out.send(h11.EndOfMessage()) or b"")
                        return
                    else:
                        return
                    if rec.bytes_up + len(data) > MAX_TUNNEL_BYTES:
                        rec.outcome, rec.reason = "byte_cap", f"request body over {MAX_TUNNEL_BYTES} bytes"
                        raise trio.BrokenResourceError
                    await upstream.send_all(data)
                    rec.bytes_up += len(data)
                    last[0] = trio.current_time()
            except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                await upstream.aclose()

        await _splice(stream, upstream, rec, forward_request=forward_request)


async def _serve_bound(stream: trio.SocketStream, conn: h11.Connection, upstream: trio.SocketStream, host: str,
                       secrets: PluginSecrets, bindings: tuple[Binding, ...], rec: _Record) -> None:
    """A CONNECT to a host secrets are bound to: TLS to the real host (its certificate checked) and from
    the plugin (a leaf of the egress CA), then HTTP/1.1 relayed with the values put in."""
    rec.kind = "connect+secrets"
    assert secrets.ca is not None
    try:
        server_ctx = await trio.to_thread.run_sync(secrets.ca.server_context, normalize_host(host))
        outward = trio.SSLStream(upstream, secrets.ca.upstream_context(), server_hostname=normalize_host(host),
                                 https_compatible=True)
    except (EgressTLSError, ssl.SSLError, OSError) as exc:
        await upstream.aclose()
        await _answer(stream, conn, 502, f"TLS toward {host} cannot be set up: {exc}", rec)
        return
    async with outward:
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                await outward.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            cause = exc.__cause__ or exc
            await _answer(stream, conn, 502, f"TLS with {host} failed, nothing was sent: "
                                             f"{getattr(cause, 'verify_message', None) or cause or type(cause).__name__}",
                          rec)
            return
        await _answer(stream, conn, 200, "", rec)
        early, _closed = conn.trailing_data
        inward = trio.SSLStream(Prefixed(stream, bytes(early)), server_ctx, server_side=True, https_compatible=True)
        try:
            with trio.fail_after(HEAD_TIMEOUT_S):
                await inward.do_handshake()
        except (trio.BrokenResourceError, trio.TooSlowError) as exc:
            rec.outcome, rec.reason = "tls_failed", f"the plugin's TLS handshake failed: {exc.__cause__ or exc}"
            return
        await relay(inward, outward, bindings, rec, host=normalize_host(host), idle_s=IDLE_TIMEOUT_S,
                    max_bytes=MAX_TUNNEL_BYTES)


async def _handle(stream: trio.SocketStream, grant: Grant, rec: _Record, release: trio.Semaphore,
                  secrets: PluginSecrets | None = None) -> None:
    started = trio.current_time()
    try:
        await _serve_one(stream, grant, rec, secrets)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # the plugin went away mid-request: nothing to answer
    except Exception as exc:  # noqa: BLE001 (our bug: this connection fails, the proxy and the daemon go on)
        rec.outcome, rec.reason = "error", f"{type(exc).__name__}: {exc}"
        log("internal_error", level="error", where="egress proxy", error=rec.reason)
    finally:
        release.release()
        with trio.CancelScope(shield=True):
            await stream.aclose()
        log("egress", level="info" if rec.outcome in ("ok", "closed") else "warning",
            plugin=rec.plugin, pid=rec.pid, kind=rec.kind, host=rec.host, port=rec.port, address=rec.address,
            outcome=rec.outcome, reason=rec.reason, bytes_up=rec.bytes_up, bytes_down=rec.bytes_down,
            **({"secrets": sorted(rec.secrets)} if rec.secrets else {}), duration_ms=round((trio.current_time() - started) * 1000, 1))


def start_proxy(nursery: trio.Nursery, grant: Grant | None, plugin: str, pid: int, fds: list[int], port: int,
                already: bool, secrets: PluginSecrets | None = None) -> trio.CancelScope:
    """Serve the proxy listener a worker handed over (the first of ``fds``, see ``adopt_listener``)
    in ``nursery``; returns the scope that ends it. ``already``: this worker has a proxy running.

    Raises ``WorkerFailure`` ("garbage") when the plugin has no grant, when a second listener
    comes, or when the socket is not the one the frame names: the worker misbehaved."""
    if not grant or already:
        raise WorkerFailure("garbage", "the worker sent an egress socket its plugin has no grant for")
    try:
        listener = adopt_listener(fds, port)
    except ValueError as exc:
        raise WorkerFailure("garbage", str(exc)) from None
    scope = trio.CancelScope()
    nursery.start_soon(serve_proxy, listener, grant, plugin, pid, scope, secrets)
    return scope


async def serve_proxy(listener: socket.socket, grant: Grant, plugin: str, pid: int,
                      scope: trio.CancelScope, secrets: PluginSecrets | None = None) -> None:
    """Accept the worker's connections on ``listener`` until ``scope`` is cancelled; never raises.

    Closing the listener (and every open connection) is part of ending: a discarded worker leaves
    nothing behind here."""
    sock = trio.socket.from_stdlib_socket(listener)
    slots = trio.Semaphore(MAX_CONNECTIONS)
    port = listener.getsockname()[1]
    log("egress_proxy_started", level="debug", plugin=plugin, pid=pid, port=port,
        grant=[str(e) for e in grant.entries])
    try:
        with scope:
            async with trio.open_nursery() as nursery:
                while True:
                    try:
                        conn, _ = await sock.accept()
                    except OSError as exc:
                        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                            await trio.sleep(0.1)
                            continue
                        if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                            continue
                        log("egress_proxy_stopped", level="warning", plugin=plugin, pid=pid, error=str(exc))
                        return
                    stream = trio.SocketStream(conn)
                    try:
                        slots.acquire_nowait()
                    except trio.WouldBlock:
                        nursery.start_soon(_busy, stream, plugin, pid)
                        continue
                    nursery.start_soon(_handle, stream, grant, _Record(plugin, pid), slots, secrets)
    except Exception as exc:  # noqa: BLE001 (our bug: the plugin loses its network, the daemon goes on)
        log("internal_error", level="error", where="egress accept loop", error=f"{type(exc).__name__}: {exc}")
    finally:
        sock.close()


async def _busy(stream: trio.SocketStream, plugin: str, pid: int) -> None:
    try:
        await _answer(stream, h11.Connection(h11.SERVER), 503, f"more than {MAX_CONNECTIONS} open connections")
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()
    log("egress", level="warning", plugin=plugin, pid=pid, outcome="busy", reason="too many connections")
