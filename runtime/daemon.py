"""The daemon: one catalog, one set of worker pools, shared by every transport and client.

``open_daemon(config)`` loads every plugin (concurrently), publishes the catalog and yields a
``Daemon``; transports call ``Daemon.execute`` to run a ``ToolCall`` and subscribe to catalog
changes with ``Daemon.subscribe``.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import trio

from runtime.config import Config
from runtime.logs import log
from runtime.plugins import Plugin, discover, load_plugin, resolve_conflicts
from runtime.protocol import jsonrpc as rpc
from runtime.protocol.core import Core, ToolCall
from runtime.registry import Catalog
from runtime.workers import PoolBusy, WorkerFailure, become_subreaper
from sandbox import wire

CallHook = Callable[[dict[str, Any]], None]


class Daemon:
    def __init__(self, config: Config, nursery: trio.Nursery) -> None:
        self.config = config
        self.nursery = nursery
        self.plugins: dict[str, Plugin] = {}
        self.failed: list[Plugin] = []
        self.catalog = Catalog(0, [], config.page_size)
        self.core = Core(lambda: self.catalog, list_ttl_ms=config.list_ttl_ms, instructions=config.instructions)
        self._subscribers: set[Callable[[], None]] = set()
        self.call_hooks: list[CallHook] = []
        self.inflight = 0
        self.ready = False
        self.stats = {"calls": 0, "errors": 0, "busy": 0, "limit_kills": 0}

    # -- plugins and catalog -------------------------------------------------------------------

    async def load(self, describe_only: bool = False) -> list[Plugin]:
        paths = discover(self.config.plugins)
        results: list[Plugin] = []

        async def one(path: Any) -> None:
            results.append(await load_plugin(path, self.nursery, self.config.policy, self.config.state_dir,
                                             self.config.min_workers, describe_only, on_kill=self._on_kill))

        async with trio.open_nursery() as n:
            for path in paths:
                n.start_soon(one, path)
        results.sort(key=lambda p: (p.name, str(p.path)))
        for plugin in results:
            if plugin.ok:
                self.plugins[plugin.name] = plugin
                log("plugin_loaded", plugin=plugin.name, tools=len(plugin.entries), layers=plugin.layers)
            else:
                self.failed.append(plugin)
                log("plugin_refused", level="error", plugin=plugin.name, path=str(plugin.path), problems=plugin.problems)
        self.publish()
        self.ready = True
        return results

    def publish(self) -> None:
        """Build a new catalog version from the loaded plugins; notify if the tool set changed."""
        entries = resolve_conflicts(list(self.plugins.values()))
        new = Catalog(self.catalog.version + 1, entries, self.config.page_size)
        changed = [e.encoded("2026-07-28") for e in new.entries] != [e.encoded("2026-07-28") for e in self.catalog.entries]
        self.catalog = new
        if changed and new.version > 1:
            for notify in list(self._subscribers):
                notify()

    def subscribe(self, notify: Callable[[], None]) -> Callable[[], None]:
        """Call ``notify()`` whenever the tool set changes; returns the unsubscribe function."""
        self._subscribers.add(notify)
        return lambda: self._subscribers.discard(notify)

    def _on_kill(self, plugin: str) -> None:
        self.stats["limit_kills"] += 0  # counted precisely by the pools; hook kept for metrics

    # -- calls ---------------------------------------------------------------------------------

    async def execute(self, call: ToolCall, emit: Callable[[bytes], None], principal: str | None = None) -> bytes:
        """Run ``call`` on its plugin's workers; returns the response bytes. Honours cancellation."""
        entry = call.entry
        pool = entry.runner
        started = time.perf_counter()
        outcome = "ok"
        core = self.core

        def on_event(frame: Any) -> None:
            data = core.progress_notification(call, frame) if isinstance(frame, wire.Progress) else core.log_notification(call, frame)
            if data is not None:
                emit(data)

        if self.inflight >= self.config.max_inflight:
            self.stats["busy"] += 1
            self._hook(call, principal, "busy", started)
            return core.call_error(call, rpc.SERVER_BUSY, "Server busy: too many calls in flight; retry later", {"retryAfterMs": 100})
        self.inflight += 1
        try:
            result = await pool.run(entry.local_name, call.arguments, call.progress_token is not None, call.log_level, on_event)
        except PoolBusy as exc:
            self.stats["busy"] += 1
            outcome = "busy"
            return core.call_error(call, rpc.SERVER_BUSY, f"Server busy: {exc}", {"retryAfterMs": 100})
        except WorkerFailure as exc:
            self.stats["errors"] += 1
            outcome = exc.kind
            log("call_failed", level="warning", tool=entry.name, plugin=entry.plugin, kind=exc.kind, error=exc.message)
            return core.call_failed(call, f"Tool {entry.name} failed: {exc.message}" if exc.kind != "timeout"
                                    else f"Tool {entry.name} {exc.message}")
        except trio.Cancelled:
            outcome = "cancelled"
            raise
        finally:
            self.inflight -= 1
            self.stats["calls"] += 1
            self._hook(call, principal, outcome, started)
        data, bug = core.call_result(call, result, pool.limits.max_output_bytes)
        if bug is not None:
            log("plugin_bug", level="error", tool=entry.name, plugin=entry.plugin, problem=bug)
        if result.traceback:
            log("tool_raised", level="warning", tool=entry.name, plugin=entry.plugin, traceback=result.traceback)
        return data

    def _hook(self, call: ToolCall, principal: str | None, outcome: str, started: float) -> None:
        if not self.call_hooks:
            return
        event = {"tool": call.entry.name, "plugin": call.entry.plugin, "principal": principal, "outcome": outcome,
                 "duration_s": time.perf_counter() - started, "argument_keys": len(call.arguments)}
        for hook in self.call_hooks:
            hook(event)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as n:
                for plugin in self.plugins.values():
                    if plugin.pool is not None:
                        n.start_soon(plugin.pool.aclose)


@asynccontextmanager
async def open_daemon(config: Config, describe_only: bool = False) -> AsyncIterator[Daemon]:
    become_subreaper()
    async with trio.open_nursery() as nursery:
        daemon = Daemon(config, nursery)
        try:
            await daemon.load(describe_only=describe_only)
            yield daemon
        finally:
            await daemon.aclose()
            nursery.cancel_scope.cancel()
