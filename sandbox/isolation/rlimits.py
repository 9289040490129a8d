"""Resource limits: per-process backstops; the cgroup layer does the real memory and pids accounting."""

from __future__ import annotations

import resource

from sandbox.wire import Limits

#: Default processes (and threads) of a worker (``Limits.max_processes``): cgroup ``pids.max`` and,
#: for a worker uid of its own, NPROC.
PIDS_MAX = 64
#: RLIMIT_AS counts virtual memory (arenas, thread stacks, mapped libraries): keep it a loose backstop.
AS_SLACK_MB = 512


def _cap(which: int, value: int) -> None:
    _soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def apply(limits: Limits, *, address_space: bool = True) -> None:
    """``address_space``: also cap RLIMIT_AS. Off for a hosted server's runtime (Node reserves tens of
    GiB of address space it never touches: a V8 pointer cage, WebAssembly guard regions), whose memory
    the cgroup limit accounts for instead."""
    _cap(resource.RLIMIT_CORE, 0)
    _cap(resource.RLIMIT_NOFILE, limits.max_open_files)
    _cap(resource.RLIMIT_FSIZE, limits.max_file_size_mb * 1024 * 1024)
    # CPU is a budget per call (``sandbox.call_guard``, ``sandbox.zygote``): only the soft limit is set
    # here, so that it can be moved on before each call; the hard one stays where it was.
    _soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s if hard == resource.RLIM_INFINITY else min(limits.cpu_s, hard), hard))
    if address_space:
        _cap(resource.RLIMIT_AS, (max(limits.memory_mb, 64) + AS_SLACK_MB) * 1024 * 1024)


def apply_nproc(pids_max: int = PIDS_MAX) -> None:
    """RLIMIT_NPROC: counted per real uid, ignored for uid 0 (trap 1), so only after the identity switch."""
    _cap(resource.RLIMIT_NPROC, pids_max)
