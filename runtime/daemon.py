"""The daemon: one catalog, one set of worker pools, shared by every transport and client.

``open_daemon(config)`` loads every plugin (concurrently), publishes the catalog and yields a
``Daemon``: plugins, catalog, hot reload and lifecycle. Calls run through ``Daemon.calls``
(``runtime.calls``); conversations with clients are ``runtime.connection``; both subscribe to
catalog changes with ``Daemon.subscribe``.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from runtime import plugin_files
from runtime.approvals import ApprovalsError, Snapshot
from runtime.approvals_shared import book_for
from runtime.config import Config, secure_state_dir
from runtime.logs import log
from runtime.plugins import Plugin, awaiting_approval, discover, load_plugin, resolve_conflicts
from runtime.calls import CallDispatcher
from runtime.mrtr import Mrtr, load_state_key
from runtime.task_store import TaskStore
from runtime.task_store_open import connect_task_store
from runtime.tasks import TaskManager
from runtime.protocol.core import Core
from runtime.protocol.catalog import Catalog
from runtime.fingerprints import fingerprint, stat_signature
from runtime.plugin_secrets import SecretStore
from runtime.scope import Scope
from runtime.spares import Spares
from runtime.spares import installed as spares_installed
from runtime.processes import become_subreaper, serve_reaper, sweep_stale_scratch
from sandbox.isolation import cgroups



def _prints(path: Path) -> tuple[str | None, str]:
    return stat_signature(path), fingerprint(path)


class Daemon:
    def __init__(self, config: Config, nursery: trio.Nursery) -> None:
        self.config = config
        self.nursery = nursery
        #: Loaded plugins by folder path.
        self.plugins: dict[str, Plugin] = {}
        self.failed: list[Plugin] = []
        self._reload_lock = trio.Lock()
        #: Workers starting at once while loading: a folder of 200 plugins must not start 200 at once
        #: (each would take 100 times longer to be Ready and could miss its start-up deadline).
        self._load_limiter = trio.CapacityLimiter(max(8, 4 * (os.cpu_count() or 1)))
        #: ``stat_signature`` of each plugin folder when it was last read (None: compare by content).
        self._signatures: dict[Path, str | None] = {}
        #: Pools of replaced or removed plugin versions, finishing their in-flight calls.
        self._retiring: set[Any] = set()
        self.reloads = 0
        self.reload_failures = 0
        self.catalog = Catalog(0, [], config.page_size)
        self.core = Core(lambda: self.catalog, list_ttl_ms=config.list_ttl_ms, instructions=config.instructions)
        self._subscribers: set[Callable[[], None]] = set()
        #: Every tool call goes through here (admission, pools, outcomes, audit and metrics hooks).
        self.calls = CallDispatcher(config.max_inflight)
        self.call_hooks = self.calls.hooks
        self.stats = self.calls.stats
        key_file = config.state_key_file or os.path.join(config.state_dir, "request-state.key")
        #: 2026-07-28 questions, retries and parked calls (``runtime.mrtr``).
        self.mrtr = Mrtr(self.core, self.calls, load_state_key(key_file), max_parked=config.max_parked_calls,
                         state_ttl_s=config.request_state_ttl_s)
        #: Tasks (``runtime.tasks``), once the task store is open (None: ``toolcell call``, or no store).
        self.tasks: TaskManager | None = None
        self.ready = False
        #: Set on SIGTERM for ``http.drain_s`` before the listeners close: ``/healthz`` says "draining"
        #: (so a balancer stops sending) while requests are still served.
        self.draining = False
        #: The operator's values of plugins' secrets, and the placeholder key of this daemon run.
        self.secrets = SecretStore(config.secrets, config.state_dir, config.egress_ca_file)
        #: The spare worker interpreter (``runtime.spares``), once serving.
        self.spares: Spares | None = None
        #: Its configuration file and plugin set (``runtime.scope``), as ``toolcell serve`` names them.
        self.scope: Scope | None = None
        #: Run after each ``SIGHUP`` reload (``runtime.reload``): the HTTP transport re-reads its tokens.
        self.sighup_hooks: list[Callable[[], Awaitable[None]]] = []
        #: Where approvals are kept (``runtime.approvals``): read once per load or reload.
        self.approvals = book_for(config)

    # -- plugins and catalog -------------------------------------------------------------------

    async def _read_approvals(self) -> Snapshot:
        # Blocking file or Redis reads, off the loop; ``read`` never raises for what it finds.
        return await trio.to_thread.run_sync(self.approvals.read, abandon_on_cancel=True)

    async def _load_paths(self, paths: list[Path], describe_only: bool = False,
                          prints: dict[Path, tuple[str | None, str]] | None = None) -> dict[Path, Plugin]:
        """Load ``paths`` concurrently (at most ``_load_limiter`` workers starting at once).

        A folder is fingerprinted *before* its worker imports it (``prints`` has those of a reload):
        an edit landing during the load then differs from what was recorded, and the watcher's next
        reload picks it up."""
        results: dict[Path, Plugin] = {}
        approved = await self._read_approvals() if paths else Snapshot()

        async def one(path: Path) -> None:
            given = (prints or {}).get(path)
            if given is None:
                try:
                    given = await plugin_files.off_loop(_prints, path, what="fingerprinting the plugin folder")
                except plugin_files.PluginFileError:
                    given = (None, "")  # its load below meets the same folder, and says why
            sig, print_ = given
            async with self._load_limiter:
                try:
                    plugin = await load_plugin(path, self.nursery, self.config.policy, self.config.state_dir,
                                               self.config.min_workers, describe_only, self.secrets, approved)
                except Exception as exc:  # our bug, met by this folder: it is refused, the others load
                    log("internal_error", level="error", where="plugin load", path=str(path),
                        error=f"{type(exc).__name__}: {str(exc)[:300]}")
                    plugin = Plugin(path, problems=[f"could not be loaded: {type(exc).__name__}: {str(exc)[:200]}"])
            plugin.fingerprint = print_
            self._signatures[path] = sig
            results[path] = plugin

        async with trio.open_nursery() as n:
            for path in paths:
                n.start_soon(one, path)
        return results

    def _admit(self, plugin: Plugin) -> bool:
        """Record a freshly loaded plugin as serving or refused. Duplicate plugin names are refused."""
        if plugin.ok:
            other = next((p for p in self.plugins.values() if p.name == plugin.name and p.path != plugin.path), None)
            if other is not None:
                plugin.problems = [f"plugin name {plugin.name!r} is already used by {other.path}"]
                if plugin.pool is not None:
                    self.nursery.start_soon(plugin.pool.aclose, 0)
                    plugin.pool = None
                plugin.entries = []
        if plugin.ok:
            self.plugins[str(plugin.path)] = plugin
            plugin.on_change = self.publish  # a hosted server's list_changed
            log("plugin_loaded", plugin=plugin.name, tools=len(plugin.entries), layers=plugin.layers)
            return True
        self.failed.append(plugin)
        log("plugin_refused", level="error", plugin=plugin.name, path=str(plugin.path), problems=plugin.problems)
        return False

    async def load(self, describe_only: bool = False) -> list[Plugin]:
        try:
            paths = await plugin_files.off_loop(discover, self.config.plugins, what="finding the plugin folders")
        except plugin_files.PluginFileError as exc:
            log("plugins_unreadable", level="error", error=exc.reason)
            paths = []
        results = await self._load_paths(paths, describe_only)
        ordered = sorted(results.values(), key=lambda p: (p.name, str(p.path)))
        for plugin in ordered:
            self._admit(plugin)
        self.publish()
        self.ready = True
        return ordered

    def _changed(self, paths: list[Path], known: dict[Path, Plugin], held: set[Path],
                 signatures: dict[Path, str | None]) -> tuple[dict[Path, tuple[str | None, str]], dict[Path, str | None]]:
        """(the folders whose content differs from the version known -- new ones included -- with
        their stat signatures and fingerprints; the signatures of folders touched but not changed).
        A folder whose stat signature is unchanged is not read. Blocking file-system work on hostile
        folders: it runs in a thread (``plugin_files.off_loop``) and touches no daemon state."""
        changed: dict[Path, tuple[str | None, str]] = {}
        touched: dict[Path, str | None] = {}
        for path in paths:
            old = known.get(path)
            sig = stat_signature(path)
            if path in held:
                changed[path] = (sig, fingerprint(path))  # held for approval: `toolcell approve` may have come
                continue
            if old is not None and sig is not None and signatures.get(path) == sig:
                continue
            print_ = fingerprint(path)
            if old is not None and old.fingerprint == print_:
                touched[path] = sig  # touched, not changed
                continue
            changed[path] = (sig, print_)
        return changed, touched

    def _scan(self, known: dict[Path, Plugin], held: set[Path], signatures: dict[Path, str | None]
              ) -> tuple[list[Path], dict[Path, tuple[str | None, str]], dict[Path, str | None]]:
        paths = discover(self.config.plugins)
        return (paths, *self._changed(paths, known, held, signatures))

    async def reload(self, quiet: bool = False) -> bool:
        """Bring the catalog in line with the plugin folders; returns True if the tool set changed.

        Only new, changed and removed plugins are touched: the others keep their pools and workers,
        and their folders cost a few ``stat`` calls each. ``quiet``: a look that finds nothing to do
        is not logged (the file watcher's catch-up)."""
        async with self._reload_lock:
            self.reloads += 1
            t0 = time.perf_counter()
            known: dict[Path, Plugin] = {p.path: p for p in list(self.plugins.values()) + self.failed}
            held = {path for path, p in known.items() if awaiting_approval(p)}
            try:
                paths, prints, touched = await plugin_files.off_loop(
                    self._scan, known, held, dict(self._signatures), what="scanning the plugin folders")
            except plugin_files.PluginFileError as exc:
                log("reload_failed", level="error", error=exc.reason, note="every plugin keeps serving as it was")
                return False
            self._signatures.update(touched)
            on_disk = set(paths)
            removed = [p for path, p in known.items() if path not in on_disk]
            if not prints and not removed:
                if not quiet:
                    log("reload_done", changed=False, catalog_version=self.catalog.version,
                        scan_ms=round((time.perf_counter() - t0) * 1000, 1))
                return False
            t1 = time.perf_counter()
            fresh = await self._load_paths(list(prints), prints=prints)
            t2 = time.perf_counter()
            retiring = []
            for path in prints:
                new, old = fresh[path], known.get(path)
                if not new.ok and old is not None and old.ok:
                    # Broken edit: keep serving the last good version, say why until it is fixed.
                    old.reload_error = list(new.problems)
                    old.fingerprint = new.fingerprint
                    self.reload_failures += 1
                    log("plugin_reload_failed", level="error", plugin=old.name, path=str(path), problems=new.problems,
                        note="the previous version keeps serving")
                    continue
                if old is not None:
                    if old.ok:
                        self.plugins.pop(str(path), None)
                        if old.pool is not None:
                            retiring.append(old.pool)
                    elif old in self.failed:
                        self.failed.remove(old)
                if not self._admit(new):
                    self.reload_failures += 1
            for old in removed:
                self._signatures.pop(old.path, None)
                if old.ok:
                    self.plugins.pop(str(old.path), None)
                    if old.pool is not None:
                        retiring.append(old.pool)
                    log("plugin_removed", plugin=old.name, path=str(old.path))
                elif old in self.failed:
                    self.failed.remove(old)
            changed_tools = self.publish()
            for pool in retiring:
                self._retiring.add(pool)
                self.nursery.start_soon(self._retire, pool)
            t3 = time.perf_counter()
            log("reload_done", changed=changed_tools, catalog_version=self.catalog.version, tools=len(self.catalog),
                loaded=len(prints), removed=len(removed), scan_ms=round((t1 - t0) * 1000, 1),
                load_ms=round((t2 - t1) * 1000, 1), swap_ms=round((t3 - t2) * 1000, 1))
            return changed_tools

    async def serve_approvals_watch(self, poll_s: float,
                                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reload whenever the shared approvals change (``toolcell approve`` on any machine), or become
        readable again, until cancelled: the plugins held for approval load, clients hear
        ``list_changed``. A book that is not watched (the state dir's) returns at once."""
        try:
            seen = await trio.to_thread.run_sync(self.approvals.version, abandon_on_cancel=True)
        except ApprovalsError as exc:
            seen = f"unreadable: {exc}"
        if seen is None:
            task_status.started()
            return
        task_status.started()
        while True:
            await trio.sleep(poll_s)
            try:
                now = await trio.to_thread.run_sync(self.approvals.version, abandon_on_cancel=True)
            except ApprovalsError as exc:
                now = f"unreadable: {exc}"
            if now == seen:
                continue
            if not (now or "").startswith("unreadable: "):
                log("approvals_changed", where=self.approvals.where, version=now)
                await self.reload()
            elif not (seen or "").startswith("unreadable: "):
                log("approvals_unreadable", level="error", error=now, note="plugins serve as loaded; "
                    "new and changed ones are held until the approvals can be read")
            seen = now

    async def _retire(self, pool: Any) -> None:
        try:
            await pool.retire()
        finally:
            self._retiring.discard(pool)

    def publish(self) -> bool:
        """Build a new catalog version from the loaded plugins; notify if the tool set changed."""
        entries = resolve_conflicts(list(self.plugins.values()))
        new = Catalog(self.catalog.version + 1, entries, self.config.page_size)
        changed = [e.encoded("2026-07-28") for e in new.entries] != [e.encoded("2026-07-28") for e in self.catalog.entries]
        self.catalog = new
        if changed and new.version > 1:
            for notify in list(self._subscribers):
                notify()
        return changed

    def subscribe(self, notify: Callable[[], None]) -> Callable[[], None]:
        """Call ``notify()`` whenever the tool set changes; returns the unsubscribe function."""
        self._subscribers.add(notify)
        return lambda: self._subscribers.discard(notify)

    # -- calls (``runtime.calls`` runs them) -------------------------------------------------------

    @property
    def inflight(self) -> int:
        return self.calls.inflight

    def abort_calls(self, reason: str) -> None:
        """Fail every call in flight with ``reason`` (shutdown's grace is over): each client gets an
        answer saying so instead of a bare end of its connection."""
        pools = [p.pool for p in self.plugins.values() if p.pool is not None] + list(self._retiring)
        for pool in pools:
            try:
                pool.abort_all(reason)
            except Exception as exc:  # our bug: the other pools are still answered
                log("internal_error", level="error", where="abort_calls", error=f"{type(exc).__name__}: {exc}")

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as n:
                for plugin in self.plugins.values():
                    if plugin.pool is not None:
                        n.start_soon(plugin.pool.aclose)
                for pool in list(self._retiring):
                    n.start_soon(pool.aclose)


async def _open_task_store(config: Config) -> TaskStore | None:
    """The configured task store; None (tasks unavailable, tools still served) if it cannot be opened."""
    try:
        return await connect_task_store(config.tasks.store, config.state_dir, limits=config.tasks.store_limits())
    except Exception as exc:  # an unreachable Redis, an unwritable state dir: say so, keep serving tools
        log("task_store_unavailable", level="error", store=config.tasks.store or "sqlite",
            error=f"{type(exc).__name__}: {str(exc)[:300]}", note="tasks are unavailable; tools are served")
        return None


#: How long a daemon that stops waits for the store to forget its catalog (a store that is down
#: must not hold the exit; the entry then goes once it is orphan_after_s old, as before).
FORGET_CATALOG_S = 2.0


async def _forget_catalog(store: TaskStore, owner: str) -> None:
    """A clean exit takes this daemon's catalog out of the store at once: the daemons still serving
    counted it as a replica with another catalog (``catalog_differs``) until it fell silent."""
    with trio.move_on_after(FORGET_CATALOG_S):
        try:
            await store.forget_catalog(owner)
        except Exception as exc:  # noqa: BLE001 (the store is down: the entry ages out instead)
            log("task_store_failed", level="warning", error=f"{type(exc).__name__}: {str(exc)[:300]}",
                note="this daemon's catalog stays listed until it is orphan_after_s old")


@asynccontextmanager
async def open_daemon(config: Config, describe_only: bool = False, replica: bool = True) -> AsyncIterator[Daemon]:
    """``replica=False`` (``toolcell call``): a one-shot process, not one of the daemons serving the
    task store, so its catalog is neither published beside theirs nor compared with them."""
    secure_state_dir(config.state_dir)  # before anything in it is trusted: approvals, environments, pidfiles
    become_subreaper()
    sweep_stale_scratch(config.state_dir)
    try:
        cgroups.sweep_stale()  # empty worker cgroups left behind by a daemon that died
    except Exception as exc:  # never fatal: strict workers re-check their own cgroup layer
        log("cgroup_sweep_failed", level="warning", error=str(exc))
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_reaper)
        daemon = Daemon(config, nursery)
        try:
            await daemon.load(describe_only=describe_only)
            # What start-up made lives as long as the daemon: out of the cyclic collector's sight, so
            # that its collections look only at what calls allocate (cheaper, and as often as before).
            gc.freeze()
            if describe_only:
                yield daemon
            else:
                # After the initial load, which it would only slow down: a spare interpreter for the
                # next worker to start (a hot reload's new version, a replacement).
                daemon.spares = Spares(config.state_dir)
                await nursery.start(daemon.spares.serve)
                await nursery.start(daemon.serve_approvals_watch, config.approvals.poll_s)
                store = await _open_task_store(config)
                # The store's upkeep (heartbeats, sweeps, mailboxes) stops, and has stopped, before the
                # store closes: a heartbeat in flight on a closed store was a spurious
                # `task_store_failed ... ClosedResourceError` at every exit.
                upkeep = trio.CancelScope()
                upkeep_stopped = trio.Event()

                async def serve_upkeep(tasks: TaskManager, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                    try:
                        with upkeep:
                            await tasks.serve(task_status=task_status)
                    finally:
                        upkeep_stopped.set()

                try:
                    if store is not None:
                        daemon.tasks = TaskManager(daemon.core, daemon.calls, store, config.tasks, nursery,
                                                   catalog_fingerprint=(lambda: daemon.catalog.fingerprint)
                                                   if replica else None)
                        await nursery.start(serve_upkeep, daemon.tasks)
                    with spares_installed(daemon.spares):
                        yield daemon
                finally:
                    if store is not None:
                        with trio.CancelScope(shield=True):
                            upkeep.cancel()
                            if daemon.tasks is not None:
                                await upkeep_stopped.wait()
                                if replica:
                                    await _forget_catalog(store, daemon.tasks.owner)
                            await store.aclose()
        finally:
            await daemon.aclose()
            nursery.cancel_scope.cancel()
