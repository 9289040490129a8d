"""The cgroup layer: a memory and pids limit per worker, and a kill that reaches every descendant.

Layout: one cgroup per worker, nested under the cgroup the daemon itself runs in (so whatever
limits and accounting the daemon is under still apply to its workers), named by the worker's pid
as the daemon sees it (``Popen.pid``):

* cgroup v2, where the daemon's own cgroup is delegated with ``memory`` and ``pids`` available:
  ``<cgroup2>/<daemon cgroup>/toolcell/<pid>`` with ``memory.max``, ``memory.swap.max``, ``pids.max``.
  The kernel lets a cgroup enable controllers for its children only while no process is in it
  ("no internal processes"), so a daemon that sits in its delegated cgroup itself cannot; a daemon
  in a leaf named ``daemon`` counts its parent, the delegated cgroup, as its own:
  ``<delegated>/daemon`` and ``<delegated>/toolcell/<pid>``. ``enter_daemon_leaf`` moves a daemon
  that is alone in a delegated cgroup (a systemd service with ``Delegate=yes``, a container's
  entrypoint) into that leaf at start; systemd's ``DelegateSubgroup=daemon`` does the same.
* cgroup v1 otherwise (this machine): ``<controller mount>/<daemon cgroup>/toolcell/<pid>`` for the
  ``memory``, ``pids`` and (when mounted) ``freezer`` hierarchies.

The worker creates and joins its cgroup itself, while it is still root and before any plugin code
runs. It cannot remove it (it is inside). The daemon, after the worker process has exited, calls
``cleanup(pid)``: it kills whatever is still in the cgroup and removes the directories.
``kill_all(pid)`` kills every process of a worker (v2 ``cgroup.kill``; v1 freeze, SIGKILL each
member, thaw), which also reaches ``setsid`` + double-fork survivors.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from dataclasses import dataclass

SUBDIR = "toolcell"
#: The leaf a daemon runs in so that its delegated cgroup (the leaf's parent) can hold the workers'.
DAEMON_LEAF = "daemon"
V1_CONTROLLERS = ("memory", "pids", "freezer")


@dataclass(frozen=True)
class Layout:
    version: int
    #: The worker cgroup directory, one per hierarchy (v2: exactly one).
    dirs: tuple[str, ...]


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, fstype, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((fields[4], rfields[0], set(rfields[2].split(","))))
    return out


def _own_paths(pid: int | str = "self") -> dict[str, str]:
    """Controller name (or "" for v2) -> cgroup path of ``pid``."""
    paths: dict[str, str] = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                paths[c] = path
    return paths


def _v2_base() -> str | None:
    own = _own_paths().get("")
    if own is not None and os.path.basename(own.rstrip("/")) == DAEMON_LEAF:
        own = os.path.dirname(own.rstrip("/"))
    for mnt, fstype, _ in _mounts():
        if fstype == "cgroup2" and own is not None:
            base = os.path.join(mnt, own.lstrip("/"))
            try:
                with open(os.path.join(base, "cgroup.controllers")) as f:
                    ctrls = set(f.read().split())
            except OSError:
                continue
            if {"memory", "pids"} <= ctrls:
                return base
    return None


def _v1_bases() -> dict[str, str]:
    own = _own_paths()
    bases = {}
    for mnt, fstype, opts in _mounts():
        if fstype != "cgroup":
            continue
        for c in V1_CONTROLLERS:
            if c in opts and c in own:
                bases[c] = os.path.join(mnt, own[c].lstrip("/"))
    return bases


def layout(worker_id: int | str) -> Layout | None:
    """Where the cgroup of ``worker_id`` lives, relative to the caller's own cgroup."""
    name = str(worker_id)
    base = _v2_base()
    if base is not None:
        return Layout(2, (os.path.join(base, SUBDIR, name),))
    v1 = _v1_bases()
    if "memory" in v1 and "pids" in v1:
        return Layout(1, tuple(os.path.join(b, SUBDIR, name) for b in v1.values()))
    return None


def enter_daemon_leaf() -> str | None:
    """Move this process into ``<own cgroup>/daemon`` when that cgroup is v2, offers memory and pids,
    holds no other process and is writable (delegated): then its workers' cgroups can go beside it.
    Returns the leaf entered, or None when there is nothing to do (or it cannot be done)."""
    own = _own_paths().get("")
    if own is None or os.path.basename(own.rstrip("/")) == DAEMON_LEAF:
        return None
    for mnt, fstype, _ in _mounts():
        if fstype != "cgroup2":
            continue
        base = os.path.join(mnt, own.lstrip("/"))
        try:
            with open(os.path.join(base, "cgroup.controllers")) as f:
                if not {"memory", "pids"} <= set(f.read().split()):
                    return None
            with open(os.path.join(base, "cgroup.procs")) as f:
                if [int(x) for x in f.read().split()] != [os.getpid()]:
                    return None  # not alone (a login session, a shell beside us): not ours to rearrange
            leaf = os.path.join(base, DAEMON_LEAF)
            os.makedirs(leaf, mode=0o755, exist_ok=True)
            _write(os.path.join(leaf, "cgroup.procs"), "0")
        except (OSError, ValueError):
            return None
        return leaf
    return None


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _enable_v2_controllers(base: str) -> None:
    for d in (base, os.path.join(base, SUBDIR)):
        os.makedirs(d, exist_ok=True)
        try:
            _write(os.path.join(d, "cgroup.subtree_control"), "+memory +pids")
        except OSError as exc:
            raise OSError(exc.errno, f"cgroup v2 not delegated: cannot enable memory,pids in {d}: {exc.strerror}") from exc


