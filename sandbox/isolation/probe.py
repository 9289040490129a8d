"""Capability probe: which isolation layers this machine can provide, why not, and how to fix it.

Each layer is tried for real, with the same code the worker uses, in a forked child (this runs in
its own fresh, single-threaded process: ``python -m sandbox.isolation.probe`` prints JSON; never
call it inside the trio daemon). ``probe()`` returns ``{layer: (available, reason, fix)}``;
``probe_profile("strict")`` applies a whole profile in a child, as a worker would.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable

from sandbox import isolation
from sandbox.isolation import LAYERS, cgroups, egress, identity, landlock, namespaces, paths, rlimits, seccomp, syscalls
from sandbox.wire import Init, Limits, Permissions

Outcome = tuple[bool, str, str]
#: Pids of the probe children, whose cgroups (named by pid, as a worker's are) are removed afterwards.
_CHILDREN: list[int] = []
TIMEOUT_S = 10.0


def _in_child(fn: Callable[[int], str], timeout_s: float = TIMEOUT_S) -> tuple[bool, str]:
    """Run ``fn(report_fd)`` in a forked child; (succeeded, its detail or error)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        code = 0
        try:
            msg = "OK " + (fn(w) or "")
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            msg = f"ERR {type(exc).__name__}: {exc}"
            if not isinstance(exc, OSError):
                msg += "\n" + traceback.format_exc(limit=5)
            code = 1
        try:
            os.write(w, msg.encode()[:60000])
        finally:
            os._exit(code)
    os.close(w)
    _CHILDREN.append(pid)
    out = b""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([r], [], [], max(left, 0))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                out = out or b"ERR timed out"
                break
            chunk = os.read(r, 65536)
            if not chunk:
                break
            out += chunk
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    text = out.decode(errors="replace")
    if text.startswith("OK"):
        return True, text[3:].strip()
    return False, (text[4:].strip() if text.startswith("ERR") else text.strip()) or "probe child died without a report"


def _probe_init(scratch: str, policy: str = "strict") -> Init:
    return Init(
        plugin_name="probe", plugin_dir=scratch, entry="probe", sys_path=[], env={}, limits=Limits(memory_mb=128),
        permissions=Permissions(), policy=policy, scratch_dir=scratch,
    )


