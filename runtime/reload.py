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

import os
import signal
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import trio

from runtime import scope as scopes
from runtime.fingerprints import SKIP_DIRS, SKIP_SUFFIXES
from runtime.logs import log
from runtime.scope import Scope

if TYPE_CHECKING:
    from runtime.daemon import Daemon

#: watchfiles checks for changes every step and yields once a step brings no new ones, so a save is
#: seen 1-2 steps after it lands; changes closer together than a step are one reload.
WATCH_STEP_MS = 10
#: After the watchers start: when to look once for what changed before they were watching.
WATCH_CATCH_UP_S = 0.25


PIDFILE_PREFIX = "toolcell-"


def pidfile_path(state_dir: str, pid: int | None = None) -> str:
    """One pidfile per daemon (``toolcell-<pid>.pid``): two daemons sharing a state dir never touch
    each other's, and ``toolcell reload`` can say which daemon it reached."""
    return os.path.join(state_dir, f"{PIDFILE_PREFIX}{os.getpid() if pid is None else pid}.pid")


def write_pidfile(state_dir: str, serving: str = "", scope: Scope | None = None) -> str:
    """Write this daemon's pidfile: its pid, what it serves (addresses, plugin folders), its scope
    (``runtime.scope``: which ``toolcell reload`` and ``toolcell tasks`` mean it by default)."""
    os.makedirs(state_dir, mode=0o711, exist_ok=True)
    path = pidfile_path(state_dir)
    with open(path, "w") as f:
        f.write(f"{os.getpid()}\n{serving}\n{scopes.encode(scope) if scope is not None else ''}\n")
    return path


class RunningDaemon(NamedTuple):
    pid: int
    #: What it serves, as its pidfile says.
    serving: str
    #: Its configuration and plugin set (None: a daemon from before scopes were recorded).
    scope: Scope | None


def _trusted_pidfile(path: str) -> float | None:
    """When the pidfile at ``path`` was written, if only this user could have written it (a regular
    file of this user that nobody else may write); else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        return None
    return st.st_mtime


def _a_daemon_since(pid: int, written: float) -> bool:
    """Whether ``pid`` can be the daemon that wrote its pidfile at ``written``: a process of this user,
    running ``serve``, that started before the file was written (a pid reused by another process since
    the daemon died started after). Where there is no ``/proc`` (not Linux) nothing more can be told."""
    proc = f"/proc/{pid}"
    if not os.path.isdir("/proc/self"):
        return True
    try:
        if os.stat(proc).st_uid != os.geteuid():
            return False
        with open(f"{proc}/cmdline", "rb") as f:
            if b"serve" not in f.read(64 * 1024).split(b"\0"):
                return False
        with open(f"{proc}/stat", "rb") as f:
            ticks = int(f.read(4096).rsplit(b")", 1)[1].split()[19])  # field 22: start, in ticks since boot
        with open("/proc/stat", "rb") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    started = boot + ticks / os.sysconf("SC_CLK_TCK")
    return started <= written + 1.0  # btime is in whole seconds


def running_daemons(state_dir: str) -> list[RunningDaemon]:
    """Every daemon with a pidfile in ``state_dir`` whose process is alive; pidfiles of daemons that
    are gone are removed. A pidfile another user could have written, or naming a process that is not
    the daemon which wrote it (another user's, not ``serve``, started after the file: the pid was
    reused), is not a daemon: ``toolcell reload`` never signals it."""
    found = []
    try:
        names = sorted(os.listdir(state_dir))
    except OSError:
        return []
    for name in names:
        if not (name.startswith(PIDFILE_PREFIX) and name.endswith(".pid")):
            continue
        path = os.path.join(state_dir, name)
        written = _trusted_pidfile(path)
        if written is None:
            continue
        try:
            with open(path) as f:
                lines = f.read(64 * 1024).split("\n")
            pid = int(lines[0])
            if pid <= 0:
                continue
            os.kill(pid, 0)
            if not _a_daemon_since(pid, written):
                raise ProcessLookupError  # the daemon is gone; its pid is another process's now
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
            continue
        except (OSError, ValueError):
            continue
        found.append(RunningDaemon(pid, lines[1].strip() if len(lines) > 1 else "",
                                   scopes.decode(lines[2]) if len(lines) > 2 and lines[2].strip() else None))
    return found


def send_reload(pid: int) -> None:
    """``toolcell reload``: signal one running daemon. Raises OSError."""
    os.kill(pid, signal.SIGHUP)


async def serve_sighup(daemon: Daemon) -> None:
    with trio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            log("reload_requested", trigger="SIGHUP")
            await daemon.reload()
            for hook in list(daemon.sighup_hooks):
                try:
                    await hook()
                except Exception as exc:  # our bug: the reload is done, the daemon serves on
                    log("internal_error", level="error", where="sighup hook",
                        error=f"{type(exc).__name__}: {str(exc)[:300]}")


def _anchor(path: str) -> str:
    """The nearest existing ancestor of ``path`` (``/`` at worst): where its appearance can be seen."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.isdir(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    return parent


def _watch_plan(folders: list[str]) -> tuple[list[str], list[str]]:
    """(folders to watch recursively, ancestors to watch for those folders being created, removed or
    replaced). inotify watches inodes: a folder removed and made again, or swapped by a rename, is a
    new inode the old watch never sees, so each folder's parent is watched (one level) as well."""
    trees = [os.path.abspath(p) for p in folders if os.path.isdir(p)]
    anchors = sorted({_anchor(p) for p in folders})
    return trees, anchors