def create_and_join(worker_id: int | str, memory_mb: int, pids_max: int) -> Layout:
    """Create the worker's cgroup(s), write the limits, and move the calling process in."""
    lay = layout(worker_id)
    if lay is None:
        raise OSError(errno.ENOENT, "no usable cgroup hierarchy (need v2 delegated with memory+pids, or v1 memory+pids)")
    limit = str(memory_mb * 1024 * 1024)
    if lay.version == 2:
        d = lay.dirs[0]
        _enable_v2_controllers(os.path.dirname(os.path.dirname(d)))
        os.makedirs(d, mode=0o755, exist_ok=True)
        _write(os.path.join(d, "memory.max"), limit)
        if os.path.exists(os.path.join(d, "memory.swap.max")):
            _write(os.path.join(d, "memory.swap.max"), "0")
        _write(os.path.join(d, "pids.max"), str(pids_max))
        _write(os.path.join(d, "cgroup.procs"), "0")
        return lay
    for d in lay.dirs:
        os.makedirs(d, mode=0o755, exist_ok=True)
        if os.path.exists(os.path.join(d, "memory.limit_in_bytes")):
            _write(os.path.join(d, "memory.limit_in_bytes"), limit)
            memsw = os.path.join(d, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):
                _write(memsw, limit)
        if os.path.exists(os.path.join(d, "pids.max")):
            _write(os.path.join(d, "pids.max"), str(pids_max))
        _write(os.path.join(d, "cgroup.procs"), "0")
    return lay


def limit_events(worker_id: int | str) -> dict[str, int]:
    """How often the worker's cgroup hit its limits: ``oom_kill`` (processes the kernel killed for
    memory) and ``pids_max`` (forks refused at ``pids.max``). Zero for what cannot be read."""
    out = {"oom_kill": 0, "pids_max": 0}
    lay = layout(worker_id)
    if lay is None:
        return out
    for d in lay.dirs:
        for name, key, field in (("memory.events", "oom_kill", "oom_kill"), ("memory.oom_control", "oom_kill", "oom_kill"),
                                 ("pids.events", "pids_max", "max")):
            try:
                with open(os.path.join(d, name)) as f:
                    for line in f:
                        parts = line.split()
                        if len(parts) == 2 and parts[0] == field and parts[1].isdigit():
                            out[key] = max(out[key], int(parts[1]))
            except OSError:
                pass
    return out


def members(worker_id: int | str) -> list[int]:
    """Pids currently in the worker's cgroup (empty when it does not exist)."""
    lay = layout(worker_id)
    if lay is None:
        return []
    pids: set[int] = set()
    for d in lay.dirs:
        try:
            with open(os.path.join(d, "cgroup.procs")) as f:
                pids.update(int(x) for x in f.read().split())
        except OSError:
            pass
    return sorted(pids)


def kill_all(worker_id: int | str, timeout_s: float = 2.0) -> bool:
    """SIGKILL every process in the worker's cgroup; True once it is empty (or never existed)."""
    lay = layout(worker_id)
    if lay is None:
        return True
    deadline = time.monotonic() + timeout_s
    if lay.version == 2:
        try:
            _write(os.path.join(lay.dirs[0], "cgroup.kill"), "1")
        except OSError:
            pass
    freezer = next((d for d in lay.dirs if os.path.exists(os.path.join(d, "freezer.state"))), None)
    while True:
        pids = members(worker_id)
        if not pids:
            return True
        if time.monotonic() > deadline:
            return False
        # Freezing first stops a fork bomb from outrunning the kill loop.
        if freezer:
            try:
                _write(os.path.join(freezer, "freezer.state"), "FROZEN")
            except OSError:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if freezer:
            try:
                _write(os.path.join(freezer, "freezer.state"), "THAWED")
            except OSError:
                pass
        time.sleep(0.01)


def cleanup(worker_id: int | str, timeout_s: float = 2.0) -> bool:
    """Kill what is left of a worker and remove its cgroup directories. True when all are gone.

    The daemon calls this after the worker process exited (or instead of waiting for it).
    """
    kill_all(worker_id, timeout_s)
    lay = layout(worker_id)
    if lay is None:
        return True
    deadline = time.monotonic() + timeout_s
    ok = True
    for d in lay.dirs:
        while True:
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                # EBUSY until the last task is fully gone (a dying task lingers briefly).
                if time.monotonic() > deadline:
                    ok = False
                    break
                time.sleep(0.005)
    return ok


def sweep_stale(prefix: str = "") -> int:
    """Remove empty worker cgroups left by a daemon that died; call once at daemon start-up.

    Only before any worker of this daemon starts: a worker's cgroup is empty for a moment between
    its creation and the worker joining it. Only names starting with ``prefix``. Returns how many
    were removed.
    """
    lay = layout("_")
    if lay is None:
        return 0
    removed = 0
    names: set[str] = set()
    for d in lay.dirs:
        try:
            parent = os.path.dirname(d)
            names.update(n for n in os.listdir(parent) if n.startswith(prefix) and os.path.isdir(os.path.join(parent, n)))
        except OSError:
            pass
    for name in sorted(names):
        if not members(name) and cleanup(name, timeout_s=0.2):
            removed += 1
    return removed
