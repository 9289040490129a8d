"""Putting back what a per_call call could write: /tmp, /dev/shm and scratch are snapshotted by the
zygote before the first call (``Reset``) and restored after every call, with the stdio file
descriptions' flags and locks. Bounded: a directory deeper than ``_MAX_DEPTH`` is moved up to the
root before it is emptied. Never imports trio.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from dataclasses import dataclass, field

from sandbox import isolation
from sandbox.wire import Init

#: A directory deeper than this below a reset root is moved up to the root before it is emptied
#: (bounded recursion and open fds, whatever a call built).
_MAX_DEPTH = 32



@dataclass
class SavedDir:
    """A directory as the zygote found it (a reset root or a directory below one)."""

    mode: int
    times: tuple[int, int]
    #: Ours (the worker uid's): its mode, times and xattrs are restored. One that is not (made by
    #: root on the way to scratch) a call cannot change either.
    owned: bool
    xattrs: dict[str, bytes] = field(default_factory=dict)
    dirs: dict[str, SavedDir] = field(default_factory=dict)
    #: name -> (mode, (atime_ns, mtime_ns), contents)
    files: dict[str, tuple[int, tuple[int, int], bytes]] = field(default_factory=dict)
    links: dict[str, str] = field(default_factory=dict)
    #: Directories another file system is mounted on (the scratch tmpfs inside /tmp), or that the
    #: worker uid cannot list (nor, then, write to): left alone.
    mounts: set[str] = field(default_factory=set)


def _xattrs(fd: int) -> dict[str, bytes]:
    try:
        return {name: os.getxattr(fd, name) for name in os.listxattr(fd)}
    except OSError:
        return {}


def _snapshot(dfd: int, dev: int) -> SavedDir:
    st = os.fstat(dfd)
    node = SavedDir(stat.S_IMODE(st.st_mode), (st.st_atime_ns, st.st_mtime_ns), st.st_uid == os.geteuid(), _xattrs(dfd))
    with os.scandir(dfd) as it:
        entries = list(it)
    for e in entries:
        est = e.stat(follow_symlinks=False)
        if stat.S_ISDIR(est.st_mode):
            if est.st_dev != dev:
                node.mounts.add(e.name)
                continue
            try:
                sub = os.open(e.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except PermissionError:
                node.mounts.add(e.name)
                continue
            try:
                node.dirs[e.name] = _snapshot(sub, dev)
            finally:
                os.close(sub)
        elif stat.S_ISREG(est.st_mode):
            fd = os.open(e.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            try:
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                data = b"".join(chunks)
            finally:
                os.close(fd)
            node.files[e.name] = (stat.S_IMODE(est.st_mode), (est.st_atime_ns, est.st_mtime_ns), data)
        elif stat.S_ISLNK(est.st_mode):
            node.links[e.name] = os.readlink(e.name, dir_fd=dfd)
        # sockets and fifos left at import are not recreated: they are gone after the first call
    return node


def _open_dir(name: str, dfd: int | None) -> int:
    """Open a directory of ours for listing and changes, whatever mode a call gave it."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(name, flags, dir_fd=dfd)
    except PermissionError:
        os.chmod(name, 0o700, dir_fd=dfd)
        return os.open(name, flags, dir_fd=dfd)


