"""Harness of the replica tests: real components on loopback, started by the tests.

* one ``redis-server`` (a unix socket of its own; it can be restarted on the same socket);
* N ``toolcell serve --http`` replicas, each with its own config file and state dir, sharing only
  what an operator hands every replica: the Redis URL, the ``requestState`` key file, the bearer
  tokens and the plugin folders (never a shared state dir);
* Debian's ``haproxy`` running ``deploy/haproxy/haproxy.cfg`` as shipped, its ``server`` lines
  written for the replicas started (the same form as the shipped ones).

A machine where ``tests/system-packages.sh`` ran has haproxy and redis-server: a test that cannot
start them fails (``pytest.fail``), it never skips. Every wait is bounded; nothing asserts on time.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import pytest
import redis
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tasks"))
from task_e2e import (  # noqa: E402
    REPO,
    TOKENS,
    WAIT_S,
    HttpDaemon,
    read_text,
    sha,
    start_http,
    until,
)
from stdio_peer import kill_process_tree  # noqa: E402

HAPROXY_CFG = REPO / "deploy" / "haproxy" / "haproxy.cfg"
#: The shipped config's server lines (one per replica), replaced by one line per replica started.
_SERVER_LINE = re.compile(r'^    server replica(\d+) "\$\{TOOLCELL_REPLICA_\1\}" check\n', re.MULTILINE)


def _binary(name: str) -> str:
    found = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.path.exists(p)), None)
    if found is None:
        pytest.fail(f"{name} is not installed; `sh tests/system-packages.sh` installs it (the README's test command)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def haproxy_config(replicas: int) -> str:
    """The shipped config with one ``server`` line per replica (``TOOLCELL_REPLICA_<i>``)."""
    text = HAPROXY_CFG.read_text()
    lines = _SERVER_LINE.findall(text)
    assert lines == ["1", "2", "3"], "deploy/haproxy/haproxy.cfg lost its server lines"
    servers = "".join(f'    server replica{i} "${{TOOLCELL_REPLICA_{i}}}" check\n' for i in range(1, replicas + 1))
    first = _SERVER_LINE.search(text)
    assert first is not None
    return text[:first.start()] + servers + _SERVER_LINE.sub("", text[first.start():])


class Redis:
    """A redis-server on a unix socket of its own, restartable on the same socket."""

    def __init__(self, folder: Path, *, persist: bool = False) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        #: ``appendonly yes``: what Redis holds survives its restart (as the README tells operators).
        self.persist = persist
        self.socket = folder / "redis.sock"
        self.log = folder / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [_binary("redis-server"), "--port", "0", "--unixsocket", str(self.socket), "--unixsocketperm", "700",
             "--save", "", "--appendonly", "yes" if self.persist else "no", "--dir", str(self.folder), "--logfile", str(self.log),
             "--daemonize", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                redis.Redis(unix_socket_path=str(self.socket), socket_timeout=2).ping()
                return
            except (redis.exceptions.ConnectionError, FileNotFoundError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"redis-server did not start: {read_text(self.log)[-2000:]}")
                time.sleep(0.05)

    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def write_replica_config(folder: Path, *, redis_url: str, key_file: Path, drain_s: float = 2.5,
                         heartbeat_s: float = 0.5, orphan_after_s: float = 1.5,
                         approvals_key_file: Path | None = None) -> Path:
    """A replica's own config file: its own state dir; the shared Redis URL, key file and tokens (and,
    with ``approvals_key_file``, approvals kept in that Redis, signed with that key)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = ['policy = "none"', "min_workers = 1", "watch = false", f'state_dir = "{folder / "state"}"',
             f'state_key_file = "{key_file}"', "[http]", f"drain_s = {drain_s}", "shutdown_grace_s = 5",
             'metrics_listen = "127.0.0.1:0"',
             "[tasks]", f'store = "{redis_url}"', f"heartbeat_s = {heartbeat_s}", f"orphan_after_s = {orphan_after_s}"]
    if approvals_key_file is not None:
        lines += ["[approvals]", f'store = "{redis_url}"', f'key_file = "{approvals_key_file}"', "poll_s = 0.3"]
    for principal, token in TOKENS.items():
        lines += ["[[http.tokens]]", f'principal = "{principal}"', f'sha256 = "{sha(token)}"']
    path = folder / "toolcell.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@dataclass
