"""Landlock: file access allowlist, TCP bind/connect rules, signal and abstract-socket scoping.

Raw syscalls (444 create_ruleset, 445 add_rule, 446 restrict_self) through ctypes. The ruleset
handles every right the running kernel's ABI knows, so anything not granted by a rule is denied:

* ABI 1: file read/write/exec/make/remove; ABI 2: REFER (cross-dir rename/link); ABI 3: TRUNCATE;
  ABI 5: IOCTL_DEV.
* ABI 4: TCP bind and connect (denied, except connect to the worker's egress proxy port).
* ABI 6: scoping: no abstract unix socket connections and no signals outside the domain.

Landlock applies to the calling thread (trap 4) and its future children; the worker is single-threaded.
"""

from __future__ import annotations

import ctypes
import errno
import os

from sandbox.isolation import syscalls
from sandbox.isolation.paths import Allowlist

CREATE_RULESET_VERSION = 1

# fs access rights
EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13
TRUNCATE = 1 << 14
IOCTL_DEV = 1 << 15

NET_BIND_TCP = 1 << 0
NET_CONNECT_TCP = 1 << 1

SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1

RULE_PATH_BENEATH = 1
RULE_NET_PORT = 2

_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1, 5: (1 << 16) - 1}
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
READ_RIGHTS = EXECUTE | READ_FILE | READ_DIR


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _NetPort(ctypes.Structure):
    _fields_ = [("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64)]


def abi_version() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is missing or disabled."""
    try:
        return syscalls.syscall(
            syscalls.NR_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION),
            what="landlock_create_ruleset",
        )
    except OSError:
        return 0


def handled_fs(abi: int) -> int:
    return _FS_BY_ABI.get(abi, _FS_BY_ABI[5])


def _create(fs: int, net: int, scoped: int, abi: int) -> int:
    attr = _RulesetAttr(fs, net, scoped)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    return syscalls.syscall(
        syscalls.NR_LANDLOCK_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0),
        what="landlock_create_ruleset",
    )


def _add_path(ruleset: int, path: str, access: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # gone or unreachable: nothing to allow
    try:
        if not os.path.isdir(path):
            access &= FILE_RIGHTS
        if not access:
            return
        rule = _PathBeneath(access, fd)
        syscalls.syscall(
            syscalls.NR_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(RULE_PATH_BENEATH), ctypes.byref(rule),
            ctypes.c_uint32(0), what=f"landlock_add_rule({path})",
        )
    finally:
        os.close(fd)


def _add_port(ruleset: int, port: int, access: int) -> None:
    rule = _NetPort(access, port)
    syscalls.syscall(
        syscalls.NR_LANDLOCK_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(RULE_NET_PORT), ctypes.byref(rule),
        ctypes.c_uint32(0), what=f"landlock_add_rule(port {port})",
    )


def _restrict(ruleset: int) -> None:
    try:
        syscalls.syscall(syscalls.NR_LANDLOCK_RESTRICT_SELF, ctypes.c_int(ruleset), ctypes.c_uint32(0),
                         what="landlock_restrict_self")
    finally:
        os.close(ruleset)


def apply(
    allow: Allowlist,
    *,
    extra_read: tuple[str, ...] = (),
    extra_write: tuple[str, ...] = (),
    connect_ports: tuple[int, ...] = (),
) -> int:
    """Restrict this thread (and its future children). Returns the ABI version used."""
    abi = abi_version()
    if abi < 1:
        raise OSError(errno.EOPNOTSUPP, "Landlock is not supported or not enabled by this kernel")
    fs = handled_fs(abi)
    write_rights = fs
    read_rights = READ_RIGHTS & fs
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    ruleset = _create(fs, net, scoped, abi)
    try:
        for p in [*allow.read, *extra_read]:
            _add_path(ruleset, p, read_rights)
        for p in allow.list_only:
            _add_path(ruleset, p, READ_DIR)
        for p in allow.devices_read:
            _add_path(ruleset, p, READ_FILE)
        for p in allow.devices_write:
            _add_path(ruleset, p, READ_FILE | WRITE_FILE | (TRUNCATE & fs))
        for p in [*allow.write, *extra_write]:
            _add_path(ruleset, p, write_rights)
        if net:
            for port in sorted(set(connect_ports)):
                _add_port(ruleset, port, NET_CONNECT_TCP)
    except BaseException:
        os.close(ruleset)
        raise
    _restrict(ruleset)
    return abi


def apply_scope_only() -> bool:
    """A fresh nested domain that only scopes signals and abstract sockets (ABI >= 6).

    Used by the per-call zygote's children: a nested domain cannot signal or ptrace its parent
    domain, so a call cannot touch the zygote. Returns False when the kernel is too old.
    """
    abi = abi_version()
    if abi < 6:
        return False
    _restrict(_create(0, 0, SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL, abi))
    return True