def _in_container() -> str:
    if os.path.exists("/.dockerenv"):
        return "docker"
    try:
        with open("/proc/1/cgroup") as f:
            text = f.read()
        for name in ("docker", "containerd", "kubepods", "libpod", "lxc"):
            if name in text:
                return name
    except OSError:
        pass
    return ""


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def proc_overmounts(mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mounts over parts of /proc (a container runtime's masked and read-only paths, systemd's
    ProtectKernelTunables=): while any exists the kernel refuses a fresh /proc in a new user
    namespace, so a worker cannot have its own."""
    try:
        with open(mountinfo) as f:
            points = [line.split()[4] for line in f if len(line.split()) > 4]
    except OSError:
        return []
    return sorted({p for p in points if p.startswith("/proc/")})


def _namespaces_fix(err: str) -> tuple[str, str]:
    container = _in_container()
    masked = proc_overmounts()
    if "mount(/proc)" in err and masked:
        return (f"/proc is partly masked ({', '.join(masked[:4])}{', …' if len(masked) > 4 else ''} mounted over), "
                "so the kernel refuses the fresh /proc of a worker's pid namespace",
                ("docker/podman: --security-opt systempaths=unconfined (podman: unmask=ALL); Kubernetes: "
                 "securityContext.procMount: Unmasked with hostUsers: false; systemd: drop ProtectKernelTunables=, "
                 "ProtectKernelLogs=, ProcSubset= and ProtectProc="))
    if _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        return ("Ubuntu's AppArmor restricts unprivileged user namespaces",
                ("sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for the "
                "interpreter granting 'userns,'"))
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        return "unprivileged user namespaces are disabled", "sysctl -w kernel.unprivileged_userns_clone=1"
    if _read("/proc/sys/user/max_user_namespaces") == "0":
        return "user.max_user_namespaces is 0", "sysctl -w user.max_user_namespaces=15000"
    if container:
        return (f"running inside {container}: its default seccomp profile blocks unshare/mount",
                ("run the container with --security-opt seccomp=unconfined (or a profile allowing unshare, "
                "mount, setns) and --security-opt apparmor=unconfined, or run toolcell on the host"))
    return "namespaces could not be created", "check the kernel config (CONFIG_USER_NS, CONFIG_PID_NS, CONFIG_NET_NS)"


def probe_hygiene(_: int) -> str:
    syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)
    syscalls.prctl(syscalls.PR_SET_PDEATHSIG, signal.SIGKILL)
    return "no_new_privs and parent-death signal"


def probe_rlimits(_: int) -> str:
    rlimits.apply(Limits())
    return "NOFILE, FSIZE, CORE, CPU, AS"


def probe_identity(_: int) -> str:
    if os.geteuid() != 0:
        return f"daemon runs unprivileged (uid {os.getuid()}): workers keep that uid"
    ident = identity.target()
    allow = paths.allowlist(_probe_init(tempfile.gettempdir()))
    blocker = identity.reachable(allow.host_paths(), ident)
    identity.drop(ident)
    rlimits.apply_nproc()
    if blocker:
        return f"uid {ident.uid}; {blocker} is not traversable by it, so identity needs the namespaces layer's view"
    return f"per-worker uid {identity.WORKER_ID_BASE}+pid"


def probe_cgroup(_: int) -> str:
    lay = cgroups.create_and_join(f"probe-{os.getpid()}", 64, 16)
    where = ", ".join(d.split("/")[4] if lay.version == 1 else d for d in lay.dirs)
    return f"cgroup v{lay.version} ({where}), nested under the daemon's own cgroup"


def probe_namespaces(report: int) -> str:
    scratch = _SCRATCHES[-1]
    init = _probe_init(scratch)
    allow = paths.allowlist(init)
    root = os.geteuid() == 0
    ident = identity.target()
    entered = namespaces.enter(ident, net=True) if root else namespaces.enter_unprivileged(net=True)
    # From here on this is pid 1 of the new namespace; the forked parent mirrors our exit status.
    namespaces.build_view(allow, scratch, ident if root else None, tmp_size_mb=16, cover_blocked=root)
    namespaces.set_hostname()
    egress.loopback_up()  # a plugin with a network grant needs lo for its proxy socket
    if root:
        identity.drop(ident, alive_fd=entered.alive_fd)
        namespaces.enter_user_ns(ident)
    else:
        syscalls.drop_all_capabilities()
    if os.getpid() != 1:
        raise OSError("not pid 1 after entering the pid namespace")
    return "user, mount, pid, net (lo only), ipc, uts, cgroup; private /proc, /tmp, /dev/shm, scratch"


def probe_landlock(_: int) -> str:
    abi = landlock.abi_version()
    if abi < 1:
        raise OSError("landlock_create_ruleset: not supported (ENOSYS) or not enabled (EOPNOTSUPP)")
    syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)  # required without CAP_SYS_ADMIN (as in a worker)
    landlock.apply(paths.Allowlist(read=["/usr"]))
    features = ["filesystem"]
    if abi >= 4:
        features.append("TCP bind/connect")
    if abi >= 6:
        features.append("signal and abstract-socket scoping")
    return f"ABI {abi}: {', '.join(features)}"


def probe_seccomp(_: int) -> str:
    seccomp.load_library()
    syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)
    denied = seccomp.build_and_load(allow_inet=False)
    try:
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()
    except PermissionError:
        pass
    else:
        raise OSError("the filter loaded but socket(AF_UNIX) still works")
    socket.socketpair()[0].close()
    return (f"libseccomp filter denying {len(denied)} syscalls; host unix sockets closed: "
            "no new AF_UNIX socket (socketpair only)")


PROBES: dict[str, Callable[[int], str]] = {
    "hygiene": probe_hygiene,
    "rlimits": probe_rlimits,
    "identity": probe_identity,
    "cgroup": probe_cgroup,
    "namespaces": probe_namespaces,
    "landlock": probe_landlock,
    "seccomp": probe_seccomp,
}


def _fix(layer: str, err: str) -> tuple[str, str]:
    """(likely cause, fix) for a failed layer."""
    if layer == "namespaces":
        cause, fix = _namespaces_fix(err)
        return f"{cause} ({err})", fix
    if layer == "landlock":
        if "ENOSYS" in err or "not supported" in err:
            return f"kernel without Landlock ({err})", "use Linux >= 5.13 built with CONFIG_SECURITY_LANDLOCK=y"
        return (f"Landlock not enabled ({err})",
                "add landlock to the lsm= kernel boot parameter (e.g. lsm=landlock,lockdown,yama,apparmor,bpf)")
    if layer == "cgroup":
        if cgroups.layout("x") is None:
            return (f"no usable cgroup: v1 memory+pids not mounted and cgroup v2 not delegated ({err})",
                    ("cgroup v2: run the daemon in a delegated cgroup (systemd: Delegate=yes, e.g. systemd-run "
                    "--user -p Delegate=yes toolcell ...) with memory and pids in its subtree_control"))
        if "not delegated" in err or "EBUSY" in err or "Device or resource busy" in err:
            return (f"cgroup v2 not delegated ({err})",
                    ("move the daemon into a leaf cgroup of a delegated subtree (Delegate=yes) so it can enable "
                    "memory and pids for its children"))
        return (f"cannot create the worker cgroup ({err})",
                ("the cgroup filesystem must be writable by the daemon (in a container: --cgroupns=private with a "
                "delegated, writable cgroup mount)"))
    if layer == "seccomp":
        if "libseccomp" in err:
            return err, "install libseccomp (Debian/Ubuntu: apt-get install libseccomp2)"
        return f"seccomp filters unavailable ({err})", "use a kernel built with CONFIG_SECCOMP_FILTER=y"
    if layer == "identity":
        return f"cannot switch uid ({err})", "run the daemon as root, or as an unprivileged user (workers then keep its uid)"
    return err, "unexpected: please report this"


def probe(layers: tuple[str, ...] = LAYERS) -> dict[str, Outcome]:
    """Try every layer in a forked child: ``{layer: (available, reason, fix)}``."""
    out: dict[str, Outcome] = {}
    try:
        for layer in layers:
            _scratch()
            ok, detail = _in_child(PROBES[layer])
            if ok:
                out[layer] = (True, detail, "")
            else:
                cause, fix = _fix(layer, detail)
                out[layer] = (False, cause, fix)
    finally:
        cleanup_probe_cgroups()
        _clean_scratch()
    return out


def _scratch() -> str:
    """A fresh scratch dir, made by the parent so it can remove it after the child is gone."""
    d = tempfile.mkdtemp(prefix="toolcell-probe-")
    _SCRATCHES.append(d)
    return d


_SCRATCHES: list[str] = []


def _clean_scratch() -> None:
    while _SCRATCHES:
        shutil.rmtree(_SCRATCHES.pop(), ignore_errors=True)


def cleanup_probe_cgroups() -> None:
    while _CHILDREN:
        cgroups.cleanup(_CHILDREN.pop())
    lay = cgroups.layout("probe")
    if lay is None:
        return
    for d in lay.dirs:
        parent = os.path.dirname(d)
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            if name.startswith("probe-"):
                cgroups.cleanup(name)


def probe_profile(policy: str = "strict") -> tuple[bool, str]:
    """Apply a whole profile in a child exactly as a worker does: (ok, applied layers or error)."""

    scratch = _scratch()

    def run(report: int) -> str:
        os.dup2(report, 3)
        try:
            applied, missing = isolation.apply(_probe_init(scratch, policy))
        except BaseException as exc:  # noqa: BLE001 (the report fd is 3 now: the caller's is closed)
            os.write(3, f"ERR {type(exc).__name__}: {exc}".encode())
            os._exit(1)
        os.write(3, f"OK applied={','.join(applied)} missing={','.join(missing)}".encode())
        os._exit(0)

    try:
        return _in_child(run)
    finally:
        cleanup_probe_cgroups()
        _clean_scratch()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    result = {k: {"available": v[0], "reason": v[1], "fix": v[2]} for k, v in probe().items()}
    cleanup_probe_cgroups()
    report: dict[str, object] = {"layers": result}
    if "--profile" in args or "--all" in args:
        ok, detail = probe_profile("strict")
        report["strict"] = {"ok": ok, "detail": detail}
    report["python"] = os.path.realpath(sys.executable)
    report["euid"] = os.geteuid()
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
