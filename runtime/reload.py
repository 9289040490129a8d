"""Hot reload: plugins change under a running daemon; clients hear ``list_changed``; no call is lost.

How this works:

* Each loaded plugin carries a fingerprint of its folder (relative path, size, mtime and content
  hash of every file except caches). A reload re-discovers the plugin folders and compares
  fingerprints, so its cost does not grow with the number of unchanged plugins: an unchanged
  plugin's workers are never touched.
* A new or changed plugin is loaded and checked in fresh workers *before* anything switches. Only
  when it loads cleanly does the catalog swap, atomically, to a new version. Calls already running
  finish on the old workers, which then retire; new calls go to the new ones.
* A plugin whose new version is broken keeps serving its last good version; the error is kept on
  the plugin (``toolcell list``, logs, metrics) until a later reload fixes it. A removed plugin's
  tools disappear at once from the catalog; its workers retire after their in-flight calls.
* Triggers: a watchfiles watcher on the plugin folders (debounced: an editor saving several files
  is one reload), SIGHUP, and ``toolcell reload`` (which sends SIGHUP to the pid in the pidfile).
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from runtime.logs import log

if TYPE_CHECKING:
    from runtime.daemon import Daemon

_SKIP_DIRS = {"__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".hypothesis"}
_SKIP_SUFFIXES = (".pyc", ".pyo", ".swp", "~")
MAX_FINGERPRINT_BYTES = 64 * 1024 * 1024
#: watchfiles checks for changes every step and yields once a step brings no new ones, so a save is
#: seen 1-2 steps after it lands; changes closer together than a step are one reload.
WATCH_STEP_MS = 10


def _files(path: Path) -> Iterator[tuple[str, str, os.stat_result]]:
    """``(relative name, full path, lstat)`` of every file of a plugin folder, in a stable order;
    caches, editor droppings and hidden folders are skipped."""
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(_SKIP_SUFFIXES) or name.startswith(".#"):
                continue
            full = os.path.join(root, name)
            try:
                st = os.lstat(full)
            except OSError:
                continue
            yield os.path.relpath(full, path), full, st


#: A file changed more recently than this is "racily clean" (git's term): a same-size rewrite within
#: the file system's timestamp granularity would leave its stat unchanged, so it is compared by content.
RACY_NS = 1_000_000_000


def stat_signature(path: Path) -> str | None:
    """A cheap digest of a plugin folder (names, inodes, sizes, mtimes, ctimes; no file is read),
    or None when a file changed too recently for its stat to be trusted (``RACY_NS``).

    Any write, rename or replacement changes a file's ctime, which user space cannot set back, so
    an unchanged signature means an unchanged folder and its content ``fingerprint`` is skipped."""
    h = hashlib.sha256()
    racy_after = time.time_ns() - RACY_NS
    for rel, _, st in _files(path):
        if st.st_ctime_ns >= racy_after or st.st_mtime_ns >= racy_after:
            return None
        h.update(f"{rel}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0".encode())
    return h.hexdigest()


def fingerprint(path: Path) -> str:
    """A digest of a plugin folder's files (names, sizes and contents); caches are ignored."""
    h = hashlib.sha256()
    budget = MAX_FINGERPRINT_BYTES
    for rel, full, st in _files(path):
        h.update(f"{rel}\0{st.st_size}\0".encode())
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISREG(st.st_mode):
            h.update(b"special")
            continue
        if st.st_size <= budget:
            budget -= st.st_size
            try:
                with open(full, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
            except OSError:
                h.update(b"unreadable")
        else:
            h.update(str(st.st_mtime_ns).encode())
    return h.hexdigest()


def pidfile_path(state_dir: str) -> str:
    return os.path.join(state_dir, "toolcell.pid")


def write_pidfile(state_dir: str) -> str:
    os.makedirs(state_dir, mode=0o711, exist_ok=True)
    path = pidfile_path(state_dir)
    with open(path, "w") as f:
        f.write(f"{os.getpid()}\n")
    return path


def send_reload(state_dir: str) -> int:
    """``toolcell reload``: signal the running daemon; returns its pid. Raises OSError/ValueError."""
    with open(pidfile_path(state_dir)) as f:
        pid = int(f.read().strip())
    os.kill(pid, signal.SIGHUP)
    return pid


async def serve_sighup(daemon: Daemon) -> None:
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            log("reload_requested", trigger="SIGHUP")
            await daemon.reload()


async def serve_watcher(daemon: Daemon, debounce_ms: int = 150) -> None:
    """Reload whenever files under the plugin folders change (debounced)."""
    try:
        import watchfiles
    except ImportError:  # pragma: no cover - watchfiles is a dependency
        log("watcher_unavailable", level="warning")
        return
    paths = [p for p in daemon.config.plugins if os.path.isdir(p)]
    if not paths:
        return

    def wanted(change: Any, path: str) -> bool:
        parts = Path(path).parts
        return not any(p in _SKIP_DIRS for p in parts) and not path.endswith(_SKIP_SUFFIXES)

    async for changes in watchfiles.awatch(*paths, watch_filter=wanted, debounce=debounce_ms, step=WATCH_STEP_MS,
                                           rust_timeout=250, recursive=True, ignore_permission_denied=True):
        log("reload_requested", trigger="watch", changed=len(changes))
        await daemon.reload()


async def serve_reloaders(daemon: Daemon) -> None:
    """Everything that triggers reloads for a serving daemon: pidfile, SIGHUP, the file watcher."""
    path = write_pidfile(daemon.config.state_dir)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_sighup, daemon)
            if daemon.config.watch:
                nursery.start_soon(serve_watcher, daemon, daemon.config.reload_debounce_ms)
    finally:
        try:
            with open(path) as f:
                if f.read().strip() == str(os.getpid()):
                    os.unlink(path)
        except OSError:
            pass
