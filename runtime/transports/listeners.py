"""Where the HTTP app is served: TCP and unix listening sockets (owner-only, TCP_USER_TIMEOUT), the
refusal to expose a non-loopback address without authentication, the server engine (toolcell's own
``h1`` or hypercorn) and graceful shutdown. The app itself is ``runtime.transports.http``.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from collections.abc import Sequence
from typing import Any, cast

import trio

from runtime.daemon import Daemon
from runtime.http_config import HttpConfig
from runtime.logs import log
from runtime.transports.http import HttpApp


def tcp_socket(host: str, port: int, write_timeout_s: float) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            # Inherited by accepted connections: a client that stops reading (or vanishes) while
            # we have unacknowledged data gets cut off instead of pinning a response forever.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(write_timeout_s * 1000))
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    sock.set_inheritable(False)
    return sock


def unix_socket(path: str) -> socket.socket:
    try:
        if stat.S_ISSOCK(os.stat(path).st_mode):
            os.unlink(path)  # a stale socket from an earlier run
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # owner-only from the first instant
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    sock.setblocking(False)
    sock.set_inheritable(False)
    return sock


def endpoint_url(sock: socket.socket, path: str) -> str:
    if sock.family == socket.AF_UNIX:
        return f"unix:{sock.getsockname()}:{path}"
    host, port = sock.getsockname()[:2]
    if sock.family == socket.AF_INET6:
        host = f"[{host}]"
    return f"http://{host}:{port}{path}"


def hypercorn_config(cfg: HttpConfig, sockets: list[socket.socket]) -> Any:
    # Lazy: hypercorn (~10 ms for its config, ~70 ms with hypercorn.trio) loads only when it serves (the
    # hypercorn engine, or the metrics listener); the default engine is h1.
    from hypercorn.config import Config as HyperConfig, Sockets

    class _Config(HyperConfig):
        def create_sockets(self) -> Sockets:
            return Sockets([], sockets, [])

    hc = _Config()
    hc.keep_alive_timeout = cfg.idle_timeout_s
    hc.graceful_timeout = cfg.shutdown_grace_s
    hc.h11_max_incomplete_size = cfg.max_header_bytes
    hc.h2_max_header_list_size = cfg.max_header_bytes
    hc.h2_max_concurrent_streams = cfg.max_requests_per_connection
    hc.keep_alive_max_requests = 1_000_000
    hc.include_server_header = False
    hc.backlog = 1024
    hc.accesslog = None
    hc.errorlog = logging.getLogger("toolcell.http")
    hc.loglevel = "WARNING"
    return hc


def is_loopback(host: str) -> bool:
    return host in ("localhost", "127.0.0.1", "::1", "[::1]") or host.startswith("127.")


def check_exposure(cfg: HttpConfig, listen: tuple[str, int] | None) -> None:
    """Refuse (ValueError) to serve a non-loopback address without authentication, unless told to."""
    if listen is not None and not is_loopback(listen[0]) and not cfg.tokens and cfg.oauth is None and not cfg.allow_unauthenticated:
        raise ValueError(f"refusing to serve {listen[0]} without authentication: add [[http.tokens]] to the config, "
                         "or set http.allow_unauthenticated = true")


def passed_address(sock: socket.socket) -> tuple[str, int] | None:
    """The (host, port) a passed (socket-activated) TCP socket is bound to; None for a unix socket."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    host, port = sock.getsockname()[:2]
    return str(host), int(port)


async def serve_http(daemon: Daemon, cfg: HttpConfig, *, listen: tuple[str, int] | None = None,
                     unix: str | None = None, passed: Sequence[socket.socket] = (), shutdown: trio.Event | None = None,
                     audit: Any = None, on_app: Any = None,
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``cfg.path`` on ``listen`` (TCP), ``unix`` and the already listening ``passed`` sockets
    (systemd socket activation) until ``shutdown`` is set, then stop gracefully: no new connections,
    long-lived streams ended, in-flight requests given ``shutdown_grace_s`` to finish.
    ``task_status.started`` gets the endpoint URLs."""
    check_exposure(cfg, listen)
    for sock in passed:
        check_exposure(cfg, passed_address(sock))
    sockets: list[socket.socket] = list(passed)
    try:
        if listen is not None:
            sockets.append(tcp_socket(listen[0], listen[1], cfg.write_timeout_s))
        if unix is not None:
            sockets.append(unix_socket(unix))
    except BaseException:
        for s in sockets:
            s.close()
        raise
    urls = [endpoint_url(s, cfg.path) for s in sockets]
    addresses = [listen] + [passed_address(s) for s in passed]
    bound = [a[0] for a in addresses if a is not None and a[0] not in ("0.0.0.0", "::", "")]
    app = HttpApp(daemon, cfg, bound_hosts=[f"[{h}]" if ":" in h else h for h in bound])
    app.audit = audit
    daemon.sighup_hooks.append(app.reload_tokens)
    if on_app is not None:
        on_app(app)
    stop = shutdown if shutdown is not None else trio.Event()

    async def trigger() -> None:
        await stop.wait()
        app.begin_shutdown()

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(app.housekeeping)
            nursery.start_soon(app.wake_slow_calls)

            async def run(task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
                if cfg.engine == "hypercorn":
                    # Lazy: only the configured engine is loaded (hypercorn.trio: ~70 ms).
                    import hypercorn.trio

                    await hypercorn.trio.serve(cast(Any, app), hypercorn_config(cfg, sockets), shutdown_trigger=trigger,
                                               task_status=task_status)
                else:
                    # Lazy: only the configured engine is loaded (h1 and its httptools parser: ~15 ms, which
                    # a stdio-only daemon or the hypercorn engine never needs).
                    from runtime.transports.h1 import H1Server

                    await H1Server(app, cfg).serve(sockets, trigger, task_status=task_status)
                nursery.cancel_scope.cancel()

            await nursery.start(run)
            task_status.started(urls)
    finally:
        app.close()
        log("http_stopped", endpoints=urls)
        if unix is not None:
            try:
                os.unlink(unix)
            except OSError:
                pass
