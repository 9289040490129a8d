"""``toolcell serve``: one daemon (one catalog, one set of worker pools) behind every transport.

stdio, Streamable HTTP on TCP and on a unix socket can run at once. SIGTERM or SIGINT starts a
graceful shutdown: with ``http.drain_s``, ``/healthz`` first says "draining" that long while
everything is still served (a balancer takes the replica out); then listeners stop accepting, long-lived streams end, in-flight requests get
``http.shutdown_grace_s`` to finish, then the workers are killed; a second signal stops at once.
End of stdin (when serving stdio) shuts the whole daemon down the same way: the process that
started us over stdio is gone.

Under systemd (``deploy/systemd/``) the daemon says ``READY=1`` once every listener serves and
``STOPPING=1`` when the shutdown starts (``Type=notify``), and serves HTTP on the sockets the
``.socket`` unit passed instead of binding its own (``runtime.systemd``).
"""

from __future__ import annotations

import os
import signal
import sys
from functools import partial
from typing import Any

import trio

from runtime import logs, systemd
from runtime.config import Config, ConfigError
from runtime.http_config import parse_listen
from runtime.scope import Scope
from sandbox.isolation import cgroups
from runtime.audit import AuditLog, AuditLogError
from runtime.daemon import open_daemon
from runtime.execution.pool import PHASES
from runtime.metrics import Metrics
from runtime.metrics import serve_metrics
from runtime.reload import serve_reloaders
from runtime.transports.listeners import check_exposure, passed_address
from runtime.transports.listeners import serve_http
from runtime.transports.stdio import serve_stdio
import socket


async def _answer_calls_at_grace_end(daemon: Any, shutdown: trio.Event, grace_s: float) -> None:
    """Calls still running just before the grace ends are answered "the server is shutting down", on
    every transport, while their connections are still open to carry the answer."""
    await shutdown.wait()
    with trio.move_on_after(max(0.0, grace_s - min(0.5, grace_s / 4))):
        await daemon.calls.wait_idle()
    if daemon.inflight > 0:
        logs.log("shutdown_calls_stopped", level="warning", calls=daemon.inflight)
        daemon.abort_calls("the server is shutting down")


async def _notify_stopping(notifier: systemd.Notifier, shutdown: trio.Event) -> None:
    await shutdown.wait()
    notifier.notify("STOPPING=1", "STATUS=draining: finishing the calls in flight")


async def _drain_then_shut_down(daemon: Any, shutdown: trio.Event, drain_s: float) -> None:
    """``/healthz`` says "draining" for ``drain_s`` while everything is still served (a balancer's
    health check takes the replica out meanwhile), then the graceful shutdown begins."""
    daemon.draining = True
    logs.log("draining", seconds=drain_s, note="/healthz answers 404 draining; requests are still served")
    await trio.sleep(drain_s)
    shutdown.set()


async def _watch_signals(daemon: Any, shutdown: trio.Event, hard_stop: trio.CancelScope, drain_s: float) -> None:
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                if shutdown.is_set() or daemon.draining:
                    logs.log("shutdown_forced", level="warning", signal=signal.Signals(signum).name)
                    hard_stop.cancel()
                    return
                logs.log("shutdown_started", signal=signal.Signals(signum).name)
                if drain_s > 0:
                    nursery.start_soon(_drain_then_shut_down, daemon, shutdown, drain_s)
                else:
                    shutdown.set()


def ensure_bindable(address: tuple[str, int]) -> None:
    """Fail before any worker starts when an address is taken, naming it (the listener binds later)."""
    host, port = address
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"cannot listen on {host}:{port}: {exc}") from None
    for family, kind, proto, _, sockaddr in infos[:1]:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from None


