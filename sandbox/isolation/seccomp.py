"""seccomp through libseccomp (ctypes): default allow, a deny list answering EPERM.

``load_library()`` must run before anything is restricted (trap 3): it opens ``libseccomp.so.2``
by soname, never through ``ctypes.util.find_library`` (which shells out). Syscalls from another
architecture (i386 ``int 0x80`` on x86_64) hit libseccomp's default bad-arch action: kill.
"""

from __future__ import annotations

import ctypes
import errno
import socket
from typing import Any

from sandbox.isolation import syscalls

SONAMES = ("libseccomp.so.2", "libseccomp.so")

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE = 1
SCMP_CMP_EQ = 4
SCMP_CMP_GT = 6
SCMP_CMP_MASKED_EQ = 7


def SCMP_ACT_ERRNO(err: int) -> int:
    return 0x00050000 | (err & 0xFFFF)


#: Denied with EPERM (SANDBOX.md, seccomp row).
DENY = (
    "ptrace", "process_vm_readv", "process_vm_writev",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "bpf", "perf_event_open", "userfaultfd",
    "keyctl", "add_key", "request_key",
    "mount", "umount2", "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree", "mount_setattr",
    "pivot_root", "chroot", "unshare", "setns",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
)
#: Syscalls newer than libseccomp 2.5 knows, by their (unified, all-architecture) number.
RAW_DENY = {"open_tree_attr": 467}
NS_FLAGS = (
    syscalls.CLONE_NEWNS, syscalls.CLONE_NEWCGROUP, syscalls.CLONE_NEWUTS, syscalls.CLONE_NEWIPC,
    syscalls.CLONE_NEWUSER, syscalls.CLONE_NEWPID, syscalls.CLONE_NEWNET, syscalls.CLONE_NEWTIME,
)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


_lib: Any = None


def load_library() -> Any:
    """Open libseccomp once (by soname) and declare the functions used."""
    global _lib
    if _lib is not None:
        return _lib
    last: OSError | None = None
    for name in SONAMES:
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            break
        except OSError as exc:
            last = exc
    else:
        raise OSError(errno.ENOENT, f"libseccomp not found ({last}); install libseccomp2")
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp),
    ]
    _lib = lib
    return lib


def _rule(lib: Any, ctx: int, action: int, nr: int, *cmps: tuple[int, int, int, int]) -> None:
    arr = (_ArgCmp * max(len(cmps), 1))(*[_ArgCmp(*c) for c in cmps])
    rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr)
    if rc < 0:
        raise OSError(-rc, f"seccomp_rule_add(syscall {nr}): {errno.errorcode.get(-rc, rc)}")


def _nr(lib: Any, name: str) -> int | None:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr < 0:
        nr = RAW_DENY.get(name, -1)
    return nr if nr >= 0 else None


def build_and_load(*, allow_inet: bool) -> list[str]:
    """Load the filter into this thread. Returns the syscall names it denies."""
    lib = load_library()
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    eperm = SCMP_ACT_ERRNO(errno.EPERM)
    denied: list[str] = []
    try:
        for name in (*DENY, *RAW_DENY):
            nr = _nr(lib, name)
            if nr is not None:
                _rule(lib, ctx, eperm, nr)
                denied.append(name)
        clone = _nr(lib, "clone")
        if clone is not None:
            for flag in NS_FLAGS:
                _rule(lib, ctx, eperm, clone, (0, SCMP_CMP_MASKED_EQ, flag, flag))
            denied.append("clone(namespace flags)")
        clone3 = _nr(lib, "clone3")
        if clone3 is not None:
            # clone3 passes flags in a struct seccomp cannot read: ENOSYS makes glibc fall back to clone.
            _rule(lib, ctx, SCMP_ACT_ERRNO(errno.ENOSYS), clone3)
            denied.append("clone3")
        sock = _nr(lib, "socket")
        if sock is not None:
            # No new AF_UNIX socket at all: connect(2) to a path socket of the host (a database's, a
            # container engine's) is out of Landlock's reach, and seccomp cannot read the path, so the
            # socket is never made. socketpair(2), which reaches nothing, stays allowed.
            if allow_inet:
                keep = {socket.AF_INET, socket.AF_INET6}
                top = max(keep)
                for fam in range(top):
                    if fam not in keep:
                        _rule(lib, ctx, eperm, sock, (0, SCMP_CMP_EQ, fam, 0))
                _rule(lib, ctx, eperm, sock, (0, SCMP_CMP_GT, top, 0))
                denied.append("socket(family not inet/inet6)")
            else:
                _rule(lib, ctx, eperm, sock)
                denied.append("socket(any family)")
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise OSError(-rc, f"seccomp_load: {errno.errorcode.get(-rc, rc)}")
    finally:
        lib.seccomp_release(ctx)
    return denied