class Cluster:
    """N replicas behind HAProxy, one Redis; ``url`` is the balancer's MCP endpoint."""

    folder: Path
    redis: Redis
    replicas: list[HttpDaemon]
    haproxy: subprocess.Popen[bytes]
    url: str
    plugins: tuple[Path, ...]
    by_name: dict[str, HttpDaemon] = field(default_factory=dict)

    def replica(self, name: str) -> HttpDaemon:
        """The replica HAProxy calls ``name`` (its ``x-toolcell-replica`` response header)."""
        return self.by_name[name]

    def name_of(self, daemon: HttpDaemon) -> str:
        return next(n for n, d in self.by_name.items() if d is daemon)

    def healthz_url(self, daemon: HttpDaemon) -> str:
        return daemon.url.rsplit("/", 1)[0] + "/healthz"

    def metrics_url(self, daemon: HttpDaemon) -> str:
        found = re.search(r"toolcell: metrics (http://\S+)", read_text(daemon.log))
        assert found is not None, read_text(daemon.log)[-2000:]
        return found.group(1)

    async def healthz(self, client: httpx2.AsyncClient, daemon: HttpDaemon) -> tuple[int, dict[str, Any]]:
        with trio.fail_after(WAIT_S):
            # The details (catalog, catalog_differs, counts) are for a client with a token.
            r = await client.get(self.healthz_url(daemon),
                                 headers={"authorization": f"Bearer {next(iter(TOKENS.values()))}"})
        return r.status_code, r.json()


async def start_haproxy(folder: Path, replicas: list[HttpDaemon]) -> tuple[subprocess.Popen[bytes], str]:
    """HAProxy with the shipped config for ``replicas``; returns it and its MCP endpoint."""
    port = free_port()
    cfg = folder / "haproxy.cfg"
    cfg.write_text(haproxy_config(len(replicas)))
    env = {**os.environ, "TOOLCELL_BALANCER_LISTEN": f"127.0.0.1:{port}"}
    for i, daemon in enumerate(replicas, 1):
        env[f"TOOLCELL_REPLICA_{i}"] = daemon.url.split("//", 1)[1].split("/", 1)[0]
    log = folder / "haproxy.log"
    with open(log, "wb") as errfile:
        proc = subprocess.Popen([_binary("haproxy"), "-db", "-f", str(cfg)], stdin=subprocess.DEVNULL,
                                stdout=errfile, stderr=errfile, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/mcp"
    async with httpx2.AsyncClient(timeout=5) as client:
        async def up() -> int:
            if proc.poll() is not None:
                pytest.fail(f"haproxy did not start:\n{read_text(log)[-3000:]}")
            try:
                return (await client.get(f"http://127.0.0.1:{port}/healthz")).status_code
            except httpx2.TransportError:
                return 0

        try:
            await until(up, lambda status: status == 200, 30)
        except BaseException:
            stop_process(proc)
            raise
    return proc, url


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def approvals_key(folder: Path) -> Path:
    """The approvals key an operator hands every replica (and wherever ``toolcell approve`` runs)."""
    key_file = folder / "approvals.key"
    if not key_file.exists():
        key_file.write_bytes(os.urandom(32))
        key_file.chmod(0o600)
    return key_file


@asynccontextmanager
async def open_cluster(folder: Path, *plugins: Path, replicas: int = 3, persist_redis: bool = False,
                       shared_approvals: bool = False, **config: Any) -> AsyncIterator[Cluster]:
    """Redis, ``replicas`` toolcell daemons (started together) and HAProxy in front of them.
    ``shared_approvals``: approvals in the Redis (``[approvals]``), signed with ``approvals_key(folder)``."""
    folder.mkdir(parents=True, exist_ok=True)
    store = Redis(folder / "redis", persist=persist_redis)
    key_file = folder / "request-state.key"
    key_file.write_bytes(os.urandom(32).hex().encode())
    key_file.chmod(0o600)
    if shared_approvals:
        config["approvals_key_file"] = approvals_key(folder)
    daemons: list[HttpDaemon | None] = [None] * replicas
    haproxy: subprocess.Popen[bytes] | None = None
    try:
        async def start(i: int) -> None:
            config_path = write_replica_config(folder / f"replica{i + 1}", redis_url=store.url(), key_file=key_file,
                                               **config)
            daemons[i] = await start_http(config_path, *plugins, log=folder / f"replica{i + 1}.log")

        async with trio.open_nursery() as nursery:
            for i in range(replicas):
                nursery.start_soon(start, i)
        started = [d for d in daemons if d is not None]
        haproxy, url = await start_haproxy(folder, started)
        cluster = Cluster(folder, store, started, haproxy, url, plugins,
                          {f"replica{i}": d for i, d in enumerate(started, 1)})
        yield cluster
    finally:
        if haproxy is not None:
            stop_process(haproxy)
        for daemon in daemons:
            if daemon is not None and daemon.proc.poll() is None:
                kill_process_tree(daemon.pid)
                with trio.move_on_after(WAIT_S):
                    await daemon.proc.wait()
        store.stop()


def config_of(cluster: Cluster, name: str) -> Path:
    """The config file of replica ``name`` (what an operator on that box runs ``toolcell`` with)."""
    return cluster.folder / name / "toolcell.toml"


def sigterm(daemon: HttpDaemon) -> None:
    os.kill(daemon.pid, signal.SIGTERM)


def sighup(daemon: HttpDaemon) -> None:
    os.kill(daemon.pid, signal.SIGHUP)
