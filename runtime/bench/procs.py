"""The processes the bench starts: spawning a server, stopping it (escalating, whole tree), and
the CPU time and memory of its process tree, via psutil.

CPU of a tree over a window is the sum, over its live processes, of own user + system time plus
the time of the children each has reaped, after minus before: short-lived processes (a fork per
call, a replaced worker) count once their parent waited for them. Only a descendant re-parented
outside the tree escapes, which can only under-count.

A server is started in a session (and process group) of its own, so that stopping it reaches
what it left behind: a grandchild whose parent exited is no longer in its tree, but still in its
group. Its stderr is read by a thread that keeps only the end (``STDERR_KEEP_BYTES``).
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence

import msgspec
import psutil


class ProcMemory(msgspec.Struct):
    """One process of a server's tree: ``server`` (the one we started) or ``child``."""

    pid: int
    role: str
    name: str
    rss_bytes: int


def _tree(root_pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_snapshot(root_pid: int) -> dict[int, float]:
    """CPU seconds (own plus reaped children's) of every live process of the tree, by pid."""
    out: dict[int, float] = {}
    for proc in _tree(root_pid):
        try:
            t = proc.cpu_times()
        except psutil.Error:
            continue
        out[proc.pid] = t.user + t.system + t.children_user + t.children_system
    return out


def cpu_delta_s(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the tree spent between two snapshots."""
    return max(0.0, sum(after.values()) - sum(before.values()))


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _parse_stat(raw: bytes) -> tuple[float, int] | None:
    """(CPU s, own plus reaped children's; RSS bytes) from the text of ``/proc/PID/stat``."""
    fields = raw[raw.rfind(b")") + 2:].split()  # after "pid (comm) "; comm may hold spaces
    try:
        # fields 14-17 (utime stime cutime cstime) and 24 (rss, pages), counted from 1 with pid
        ticks = int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
        return ticks / _TICKS_PER_S, int(fields[21]) * _PAGE_BYTES
    except (IndexError, ValueError):
        return None


class TreeSampler:
    """CPU seconds and RSS of a server's tree, cheaply enough to read every timeline interval
    (inside the measured window): the tree is walked once, at the first sample (a walk scans all
    of /proc, ~10 ms), and each of its processes' ``/proc/PID/stat`` is opened then; a sample is
    one ``pread`` per process (psutil's objects read two files per process, ~10x the cost). A
    process started later (a replaced worker) is missed until the next segment's sampler: the
    per-interval figures can only under-count. ``close`` releases the files."""

    def __init__(self, root_pid: int) -> None:
        self.root_pid = root_pid
        self.fds: list[int] | None = None

    def sample(self) -> tuple[float, int] | None:
        """(CPU s, RSS bytes) of the tree's live processes; None when none is left."""
        if self.fds is None:
            self.fds = []
            for proc in _tree(self.root_pid):
                try:
                    self.fds.append(os.open(f"/proc/{proc.pid}/stat", os.O_RDONLY | os.O_CLOEXEC))
                except OSError:
                    continue
        cpu, rss, seen = 0.0, 0, 0
        for fd in self.fds:
            try:
                got = _parse_stat(os.pread(fd, 4096, 0))
            except OSError:  # the process is gone (ESRCH)
                continue
            if got is not None:
                cpu += got[0]
                rss += got[1]
                seen += 1
        return (cpu, rss) if seen else None

    def close(self) -> None:
        """Close the ``/proc`` files."""
        for fd in self.fds or []:
            os.close(fd)
        self.fds = []


def _short_name(proc: psutil.Process) -> str:
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return "?"
    if not cmdline:
        try:
            return proc.name()
        except psutil.Error:
            return "?"
    if "-c" in cmdline[1:-1]:
        text = f"{os.path.basename(cmdline[0])} -c ..."
    else:
        text = " ".join([os.path.basename(cmdline[0]), *cmdline[1:]])
    return text if len(text) <= 60 else text[:57] + "..."


def memory_snapshot(root_pid: int) -> list[ProcMemory]:
    """RSS of the started process and of each of its descendants."""
    out: list[ProcMemory] = []
    for proc in _tree(root_pid):
        try:
            rss = proc.memory_info().rss
        except psutil.Error:
            continue
        out.append(ProcMemory(proc.pid, "server" if proc.pid == root_pid else "child", _short_name(proc), rss))
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a server we are about to start)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


#: How much of the end of a server's stderr is kept (for the report's "its stderr ends: ...").
#: It went to a temporary file, which a server writing stderr without end grew at 2 GB/s.
STDERR_KEEP_BYTES = 64 * 1024
#: How often the stderr reader looks whether it was told to stop.
_STDERR_POLL_MS = 200


class StderrTail:
    """Drains a server's stderr pipe on a thread (a full pipe would stall the server) and keeps
    its last ``STDERR_KEEP_BYTES``. The thread owns the pipe's read end and closes it when done:
    at end of file, or once ``close`` was called and nothing is left to read."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._tail = bytearray()
        self._lock = threading.Lock()
        self._closing = False
        self._thread = threading.Thread(target=self._drain, name="toolcell-bench-stderr", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        try:
            while True:
                if not poller.poll(_STDERR_POLL_MS):
                    if self._closing:
                        return
                    continue
                data = os.read(self._fd, 65536)
                if not data:
                    return
                with self._lock:
                    self._tail += data
                    if len(self._tail) > 2 * STDERR_KEEP_BYTES:
                        del self._tail[:-STDERR_KEEP_BYTES]
                if self._closing:
                    return
        except OSError:
            return
        finally:
            os.close(self._fd)

    def text(self, max_bytes: int, settle_s: float = 0.0) -> str:
        """The last ``max_bytes`` (at most ``STDERR_KEEP_BYTES``); waits up to ``settle_s`` for
        the pipe's end of file first (the server has exited: what it wrote last is still coming)."""
        if settle_s:
            self._thread.join(settle_s)
        with self._lock:
            return bytes(self._tail[-max_bytes:]).decode(errors="replace")

    def close(self) -> None:
        """Stop reading (the thread ends within ``_STDERR_POLL_MS``, or at once at end of file)."""
        self._closing = True
        self._thread.join(2 * _STDERR_POLL_MS / 1000)


class Server:
    """A server process we started, in a session of its own: stderr is drained by a
    ``StderrTail``, and ``stop`` escalates and kills what is left of its group and tree."""

    def __init__(self, argv: Sequence[str], cwd: str | None, stdio: bool, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        pipe = subprocess.PIPE if stdio else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, stdin=pipe, stdout=pipe, stderr=subprocess.PIPE, cwd=cwd, env=env,
                                     bufsize=0, start_new_session=True)
        assert self.proc.stderr is not None
        # The thread owns the pipe's read end from here (the file object would close it again).
        self._stderr = StderrTail(os.dup(self.proc.stderr.fileno()))
        self.proc.stderr.close()

    @property
    def pid(self) -> int:
        """The started process's pid."""
        return self.proc.pid

    def exited(self) -> int | None:
        """Its exit code, or None while it runs."""
        return self.proc.poll()

    def stderr_tail(self, max_bytes: int = 2000) -> str:
        """The end of what it wrote to stderr (up to ``STDERR_KEEP_BYTES``)."""
        return self._stderr.text(max_bytes, settle_s=0.5 if self.proc.returncode is not None else 0.0)

    def _exits_within(self, timeout_s: float) -> bool:
        """Whether the server has exited within ``timeout_s``, leaving it unreaped (a zombie keeps
        its pid, which is its group's id, from being reused while we signal that group)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
                    return True
            except ChildProcessError:  # reaped already (by ``exited``)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _signal_group(self, sig: int) -> None:
        # The group is the one Popen made (start_new_session): its id is the server's pid, which
        # stays taken while the server is an unreaped zombie or any member of the group lives. Only
        # when the server was reaped before ``stop`` and its whole group is gone could the number
        # name another group, and then only after the kernel's pid counter came round again.
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace_s: float = 5.0) -> int | None:
        """Close its stdin, wait, SIGTERM its group, wait, SIGKILL it; then kill what is left of
        its group (orphans of the server) and of its tree (those that made groups of their own)."""
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        exited = self._exits_within(grace_s if self.proc.stdin is not None else 0.01)
        if not exited:
            self._signal_group(signal.SIGTERM)
            exited = self._exits_within(grace_s)
        alive = descendants
        if exited:  # its children may still be finishing
            _, alive = psutil.wait_procs(descendants, timeout=1.0)
        self._signal_group(signal.SIGKILL)
        self.proc.wait()
        for child in alive:
            try:
                child.kill()
            except psutil.Error:
                pass
        self._stderr.close()
        return self.proc.returncode
