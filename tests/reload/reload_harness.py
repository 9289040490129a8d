"""Hot-reload test helpers: plugin folders written to disk, the daemon's JSON log read back, a
client-side count of ``list_changed`` notifications, and a real ``toolcell serve --http`` subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
from mcp import types

REPO = Path(__file__).resolve().parents[2]
#: Bound of every wait for something that must happen.
WAIT_S = 20.0
#: How long a client must stay quiet after a reload that changed nothing it can see.
QUIET_S = 1.0


def write_plugin(root: Path, name: str, tools: dict[str, str], extra: str = "", doc: str = "Tool {name}.") -> Path:
    """Write (or rewrite) plugin ``name``: one ``@tool`` per entry of ``tools`` (name -> the text it
    returns), each described by ``doc``; ``extra`` is appended to the module."""
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plugin.toml").write_text(f'name = "{name}"\nversion = "1.0"\nentry = "{name}"\n')
    body = ["from sandbox import tool", ""]
    for tool_name, returns in tools.items():
        body += ["@tool", f"def {tool_name}(x: int = 0) -> str:", f'    """{doc.format(name=tool_name)}"""',
                 f"    return {returns!r}", ""]
    (folder / f"{name}.py").write_text("\n".join(body) + extra)
    return folder


class LogWatch:
    """Reads the daemon's JSON log lines from its stderr file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") == name:
                out.append(rec)
        return out

    async def wait_for(self, name: str, count: int) -> list[dict[str, Any]]:
        """Wait (bounded) until ``name`` was logged at least ``count`` times."""
        with trio.fail_after(WAIT_S):
            while len(self.events(name)) < count:
                await trio.sleep(0.02)
        return self.events(name)


class Counter:
    """The ``list_changed`` frames one client's ``message_handler`` saw."""

    def __init__(self) -> None:
        self.seen: list[types.ToolListChangedNotification] = []
        self.changed = trio.Event()

    async def handler(self, message: Any) -> None:
        root = getattr(message, "root", message)
        if isinstance(root, types.ToolListChangedNotification):
            self.seen.append(root)
            self.changed.set()

    async def reaches(self, count: int) -> None:
        with trio.fail_after(WAIT_S):
            while len(self.seen) < count:
                self.changed = trio.Event()
                await self.changed.wait()

    async def stays_at(self, count: int) -> None:
        """Nothing more arrives within ``QUIET_S`` (a bounded wait, ended early by an arrival)."""
        with trio.move_on_after(QUIET_S):
            while len(self.seen) <= count:
                self.changed = trio.Event()
                await self.changed.wait()
        assert len(self.seen) == count


@dataclass
class HttpDaemon:
    proc: subprocess.Popen[bytes]
    url: str
    metrics_url: str
    logs: LogWatch

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=WAIT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=WAIT_S)


def start_http_daemon(tmp: Path, plugins: Path) -> HttpDaemon:
    """``toolcell serve --http`` on an ephemeral loopback port, watching ``plugins``, with metrics on."""
    config = tmp / "toolcell.toml"
    config.write_text(f'state_dir = "{tmp / "state"}"\n\n[http]\nmetrics_listen = "127.0.0.1:0"\n')
    stderr_path = tmp / "stderr.log"
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "serve", "--config", str(config), "--policy", "none",
             "--plugins", str(plugins), "--http", "127.0.0.1:0"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, cwd=str(REPO),
            env=dict(os.environ, PYTHONPATH=str(REPO)))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = stderr_path.read_text(errors="replace")
        endpoint, metrics = re.search(r"MCP endpoint (http://\S+)", text), re.search(r"metrics (http://\S+)", text)
        if endpoint and metrics:
            return HttpDaemon(proc, endpoint.group(1), metrics.group(1), LogWatch(stderr_path))
        if proc.poll() is not None:
            raise RuntimeError(f"toolcell serve exited early:\n{text}")
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"toolcell serve did not start:\n{stderr_path.read_text(errors='replace')}")


def metric(exposition: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text exposition (None if absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in exposition.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key == (f"{name}{{{want}}}" if want else name):
            return float(value)
    return None