class Reset:
    """Puts /tmp, /dev/shm and scratch back as the zygote found them (see the module doc)."""

    def __init__(self, roots: list[str]) -> None:
        self.roots: list[tuple[str, int, SavedDir]] = []
        for path in roots:
            fd = _open_dir(path, None)
            try:
                dev = os.fstat(fd).st_dev
                self.roots.append((path, dev, _snapshot(fd, dev)))
            finally:
                os.close(fd)
        self._hoisted = 0
        self.stdio: list[tuple[int, int, int]] = []
        for fd in (0, 1, 2):
            try:
                flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            except OSError:
                continue
            try:
                pipe_size = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
            except OSError:
                pipe_size = -1
            self.stdio.append((fd, flags, pipe_size))

    def run(self) -> None:
        for path, dev, node in self.roots:
            fd = _open_dir(path, None)
            try:
                self._reset_dir(fd, node, dev, fd, root=True)
            finally:
                os.close(fd)
        for fd, flags, pipe_size in self.stdio:
            # Open file descriptions are shared with Z and R: a call's O_NONBLOCK or flock would stay.
            try:
                if fcntl.fcntl(fd, fcntl.F_GETFL) != flags:
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags)
                fcntl.flock(fd, fcntl.LOCK_UN)
                if pipe_size > 0 and fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ) != pipe_size:
                    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, pipe_size)
            except OSError:
                pass

    def _reset_dir(self, dfd: int, node: SavedDir, dev: int, root_fd: int, root: bool = False) -> None:
        while True:
            hoisted = self._hoisted
            with os.scandir(dfd) as it:
                entries = list(it)
            seen: set[str] = set()
            for e in entries:
                name = e.name
                if e.is_dir(follow_symlinks=False):
                    if name in node.mounts:
                        continue
                    if e.stat(follow_symlinks=False).st_dev != dev:
                        raise OSError(errno.EBUSY, f"unexpected mount point {name!r} in a reset directory")
                    sub = _open_dir(name, dfd)
                    try:
                        if name in node.dirs:
                            seen.add(name)
                            self._reset_dir(sub, node.dirs[name], dev, root_fd)
                        else:
                            self._empty(sub, root_fd, 1)
                    finally:
                        os.close(sub)
                    if name not in node.dirs:
                        os.rmdir(name, dir_fd=dfd)
                else:
                    os.unlink(name, dir_fd=dfd)  # template files are written again below
            if not (root and self._hoisted != hoisted):
                break
        for name, sub_node in node.dirs.items():
            if name not in seen:
                os.mkdir(name, 0o700, dir_fd=dfd)
                sub = _open_dir(name, dfd)
                try:
                    self._reset_dir(sub, sub_node, dev, root_fd)
                finally:
                    os.close(sub)
        for name, (mode, times, data) in node.files.items():
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                os.write(fd, data)
                os.fchmod(fd, mode)
                os.utime(fd, ns=times)
            finally:
                os.close(fd)
        for name, target in node.links.items():
            os.symlink(target, name, dir_fd=dfd)
        if not node.owned:
            return
        xattrs = _xattrs(dfd)
        if xattrs != node.xattrs:
            for name in xattrs:
                os.removexattr(dfd, name)
            for name, value in node.xattrs.items():
                os.setxattr(dfd, name, value)
        os.fchmod(dfd, node.mode)
        os.utime(dfd, ns=node.times)

    def _empty(self, dfd: int, root_fd: int, depth: int) -> None:
        with os.scandir(dfd) as it:
            entries = list(it)
        for e in entries:
            if not e.is_dir(follow_symlinks=False):
                os.unlink(e.name, dir_fd=dfd)
                continue
            if depth >= _MAX_DEPTH:
                self._hoist(dfd, e.name, root_fd)
                continue
            sub = _open_dir(e.name, dfd)
            try:
                self._empty(sub, root_fd, depth + 1)
            finally:
                os.close(sub)
            os.rmdir(e.name, dir_fd=dfd)

    def _hoist(self, dfd: int, name: str, root_fd: int) -> None:
        """Move a deep directory up to the root; the root's pass removes it (bounded depth)."""
        os.chmod(name, 0o700, dir_fd=dfd)  # moving a directory rewrites its ".."
        for n in range(1 << 20):
            try:
                os.rename(name, f".toolcell-reset-{n}", src_dir_fd=dfd, dst_dir_fd=root_fd)
                self._hoisted += 1
                return
            except (FileExistsError, IsADirectoryError, NotADirectoryError):
                continue
            except OSError as exc:
                if exc.errno != errno.ENOTEMPTY:
                    raise
        raise OSError(errno.EEXIST, "no free name to move a directory to")


def reset_roots(init: Init) -> list[str]:
    """The directories to reset after every call: scratch, and /tmp and /dev/shm where private."""
    granted = [os.path.realpath(p) for p in init.permissions.write]

    def granted_path(p: str) -> bool:  # a granted path inside a root is a mount point there: left alone
        return any(p == g or p.startswith(g.rstrip("/") + "/") for g in granted)

    roots = []
    if init.scratch_dir:
        scratch = os.path.realpath(init.scratch_dir)
        if os.path.isdir(scratch) and not granted_path(scratch):
            roots.append(scratch)
    # /tmp and /dev/shm are this worker's own tmpfs only when its mount view was built (namespaces);
    # otherwise they are the host's, and not ours to empty.
    private = init.policy != "none" and "namespaces" not in isolation.last_reasons and os.getpid() == 1
    if private:
        for p in ("/tmp", "/dev/shm"):
            if os.path.isdir(p) and not granted_path(p) and p not in roots:
                roots.append(p)
    return roots
