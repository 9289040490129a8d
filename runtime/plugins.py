"""Loading plugin folders into checked tool entries, and building the catalog from them.

A plugin's code runs only in its workers: the daemon learns the tool definitions from the first
worker's ``Ready`` frame and checks them here. A plugin with any problem is refused as a whole
(with every problem listed); the other plugins keep serving. When two plugins expose the same
public name, the plugin whose name sorts first keeps it, always, and the conflict is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import msgspec
import trio

from runtime.logs import log
from runtime.manifest import MANIFEST_NAME, Manifest, ManifestError, load_manifest
from runtime.protocol.catalog import ToolEntry
from runtime.protocol.schemas import check_tool
from runtime.processes import PoolSpec
from runtime.workers import PluginLoadError, WorkerPool


@dataclass(eq=False)
class Plugin:
    """One plugin folder and what became of it."""

    path: Path
    manifest: Manifest | None = None
    pool: WorkerPool | None = None
    entries: list[ToolEntry] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    #: Digest of the folder's files when this version was loaded (hot reload compares it).
    fingerprint: str = ""
    #: Problems of a newer version on disk that failed to load; this version keeps serving.
    reload_error: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.manifest.name if self.manifest else self.path.name

    @property
    def ok(self) -> bool:
        return not self.problems


def discover(dirs: Iterable[str]) -> list[Path]:
    """Plugin folders: each directory given that holds a manifest, or its immediate subfolders that do."""
    found: list[Path] = []
    for d in dirs:
        root = Path(d).resolve()
        if (root / MANIFEST_NAME).is_file():
            found.append(root)
        elif root.is_dir():
            found.extend(sorted(p for p in root.iterdir() if p.is_dir() and (p / MANIFEST_NAME).is_file()))
        else:
            log("plugin_dir_missing", level="warning", path=str(root))
    return found


async def load_plugin(path: Path, nursery: trio.Nursery, policy: str, state_dir: str, min_workers: int,
                      describe_only: bool = False) -> Plugin:
    """Load one plugin: manifest, first worker, tool checks. Never raises for the plugin's faults."""
    plugin = Plugin(path)
    try:
        plugin.manifest = load_manifest(path)
    except ManifestError as exc:
        plugin.problems = [f"{exc.path}: {p}" for p in exc.problems]
        return plugin
    spec = PoolSpec(plugin.manifest, str(path), policy, state_dir, min_workers=min_workers, describe_only=describe_only)
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
