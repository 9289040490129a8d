"""A spawned MCP stdio server seen from the client side: non-blocking pipes, handshake, shutdown.

The load loop uses the raw file descriptors directly (``read_fd``/``write_fd``); this module
only adds the slow-path conveniences around it: starting the process with stderr going to a
file (a full stderr pipe would stall the server), one request/response exchange with a
timeout, the legacy handshake, and an escalating stop that also sweeps descendants.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import psutil

import mcpwire

READ_CHUNK = 1 << 20


class ServerError(RuntimeError):
    """The server under test failed to start, answered wrongly, or died."""


class StdioServer:
    """One server process spoken to over newline-delimited JSON on its stdin/stdout."""

    def __init__(self, argv: Sequence[str], cwd: str | None = None, env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self._stderr = tempfile.TemporaryFile(prefix="loadgen-stderr-")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=cwd,
            env=env,
            bufsize=0,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.write_fd = self.proc.stdin.fileno()
        self.read_fd = self.proc.stdout.fileno()
        os.set_blocking(self.write_fd, False)
        os.set_blocking(self.read_fd, False)
        self.pending = b""  # bytes read past the last complete line
        self._next_id = -1  # slow-path requests use negative ids; the load loop uses 0, 1, 2, ...

    @property
    def pid(self) -> int:
        """The server's process id (the root of the tree whose CPU and memory are measured)."""
        return self.proc.pid

    def stderr_tail(self, max_bytes: int = 2000) -> str:
        """The last bytes the server wrote to stderr, for error messages."""
        self._stderr.flush()
        size = self._stderr.seek(0, os.SEEK_END)
        self._stderr.seek(max(0, size - max_bytes))
        return self._stderr.read().decode("utf-8", "replace")

    def write_all(self, data: bytes, timeout_s: float) -> None:
        """Write ``data`` completely, waiting for the pipe as needed."""
        deadline = time.monotonic() + timeout_s
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.write_fd, view) :]
            except BlockingIOError:
                self._wait(self.write_fd, select.POLLOUT, deadline)
            except BrokenPipeError as exc:
                raise ServerError(f"server closed its stdin; stderr:\n{self.stderr_tail()}") from exc

    def read_line(self, timeout_s: float) -> bytes:
        """Return the next complete line from the server (without its newline)."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.pending:
            self._wait(self.read_fd, select.POLLIN, deadline)
            chunk = os.read(self.read_fd, READ_CHUNK)
            if not chunk:
                raise ServerError(f"server closed its stdout (exit {self.proc.poll()}); stderr:\n{self.stderr_tail()}")
            self.pending += chunk
        line, _, self.pending = self.pending.partition(b"\n")
        return line

    def call(self, method: str, params: dict[str, Any] | None, modern: bool, timeout_s: float) -> dict[str, Any]:
        """Send one request and return its response, skipping notifications and answering server requests."""
        request_id = self._next_id
        self._next_id -= 1
        self.write_all(mcpwire.request(method, params, request_id, modern), timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            line = self.read_line(max(0.0, deadline - time.monotonic()))
            if not line.strip():
                continue
            try:
                message = mcpwire.decode_any(line)
            except Exception as exc:
                raise ServerError(f"server wrote a line that is not JSON: {line[:300]!r}") from exc
            if not isinstance(message, dict):
                raise ServerError(f"server wrote a non-object message: {line[:300]!r}")
            if message.get("id") == request_id and "method" not in message:
                return message
            if "method" in message and "id" in message:
                self.write_all(mcpwire.refusal(message["id"]), timeout_s)

    def handshake(self, timeout_s: float) -> dict[str, Any]:
        """Do the legacy ``initialize`` + ``notifications/initialized`` exchange; return the result."""
        reply = self.call("initialize", mcpwire.initialize_params(), modern=False, timeout_s=timeout_s)
        if "result" not in reply:
            raise ServerError(f"initialize failed: {reply}")
        self.write_all(mcpwire.initialized_notification(), timeout_s)
        result: dict[str, Any] = reply["result"]
        return result

    def stop(self, grace_s: float = 5.0) -> int | None:
        """Close stdin, wait, then SIGTERM and SIGKILL; finally kill any surviving descendants."""
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            descendants = []
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _, alive = psutil.wait_procs(descendants, timeout=grace_s)
        for child in alive:
            try:
                child.kill()
            except psutil.Error:
                pass
        self._stderr.close()
        return self.proc.returncode

    def _wait(self, fd: int, event: int, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ServerError(f"timed out waiting for the server; stderr:\n{self.stderr_tail()}")
        poller = select.poll()
        poller.register(fd, event)
        if not poller.poll(remaining * 1000):
            raise ServerError(f"timed out waiting for the server; stderr:\n{self.stderr_tail()}")
