"""Loading plugin folders into checked tool entries, and building the catalog from them.

A plugin's code runs only in its workers: the daemon learns the tool definitions from the first
worker's ``Ready`` frame and checks them here. A plugin with any problem is refused as a whole
(with every problem listed); the other plugins keep serving. When two plugins expose the same
public name, the plugin whose name sorts first keeps it, always, and the conflict is reported.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import msgspec
import trio

from runtime import plugin_files
from runtime.logs import log
from runtime.manifest import MANIFEST_NAME, Manifest, ManifestError, load_manifest
from runtime.protocol.catalog import ToolEntry
from runtime.protocol.schemas import check_tool
from runtime.plugin_secrets import SecretError, SecretStore
from runtime.processes import PoolSpec
from runtime.execution.hosted import HostedRunner
from runtime.execution.pool import WorkerPool
from runtime.execution.runner import PluginLoadError, Runner
from sandbox import wire
from runtime import approvals, installer
from runtime import launch
from runtime.approvals import HELD, Snapshot


@dataclass(eq=False)
class Plugin:
    """One plugin folder and what became of it."""

    path: Path
    manifest: Manifest | None = None
    #: What runs its calls: a pool of workers, or a hosted server's instances.
    pool: Runner | None = None
    entries: list[ToolEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    #: Digest of the folder's files when this version was loaded (hot reload compares it).
    fingerprint: str = ""
    #: Problems of a newer version on disk that failed to load; this version keeps serving.
    reload_error: list[str] = field(default_factory=list)
    #: Set by the daemon once admitted: the plugin's tools changed while it served (a hosted server's
    #: ``list_changed``).
    on_change: Callable[[], Any] | None = None

    @property
    def name(self) -> str:
        return self.manifest.name if self.manifest else self.path.name

    @property
    def ok(self) -> bool:
        return not self.problems


def awaiting_approval(plugin: Plugin) -> bool:
    """A version of this plugin was held because it asks for more than was approved (``runtime.approvals``):
    every reload tries it again, since an approval changes no file in its folder."""
    return any(p.startswith(HELD) for p in (*plugin.problems, *plugin.reload_error))


def discover(dirs: Iterable[str]) -> list[Path]:
    """Plugin folders: each directory given that holds a manifest, or its immediate subfolders that do.

    A subfolder whose name starts with a dot is never a plugin: that is where folders are put together
    before they are finished (``toolcell import`` and ``add`` move a folder in with one rename). A
    manifest counts whatever it is (``lexists``): one that is a FIFO, a link or a folder is found, and
    then refused with that reason when it is read (``runtime.plugin_files``), not skipped unseen."""
    found: list[Path] = []
    for d in dirs:
        root = Path(d).resolve()
        if os.path.lexists(root / MANIFEST_NAME):
            found.append(root)
        elif root.is_dir():
            found.extend(sorted(p for p in root.iterdir()
                                if not p.name.startswith(".") and p.is_dir() and os.path.lexists(p / MANIFEST_NAME)))
        else:
            log("plugin_dir_missing", level="warning", path=str(root))
    return found


async def load_plugin(path: Path, nursery: trio.Nursery, policy: str, state_dir: str, min_workers: int,
                      describe_only: bool = False, secrets: SecretStore | None = None,
                      approved: Snapshot | None = None) -> Plugin:
    """Load one plugin: manifest, first worker, tool checks. Never raises for the plugin's faults.

    ``secrets``: the operator's values for plugins' secrets (none when not given). ``approved``: the
    approvals to check it against (None: the state dir's, read now)."""
    plugin = Plugin(path)
    try:
        plugin.manifest = await plugin_files.off_loop(load_manifest, path, what=f"reading {MANIFEST_NAME}")
    except ManifestError as exc:
        plugin.problems = exc.located()
        return plugin
    except plugin_files.PluginFileError as exc:
        plugin.problems = [f"{path / MANIFEST_NAME}: {exc.reason}"]
        return plugin
    held = (approvals.check(plugin.manifest, path, state_dir) if approved is None
            else approvals.check_in(approved, plugin.manifest, path))
    if held:
        plugin.problems = [held]
        return plugin
    bound = None
    if plugin.manifest.secrets:
        store = secrets if secrets is not None else SecretStore({}, state_dir)
        try:
            bound = store.for_plugin(plugin.manifest.name, plugin.manifest.secrets)
        except SecretError as exc:
            plugin.problems = [exc.reason]
            return plugin
    extra_sys_path: tuple[str, ...] = ()
    if plugin.manifest.dependencies:
        try:
            env = await installer.python_requirements(plugin.manifest.dependencies, state_dir, str(path),
                                                      source_builds=plugin.manifest.allow_source_builds,
                                                      policy=policy)
        except installer.InstallError as exc:
            plugin.problems = [f"dependencies: {exc.reason}"]
            return plugin
        extra_sys_path = (env.site,)
    spec = PoolSpec(plugin.manifest, str(path), policy, state_dir, min_workers=min_workers, describe_only=describe_only,
                    extra_sys_path=extra_sys_path, secrets=bound)
    if plugin.manifest.kind == "server":
        return await _load_server(plugin, spec, nursery)
    pool = WorkerPool(spec, nursery)
    try:
        ready = await pool.start()
    except PluginLoadError as exc:
        await pool.aclose(grace_s=0)
        plugin.problems = [f"{exc.stage}: {exc.message}"]
        return plugin
    plugin.layers = list(ready.layers)
    seen: set[str] = set()
    policies = plugin.manifest.tools
    for unknown in sorted(set(policies) - {t.name for t in ready.tools}):
        plugin.problems.append(f"[tools.{unknown}] names no tool of this plugin")
    for spec_ in ready.tools:
        policy_ = policies.get(spec_.name)
        if policy_ is not None:
            spec_ = msgspec.structs.replace(
                spec_, task_support=policy_.task_support or spec_.task_support,
                task_after_ms=policy_.task_after_ms if policy_.task_after_ms is not None else spec_.task_after_ms)
        public = plugin.manifest.prefix + spec_.name
        if public in seen:
            plugin.problems.append(f"tool {public!r} is defined twice")
            continue
        seen.add(public)
        checked, problems = check_tool(spec_, public)
        if checked is None:
            plugin.problems.extend(problems)
        else:
            plugin.entries.append(ToolEntry(public, plugin.name, spec_.name, checked, pool))
    if not ready.tools:
        plugin.problems.append("the plugin defines no tools")
    if plugin.problems:
        plugin.entries = []
        await pool.aclose(grace_s=0)
        return plugin
    plugin.pool = pool
    return plugin


async def _load_server(plugin: Plugin, spec: PoolSpec, nursery: trio.Nursery) -> Plugin:
    """A hosted MCP server (``runtime.execution.hosted``): install or resolve what it runs, start it, list its tools.

    Unlike a plugin's, a third-party server's tool that fails the checks is left out (and logged)
    rather than refusing the whole server."""
    try:
        argv, reads = await launch.server_command(spec.manifest, spec.plugin_dir, spec.state_dir)
    except installer.InstallError as exc:
        plugin.problems = [f"install: {exc.reason}"]
        return plugin
    except launch.LaunchError as exc:
        plugin.problems = [f"command: {exc}"]
        return plugin
    runner = HostedRunner(spec, nursery, argv, reads)
    try:
        ready = await runner.start()
    except PluginLoadError as exc:
        await runner.aclose(grace_s=0)
        plugin.problems = [f"{exc.stage}: {exc.message}"]
        return plugin
    plugin.layers = list(ready.layers)
    plugin.entries = hosted_entries(plugin, runner, ready.tools)
    if not plugin.entries:
        plugin.problems.append("the server lists no usable tools")
        await runner.aclose(grace_s=0)
        return plugin

    def changed(tools: list[wire.ToolSpec]) -> None:
        plugin.entries = hosted_entries(plugin, runner, tools)
        if plugin.on_change is not None:
            plugin.on_change()

    runner.on_tools_changed = changed
    plugin.pool = runner
    return plugin


def hosted_entries(plugin: Plugin, runner: Runner, tools: list[wire.ToolSpec]) -> list[ToolEntry]:
    """Catalog entries for a hosted server's tools; a tool that fails the checks is left out and logged."""
    assert plugin.manifest is not None
    entries: list[ToolEntry] = []
    seen: set[str] = set()
    dropped: list[dict[str, Any]] = []
    for spec_ in tools:
        public = plugin.manifest.prefix + spec_.name
        checked, problems = check_tool(spec_, public) if public not in seen else (None, [f"tool {public!r} twice"])
        if checked is None:
            dropped.append({"tool": public[:100], "problems": problems[:5]})
            continue
        seen.add(public)
        entries.append(ToolEntry(public, plugin.name, spec_.name, checked, runner))
    if dropped:  # one line per listing: a server may list a thousand broken tools, on every list_changed
        log("hosted_tool_dropped", level="warning", plugin=plugin.name, dropped=len(dropped), first=dropped[:5])
    return entries


def resolve_conflicts(plugins: list[Plugin]) -> list[ToolEntry]:
    """Every servable entry; a name claimed twice goes to the plugin whose name sorts first."""
    owner: dict[str, Plugin] = {}
    entries: list[ToolEntry] = []
    for plugin in sorted((p for p in plugins if p.ok), key=lambda p: (p.name, str(p.path))):
        plugin.conflicts = []
        for entry in plugin.entries:
            winner = owner.get(entry.name)
            if winner is not None:
                note = f"tool {entry.name!r} is also provided by plugin {winner.name!r}, which keeps it"
                plugin.conflicts.append(note)
                log("tool_name_conflict", level="warning", tool=entry.name, kept=winner.name, dropped=plugin.name)
                continue
            owner[entry.name] = plugin
            entries.append(entry)
    return entries
