"""Namespaces: user + mount + pid + net + ipc + uts (+ cgroup), a pid-1 worker, a private file view.

How this works (root-started worker, this machine's case):

1. ``enter()``: the worker process W unshares mount, pid, net, ipc, uts and cgroup namespaces (owned
   by the initial user namespace, so it can still mount as real root) and forks. The child C is pid 1
   of the new pid namespace and carries on as the worker. W becomes ``_reap``: it closes every fd
   (the IPC fd included), drops to the worker uid, turns SIGTERM/SIGINT/SIGHUP into SIGKILL for C
   and exits with C's status. C dies with W (PDEATHSIG, armed through an alive pipe so the race with
   W's death is closed), and every process in the namespace dies with C (pid 1 exit), double-forked
   ``setsid`` survivors included.
2. ``build_view()`` in C, still root: / becomes private recursively; the host paths the worker needs
   that are about to be hidden are cloned (``open_tree``); the whole tree is made read-only, nosuid
   and nodev (recursive ``mount_setattr``; /dev keeps its device nodes); a fresh /proc; sized private
   tmpfs (``size=``, ``nr_inodes=``) on /tmp, /dev/shm and the scratch dir, owned by the worker uid;
   a read-only tmpfs over each directory the worker uid could not traverse (``/root`` is 0700 here
   and holds the interpreter), with the needed trees attached back inside it.
3. ``enter_user_ns()`` in C, after the identity switch: unshare a user namespace as the
   unprivileged worker uid, map that uid (and gid) to itself, and drop every capability.

A worker started by a non-root daemon takes ``enter_unprivileged()`` instead: one unshare with the
user namespace first, self-mapping, then the same fork and view (no ancestor covers needed).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

from sandbox.isolation import hygiene, identity, syscalls
from sandbox.isolation.paths import Allowlist, is_under, minimal

HOSTNAME = "toolcell"
NS_FLAGS_BASE = (
    syscalls.CLONE_NEWNS | syscalls.CLONE_NEWPID | syscalls.CLONE_NEWIPC | syscalls.CLONE_NEWUTS
    | syscalls.CLONE_NEWCGROUP
)
#: inode caps of the private tmpfs mounts (disk-fill and inode-fill bombs).
TMP_INODES = 16384
SHM_INODES = 1024


@dataclass
class Entered:
    """What ``enter`` leaves for the child (pid 1) to finish."""

    alive_fd: int
    net: bool
    user_ns: bool = False
    notes: list[str] = field(default_factory=list)


def flags(*, net: bool) -> int:
    return NS_FLAGS_BASE | (syscalls.CLONE_NEWNET if net else 0)


def _write(path: str, data: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, data.encode())
    finally:
        os.close(fd)


def _reap(child: int, alive_w: int, ident: identity.Identity | None) -> None:
    """The parent left outside the pid namespace: wait for pid 1 and mirror its fate. Never returns.

    Every path ends in ``os._exit`` (the ``finally``): whatever fails here, this process must never
    return into the worker's code, which would import the plugin outside the pid namespace. pid 1's
    end is passed on unchanged: a signal by dying of the same signal (SIGKILL too), a status as is."""
    code = 125
    try:
        os.closerange(3, alive_w)
        os.closerange(alive_w + 1, 1 << 20)

        def kill_child(*_: object) -> None:
            try:
                os.kill(child, signal.SIGKILL)
            except OSError:
                pass

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, kill_child)
        hygiene._on_orphaned.append(kill_child)  # the daemon died: take pid 1 (and so everything) along
        if ident is not None and os.geteuid() == 0:
            identity.drop(ident)
        else:
            hygiene.arm_parent_death_signal()
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except InterruptedError:
                continue
        code = os.waitstatus_to_exitcode(status)
        if code < 0:
            signum = -code
            code = 128 + signum
            if signum not in (signal.SIGKILL, signal.SIGSTOP):
                try:
                    signal.signal(signum, signal.SIG_DFL)
                except (OSError, ValueError):
                    pass
            try:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
                os.kill(os.getpid(), signum)
            except OSError:
                pass
    except BaseException:  # noqa: BLE001 (whatever broke, the reaper must not outlive pid 1)
        try:
            os.kill(child, signal.SIGKILL)
        except BaseException:  # noqa: BLE001
            pass
    finally:
        os._exit(code)


def _fork_into_pid_ns(ident: identity.Identity | None, net: bool) -> Entered:
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(alive_r)
        _reap(pid, alive_w, ident)
    os.close(alive_w)
    os.setsid()  # own session: a kill(0, ...) from inside never reaches the reaper's process group
    hygiene.forked_from_single_thread()
    hygiene.arm_parent_death_signal(alive_fd=alive_r)
    return Entered(alive_fd=alive_r, net=net)


def enter(ident: identity.Identity | None, *, net: bool) -> Entered:
    """Root path: unshare everything but the user namespace, fork; returns in pid 1 only."""
    syscalls.unshare(flags(net=net))
    return _fork_into_pid_ns(ident, net)


def enter_unprivileged(*, net: bool) -> Entered:
    """Non-root path: the user namespace comes first and owns the others."""
    uid, gid = os.getuid(), os.getgid()
    syscalls.unshare(syscalls.CLONE_NEWUSER | flags(net=net))
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    entered = _fork_into_pid_ns(None, net)
    entered.user_ns = True
    return entered


def enter_user_ns(ident: identity.Identity) -> None:
    """After the uid switch: a user namespace mapping the worker ids to themselves, no capabilities."""
    syscalls.unshare(syscalls.CLONE_NEWUSER)
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{ident.uid} {ident.uid} 1")
    _write("/proc/self/gid_map", f"{ident.gid} {ident.gid} 1")
    syscalls.drop_all_capabilities()


def _makedirs_public(path: str) -> None:
    """mkdir -p with 0755 components (umask is 077 by now), so the worker uid can traverse them."""
    missing = []
    p = path
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        os.mkdir(d)
        os.chmod(d, 0o755)


def _mountpoint_like(src_is_dir: bool, path: str) -> None:
    if src_is_dir:
        _makedirs_public(path)
    elif not os.path.lexists(path):
        _makedirs_public(os.path.dirname(path))
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))


def _tmpfs(target: str, size_mb: int, inodes: int, mode: int, ident: identity.Identity | None) -> None:
    opts = f"size={size_mb}m,nr_inodes={inodes},mode={mode:o}"
    if ident is not None:
        opts += f",uid={ident.uid},gid={ident.gid}"
    syscalls.mount("tmpfs", target, "tmpfs", syscalls.MS_NOSUID | syscalls.MS_NODEV, opts)


def build_view(
    allow: Allowlist, scratch: str, ident: identity.Identity | None, *, tmp_size_mb: int, cover_blocked: bool
) -> list[str]:
    """Set up the worker's mount namespace (see the module doc, step 2). Returns the covered dirs."""
    ro = syscalls.MOUNT_ATTR_RDONLY | syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NODEV
    syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE)
    host = [p for p in allow.host_paths() if p not in (scratch, *("/tmp", "/dev/shm"))]
    # private tmpfs: path -> (size_mb, inodes, mode, owner); blocked ancestors get a read-only 0755 one
    covers: dict[str, tuple[int, int, int, identity.Identity | None]] = {}
    for p, inodes in (("/tmp", TMP_INODES), ("/dev/shm", SHM_INODES)):
        if os.path.isdir(p) and p not in allow.write:
            covers[p] = (tmp_size_mb, inodes, 0o700, ident)
    if scratch:
        covers[os.path.realpath(scratch)] = (tmp_size_mb, TMP_INODES, 0o700, ident)
    blocked: list[str] = []
    if cover_blocked and ident is not None:
        for p in [*host, *covers]:
            b = identity.blocked_ancestor(p, ident)
            if b is not None and b != p and not any(is_under(b, c) for c in covers):
                covers[b] = (1, 1024, 0o755, None)
                blocked.append(b)
    write = set(allow.write)
    # Clone what the covers are about to hide, before anything is mounted over it.
    clones: list[tuple[str, bool, bool, int]] = []
    for p in minimal([h for h in host if h not in write]) + minimal(list(write)):
        if any(is_under(p, c) and p != c for c in covers):
            clones.append((p, os.path.isdir(p), p in write, syscalls.open_tree_clone(p)))
    for p in write:
        if not any(is_under(p, c) for c in covers):
            syscalls.mount(p, p, None, syscalls.MS_BIND | syscalls.MS_REC)
    syscalls.mount_setattr("/", ro, recursive=True)
    syscalls.mount_setattr("/dev", 0, syscalls.MOUNT_ATTR_NODEV)
    for p in write:
        if not any(is_under(p, c) for c in covers):
            syscalls.mount_setattr(p, 0, syscalls.MOUNT_ATTR_RDONLY, recursive=True)
    syscalls.mount("proc", "/proc", "proc", syscalls.MS_NOSUID | syscalls.MS_NODEV | syscalls.MS_NOEXEC)
    # Covers and re-attached clones, shallowest first (a cover may sit inside another one).
    steps: list[tuple[int, int, str]] = [(c.count("/"), 0, c) for c in covers]
    steps += [(p.count("/"), 1, p) for p, _, _, _ in clones]
    by_path = {p: (is_dir, w, fd) for p, is_dir, w, fd in clones}
    for _, kind, p in sorted(steps):
        if kind == 0:
            size, inodes, mode, owner = covers[p]
            _makedirs_public(p)
            _tmpfs(p, size, inodes, mode, owner)
        else:
            is_dir, w, fd = by_path[p]
            _mountpoint_like(is_dir, p)
            syscalls.move_mount(fd, p)
            os.close(fd)
            if w:
                syscalls.mount_setattr(p, syscalls.MOUNT_ATTR_NOSUID | syscalls.MOUNT_ATTR_NODEV,
                                       syscalls.MOUNT_ATTR_RDONLY, recursive=True)
            else:
                syscalls.mount_setattr(p, ro, recursive=True)
    for b in blocked:
        syscalls.mount_setattr(b, ro)
    if scratch:
        os.chdir(scratch)  # the old cwd is the directory under the new tmpfs
    return blocked


def set_hostname() -> None:
    syscalls.sethostname(HOSTNAME)


def pid1_of(worker_pid: int) -> int | None:
    """Host pid of a worker's pid 1 (the only child of the process the daemon spawned), if alive."""
    try:
        with open(f"/proc/{worker_pid}/task/{worker_pid}/children") as f:
            kids = f.read().split()
    except OSError:
        return None
    return int(kids[0]) if len(kids) == 1 else None


def host_path(worker_pid: int, path: str) -> str | None:
    """Where the daemon can reach ``path`` of a live worker's private view (e.g. its scratch tmpfs).

    ``/proc/<pid 1>/root/<path>``. Absolute symlinks met below it resolve against the *daemon's*
    root, so open what is found there with ``O_NOFOLLOW`` / ``openat2(RESOLVE_IN_ROOT)`` (trap 11).
    """
    pid1 = pid1_of(worker_pid)
    if pid1 is None:
        return None
    return f"/proc/{pid1}/root/{path.lstrip('/')}"