def import_watchfiles() -> Any:
    """``watchfiles``, or None after a loud warning saying what is lost and how to fix it."""
    try:
        # Lazy: watchfiles (and its Rust extension) only when a folder is watched.
        import watchfiles
    except Exception as exc:  # noqa: BLE001 (any failure to import means no watching)
        log("watcher_unavailable", level="error", error=f"{type(exc).__name__}: {exc}",
            note="plugin folders are NOT watched: changes are picked up only on SIGHUP or `toolcell reload`",
            fix="pip install watchfiles")
        return None
    return watchfiles


def _absolute(paths: list[str]) -> list[str]:
    return [os.path.abspath(p) for p in paths]


def _present(folders: list[str]) -> list[str]:
    return [f for f in folders if os.path.isdir(f)]


def _a_watched_folder_went_away(changes: Any, watched: set[str], trees: list[str]) -> bool:
    """A change to a watched folder itself, or a tree root gone: that tree's watch is dead."""
    return any(os.path.abspath(path) in watched for _, path in changes) or any(not os.path.isdir(r) for r in trees)


async def serve_watcher(daemon: Daemon, debounce_ms: int = 150) -> None:
    """Reload whenever files under the plugin folders change (debounced), and keep watching when a
    folder disappears, reappears or is replaced (or is missing at start and appears later)."""
    watchfiles = import_watchfiles()
    if watchfiles is None:
        return
    folders = _absolute(daemon.config.plugins)
    watched = set(folders)

    def wanted(change: Any, path: str) -> bool:
        parts = Path(path).parts
        return not any(p in SKIP_DIRS for p in parts) and not path.endswith(SKIP_SUFFIXES)

    def touches_a_folder(path: str) -> bool:
        path = os.path.abspath(path)
        return any(f == path or f.startswith(path + os.sep) for f in watched)

    while True:
        trees, anchors = _watch_plan(folders)
        for missing in sorted(set(folders) - set(trees)):
            log("plugin_dir_missing", level="warning", path=missing, note="watching for it to appear")
        rearm = trio.Event()

        async def watch_trees(trees: list[str] = trees, rearm: trio.Event = rearm) -> None:
            async for changes in watchfiles.awatch(*trees, watch_filter=wanted, debounce=debounce_ms,
                                                   step=WATCH_STEP_MS, rust_timeout=250, recursive=True,
                                                   ignore_permission_denied=True):
                if _a_watched_folder_went_away(changes, watched, trees):
                    rearm.set()  # a watched folder itself went away: its watch is dead
                    return
                log("reload_requested", trigger="watch", changed=len(changes))
                await daemon.reload()

        async def watch_anchors(anchors: list[str] = anchors, rearm: trio.Event = rearm) -> None:
            async for _changes in watchfiles.awatch(*anchors, watch_filter=lambda _c, p: touches_a_folder(p),
                                                   debounce=debounce_ms, step=WATCH_STEP_MS, rust_timeout=250,
                                                   recursive=False, ignore_permission_denied=True):
                rearm.set()
                return

        async def catch_up(plan: tuple[list[str], list[str]] = (trees, anchors), rearm: trio.Event = rearm) -> None:
            # A change made after the folders were last scanned (the daemon's start, or the reload
            # below a re-arm) but before the watchers above were watching (each sets its watches when
            # it first runs) raises no event: once they are surely set, look again (a no-op if nothing
            # changed, and then silent). A missing folder that appeared meanwhile (or a watched one
            # that went) changes what must be watched: that is a re-arm, which reloads too.
            await trio.sleep(WATCH_CATCH_UP_S)
            if _watch_plan(folders) != plan:
                rearm.set()
                return
            await daemon.reload(quiet=True)

        async with trio.open_nursery() as nursery:
            if trees:
                nursery.start_soon(watch_trees)
            nursery.start_soon(watch_anchors)
            nursery.start_soon(catch_up)
            await rearm.wait()
            nursery.cancel_scope.cancel()
        present = _present(folders)
        log("watch_rearmed", folders=present, missing=[f for f in folders if f not in present])
        log("reload_requested", trigger="watch", changed="folder replaced")
        await daemon.reload()


async def serve_reloaders(daemon: Daemon) -> None:
    """Everything that triggers reloads for a serving daemon: pidfile, SIGHUP, the file watcher."""
    serving = getattr(daemon, "serving", "") or "plugins " + ", ".join(daemon.config.plugins)
    scope = getattr(daemon, "scope", None) or scopes.scope_of(None, daemon.config.plugins)
    path = write_pidfile(daemon.config.state_dir, serving, scope)
    if daemon.tasks is not None:
        try:
            scopes.record_owner(daemon.config.state_dir, scope, daemon.tasks.owner)
        except OSError as exc:  # `toolcell tasks` will not know this daemon's tasks as its scope's
            log("scope_record_failed", level="warning", error=str(exc))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_sighup, daemon)
            if daemon.config.watch:
                nursery.start_soon(serve_watcher, daemon, daemon.config.reload_debounce_ms)
    finally:
        try:
            os.unlink(path)  # named by our own pid: never another daemon's
        except OSError:
            pass
