"""CPU time and resident memory of a server's whole process tree (daemon plus workers), via psutil.

Each process contributes its own user + system time plus the times of the children it has
reaped (``children_user``/``children_system``), and the tree's CPU over a window is the total
after minus the total before. That way short-lived processes (a fork per call, a worker that
is replaced) are counted once their parent has waited for them, and a process alive at the
start that exits later is neither lost nor counted twice. Only a descendant that is orphaned
(re-parented outside the tree) and reaped by someone else escapes, which under-counts.
"""

from __future__ import annotations

import os

import msgspec
import psutil


class ProcMemory(msgspec.Struct):
    """One process of the tree: its role, short command line and resident set size."""

    pid: int
    role: str  # "daemon" for the spawned process, "child" for every descendant
    name: str
    rss_bytes: int


def _tree(root_pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(root_pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def cpu_snapshot(root_pid: int) -> dict[int, float]:
    """CPU seconds (own plus reaped children's) of every live process in the tree, keyed by pid."""
    out: dict[int, float] = {}
    for proc in _tree(root_pid):
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        out[proc.pid] = times.user + times.system + times.children_user + times.children_system
    return out


def cpu_delta_s(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds the tree spent between two snapshots."""
    return max(0.0, sum(after.values()) - sum(before.values()))


def _short_name(proc: psutil.Process) -> str:
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return "?"
    if not cmdline:
        return proc.name()
    if "-c" in cmdline[1:-1]:  # inline code is long and says little: name the interpreter only
        text = f"{os.path.basename(cmdline[0])} -c ..."
    elif "python" in os.path.basename(cmdline[0]) and len(cmdline) > 1:
        text = " ".join(os.path.basename(w) if i == 0 else w for i, w in enumerate(cmdline[1:]))
    else:
        text = " ".join(cmdline)
    return text if len(text) <= 60 else text[:57] + "..."


def memory_snapshot(root_pid: int) -> list[ProcMemory]:
    """RSS of the spawned process ("daemon") and of each of its descendants ("child")."""
    out: list[ProcMemory] = []
    for proc in _tree(root_pid):
        try:
            rss = proc.memory_info().rss
        except psutil.Error:
            continue
        role = "daemon" if proc.pid == root_pid else "child"
        out.append(ProcMemory(pid=proc.pid, role=role, name=_short_name(proc), rss_bytes=rss))
    return out
