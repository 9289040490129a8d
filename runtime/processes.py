"""Process primitives of the daemon: starting a worker interpreter, killing a whole process tree,
reaping the orphans it adopts as child subreaper, and removing dead daemons' scratch folders.

No pool logic and no IPC here (``runtime.execution.pool`` has both); ``runtime.spares`` starts its spare
interpreters with the same ``spawn_process``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from typing import Any

import msgspec
import psutil
import trio

import sandbox
from runtime.manifest import Manifest
from runtime.plugin_secrets import PluginSecrets
from sandbox.wire import Permissions

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sandbox.__file__)))
_PYTHON = os.path.realpath(sys.executable)


def _worker_sys_path() -> list[str]:
    paths = [_ROOT, os.path.dirname(os.path.dirname(os.path.abspath(msgspec.__file__)))]
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p:
            paths.append(p)
    out: list[str] = []
    for p in paths:
        if p not in out:
            out.append(p)
    return out


WORKER_SYS_PATH = _worker_sys_path()


def sweep_stale_scratch(state_dir: str) -> int:
    """Remove the scratch folders (``<daemon pid>~<plugin>-*``) of daemons that are gone: a daemon
    that was killed never got to remove its workers' folders."""
    removed = 0
    try:
        names = os.listdir(state_dir)
    except OSError:
        return 0
    for name in names:
        pid_text, sep, _ = name.partition("~")
        if not sep or not pid_text.isdigit() or int(pid_text) == os.getpid():
            continue
        try:
            os.kill(int(pid_text), 0)
            continue
        except ProcessLookupError:
            pass
        except OSError:
            continue
        shutil.rmtree(os.path.join(state_dir, name), ignore_errors=True)
        removed += 1
    return removed


def become_subreaper() -> None:
    """Orphans of killed workers (double-forked grandchildren) get re-parented to us."""
    PR_SET_CHILD_SUBREAPER = 36
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def kill_tree(pid: int) -> None:
    """SIGKILL a worker, its process group and every descendant we can find."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for proc in descendants:
        try:
            proc.kill()
        except psutil.Error:
            pass


#: Tokens of every worker this daemon started (registered before the spawn) and has not reaped.
LIVE_WORKER_TOKENS: set[str] = set()
#: Pids of the worker processes themselves until they are reaped: the orphan sweep skips them
#: without reading their environment (a sweep per worker exit stays cheap with many workers).
LIVE_WORKER_PIDS: set[int] = set()
#: Set to ``plugin:token`` in every worker's environment; inherited by whatever it forks.
WORKER_MARKER = "TOOLCELL_WORKER"


def _is_escaped_worker_process(proc: psutil.Process) -> bool:
    """A process carrying the marker of a worker that is gone."""
    try:
        marker = proc.environ().get(WORKER_MARKER)
    except psutil.Error:
        return False
    return marker is not None and marker.rpartition(":")[2] not in LIVE_WORKER_TOKENS


#: Every process this daemon started itself (workers, spares), by pid, until trio has waited for it:
#: only trio may reap those. Any other child is an orphan we adopted as child subreaper.
SPAWNED: dict[int, trio.Process] = {}


def sweep_orphans() -> int:
    """Kill and reap the children we adopted: everything that is our child but not a process we started.

    With the daemon as child subreaper, when a worker dies its pid-namespace init and any double-forked
    grandchild whose parent died are re-parented to us. A dead one is reaped here (nothing else would
    wait for it: it would stay a zombie until the daemon exits); a live one that carries the marker
    of a worker that is gone is killed (and reaped at the next sweep). The daemon owns its process:
    any dead child it did not start through ``spawn_process`` is reaped, so a program that embeds
    ``open_daemon`` and waits for children of its own must start them through ``SPAWNED`` too."""
    swept = 0
    try:
        children = psutil.Process().children()
    except psutil.Error:
        return 0
    for child in children:
        pid = child.pid
        proc = SPAWNED.get(pid)
        if proc is not None:
            if proc.returncode is None:
                continue  # ours: trio waits for it
            del SPAWNED[pid]
        if pid in LIVE_WORKER_PIDS:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    swept += 1
                continue
        except (psutil.Error, ChildProcessError, OSError):
            continue
        if _is_escaped_worker_process(child):
            try:
                child.kill()
                swept += 1
            except psutil.Error:
                pass
    return swept


def _sigchld_seen(signum: int, frame: Any) -> None:
    """SIGCHLD outside the reaper's receiver: nothing to do (the reaper sweeps on its interval)."""


