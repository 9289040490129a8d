"""The worker side of a hosted MCP server: isolate, then run the server's own executable.

A plugin of kind "server" (``runtime.execution.hosted``) is an existing MCP server (a Node or Python program,
any executable) rather than code written for ``sandbox.api``. Its worker starts exactly like every
other worker -- ``Init`` over the IPC fd, every isolation layer applied by ``sandbox.isolation`` --
and then, instead of importing a plugin, comes here:

1. become undumpable (``PR_SET_DUMPABLE`` 0: the server, same uid, cannot ptrace this process, take
   its descriptors with ``pidfd_getfd`` or open its ``/proc/<pid>/mem`` and ``/proc/<pid>/fd``);
   fork; the child closes every fd but stdio and ``execve``s ``init.command`` with the environment as the
   isolation left it (the manifest's allowlist, plus the egress proxy variables when the plugin
   holds a network grant), in the plugin folder (read-only: relative paths in the command work as
   they read; ``HOME`` is the private scratch dir). It inherits stdin and stdout, which are pipes to the daemon: the daemon
   speaks MCP to it over them as a client; its stderr is a third pipe, logged (capped) by the daemon.
   Landlock, seccomp, the namespaces, the cgroup and the rlimits carry over ``execve``.
2. this process (pid 1 of the worker's pid namespace when namespaces are on) reports ``Ready`` --
   or ``LoadFailed`` with the reason the ``execve`` failed --, closes the IPC socket (the daemon reads
   nothing more from it), then only reaps: every orphan of the
   namespace is re-parented to it. When the server exits, it exits with the same status, and with
   pid 1 the kernel kills whatever the server left behind in the namespace.

The server process is not trusted more than a plugin: everything it writes is checked by the daemon.
Never imports trio.
"""

from __future__ import annotations

import os
import signal
import socket
from typing import Any, Protocol

from sandbox.isolation import hygiene, syscalls
from sandbox.wire import Init, LoadFailed, Ready


class _Channel(Protocol):
    sock: socket.socket

    def send(self, msg: Any) -> None: ...


def _exec_child(argv: list[str], env: dict[str, str], report_fd: int, cwd: str) -> None:
    """In the forked child: exec the server; on failure write why to ``report_fd``. Never returns."""
    try:
        # Nothing of the supervisor's but stdio reaches the server: the IPC socket and anything else
        # (``report_fd`` is close-on-exec: it goes at ``execve``).
        os.closerange(3, report_fd)
        os.closerange(report_fd + 1, 1 << 20)
        hygiene.forked_from_single_thread()
        # Dies with this process (not through ``arm_parent_death_signal``, whose re-parenting check
        # compares against the daemon's pid).
        syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
        for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if cwd:
            os.chdir(cwd)
        os.execve(argv[0], argv, env)
    except BaseException as exc:  # noqa: BLE001 (whatever failed, say so and leave)
        try:
            os.write(report_fd, f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:2000])
        except OSError:
            pass
    finally:
        os._exit(127)


def run(chan: _Channel, init: Init, layers: list[str], missing: list[str]) -> None:
    """Start the server and supervise it until it exits; then exit with its status. Never returns."""
    send = chan.send
    # Undumpable (set after every uid change of the isolation, which would clear it): a process of the
    # same uid, the server included, can then neither ptrace this one, nor take its descriptors
    # (pidfd_getfd), nor open its /proc/<pid>/mem or /proc/<pid>/fd. The server gets its own,
    # dumpable, mm at execve.
    syscalls.prctl(syscalls.PR_SET_DUMPABLE, 0)
    argv = list(init.command)
    env = dict(os.environ)
    report_r, report_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        os.close(report_r)
        _exec_child(argv, env, report_w, init.plugin_dir)
    os.close(report_w)
    failure = b""
    while True:
        chunk = os.read(report_r, 4096)
        if not chunk:
            break
        failure += chunk
    os.close(report_r)
    if failure:
        os.waitpid(pid, 0)
        send(LoadFailed(f"could not start {argv[0]}: {failure.decode('utf-8', 'replace')}", stage="start"))
        os._exit(0)
    # stdin and stdout belong to the server alone: its stdout reaches EOF as soon as it (and what it
    # started) is gone, not when this process is.
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    send(Ready(pid, [], layers=layers, missing=missing))
    # The daemon reads nothing more from this channel: closed, there is nothing left here to take.
    chan.sock.close()
    code = 0
    while True:
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if reaped == pid:
            code = os.waitstatus_to_exitcode(status)
            break
    os._exit(code if code >= 0 else 128 - code)
