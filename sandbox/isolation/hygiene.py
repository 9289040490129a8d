"""Process hygiene: the first layer, cheap and always applied (also under the ``none`` policy).

Closes every inherited fd but stdio and the IPC fd, arms the parent-death signal, sets
``no_new_privs`` (required by seccomp, and stops setuid escalation), umask 077, cwd = scratch.
"""

from __future__ import annotations

import os
import select
import signal
import sys

from sandbox.isolation import syscalls

IPC_FD = 3


def find_ipc_fd(default: int = IPC_FD) -> int:
    """The worker's IPC fd: the socket of the ``chan`` (``sandbox.worker.Channel``) of a caller.

    The daemon passes the fd number in the bootstrap (``main(N)``); it is usually but not always 3.
    """
    frame = sys._getframe(1)
    while frame is not None:
        chan = frame.f_locals.get("chan")
        sock = getattr(chan, "sock", None)
        if sock is not None and hasattr(sock, "fileno"):
            fd = sock.fileno()
            if fd >= 0:
                return int(fd)
        frame = frame.f_back  # type: ignore[assignment]
    return default


def close_inherited_fds(keep: int = IPC_FD) -> None:
    """Close every fd above stdio except ``keep`` (uses ``close_range`` where the kernel has it)."""
    if keep < 3:
        keep = IPC_FD
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 20)


def arm_parent_death_signal(sig: int = signal.SIGKILL, *, alive_fd: int | None = None) -> None:
    """Die with ``sig`` when the parent thread exits; re-armed after every fork and uid change.

    ``alive_fd`` is the read end of a pipe whose write end only the parent holds: if it already
    reports EOF, the parent died before the signal was armed and we exit ourselves.
    """
    syscalls.prctl(syscalls.PR_SET_PDEATHSIG, sig)
    if alive_fd is not None:
        readable, _, _ = select.select([alive_fd], [], [], 0)
        if readable:
            os._exit(137)
    elif os.getppid() == 1 and os.getpid() != 1:
        os._exit(137)  # reparented to init already: our parent is gone


def apply(scratch_dir: str, ipc_fd: int = IPC_FD) -> None:
    close_inherited_fds(ipc_fd)
    arm_parent_death_signal()
    syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)
    os.umask(0o077)
    if scratch_dir:
        os.chdir(scratch_dir)