async def serve_reaper(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Reap adopted children whenever one may have died (SIGCHLD), at most every 50 ms, and every
    ``REAP_INTERVAL_S`` in any case (a signal may be missed while another sweep runs)."""
    installed = False
    try:
        if signal.getsignal(signal.SIGCHLD) in (signal.SIG_DFL, None):
            # A Python-level handler that does nothing is what trio restores when the receiver
            # closes: a SIGCHLD that the C handler took just before then is then harmless, where
            # with SIG_DFL CPython raises "Signal 17 ignored due to race condition" in whatever
            # code runs next (an embedded daemon's host, a test).
            signal.signal(signal.SIGCHLD, _sigchld_seen)
            installed = True
        receiver = trio.open_signal_receiver(signal.SIGCHLD)
        signals: Any = receiver.__enter__()
    except (RuntimeError, ValueError):  # not in the main thread (embedded): poll only
        receiver, signals = None, None
    task_status.started()
    try:
        while True:
            with trio.move_on_after(REAP_INTERVAL_S):
                if signals is not None:
                    await signals.__anext__()
                else:
                    await trio.sleep_forever()
            sweep_orphans()
            await trio.sleep(0.05)
    finally:
        if receiver is not None:
            receiver.__exit__(None, None, None)
        if installed and signal.getsignal(signal.SIGCHLD) is _sigchld_seen:
            # Leave the process as found: a Python-level handler left installed makes every later
            # SIGCHLD (a host's or a test's children exiting) write to the signal wake-up fd, and
            # while trio tears a run down that fd is already closed: the write failed as an
            # "Exception ignored" (EBADF, or EPIPE once the number was reused) in whatever ran next.
            # (``signal.signal`` first runs any handler already pending, so none is lost to SIG_DFL.)
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            # A SIGCHLD that came between that call's check of pending signals and its switch to
            # SIG_DFL was taken by the old C handler and is pending with nothing to run: CPython
            # raises "Signal 17 ignored due to race condition" at its next check, in whatever code
            # runs next (it failed a test once, in trio's teardown of this task). The second call's
            # check raises it here, where it is dropped (no handler is lost: the child is reaped
            # by whoever waits for it).
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)


REAP_INTERVAL_S = 2.0


@dataclass(frozen=True)
class PoolSpec:
    """Everything needed to start workers for one plugin (one version of it)."""

    manifest: Manifest
    plugin_dir: str
    policy: str
    state_dir: str
    min_workers: int = 1
    describe_only: bool = False
    #: Put before the daemon's own paths on the worker's ``sys.path``: the plugin's installed
    #: requirements (``runtime.installer``), readable by its workers only.
    extra_sys_path: tuple[str, ...] = ()
    #: The plugin's secrets (``runtime.plugin_secrets``): placeholders in the environment, values for
    #: the egress proxy only.
    secrets: PluginSecrets | None = None

    @staticmethod
    def base_env() -> dict[str, str]:
        """What every worker's environment starts from (and all a spare worker has)."""
        return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TZ": os.environ.get("TZ", "UTC")}

    def permissions(self) -> Permissions:
        """The manifest's permissions, and the CA bundle a plugin with secrets reads."""
        p = self.manifest.permissions
        extra = self.secrets.read_paths() if self.secrets is not None else []
        return msgspec.structs.replace(p, read=[*p.read, *extra]) if extra else p

    def env(self, token: str = "") -> dict[str, str]:
        env = self.base_env()
        for name in self.manifest.env.allow:
            if name in os.environ:
                env[name] = os.environ[name]
        env.update(self.manifest.env.set)
        if self.secrets is not None:
            env.update(self.secrets.worker_env())
        env[WORKER_MARKER] = f"{self.manifest.name}:{token}"
        return env


async def spawn_process(env: dict[str, str], cwd: str, spare: bool = False,
                        piped: bool = False) -> tuple[trio.Process, socket.socket]:
    """Start ``sandbox.worker.main`` in a fresh ``python -I -S -B`` with its IPC socket on fd 3, in a
    session of its own; returns the process and our (non-blocking) end of the socket. Raises OSError.

    ``spare``: it will adopt the environment its ``Init`` frame carries (``runtime.spares``).
    ``piped``: stdin, stdout and stderr are three pipes (a hosted server's MCP channel and its log,
    ``runtime.execution.hosted_session``; a build, ``runtime.builds``); otherwise stdin is closed and stderr
    joins stdout (a plugin's prints, kept for its log)."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    fd = child.fileno()
    # The IPC socket always lands on fd 3 in the worker (only 0-2 and it survive the exec).
    move = "" if fd == 3 else f"import os;os.dup2({fd},3);os.close({fd});"
    bootstrap = (
        f"{move}import sys;sys.path[:0]={WORKER_SYS_PATH!r};"
        f"from sandbox.worker import main;main(3{', spare=True' if spare else ''})"
    )
    try:
        proc = await trio.lowlevel.open_process(
            [_PYTHON, "-I", "-S", "-B", "-c", bootstrap],
            stdin=subprocess.PIPE if piped else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if piped else subprocess.STDOUT,
            pass_fds=(fd,),
            start_new_session=True,
            env=env,
            cwd=cwd,
        )
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    SPAWNED[proc.pid] = proc
    parent.setblocking(False)
    return proc, parent
