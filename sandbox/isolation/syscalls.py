"""Thin ctypes wrappers for the Linux calls CPython 3.11 does not expose.

Everything here raises ``OSError`` with the real errno. libc is opened once, by the already-loaded
handle (``CDLL(None)``), so nothing shells out (``ctypes.util.find_library`` runs ``ldconfig`` and
``gcc``, which fails once rlimits or Landlock are on). The syscall numbers used directly (mount API,
Landlock) are from the unified table every architecture has shared since 5.1.
"""

from __future__ import annotations

import ctypes
import os

libc = ctypes.CDLL(None, use_errno=True)
_syscall = libc.syscall
_syscall.restype = ctypes.c_long

# -- prctl -----------------------------------------------------------------------------------------
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

# -- namespaces ------------------------------------------------------------------------------------
CLONE_NEWTIME = 0x00000080
CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
ALL_NS_FLAGS = (
    CLONE_NEWTIME | CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID
    | CLONE_NEWNET
)

# -- mounts ----------------------------------------------------------------------------------------
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18

MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4
MOUNT_ATTR_NOEXEC = 0x8

AT_FDCWD = -100
AT_EMPTY_PATH = 0x1000
AT_RECURSIVE = 0x8000
OPEN_TREE_CLONE = 1
OPEN_TREE_CLOEXEC = os.O_CLOEXEC
MOVE_MOUNT_F_EMPTY_PATH = 0x4

NR_OPEN_TREE = 428
NR_MOVE_MOUNT = 429
NR_MOUNT_SETATTR = 442
NR_LANDLOCK_CREATE_RULESET = 444
NR_LANDLOCK_ADD_RULE = 445
NR_LANDLOCK_RESTRICT_SELF = 446


def _check(ret: int, what: str) -> int:
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def syscall(nr: int, *args: object, what: str = "syscall") -> int:
    return _check(_syscall(ctypes.c_long(nr), *args), what)


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    return _check(
        libc.prctl(
            ctypes.c_int(option), ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), ctypes.c_ulong(arg4),
            ctypes.c_ulong(arg5),
        ),
        f"prctl({option})",
    )


def unshare(flags: int) -> None:
    _check(libc.unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        libc.mount(
            source.encode() if source is not None else None,
            target.encode(),
            fstype.encode() if fstype is not None else None,
            ctypes.c_ulong(flags),
            data.encode() if data is not None else None,
        ),
        f"mount({target})",
    )


def sethostname(name: str) -> None:
    raw = name.encode()
    _check(libc.sethostname(raw, ctypes.c_size_t(len(raw))), "sethostname")


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def mount_setattr(path: str, attr_set: int, attr_clr: int = 0, *, recursive: bool = False, dirfd: int = AT_FDCWD) -> None:
    """Change mount flags of the mount at ``path`` (or of ``dirfd`` itself when ``path`` is "")."""
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    flags = (AT_RECURSIVE if recursive else 0) | (AT_EMPTY_PATH if not path else 0)
    syscall(
        NR_MOUNT_SETATTR, ctypes.c_int(dirfd), path.encode(), ctypes.c_uint(flags), ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)), what=f"mount_setattr({path or dirfd})",
    )


def open_tree_clone(path: str) -> int:
    """A detached recursive bind mount of ``path``: survives anything later mounted over ``path``."""
    return syscall(
        NR_OPEN_TREE, ctypes.c_int(AT_FDCWD), path.encode(),
        ctypes.c_uint(OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE), what=f"open_tree({path})",
    )


def move_mount(fd: int, target: str) -> None:
    syscall(
        NR_MOVE_MOUNT, ctypes.c_int(fd), b"", ctypes.c_int(AT_FDCWD), target.encode(),
        ctypes.c_uint(MOVE_MOUNT_F_EMPTY_PATH), what=f"move_mount({target})",
    )


# -- capabilities ----------------------------------------------------------------------------------
class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def drop_all_capabilities() -> None:
    """Empty the bounding, ambient, effective, permitted and inheritable sets of this thread."""
    cap = 0
    while True:
        try:
            prctl(PR_CAPBSET_DROP, cap)
        except OSError:
            break  # EINVAL past the last capability the kernel knows (EPERM without CAP_SETPCAP)
        cap += 1
    try:
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:
        pass
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), data), "capset")


def effective_capabilities() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0
