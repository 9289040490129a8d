"""HTTP transport test harness: small test plugins and a real ``toolcell serve --http`` subprocess.

One locked-down server (tokens with scopes, rate limits, small caps, audit log, metrics) is
started once and shared by the tests; tests that need the daemon's internals start
one in-process instead (``open_http``).
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[2]

ALPHA = '''
import os
import time

from sandbox import current, tool


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@tool
def sleep(seconds: float, marker: str = "") -> str:
    """Sleep, after writing this worker's pid to ``marker`` (if given).

    Args:
        seconds: How long to sleep.
        marker: A file to write the pid to.
    """
    if marker:
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
    time.sleep(seconds)
    return "slept"


@tool
def progress(steps: int = 3) -> str:
    """Report progress ``steps`` times, then finish."""
    ctx = current()
    for i in range(steps):
        ctx.progress(i + 1, steps, f"step {i + 1}")
        time.sleep(0.02)
    return "done"


@tool
def chatty() -> str:
    """Log one message at info level, then finish."""
    current().log("info", "hello from chatty")
    time.sleep(0.05)
    return "chatted"


@tool(description="Route by region (mirrored in Mcp-Param headers)", input_schema={
    "type": "object",
    "properties": {
        "region": {"type": "string", "x-mcp-header": "Region"},
        "count": {"type": "integer", "minimum": 0, "maximum": 1000, "x-mcp-header": "Count"},
        "dry": {"type": "boolean", "x-mcp-header": "Dry"},
    },
    "required": ["region"],
})
def routed(region: str, count: int = 0, dry: bool = False) -> str:
    return f"{region}:{count}:{dry}"
'''

BETA = '''
from sandbox import tool


@tool
def secret() -> str:
    """Only for principals whose scopes include the beta plugin."""
    return "beta secret"


@tool
def limited() -> str:
    """A tool with its own tight rate limit."""
    return "ok"
'''

TOKENS = {"full": "tok-full-0123456789", "alpha": "tok-alpha-0123456789", "slow": "tok-slow-0123456789"}


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def write_plugin(root: Path, name: str, code: str, prefix: str) -> None:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plugin.toml").write_text(
        f'name = "{name}"\nversion = "0.1.0"\nentry = "{name}"\nprefix = "{prefix}"\n'
        f'description = "test plugin {name}"\n\n[limits]\ntimeout_s = 20\nmax_concurrency = 4\n')
    (folder / f"{name}.py").write_text(textwrap.dedent(code))
    for path in (root, folder):
        path.chmod(0o755)


def make_plugins(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    root.parent.chmod(0o755)
    write_plugin(root, "alpha", ALPHA, "a_")
    write_plugin(root, "beta", BETA, "b_")
    return root


LOCKED_CONFIG = f'''
policy = "none"
min_workers = 1

[http]
max_body_bytes = 65536
max_header_bytes = 4096
body_timeout_s = 1.0
tool_rates = {{ "b_limited" = {{ per_s = 0.01, burst = 2 }} }}
metrics_listen = "127.0.0.1:0"
audit_log = "AUDIT_PATH"
allowed_origins = ["https://app.example.com"]

[[http.tokens]]
principal = "full"
sha256 = "{sha(TOKENS["full"])}"

[[http.tokens]]
principal = "alpha-only"
sha256 = "{sha(TOKENS["alpha"])}"
scopes = ["plugin:alpha"]

[[http.tokens]]
principal = "slow"
sha256 = "{sha(TOKENS["slow"])}"
rate = {{ per_s = 0.01, burst = 3 }}
'''


@dataclass
class ServerProcess:
    proc: subprocess.Popen[str]
    url: str
    metrics_url: str
    audit_path: Path
    stderr_path: Path
    plugins: Path
    base: str = field(init=False)

    def __post_init__(self) -> None:
        self.base = self.url.rsplit("/", 1)[0]


def start_server(tmp: Path, config_text: str, *extra: str) -> ServerProcess:
    plugins = make_plugins(tmp / "plugins")
    audit = tmp / "audit.jsonl"
    config = tmp / "toolcell.toml"
    config.write_text(config_text.replace("AUDIT_PATH", str(audit)))
    stderr_path = tmp / "stderr.log"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # The child keeps its own copy of the descriptor: ours is closed as soon as it is started.
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "serve", "--config", str(config), "--plugins", str(plugins),
             "--http", "127.0.0.1:0", *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
            text=True, env=env,
            cwd=str(REPO))
    deadline = time.monotonic() + 60
    url = metrics = ""
    while time.monotonic() < deadline:
        text = stderr_path.read_text()
        m = re.search(r"MCP endpoint (http://\S+)", text)
        mm = re.search(r"metrics (http://\S+)", text)
        if m and (mm or "metrics_listen" not in config_text):
            url, metrics = m.group(1), mm.group(1) if mm else ""
            break
        if proc.poll() is not None:
            raise RuntimeError(f"toolcell serve exited early:\n{text}")
        time.sleep(0.1)
    else:
        proc.kill()
        proc.wait(timeout=10)
        raise RuntimeError(f"toolcell serve did not start:\n{stderr_path.read_text()}")
    return ServerProcess(proc, url, metrics, audit, stderr_path, plugins)


def stop_server(server: ServerProcess) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(timeout=10)


# -- in-process -------------------------------------------------------------------------------


@dataclass
class InProcess:
    daemon: Any
    url: str
    shutdown: trio.Event
    app: Any = None


async def drop_plugin(daemon: Any, name: str) -> None:
    """Unload plugin ``name`` the way a reload does: publish the smaller catalog, then retire its pool."""
    key = next(k for k, p in daemon.plugins.items() if p.name == name)
    plugin = daemon.plugins.pop(key)
    assert daemon.publish()
    if plugin.pool is not None:
        await plugin.pool.aclose()


@asynccontextmanager
async def open_http(plugins: Path, state_dir: Path, **http: Any) -> AsyncIterator[InProcess]:
    """A daemon with an HTTP listener on 127.0.0.1 (ephemeral port), in this trio run."""
    from runtime.config import Config
    from runtime.daemon import open_daemon
    from runtime.http_config import HttpConfig
    from runtime.transports.listeners import serve_http

    hcfg = HttpConfig(**http)
    cfg = Config(plugins=[str(plugins)], policy="none", min_workers=1, state_dir=str(state_dir), http=hcfg)
    async with open_daemon(cfg) as daemon, trio.open_nursery() as nursery:
        shutdown = trio.Event()
        apps: list[Any] = []
        urls = await nursery.start(partial(serve_http, daemon, hcfg, listen=("127.0.0.1", 0), shutdown=shutdown,
                                           on_app=apps.append))
        try:
            yield InProcess(daemon, urls[0], shutdown, apps[0])
        finally:
            shutdown.set()
