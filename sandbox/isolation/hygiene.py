"""Process hygiene: the first layer, cheap and always applied (also under the ``none`` policy).

Closes every inherited fd but stdio and the IPC fd, arms the parent-death signal (robust to a
multi-threaded parent: ``watch_threaded_parent``), sets
``no_new_privs`` (required by seccomp, and stops setuid escalation), umask 077, cwd = scratch.
"""

from __future__ import annotations

import os
import select
import signal
import sys
from collections.abc import Callable

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


#: The signal the kernel sends this process when its parent *thread* exits (see ``arm_parent_death_signal``).
_death_signal = signal.SIGKILL
#: The parent process at start-up, and what to do before dying once it is really gone.
_parent_pid = 0
_on_orphaned: list[Callable[[], None]] = []


def _parent_gone(signum: int, frame: object) -> None:
    if os.getppid() == _parent_pid:
        return  # only the spawning thread of a multi-threaded parent exited: the parent lives on
    for fn in _on_orphaned:
        try:
            fn()
        except OSError:
            pass
    os._exit(137)


def watch_threaded_parent() -> None:
    """Make this process's parent-death signal survive a multi-threaded parent (the trio daemon).

    ``PR_SET_PDEATHSIG`` fires when the parent *thread* that forked us exits, and trio spawns
    processes from its thread cache, whose threads exit after 10 s idle: SIGKILL would then kill a
    perfectly healthy worker. So the daemon's direct child arms a catchable signal instead and dies
    only if its parent process has really gone (it was re-parented).
    """
    global _death_signal, _parent_pid
    _parent_pid = os.getppid()
    _death_signal = signal.SIGUSR2
    signal.signal(signal.SIGUSR2, _parent_gone)


def forked_from_single_thread() -> None:
    """In a child forked by this (single-threaded) process: back to a plain SIGKILL on parent death."""
    global _death_signal
    _death_signal = signal.SIGKILL
    _on_orphaned.clear()
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def arm_parent_death_signal(*, alive_fd: int | None = None) -> None:
    """Arm the parent-death signal; re-armed after every fork and every uid change (trap 2).

    ``alive_fd`` is the read end of a pipe whose write end only the parent holds: if it already
    reports EOF, the parent died before the signal was armed and we exit ourselves.
    """
    syscalls.prctl(syscalls.PR_SET_PDEATHSIG, _death_signal)
    if alive_fd is not None:
        readable, _, _ = select.select([alive_fd], [], [], 0)
        if readable:
            os._exit(137)
    elif _parent_pid and os.getppid() != _parent_pid:
        os._exit(137)  # re-parented already: our parent is gone


def apply(scratch_dir: str, ipc_fd: int = IPC_FD) -> None:
    close_inherited_fds(ipc_fd)
    watch_threaded_parent()
    arm_parent_death_signal()
    syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)
    os.umask(0o077)
    if scratch_dir:
        os.chdir(scratch_dir)
