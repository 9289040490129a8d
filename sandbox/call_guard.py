"""Per-call limits and leftovers in a pooled worker (one process serving many calls in turn).

* **CPU per call.** ``limits.cpu_s`` is a budget for one call, not for the worker's life: before each
  call the soft ``RLIMIT_CPU`` is moved to the CPU time used so far plus ``cpu_s`` (the hard limit is
  left open, so it can be moved again). A call over it gets ``SIGXCPU``; the worker answers by
  exiting with ``CPU_LIMIT_EXIT`` (the pooled worker is pid 1 of its namespace, where a signal left at
  its default action is ignored), which the daemon reports as the call's CPU limit. The plugin runs in
  this process and could undo the limit; the daemon's wall-clock deadline bounds such a call anyway.
* **Nothing outlives its call.** After each call the worker checks that the call left no thread and no
  process running: threads through ``/proc/<pid>/task``'s link count (a ``stat`` of the path), processes
  through ``waitpid(-1, WNOHANG | __WALL)``, which reaps what has ended and says whether any child is
  left (the worker is pid 1 of its pid namespace, so double-forked orphans are its children too; only
  then is the ``children`` file read, to count them for the message). If anything still runs, the
  worker says why on stderr (the daemon log) and exits after the call's result is sent, and the daemon
  starts a fresh worker.
* **It holds nothing the plugin could use.** The guard keeps no descriptor open: the plugin runs in
  this process and would inherit every one (a kept fd of ``/proc/1/task`` or of the ``children`` file
  was visible to plugin code). A path lookup and a ``waitpid`` per call cost ~1-2 us more than the
  kept fds did.
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


#: ``waitpid`` option: children of every kind (also those started by ``clone`` with an exit signal other
#: than SIGCHLD, which a plain ``waitpid`` neither reaps nor counts).
_WALL = 0x40000000


class CallGuard:
    """Set up before each call with ``before()``; ``after()`` says what the call left running, if anything."""

    def __init__(self, cpu_s: int) -> None:
        self.cpu_s = cpu_s
        # By pid, not /proc/self: one symlink fewer to resolve on every call.
        self._tasks = f"/proc/{os.getpid()}/task"
        self.threads = 0
        self.threads = self._threads()
        if self.threads < 0:
            # Without a view of its own /proc entries (a policy that hides /proc) the thread check is off.
            os.write(2, b"toolcell worker: /proc is not readable here, so leftover threads of a pooled call "
                        b"cannot be detected\n")
        signal.signal(signal.SIGXCPU, self._on_cpu_limit)
        _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        self._hard = hard
        self._soft = -1

    def _threads(self) -> int:
        try:
            return os.stat(self._tasks).st_nlink - 2
        except OSError:
            return -1

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
        left = []
        if self.threads >= 0:
            threads = self._threads()
            if threads > self.threads:
                left.append(f"{threads - self.threads} thread(s)")
        if _children_left():
            left.append(f"{_count_children() or 'some'} process(es)")
        return " and ".join(left) or None


def _children_left() -> bool:
    """Reap the children that have ended; True if any is still there."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG | _WALL)
        except ChildProcessError:
            return False
        except InterruptedError:
            continue
        if pid == 0:
            return True


def _count_children() -> int:
    """How many children this process has (read only when some are left: the message counts them)."""
    count = 0
    try:
        for tid in os.listdir("/proc/self/task"):
            fd = os.open(f"/proc/self/task/{tid}/children", os.O_RDONLY | os.O_CLOEXEC)
            try:
                count += len(os.read(fd, 1 << 16).split())
            finally:
                os.close(fd)
    except OSError:
        pass
    return count
