"""Prometheus metrics, served on their own listener (never on the MCP endpoint).

Per-call numbers (calls and errors by tool, latency histogram per tool) come from one
``Daemon.call_hooks`` entry; everything else (queue depth, workers alive and restarted, limit
kills, HTTP statuses, sessions, streams) is read from the live objects at scrape time, so nothing
is counted twice and nothing costs anything between scrapes. Off unless ``http.metrics_listen``
is set; ``prometheus_client`` is imported only then.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, cast

import trio

from runtime.daemon import Daemon
from runtime.execution.pool import PHASES
from runtime.http_config import HttpConfig
from runtime.transports.asgi import lifespan
from runtime.transports.listeners import endpoint_url, hypercorn_config, tcp_socket

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, daemon: Daemon) -> None:
        # Lazy: prometheus-client and the metrics listener load only when metrics are exported.
        from prometheus_client import CollectorRegistry, Counter, Histogram

        PHASES.on = True  # the pools time calls by phase from now on (toolcell_call_phase_*)
        self.daemon = daemon
        self.apps: list[Any] = []
        self.registry = CollectorRegistry(auto_describe=True)
        self._calls = Counter("toolcell_tool_calls", "Tool calls that reached a worker pool, by outcome",
                              ["tool", "outcome"], registry=self.registry)
        self._errors = Counter("toolcell_tool_call_errors", "Tool calls that did not end ok (tool errors included)",
                               ["tool", "kind"], registry=self.registry)
        self._latency = Histogram("toolcell_tool_call_duration_seconds", "Tool call latency (queue + run)", ["tool"],
                                  buckets=_BUCKETS, registry=self.registry)
        self.registry.register(_Live(self))

    def hook(self, event: dict[str, Any]) -> None:
        tool = event["tool"]
        outcome = event["outcome"]
        self._calls.labels(tool, outcome).inc()
        if outcome != "ok":
            self._errors.labels(tool, outcome).inc()
        self._latency.labels(tool).observe(event.get("duration_s", 0.0))

    def add_app(self, app: Any) -> None:
        self.apps.append(app)

    def exposition(self) -> bytes:
        # Lazy: prometheus-client and the metrics listener load only when metrics are exported.
        from prometheus_client import generate_latest

        return bytes(generate_latest(self.registry))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """A tiny ASGI app: ``GET /metrics``."""
        if scope["type"] == "lifespan":
            return await lifespan(receive, send)
        if scope["type"] != "http":
            return
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            # Lazy: prometheus-client and the metrics listener load only when metrics are exported.
            from prometheus_client import CONTENT_TYPE_LATEST

            status, body, ctype = 200, self.exposition(), CONTENT_TYPE_LATEST.encode()
        else:
            status, body, ctype = 404, b"Not Found: try /metrics\n", b"text/plain"
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", ctype), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _Live:
    """Reads gauges and pool counters at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        # Lazy: prometheus-client and the metrics listener load only when metrics are exported.
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        daemon = self.metrics.daemon
        inflight = GaugeMetricFamily("toolcell_calls_in_flight", "Tool calls running or queued")
        inflight.add_metric([], daemon.inflight)
        yield inflight
        tools = GaugeMetricFamily("toolcell_tools", "Tools in the catalog")
        tools.add_metric([], len(daemon.catalog))
        yield tools
        catalog = GaugeMetricFamily("toolcell_catalog_info", "The fingerprint of the tools served (replicas of one "
                                    "service should all show the same)", labels=["fingerprint"])
        catalog.add_metric([daemon.catalog.fingerprint], 1)
        yield catalog
        differing = GaugeMetricFamily("toolcell_catalog_differing_replicas",
                                      "Daemons sharing this task store that serve another catalog")
        differing.add_metric([], len(daemon.tasks.catalogs_differing()) if daemon.tasks is not None else 0)
        yield differing
        draining = GaugeMetricFamily("toolcell_draining", "1 while the daemon drains before it stops (SIGTERM)")
        draining.add_metric([], 1 if daemon.draining else 0)
        yield draining
        plugins = GaugeMetricFamily("toolcell_plugins", "Plugins by state", labels=["state"])
        plugins.add_metric(["loaded"], len(daemon.plugins))
        plugins.add_metric(["refused"], len(daemon.failed))
        yield plugins
        queue = GaugeMetricFamily("toolcell_queue_depth", "Calls waiting for a worker", labels=["plugin"])
        alive = GaugeMetricFamily("toolcell_workers_alive", "Worker processes alive", labels=["plugin"])
        restarts = CounterMetricFamily("toolcell_worker_restarts", "Workers started to replace lost ones",
                                       labels=["plugin"])
        kills = CounterMetricFamily("toolcell_limit_kills", "Workers killed for exceeding a limit", labels=["plugin"])
        # Where completed calls' time went (what `toolcell bench` reports per plugin): summed in
        # the pool as plain floats, so they cost nothing between scrapes.
        phase_calls = CounterMetricFamily("toolcell_call_phase_calls", "Calls completed by a worker, timed by phase",
                                          labels=["plugin"])
        phase_seconds = CounterMetricFamily(
            "toolcell_call_phase_seconds", "Time completed calls spent waiting for a worker (queue), on the "
            "daemon-worker channel (channel) and in the worker (worker)", labels=["plugin", "phase"])
        for plugin in sorted(daemon.plugins.values(), key=lambda p: p.name):
            name = plugin.name
            pool = plugin.pool
            if pool is None:
                continue
            queue.add_metric([name], pool.queued())
            alive.add_metric([name], pool.alive())
            restarts.add_metric([name], pool.restarts)
            kills.add_metric([name], pool.limit_kills)
            totals = getattr(pool, "phase_totals", None)
            if totals is not None:
                phase_calls.add_metric([name], totals[0])
                for phase, value in zip(("queue", "channel", "worker"), totals[1:], strict=True):
                    phase_seconds.add_metric([name, phase], value)
        yield from (queue, alive, restarts, kills, phase_calls, phase_seconds)
        reloads = CounterMetricFamily("toolcell_reloads", "Reloads of the plugin folders (watcher, SIGHUP, toolcell reload)")
        reloads.add_metric([], daemon.reloads)
        reload_failures = CounterMetricFamily("toolcell_reload_failures",
                                              "Plugin versions that failed to load during a reload")
        reload_failures.add_metric([], daemon.reload_failures)
        failing = GaugeMetricFamily("toolcell_plugin_reload_failing",
                                    "1 while the version of a plugin on disk fails to load (its last good version serves)",
                                    labels=["plugin"])
        for plugin in sorted(daemon.plugins.values(), key=lambda p: p.name):
            failing.add_metric([plugin.name], 1 if plugin.reload_error else 0)
        yield from (reloads, reload_failures, failing)
        busy = CounterMetricFamily("toolcell_busy_rejections", "Calls refused because a queue was full")
        busy.add_metric([], daemon.stats.get("busy", 0))
        yield busy
        apps = self.metrics.apps
        if not apps:
            return
        statuses = CounterMetricFamily("toolcell_http_responses", "HTTP responses by status", labels=["status"])
        limited = CounterMetricFamily("toolcell_http_rate_limited", "Requests refused by a rate limit", labels=["limit"])
        sessions = GaugeMetricFamily("toolcell_http_sessions", "Open legacy sessions")
        streams = GaugeMetricFamily("toolcell_http_streams", "Open long-lived SSE streams")
        active = GaugeMetricFamily("toolcell_http_active_requests", "POST requests being handled")
        counts: dict[int, int] = {}
        limits: dict[str, int] = {}
        n_sessions = n_streams = n_active = 0
        for app in apps:
            for status, n in app.status_counts.items():
                counts[status] = counts.get(status, 0) + n
            for what, n in app.rate_limited.items():
                limits[what] = limits.get(what, 0) + n
            n_sessions += len(app.sessions)
            n_streams += app.streams
            n_active += app.active
        for status, n in sorted(counts.items()):
            statuses.add_metric([str(status)], n)
        for what, n in sorted(limits.items()):
            limited.add_metric([what], n)
        sessions.add_metric([], n_sessions)
        streams.add_metric([], n_streams)
        active.add_metric([], n_active)
        yield from (statuses, limited, sessions, streams, active)


async def serve_metrics(metrics: Metrics, listen: tuple[str, int], shutdown: trio.Event,
                        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``/metrics`` on ``listen`` until ``shutdown`` is set."""
    # Lazy: hypercorn.trio (~70 ms) loads only when the metrics listener serves (the default engine is h1).
    import hypercorn.trio

    sock = tcp_socket(listen[0], listen[1], 30.0)
    url = endpoint_url(sock, "/metrics")
    cfg = HttpConfig(shutdown_grace_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: hypercorn.trio.serve(
            cast(Any, metrics), hypercorn_config(cfg, [sock]), shutdown_trigger=shutdown.wait, task_status=task_status))
        task_status.started(url)
