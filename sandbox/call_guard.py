"""Per-call limits and leftovers in a pooled worker (one process serving many calls in turn).

* **CPU per call.** ``limits.cpu_s`` is a budget for one call, not for the worker's life: before each
  call the soft ``RLIMIT_CPU`` is moved to the CPU time used so far plus ``cpu_s`` (the hard limit is
  left open, so it can be moved again). A call over it gets ``SIGXCPU``; the worker answers by
  exiting with ``CPU_LIMIT_EXIT`` (the pooled worker is pid 1 of its namespace, where a signal left at
  its default action is ignored), which the daemon reports as the call's CPU limit. The plugin runs in
  this process and could undo the limit; the daemon's wall-clock deadline bounds such a call anyway.
* **Nothing outlives its call.** After each call the worker checks that the call left no thread and no
  process running: threads through ``/proc/self/task``'s link count (an ``fstat`` of a kept fd),
  processes through the children of this process (a ``pread`` of its kept ``children`` file) (pid 1 of the worker's pid namespace, so double-forked orphans are its
  children too). Dead children are reaped; if anything still runs, the worker says why on stderr (the
  daemon log) and exits after the call's result is sent, and the daemon starts a fresh worker.
"""

from __future__ import annotations

import os
import resource
import signal
import time
from typing import Any

#: Exit status of a worker whose call used up its CPU budget (128 + SIGXCPU, as a shell reports it).
CPU_LIMIT_EXIT = 128 + signal.SIGXCPU
#: Exit status of a worker that retires because a call left something running.
LEFTOVER_EXIT = 0


class CallGuard:
    """Set up before each call with ``before()``; ``after()`` says what the call left running, if anything."""

    def __init__(self, cpu_s: int) -> None:
        self.cpu_s = cpu_s
        pid = os.getpid()
        # Kept open: a stat or read of an open procfs fd is ~1-3 µs, opening the file each call ~20.
        self._task_path = "/proc/self/task"
        self._children_path = f"/proc/{pid}/task/{pid}/children"
        self._task_fd = self._open(self._task_path, os.O_DIRECTORY)
        self._children_fd = self._open(self._children_path, 0)
        self.threads = 0
        self.threads = self._threads()
        if self._task_fd < 0 or self._children_fd < 0:
            # Without a view of its own /proc entries (a policy that hides /proc) the check is off: say so.
            os.write(2, b"toolcell worker: /proc is not readable here, so leftover threads and processes of a "
                        b"pooled call cannot be detected\n")
        signal.signal(signal.SIGXCPU, self._on_cpu_limit)
        _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        self._hard = hard
        self._soft = -1

    @staticmethod
    def _open(path: str, flags: int) -> int:
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
        except OSError:
            return -1

    def _threads(self) -> int:
        try:
            return os.fstat(self._task_fd).st_nlink - 2
        except OSError:  # closed under us (by the plugin): open it again
            self._task_fd = self._open(self._task_path, os.O_DIRECTORY)
            try:
                return os.fstat(self._task_fd).st_nlink - 2
            except OSError:
                return self.threads

    @staticmethod
    def _on_cpu_limit(_signum: int, _frame: Any) -> None:
        try:
            os.write(2, b"toolcell worker: the call used up its CPU limit (cpu_s); the worker exits\n")
        finally:
            os._exit(CPU_LIMIT_EXIT)

    def before(self) -> None:
        soft = int(time.process_time()) + 1 + self.cpu_s
        if soft == self._soft:
            return  # RLIMIT_CPU counts whole seconds: the limit moves once per CPU-second at most
        self._soft = soft
        hard = self._hard
        if hard != resource.RLIM_INFINITY and soft > hard:
            soft = hard
        try:
            resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
        except (ValueError, OSError):
            pass

    def after(self) -> str | None:
        """None if the call left nothing running; otherwise what it left, in words."""
        threads = self._threads()
        left = []
        if threads > self.threads:
            left.append(f"{threads - self.threads} thread(s)")
        running = self._running_children()
        if running:
            left.append(f"{running} process(es)")
        return " and ".join(left) or None

    def _children(self) -> int:
        try:
            return len(os.pread(self._children_fd, 65536, 0).split())
        except OSError:
            self._children_fd = self._open(self._children_path, 0)
            try:
                return len(os.pread(self._children_fd, 65536, 0).split())
            except OSError:
                return 0  # no CONFIG_PROC_CHILDREN: nothing to check with

    def _running_children(self) -> int:
        if not self._children():
            return 0
        while True:  # reap what has already ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return 0
            if pid == 0:
                break
        return self._children()
