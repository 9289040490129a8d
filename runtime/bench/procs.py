"""The processes the bench starts: spawning a server, stopping it (escalating, whole tree), and
the CPU time and memory of its process tree, via psutil.

CPU of a tree over a window is the sum, over its live processes, of own user + system time plus
the time of the children each has reaped, after minus before: short-lived processes (a fork per
call, a replaced worker) count once their parent waited for them. Only a descendant re-parented
outside the tree escapes, which can only under-count.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
from collections.abc import Sequence
from typing import IO

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


class Server:
    """A server process we started: stderr goes to a temporary file (a full stderr pipe would
    stall the server), and ``stop`` escalates and sweeps the whole tree."""

    def __init__(self, argv: Sequence[str], cwd: str | None, stdio: bool, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self._stderr: IO[bytes] = tempfile.TemporaryFile(prefix="toolcell-bench-stderr-")
        pipe = subprocess.PIPE if stdio else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.argv, stdin=pipe, stdout=pipe, stderr=self._stderr, cwd=cwd, env=env,
                                         bufsize=0)
        except OSError:
            self._stderr.close()
            raise

    @property
    def pid(self) -> int:
        """The started process's pid."""
        return self.proc.pid

    def exited(self) -> int | None:
        """Its exit code, or None while it runs."""
        return self.proc.poll()

    def stderr_tail(self, max_bytes: int = 2000) -> str:
        """The end of what it wrote to stderr."""
        try:
            self._stderr.seek(0, os.SEEK_END)
            size = self._stderr.tell()
            self._stderr.seek(max(0, size - max_bytes))
            return self._stderr.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def stderr_text(self, max_bytes: int = 65536) -> str:
        """The start of what it wrote to stderr."""
        try:
            self._stderr.seek(0)
            return self._stderr.read(max_bytes).decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def stop(self, grace_s: float = 5.0) -> int | None:
        """Close its stdin, wait, SIGTERM, wait, SIGKILL; then kill what is left of its tree."""
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
        try:
            self.proc.wait(grace_s if self.proc.stdin is not None else 0.01)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _, alive = psutil.wait_procs(descendants, timeout=1.0)
        for child in alive:
            try:
                child.kill()
            except psutil.Error:
                pass
        self._stderr.close()
        return self.proc.returncode
