"""Real MCP servers from the registries, hosted in the sandbox and driven with the official SDK client.

``@modelcontextprotocol/server-everything`` and ``server-filesystem`` come from npm (``npm ci``
installs them from ``package.json``); ``mcp-server-time`` and ``mcp-server-fetch`` are installed by
toolcell itself, through its ``pypi:`` support, into the session's state dir.
"""

from __future__ import annotations

import http.server
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import trio
from conftest import (
    EVERYTHING,
    FETCH_PACKAGE,
    FILESYSTEM,
    NODE,
    NODE_MODULES,
    TIME_PACKAGE,
    connect,
    public,
    text,
    write_config,
)

pytestmark = pytest.mark.filterwarnings("ignore:The logging capability is deprecated")


def everything(make_server: Callable[..., Path], **limits: Any) -> Path:
    return make_server("everything", {"command": [str(NODE), str(EVERYTHING), "stdio"]}, prefix="ev_",
                       permissions={"read": [str(NODE_MODULES)]}, limits=limits or None)


async def test_the_everything_server_lists_and_answers_through_the_sandbox(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    plugins = everything(make_server)
    progress: list[float] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append(value)

    async with connect(plugins, write_config(tmp_path, state_dir), tmp_path / "d.log") as client:
        names = [t.name for t in (await client.list_tools()).tools]
        assert {"ev_echo", "ev_get-sum", "ev_get-structured-content", "ev_trigger-long-running-operation"} <= set(names)
        assert text(await client.call_tool("ev_echo", {"message": "through the sandbox"})) == "Echo: through the sandbox"
        summed = await client.call_tool("ev_get-sum", {"a": 20, "b": 22})
        assert "42" in text(summed) and not summed.is_error
        structured = await client.call_tool("ev_get-structured-content", {"location": "New York"})
        assert structured.structured_content is not None and not structured.is_error
        long = await client.call_tool("ev_trigger-long-running-operation", {"duration": 1, "steps": 3},
                                      progress_callback=on_progress)
        assert not long.is_error, text(long)
        assert progress, "no progress notification was relayed"
        # the server's environment is the manifest's allowlist, not the daemon's
        env = text(await client.call_tool("ev_get-env", {}))
        assert "PYTHONPATH" not in env and "TOOLCELL_WORKER" in env


@pytest.mark.parametrize("policy", ["strict", "none"])
async def test_the_filesystem_server_works_in_its_folder_and_the_sandbox_refuses_the_rest(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path, policy: str) -> None:
    granted = tmp_path / "granted"
    secret_dir = Path(f"/var/tmp/toolcell-fs-secret-{uuid.uuid4().hex}")
    granted.mkdir()
    public(granted)
    # A root daemon's workers run under a uid of their own: the granted folder must let it write.
    granted.chmod(0o777)
    secret_dir.mkdir()
    (secret_dir / "secret.txt").write_text("host secret")
    os.chmod(secret_dir, 0o755)
    os.chmod(secret_dir / "secret.txt", 0o644)
    (granted / "hello.txt").write_text("hello from the granted folder")
    # The server's own arguments allow both folders; the sandbox grants only the first.
    plugins = make_server("files", {"command": [str(NODE), str(FILESYSTEM), str(granted), str(secret_dir)]},
                          prefix="fs_", permissions={"read": [str(NODE_MODULES)], "write": [str(granted)]})
    try:
        async with connect(plugins, write_config(tmp_path, state_dir), tmp_path / "d.log", policy=policy) as client:
            read = await client.call_tool("fs_read_text_file", {"path": str(granted / "hello.txt")})
            assert text(read) == "hello from the granted folder", text(read)
            wrote = await client.call_tool("fs_write_file", {"path": str(granted / "new.txt"), "content": "written"})
            assert not wrote.is_error, text(wrote)
            assert (granted / "new.txt").read_text() == "written"
            stolen = await client.call_tool("fs_read_text_file", {"path": str(secret_dir / "secret.txt")})
            planted = await client.call_tool("fs_write_file", {"path": str(secret_dir / "planted.txt"), "content": "x"})
            if policy == "strict":
                assert stolen.is_error and "host secret" not in text(stolen), text(stolen)
                assert "EACCES" in text(stolen) or "denied" in text(stolen).lower(), text(stolen)
                assert planted.is_error and not (secret_dir / "planted.txt").exists(), text(planted)
            else:
                # The canary: unsandboxed, the server's own checks let both through.
                assert text(stolen) == "host secret", text(stolen)
                assert (secret_dir / "planted.txt").exists()
    finally:
        for f in secret_dir.iterdir():
            f.unlink()
        secret_dir.rmdir()


async def test_the_time_server_is_installed_from_pypi_by_toolcell_and_answers(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    plugins = make_server("time", {"package": TIME_PACKAGE, "args": ["--local-timezone=UTC"]}, prefix="time_")
    async with connect(plugins, write_config(tmp_path, state_dir), tmp_path / "d.log") as client:
        names = {t.name for t in (await client.list_tools()).tools}
        assert {"time_get_current_time", "time_convert_time"} <= names
        now = await client.call_tool("time_get_current_time", {"timezone": "Europe/Paris"})
        assert not now.is_error and "Europe/Paris" in text(now), text(now)
    envs = list((state_dir / "envs").glob("pypi-*/requirements.lock"))
    assert any("mcp-server-time==" in p.read_text() and "--hash=sha256:" in p.read_text() for p in envs)


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = f"<html><body><p>page served on port {self.server.server_address[1]}</p></body></html>".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def two_sites() -> Iterator[tuple[int, int]]:
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page) for _ in range(2)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for t in threads:
        t.start()
    yield servers[0].server_address[1], servers[1].server_address[1]
    for s in servers:
        s.shutdown()
        s.server_close()


async def test_the_fetch_server_reaches_its_granted_site_through_the_proxy_and_nothing_else(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path, two_sites: tuple[int, int]) -> None:
    granted, other = two_sites
    plugins = make_server("fetch", {"package": FETCH_PACKAGE, "args": ["--ignore-robots-txt", "--allow-private-ips"]},
                          permissions={"network": [f"127.0.0.1:{granted}"]})
    log = tmp_path / "d.log"
    async with connect(plugins, write_config(tmp_path, state_dir), log) as client:
        # raw: its HTML simplification runs a Node helper (readabilipy) that its wheel does not ship
        page = await client.call_tool("fetch", {"url": f"http://127.0.0.1:{granted}/", "raw": True})
        assert f"page served on port {granted}" in text(page), text(page)
        refused = await client.call_tool("fetch", {"url": f"http://127.0.0.1:{other}/", "raw": True})
        assert refused.is_error and f"port {other}" not in text(refused), text(refused)
        outside = await client.call_tool("fetch", {"url": "http://pypi.org/", "raw": True})
        assert outside.is_error, text(outside)
    events = log.read_text()
    assert '"event":"egress"' in events and '"outcome":"refused"' in events


async def test_a_server_killed_mid_call_fails_that_call_clearly_and_comes_back(
        make_server: Callable[..., Path], state_dir: Path, tmp_path: Path) -> None:
    plugins = everything(make_server)
    log = tmp_path / "d.log"
    async with connect(plugins, write_config(tmp_path, state_dir), log) as client:
        assert text(await client.call_tool("ev_echo", {"message": "before"})) == "Echo: before"
        box: dict[str, Any] = {}

        async def long_call() -> None:
            box["result"] = await client.call_tool("ev_trigger-long-running-operation", {"duration": 30, "steps": 30})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_call)
            victim = None
            with trio.fail_after(20):
                while victim is None:
                    await trio.sleep(0.1)
                    for proc in psutil.process_iter(["cmdline"]):
                        if str(EVERYTHING) in " ".join(proc.info["cmdline"] or []):
                            victim = proc
            await trio.sleep(0.5)
            victim.kill()
        result = box["result"]
        assert result.is_error and "killed by SIGKILL" in text(result), text(result)
        with trio.fail_after(30):
            while True:
                again = await client.call_tool("ev_echo", {"message": "after"})
                if not again.is_error:
                    break
                await trio.sleep(0.2)
        assert text(again) == "Echo: after"
    assert "hosted_server_exited" in log.read_text()
