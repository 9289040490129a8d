"""Isolation layers a worker applies to itself before importing plugin code.

``apply(init)`` returns ``(applied, missing)``: the layer names actually in force, and the ones the
policy wanted but the machine could not provide. Policies:

* ``strict``: every layer is required; the first missing one raises ``IsolationError`` naming it
  (fail closed: the worker reports ``LoadFailed``).
* ``compat``: apply what works, report the rest as missing (also on stderr, with the cause).
* ``none``: hygiene and rlimits only (the daemon logs the plugin as running unsandboxed).

Layers, in the order reported (``LAYERS``). The order they are *applied* in differs where privilege
demands it: the cgroup and the mount view need root, so they come before the uid switch, and the
user namespace can only map the worker uid after it.

1. hygiene, 2. rlimits, 4. cgroup (create + join, as root), 5a. namespaces (unshare, fork: this
process continues as pid 1, its parent becomes a reaper; private mount view), 3. identity (drop to
the worker uid), 5b. user namespace (map the worker uid, drop capabilities), 6. landlock,
7. seccomp. A plugin with a network grant adds ``egress`` right after 5a, while the worker still
holds CAP_NET_ADMIN over its (empty) network namespace: ``lo`` up, a listener on 127.0.0.1 handed
to the daemon, the proxy variables set; Landlock then allows TCP connects to that port only.
Under ``none`` a grant is not enforced at all (the plugin shares the host's network).

With namespaces on, the calling process returns from ``apply`` as pid 1 of a new pid namespace,
i.e. as a *child* of the process the daemon spawned (see ``namespaces``). Never imports trio.
"""

from __future__ import annotations

import os
import sys

from sandbox.isolation import cgroups, egress, hygiene, identity, landlock, namespaces, paths, rlimits, seccomp, syscalls
from sandbox.wire import Init

LAYERS = ("hygiene", "rlimits", "identity", "cgroup", "namespaces", "landlock", "seccomp")
#: Reported (after ``LAYERS``) only by a worker whose plugin holds a network grant: its own network
#: namespace with only ``lo``, and its proxy socket handed to the daemon (see ``egress``).
EGRESS = "egress"
POLICIES = ("strict", "compat", "none")

#: Why each missing layer is missing, from the last ``apply`` in this process (for logs and tests).
last_reasons: dict[str, str] = {}


class IsolationError(RuntimeError):
    """A layer the ``strict`` policy requires could not be applied."""

    def __init__(self, layer: str, reason: str) -> None:
        super().__init__(f"layer {layer!r} unavailable: {reason}")
        self.layer = layer
        self.reason = reason


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def apply(init: Init) -> tuple[list[str], list[str]]:
    """Apply the layers ``init.policy`` asks for to this process. See the module doc."""
    policy = init.policy
    if policy not in POLICIES:
        raise IsolationError("policy", f"unknown isolation policy {policy!r}")
    strict = policy == "strict"
    applied: set[str] = set()
    missing: dict[str, str] = {}
    last_reasons.clear()

    def fail(layer: str, reason: str) -> None:
        if strict:
            raise IsolationError(layer, reason)
        missing[layer] = reason

    scratch = os.path.realpath(init.scratch_dir) if init.scratch_dir else ""
    ipc_fd = hygiene.find_ipc_fd()
    hygiene.apply(scratch, ipc_fd)
    applied.add("hygiene")
    rlimits.apply(init.limits, address_space=not init.command)
    applied.add("rlimits")
    if policy == "none":
        return _ordered(applied), []

    # Everything that might need a file lookup or a library load happens before any restriction.
    try:
        seccomp.load_library()
        seccomp_err = ""
    except OSError as exc:
        seccomp_err = _why(exc)
    allow = paths.allowlist(init)
    root = os.geteuid() == 0
    worker_pid = os.getpid()
    ident = identity.target(worker_pid)

    try:
        cgroups.create_and_join(worker_pid, init.limits.memory_mb, init.limits.max_processes)
        applied.add("cgroup")
    except OSError as exc:
        fail("cgroup", _why(exc))

    network = bool(init.permissions.network)
    entered: namespaces.Entered | None = None
    ns_err = ""
    try:
        if root:
            entered = namespaces.enter(ident, net=True)
        else:
            entered = namespaces.enter_unprivileged(net=True)
        namespaces.build_view(allow, scratch, ident if root else None,
                              tmp_size_mb=max(init.limits.memory_mb, 16), cover_blocked=root)
        namespaces.set_hostname()
    except OSError as exc:
        ns_err = _why(exc)
        if entered is None or strict:
            fail("namespaces", ns_err)

    proxy_port = 0
    if network:
        try:
            if entered is not None:
                egress.loopback_up()
            proxy_port = egress.hand_over(ipc_fd)
            egress.set_proxy_env(proxy_port)
            if entered is not None:
                applied.add(EGRESS)
            else:
                fail(EGRESS, "no network namespace: the plugin shares the host's network; only Landlock "
                     "(TCP connects to the proxy port) keeps it from dialling out directly")
        except OSError as exc:
            fail(EGRESS, f"egress proxy set-up: {_why(exc)} (the plugin has no network)")

    if root:
        blocker = None if (entered and not ns_err) else identity.reachable([*allow.host_paths(), scratch], ident)
        if blocker is not None:
            fail("identity", f"{blocker} is not traversable by uid {ident.uid} and no private mount view was built")
        else:
            try:
                if not (entered and not ns_err):
                    identity.chown_scratch(scratch, ident)
                identity.drop(ident, alive_fd=entered.alive_fd if entered else None)
                rlimits.apply_nproc(init.limits.max_processes)
                applied.add("identity")
            except OSError as exc:
                fail("identity", _why(exc))
        if entered and not ns_err:
            if "identity" in applied:
                try:
                    namespaces.enter_user_ns(ident)
                except OSError as exc:
                    ns_err = _why(exc)
                    fail("namespaces", f"user namespace: {ns_err}")
            else:
                ns_err = "user namespace needs the identity switch first"
                fail("namespaces", ns_err)
    else:
        applied.add("identity")  # never root: the daemon's own unprivileged uid
        if entered and not ns_err:
            syscalls.drop_all_capabilities()
    if entered is not None:
        os.close(entered.alive_fd)
        if not ns_err:
            applied.add("namespaces")
        elif "namespaces" not in missing:
            fail("namespaces", ns_err)

    pid_ns = "namespaces" in applied
    try:
        landlock.apply(
            allow,
            extra_read=("/proc",) if pid_ns else (),
            extra_write=tuple(p for p in (scratch, "/tmp", "/dev/shm") if p),
            connect_ports=(proxy_port,) if proxy_port else (),
        )
        applied.add("landlock")
    except OSError as exc:
        fail("landlock", _why(exc))

    if seccomp_err:
        fail("seccomp", seccomp_err)
    else:
        try:
            seccomp.build_and_load(allow_inet=bool(proxy_port))
            applied.add("seccomp")
        except OSError as exc:
            fail("seccomp", _why(exc))

    last_reasons.update(missing)
    for layer, reason in missing.items():
        print(f"toolcell isolation ({policy}): layer {layer} missing: {reason}", file=sys.stderr, flush=True)
    return _ordered(applied), [m for m in (*LAYERS, EGRESS) if m in missing]


def _ordered(layers: set[str]) -> list[str]:
    return [name for name in (*LAYERS, EGRESS) if name in layers]
