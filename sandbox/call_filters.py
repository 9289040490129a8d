"""The per-call layers the zygote adds on top of the worker's (``sandbox.zygote``): a Landlock
ruleset that only scopes signals and abstract sockets, and a second seccomp filter (``CALL_DENY``)
against kernel objects that outlive a call and against changing or reaching into another process.
Prepared once in the zygote; every call process inherits them. Never imports trio.
"""

from __future__ import annotations

import ctypes
import errno

from sandbox.isolation import landlock, seccomp, syscalls


class RulesetAttr(ctypes.Structure):
    _fields_ = [("fs", ctypes.c_uint64), ("net", ctypes.c_uint64), ("scoped", ctypes.c_uint64)]


def scope_ruleset() -> int:
    """A Landlock ruleset fd that only scopes signals and abstract sockets (ABI >= 6), or -1."""
    if landlock.abi_version() < 6:
        return -1
    attr = RulesetAttr(0, 0, landlock.SCOPE_ABSTRACT_UNIX_SOCKET | landlock.SCOPE_SIGNAL)
    return syscalls.syscall(syscalls.NR_LANDLOCK_CREATE_RULESET, ctypes.byref(attr),
                            ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0), what="landlock_create_ruleset")


_NE = 1  # SCMP_CMP_NE
_PRIO_PROCESS = 0
_IOPRIO_WHO_PROCESS = 1
#: The call filter: syscall -> conditions (argument, value) under which it fails with EPERM (the
#: argument differs from the value); an empty tuple denies it outright. Conditions are alternatives.
CALL_DENY: dict[str, tuple[tuple[int, int], ...]] = {
    # kernel objects that outlive the process that made them
    "shmget": (), "msgget": (), "semget": (), "mq_open": (),
    # changing another process (pid 0 is the caller itself)
    "prlimit64": ((0, 0),), "sched_setaffinity": ((0, 0),), "sched_setscheduler": ((0, 0),),
    "sched_setparam": ((0, 0),), "sched_setattr": ((0, 0),), "migrate_pages": ((0, 0),), "move_pages": ((0, 0),),
    "setpriority": ((0, _PRIO_PROCESS), (1, 0)), "ioprio_set": ((0, _IOPRIO_WHO_PROCESS), (1, 0)),
    # reaching into another process (Landlock and non-dumpable processes already stop these)
    "kcmp": (), "pidfd_getfd": (), "process_madvise": (), "process_mrelease": (),
}


def load_call_filter() -> None:
    """Load the ``CALL_DENY`` seccomp filter into Z, before R and any call process are forked: they
    all inherit it, and neither Z nor R needs any of these calls."""
    lib = seccomp.load_library()
    ctx = lib.seccomp_init(seccomp.SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError(errno.ENOMEM, "seccomp_init failed")
    eperm = seccomp.SCMP_ACT_ERRNO(errno.EPERM)
    arg = seccomp._ArgCmp  # the type libseccomp's prototypes were declared with
    try:
        for name, conds in CALL_DENY.items():
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue
            for cond in conds or (None,):
                arr = (arg * 1)(arg(cond[0], _NE, cond[1], 0)) if cond else (arg * 1)()
                rc = lib.seccomp_rule_add_array(ctx, eperm, nr, 1 if cond else 0, arr)
                if rc < 0:
                    raise OSError(-rc, f"seccomp_rule_add({name})")
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise OSError(-rc, "seccomp_load")
    finally:
        lib.seccomp_release(ctx)
