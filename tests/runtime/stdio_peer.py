"""A raw JSON-RPC peer for ``toolcell serve --stdio`` in a real subprocess (bounded waits everywhere).

Used where the process boundary is the point: worker processes, crashes, kills, garbage on stdin.
Every line the daemon writes to stdout is parsed and kept; a line that is not JSON fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import IO, Any

import psutil
import trio

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "plugins"
CONFORMANCE = BUNDLED / "conformance"
WAIT_S = 15.0


def toolcell_command(*plugins: Path | str, policy: str | None = "none", extra: tuple[str, ...] = (),
                     watch: bool = False) -> list[str]:
    """The serve command. The plugin-folder watcher is off unless asked for: these tests never edit
    plugins, and (see test_stdio_transport) it delays the exit on stdin EOF."""
    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--stdio"]
    if not watch:
        cmd.append("--no-watch")
    for p in plugins:
        cmd += ["--plugins", str(p)]
    if policy is not None:
        cmd += ["--policy", policy]
    return cmd + list(extra)


class StdioPeer:
    def __init__(self, proc: trio.Process, stderr_path: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self.messages: list[Any] = []
        self.raw_lines: list[bytes] = []
        self._changed = trio.Event()
        self._eof = trio.Event()
        self._next_id = 1000

    # -- sending -------------------------------------------------------------------------------

    async def send_raw(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(data)

    async def send(self, obj: Any) -> None:
        await self.send_raw(json.dumps(obj).encode() + b"\n")

    async def notify(self, method: str, params: Any = None) -> None:
        obj: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            obj["params"] = params
        await self.send(obj)

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    async def start_request(self, method: str, params: Any = None, id: Any = None) -> Any:
        request_id = self.new_id() if id is None else id
        obj: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            obj["params"] = params
        await self.send(obj)
        return request_id

    async def request(self, method: str, params: Any = None, id: Any = None, timeout: float = WAIT_S) -> Any:
        request_id = await self.start_request(method, params, id)
        return await self.response(request_id, timeout)

    async def initialize(self, version: str = "2025-11-25") -> Any:
        result = await self.request("initialize", {"protocolVersion": version, "capabilities": {},
                                                   "clientInfo": {"name": "stdio-peer", "version": "0"}})
        assert result["result"]["protocolVersion"] == version, result
        await self.notify("notifications/initialized")
        return result["result"]

    async def call(self, name: str, arguments: dict[str, Any] | None = None, *, token: Any = None,
                   timeout: float = WAIT_S) -> Any:
        """``tools/call`` and wait; returns the whole response message."""
        request_id = await self.start_call(name, arguments, token=token)
        return await self.response(request_id, timeout)

    async def start_call(self, name: str, arguments: dict[str, Any] | None = None, *, token: Any = None,
                         id: Any = None) -> Any:
        params: dict[str, Any] = {"name": name, "arguments": arguments or {}}
        if token is not None:
            params["_meta"] = {"progressToken": token}
        return await self.start_request("tools/call", params, id)

    # -- receiving -----------------------------------------------------------------------------

    async def pump(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        while True:
            chunk = await self.proc.stdout.receive_some(1 << 16)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                self.raw_lines.append(line)
                self.messages.append(json.loads(line))  # stdout must carry only JSON
            self._changed.set()
            self._changed = trio.Event()
        assert buf == b"", f"stdout ended mid-line: {buf[:200]!r}"
        self._eof.set()
        self._changed.set()

    async def wait_for(self, predicate: Callable[[Any], bool], timeout: float = WAIT_S) -> Any:
        with trio.fail_after(timeout):
            seen = 0
            while True:
                for message in self.messages[seen:]:
                    if predicate(message):
                        return message
                seen = len(self.messages)
                if self._eof.is_set():
                    raise AssertionError(f"stdout closed before the expected message; stderr:\n{self.stderr()}")
                await self._changed.wait()

    async def response(self, request_id: Any, timeout: float = WAIT_S) -> Any:
        return await self.wait_for(lambda m: _is_response_to(m, request_id), timeout)

    def responses_to(self, request_id: Any) -> list[Any]:
        return [m for m in self.messages if _is_response_to(m, request_id)]

    def notifications(self, method: str) -> list[Any]:
        return [m for m in self.messages if isinstance(m, dict) and m.get("method") == method and "id" not in m]

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    async def close(self, timeout: float = WAIT_S) -> int:
        """Close stdin (the client hangs up) and wait for a clean exit; returns the exit code."""
        assert self.proc.stdin is not None
        await self.proc.stdin.aclose()
        with trio.fail_after(timeout):
            await self._eof.wait()
            return await self.proc.wait()


def _is_response_to(message: Any, request_id: Any) -> bool:
    return (isinstance(message, dict) and "method" not in message and "id" in message
            and message["id"] == request_id and type(message["id"]) is type(request_id))


@asynccontextmanager
async def open_toolcell(*plugins: Path | str, policy: str | None = "none", extra: tuple[str, ...] = (),
                        stderr_path: Path, env: dict[str, str] | None = None, watch: bool = False
                        ) -> AsyncIterator[StdioPeer]:
    """Start ``toolcell serve --stdio`` (real subprocess); kill it if the test leaves it running.

    The daemon's stderr (its structured log) goes to ``stderr_path``."""
    with open_log(stderr_path, "wb") as errfile:
        proc = await trio.lowlevel.open_process(
            toolcell_command(*plugins, policy=policy, extra=extra, watch=watch),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=errfile, cwd=str(REPO), env={**os.environ, **(env or {})})
    peer = StdioPeer(proc, stderr_path)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(peer.pump)
            try:
                yield peer
            finally:
                if proc.returncode is None:
                    kill_process_tree(proc.pid)
                with trio.move_on_after(WAIT_S):
                    await proc.wait()
                nursery.cancel_scope.cancel()
    finally:
        if proc.returncode is None:
            kill_process_tree(proc.pid)


def open_log(path: Path, mode: str) -> IO[Any]:
    """A log file for a child's stderr (a plain sync open, kept out of async functions)."""
    return open(path, mode)


def kill_process_tree(pid: int) -> None:
    """Kill the daemon we started and every process below it (its workers), by pid."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.Error:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.Error:
            pass


def process_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def wait_gone(pid: int, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not process_gone(pid):
            await trio.sleep(0.02)


def text_of(response: Any) -> str:
    result = response["result"]
    return " ".join(c.get("text", "") for c in result["content"] if c.get("type") == "text")
