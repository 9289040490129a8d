"""Per-call limits and leftovers in a pooled worker (one process serving many calls in turn).

* **CPU per call.** ``limits.cpu_s`` is a budget for one call, not for the worker's life: before each
  call the soft ``RLIMIT_CPU`` is moved to the CPU time used so far plus ``cpu_s`` (the hard limit is
  left open, so it can be moved again). A call over it gets ``SIGXCPU``; the worker answers by
  exiting with ``CPU_LIMIT_EXIT`` (the pooled worker is pid 1 of its namespace, where a signal left at
  its default action is ignored), which the daemon reports as the call's CPU limit. The plugin runs in
  this process and could undo the limit; the daemon's wall-clock deadline bounds such a call anyway.
* **Nothing outlives its call.** After each call the worker checks that the call left no thread and no
  process running: threads through ``/proc/self/task``'s link count (one ``stat``), processes through
  the children of this process (pid 1 of the worker's pid namespace, so double-forked orphans are its
  children too). Dead children are reaped; if anything still runs, the worker says why on stderr (the
  daemon log) and exits after the call's result is sent, and the daemon starts a fresh worker.
"""

from __future__ import annotations

import os
import resource
import signal
from typing import Any

#: Exit status of a worker whose call used up its CPU budget (128 + SIGXCPU, as a shell reports it).
CPU_LIMIT_EXIT = 128 + signal.SIGXCPU
#: Exit status of a worker that retires because a call left something running.
LEFTOVER_EXIT = 0


class CallGuard:
    """Set up before each call with ``before()``; ``after()`` says what the call left running, if anything."""

    def __init__(self, cpu_s: int) -> None:
        self.cpu_s = cpu_s
        self.threads = self._threads()
        pid = os.getpid()
        self._children_path = f"/proc/{pid}/task/{pid}/children"
        self._can_list_children = os.path.exists(self._children_path)
        signal.signal(signal.SIGXCPU, self._on_cpu_limit)
        _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        self._hard = hard

    @staticmethod
    def _threads() -> int:
        try:
            return os.stat("/proc/self/task").st_nlink - 2
        except OSError:
            return 1

    @staticmethod
    def _on_cpu_limit(_signum: int, _frame: Any) -> None:
        try:
            os.write(2, b"toolcell worker: the call used up its CPU limit (cpu_s); the worker exits\n")
        finally:
            os._exit(CPU_LIMIT_EXIT)

    def before(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        soft = int(usage.ru_utime + usage.ru_stime) + 1 + self.cpu_s
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
        if self._can_list_children:
            running = self._running_children()
            if running:
                left.append(f"{running} process(es)")
        return " and ".join(left) or None

    def _running_children(self) -> int:
        try:
            with open(self._children_path, "rb") as f:
                pids = f.read().split()
        except OSError:
            return 0
        if not pids:
            return 0
        while True:  # reap what has already ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return 0
            if pid == 0:
                break
        try:
            with open(self._children_path, "rb") as f:
                return len(f.read().split())
        except OSError:
            return 0