async def serve(cfg: Config, *, stdio: bool = False, http: str | None = None, unix: str | None = None,
                scope: Scope | None = None, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until shut down. ``http`` is ``HOST:PORT`` ("" for the configured/default address)."""
    hcfg = cfg.http
    leaf = cgroups.enter_daemon_leaf()  # a delegated cgroup v2 (Delegate=yes, a container): workers beside us
    if leaf is not None:
        logs.log("cgroup_leaf_entered", cgroup=leaf)
    notifier = systemd.Notifier.from_environment()
    passed = [sock for _, sock in systemd.listen_sockets()]
    listen = parse_listen(http if http else (hcfg.listen or "")) if http is not None else None
    unix = unix or (hcfg.unix if http is not None else None)
    if passed:  # socket activation: the service manager bound the HTTP listeners already
        if http is None and not unix:
            for sock in passed:
                sock.close()
            raise ValueError("sockets were passed by the service manager but no HTTP transport was asked for "
                             "(add --http to the command line)")
        listen = unix = None
    for sock in passed:
        check_exposure(hcfg, passed_address(sock))
    if listen is not None:
        check_exposure(hcfg, listen)
        ensure_bindable(listen)
    if hcfg.metrics_listen and (listen is not None or unix or passed or stdio):
        ensure_bindable(parse_listen(hcfg.metrics_listen, default_port=9464))
    audit: Any = None
    if hcfg.audit_log:
        try:
            audit = AuditLog(hcfg.audit_log)  # before the daemon starts: a log it cannot open stops it
        except AuditLogError as exc:
            raise ConfigError(str(exc)) from None
    try:
        async with open_daemon(cfg) as daemon:
            daemon.scope = scope
            metrics: Any = None
            if audit is not None:
                daemon.call_hooks.append(audit.hook)
            if hcfg.metrics_listen and (listen is not None or unix or passed or stdio):
                metrics = Metrics(daemon)
                daemon.call_hooks.append(metrics.hook)
            tracer = _tracing()
            if tracer is not None:
                daemon.calls.tracer = tracer
            shutdown = trio.Event()
            urls: list[str] = []
            try:
                async with trio.open_nursery() as outer:
                    outer.start_soon(_watch_signals, daemon, shutdown, outer.cancel_scope, hcfg.drain_s)
                    outer.start_soon(_answer_calls_at_grace_end, daemon, shutdown, hcfg.shutdown_grace_s)
                    outer.start_soon(_notify_stopping, notifier, shutdown)
                    outer.start_soon(serve_reloaders, daemon)
                    async with trio.open_nursery() as servers:
                        if listen is not None or unix or passed:
                            urls = await servers.start(partial(
                                serve_http, daemon, hcfg, listen=listen, unix=unix, passed=passed, shutdown=shutdown,
                                audit=audit,
                                on_app=metrics.add_app if metrics is not None else None))
                            for url in urls:
                                print(f"toolcell: MCP endpoint {url}", file=sys.stderr, flush=True)
                        if metrics is not None:
                            murl = await servers.start(serve_metrics, metrics, parse_listen(hcfg.metrics_listen or "", default_port=9464),
                                                       shutdown)
                            urls.append(murl)
                            print(f"toolcell: metrics {murl}", file=sys.stderr, flush=True)
                        logs.log("serving", transports=(["stdio"] if stdio else []) + urls, tools=len(daemon.catalog),
                                 plugins=len(daemon.plugins), refused=len(daemon.failed), policy=cfg.policy)
                        if stdio:
                            servers.start_soon(_serve_stdio, daemon, shutdown, hcfg.shutdown_grace_s)
                        task_status.started(urls)
                        notifier.notify("READY=1", f"STATUS=serving {len(daemon.catalog)} tools")
                    outer.cancel_scope.cancel()
            finally:
                if tracer is not None:
                    daemon.calls.tracer = None
                    await trio.to_thread.run_sync(tracer.shutdown)  # flushes what is left to the collector
                logs.log("stopped")
    finally:
        if audit is not None:
            audit.close()


def tracing_wanted() -> bool:
    """Whether the standard ``OTEL_*`` environment asks for traces: ``OTEL_TRACES_EXPORTER`` naming
    an exporter, or an OTLP endpoint set; never with ``OTEL_SDK_DISABLED=true``."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _tracing() -> Any:
    """The daemon's tracer when the ``OTEL_*`` environment asks for traces, else None."""
    if not tracing_wanted():
        return None
    try:
        # Lazy: OpenTelemetry is an optional extra (toolcell[otel]), imported only when traces are on.
        from runtime.tracing import Tracing
    except ImportError as exc:
        logs.log("tracing_unavailable", level="warning", error=f"the OTEL_* environment asks for traces, but "
                 f"{exc.name or 'opentelemetry'} is not installed: pip install 'toolcell[otel]'")
        return None
    PHASES.on = True  # the pools time each call's queue wait and worker round trip (the child spans)
    tracer = Tracing()
    logs.log("tracing", exporter="otlp", endpoint=os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
             or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318")
    return tracer


async def _serve_stdio(daemon: Any, shutdown: trio.Event, grace_s: float) -> None:
    # On shutdown, calls in flight get the grace period (new ones are refused), then whatever is
    # left is answered with an error saying the server is shutting down.
    await serve_stdio(daemon, shutdown=shutdown, grace_s=grace_s)
    shutdown.set()
