"""Fixtures for the sandbox tests: the capability probe, an attack plugin, real worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from sandbox_harness import Worker, write_plugin

# Each tool tries one attack and reports {"ok": <the attack worked>, "detail": ...} as JSON text.
ATTACK_PLUGIN = r'''
import ctypes
import json
import os
import signal
import socket
import time

from sandbox import tool


def report(ok, detail=""):
    return json.dumps({"ok": bool(ok), "detail": str(detail)[:500]})


@tool
def whoami() -> str:
    return json.dumps({"uid": os.getuid(), "pid": os.getpid(), "host": socket.gethostname(), "cwd": os.getcwd()})


@tool
def read_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return report(True, f.read(200))
    except OSError as exc:
        return report(False, repr(exc))


@tool
def list_dir(path: str) -> str:
    try:
        return report(True, sorted(os.listdir(path)))
    except OSError as exc:
        return report(False, repr(exc))


@tool
def fd_targets() -> str:
    """What each fd above 3 (IPC) points to, except the one this listing opens."""
    import json as _json
    out = []
    for name in os.listdir("/proc/self/fd"):
        if int(name) > 3:
            try:
                out.append(os.readlink(f"/proc/self/fd/{name}"))
            except OSError:
                pass
    return _json.dumps([t for t in out if not t.startswith("/proc/") or "/fd" not in t])


@tool
def write_file(path: str, data: str = "pwned") -> str:
    try:
        with open(path, "w") as f:
            f.write(data)
        return report(True, path)
    except OSError as exc:
        return report(False, repr(exc))


@tool
def tcp_connect(port: int) -> str:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        s.sendall(b"pwned")
        s.close()
        return report(True, "connected")
    except OSError as exc:
        return report(False, repr(exc))


@tool
def abstract_connect(name: str) -> str:
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2)
        s.connect("\0" + name)
        s.sendall(b"pwned")
        s.close()
        return report(True, "connected")
    except OSError as exc:
        return report(False, repr(exc))


@tool
def kill_pid(pid: int) -> str:
    try:
        os.kill(pid, signal.SIGKILL)
        return report(True, "signal sent")
    except OSError as exc:
        return report(False, repr(exc))


@tool
def ptrace_pid(pid: int) -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    PTRACE_SEIZE = 0x4206
    rc = libc.ptrace(ctypes.c_long(PTRACE_SEIZE), ctypes.c_long(pid), None, None)
    if rc == 0:
        return report(True, "seized")
    return report(False, os.strerror(ctypes.get_errno()))


@tool
def proc_snoop(pid: int, needle: str) -> str:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read()
        return report(needle.encode() in data, "read environ")
    except OSError as exc:
        return report(False, repr(exc))


@tool
def fork_bomb(n: int) -> str:
    r, w = os.pipe()
    pids = []
    err = ""
    for _ in range(n):
        try:
            pid = os.fork()
        except OSError as exc:
            err = repr(exc)
            break
        if pid == 0:
            os.close(w)
            os.read(r, 1)
            os._exit(0)
        pids.append(pid)
    os.close(w)
    os.close(r)
    for pid in pids:
        os.waitpid(pid, 0)
    return report(len(pids) >= n, f"{len(pids)} {err}")


@tool
def memory_bomb(mb: int) -> str:
    pid = os.fork()
    if pid == 0:
        chunks = []
        try:
            for _ in range(mb // 16):
                chunks.append(bytearray(b"\x01") * (16 << 20))
        except MemoryError:
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return report(os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status))


@tool
def syscall_probe() -> str:
    libc = ctypes.CDLL(None, use_errno=True)
    out = {}
    out["unshare"] = libc.unshare(0x10000000) == 0 or os.strerror(ctypes.get_errno())
    out["ptrace_traceme"] = libc.ptrace(0, 0, None, None) == 0 or os.strerror(ctypes.get_errno())
    try:
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).close()
        out["inet_socket"] = True
    except OSError as exc:
        out["inet_socket"] = exc.strerror
    return json.dumps(out)


@tool
def spawn_survivor(seconds: int = 30, linger: float = 0) -> str:
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            time.sleep(seconds)
        os._exit(0)
    os.waitpid(pid, 0)
    time.sleep(linger)
    return report(True, "double-forked")


STATE = {"n": 0}


@tool
def counter() -> str:
    STATE["n"] += 1
    return str(STATE["n"])


@tool
def crash() -> str:
    os._exit(7)


@tool
def hit_zygote() -> str:
    out = []
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        try:
            os.kill(os.getppid(), sig)
            out.append("sent")
        except OSError as exc:
            out.append(exc.strerror)
    return json.dumps(out)
'''


@pytest.fixture(scope="session")
def probe() -> dict[str, Any]:
    """The capability probe's report, exactly as the daemon gets it (a subprocess)."""
    from runtime.doctor import run_probe

    return run_probe(timeout_s=60)


@pytest.fixture(scope="session")
def require(probe: dict[str, Any]) -> Callable[..., None]:
    """``require("landlock", ...)``: skip, with the probe's reason, unless every layer is available."""

    def check(*layers: str) -> None:
        for layer in layers:
            info = probe["layers"].get(layer, {})
            if not info.get("available"):
                pytest.skip(f"layer {layer} unavailable here: {info.get('reason')} (fix: {info.get('fix')})")

    return check


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_plugin(tmp_path_factory.mktemp("attack") / "plugin", ATTACK_PLUGIN)


@pytest.fixture
def spawn(plugin_dir: Path) -> Iterator[Callable[..., Worker]]:
    """Start workers on the attack plugin; every one is killed and cleaned up after the test."""
    workers: list[Worker] = []

    def start(policy: str = "strict", **kwargs: Any) -> Worker:
        w = Worker(kwargs.pop("plugin", plugin_dir), policy=policy, **kwargs)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.close()


@pytest.fixture
def victim() -> Iterator[subprocess.Popen[bytes]]:
    """A process outside the sandbox, holding a secret in its environment."""
    p = subprocess.Popen(
        ["sleep", "30"], env={"TOOLCELL_TEST_SECRET": "s3cret-canary", "PATH": "/usr/bin:/bin"},
        stdin=subprocess.DEVNULL,
    )
    yield p
    p.kill()
    p.wait(timeout=5)
