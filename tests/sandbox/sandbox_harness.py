"""Spawn a real worker exactly as the daemon does, and talk to it with bounded waits (sync)."""

from __future__ import annotations

import os
import select
import site
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Self

from sandbox.wire import Call, Init, Limits, Permissions, Shutdown, encode_frame, from_worker_decoder, split_frames

REPO_ROOT = str(Path(__file__).resolve().parents[2])
PYTHON = os.path.realpath(sys.executable)


def site_dirs() -> list[str]:
    dirs = [p for p in sys.path if "site-packages" in p or "dist-packages" in p]
    for p in site.getsitepackages():
        if p not in dirs and os.path.isdir(p):
            dirs.append(p)
    return dirs


def bootstrap(prelude: str = "", ipc_fd: int = 3) -> str:
    paths = [REPO_ROOT, *site_dirs()]
    return f"import sys; sys.path[:0]={paths!r}\n{prelude}\nfrom sandbox.worker import main; main({ipc_fd})"


def write_plugin(folder: Path, code: str, entry: str = "attack_plugin") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)
    (folder / f"{entry}.py").write_text(textwrap.dedent(code))
    return folder


class Worker:
    """One worker process with its IPC socket; ``close()`` kills its whole tree."""

    def __init__(
        self,
        plugin_dir: Path,
        *,
        policy: str = "strict",
        mode: str = "pooled",
        entry: str = "attack_plugin",
        limits: Limits | None = None,
        permissions: Permissions | None = None,
        scratch_root: Path | None = None,
        prelude: str = "",
        env: dict[str, str] | None = None,
        ipc_fd: int = 3,
    ) -> None:
        import tempfile

        self.scratch = tempfile.mkdtemp(prefix="toolcell-scratch-", dir=str(scratch_root) if scratch_root else None)
        os.chmod(self.scratch, 0o700)
        self.sock, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [PYTHON, "-I", "-S", "-c", bootstrap(prelude, ipc_fd)],
            pass_fds=[ipc_fd],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=env or {"PATH": "/usr/bin:/bin"},
            cwd=self.scratch,
            preexec_fn=None if child.fileno() == ipc_fd else _dup_to(child.fileno(), ipc_fd),  # noqa: PLW1509
        )
        child.close()
        self.buf = bytearray()
        self.init = Init(
            plugin_name="attack",
            plugin_dir=str(plugin_dir),
            entry=entry,
            sys_path=[],
            env={},
            limits=limits or Limits(),
            permissions=permissions or Permissions(),
            policy=policy,
            scratch_dir=self.scratch,
            mode=mode,
        )
        self.sock.sendall(encode_frame(self.init))
        self.next_id = 1

    def recv(self, timeout_s: float = 10.0) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            frames = split_frames(self.buf)
            if frames:
                # keep any extra complete frames for the next call
                rest = b"".join(encode_frame_raw(f) for f in frames[1:])
                self.buf[:0] = rest
                return from_worker_decoder.decode(frames[0])
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no frame from the worker in time")
            r, _, _ = select.select([self.sock], [], [], left)
            if r:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    raise EOFError("worker closed the channel")
                self.buf += chunk

    def ready(self, timeout_s: float = 10.0) -> Any:
        return self.recv(timeout_s)

    def call(self, tool: str, timeout_s: float = 10.0, **arguments: Any) -> Any:
        cid = self.next_id
        self.next_id += 1
        self.sock.sendall(encode_frame(Call(cid, tool, arguments)))
        while True:
            msg = self.recv(timeout_s)
            if getattr(msg, "id", None) == cid and type(msg).__name__ in ("Result", "ResultReturned"):
                return msg

    def shutdown(self) -> None:
        try:
            self.sock.sendall(encode_frame(Shutdown()))
        except OSError:
            pass

    def close(self) -> str:
        """Kill the whole tree (reaper first: pid 1 follows through PDEATHSIG), clean up; returns stderr."""
        from sandbox.isolation import cgroups

        try:
            os.killpg(self.proc.pid, 9)
        except OSError:
            pass
        try:
            _, err = self.proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            err = b""
        cgroups.cleanup(self.proc.pid)
        self.sock.close()
        subprocess.run(["rm", "-rf", self.scratch], check=False)
        return err.decode(errors="replace")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def encode_frame_raw(body: bytes) -> bytes:
    return len(body).to_bytes(4, "big") + body


def _dup_to(fd: int, target: int) -> Any:
    def f() -> None:
        os.dup2(fd, target)

    return f


def text_of(result: Any) -> str:
    return "".join(c.get("text", "") for c in result.content)
