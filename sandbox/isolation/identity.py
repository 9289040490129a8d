"""Identity: a root-started worker runs its plugin under an unprivileged uid, never 0.

Each live worker gets its own uid/gid, ``WORKER_ID_BASE + pid of the worker process`` (pids are
unique among live processes), so RLIMIT_NPROC counts one worker's processes only and two workers
can never signal, ptrace or share files with each other by uid. Nothing on the host owns these ids.

Trap 2: changing uid clears the dumpable flag and the parent-death signal; both are set again.
Trap 12: the worker uid must reach the interpreter and code. Here the interpreter lives under
``/root`` (0700), so the mount layer rebuilds a traversable view of the needed paths; without
that layer ``reachable()`` says whether dropping would break imports.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from sandbox.isolation import hygiene, syscalls

WORKER_ID_BASE = 1_900_000_000


@dataclass(frozen=True)
class Identity:
    uid: int
    gid: int


def target(worker_pid: int | None = None) -> Identity:
    """The identity the worker should end up with (its current one when not started as root)."""
    if os.geteuid() != 0:
        return Identity(os.getuid(), os.getgid())
    n = WORKER_ID_BASE + (worker_pid if worker_pid is not None else os.getpid())
    return Identity(n, n)


def can_search(path: str, ident: Identity, *, read: bool = False) -> bool:
    """Whether ``ident`` (no capabilities, no supplementary groups) may traverse (and list) ``path``."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    need = 0o5 if read else 0o1
    if st.st_uid == ident.uid:
        bits = (st.st_mode >> 6) & 0o7
    elif st.st_gid == ident.gid:
        bits = (st.st_mode >> 3) & 0o7
    else:
        bits = st.st_mode & 0o7
    if not stat.S_ISDIR(st.st_mode):
        need = 0o4 if read else 0
    return bits & need == need


def blocked_ancestor(path: str, ident: Identity) -> str | None:
    """The topmost directory on the way to ``path`` that ``ident`` cannot traverse, if any."""
    parts = os.path.realpath(path).split("/")[1:]
    cur = "/"
    for part in ["", *parts]:
        cur = os.path.join(cur, part) if part else cur
        if os.path.isdir(cur) and not can_search(cur, ident):
            return cur
    return None


def reachable(paths: list[str], ident: Identity) -> str | None:
    """``None`` when every path is reachable by ``ident``, else the first blocking directory."""
    for p in paths:
        b = blocked_ancestor(p, ident)
        if b is not None and b != os.path.realpath(p):
            return b
    return None


def drop(ident: Identity, *, alive_fd: int | None = None) -> None:
    """Switch real, effective and saved ids to ``ident``; re-arm PDEATHSIG and dumpable."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setresgid(ident.gid, ident.gid, ident.gid)
        os.setresuid(ident.uid, ident.uid, ident.uid)
        if os.getuid() == 0 or os.geteuid() == 0:
            raise OSError("identity: still uid 0 after setresuid")
    # Dumpable stays on so /proc/self/{uid,gid}_map can still be written (user namespace). The
    # namespace and seccomp layers make ptrace by other same-uid processes moot.
    syscalls.prctl(syscalls.PR_SET_DUMPABLE, 1)
    hygiene.arm_parent_death_signal(alive_fd=alive_fd)


def chown_scratch(scratch_dir: str, ident: Identity) -> None:
    """Give the worker uid its scratch dir (needed only when no private tmpfs covers it)."""
    if scratch_dir and os.geteuid() == 0:
        os.chown(scratch_dir, ident.uid, ident.gid, follow_symlinks=False)
        os.chmod(scratch_dir, 0o700)
