"""File watching keeps working when a watched plugins folder is removed and made again, replaced by a
rename (a deploy that swaps folders, ``git checkout``, rsync), or is missing when the daemon starts.
Seen by the official SDK client over stdio: one ``list_changed`` per effective change, the right tools."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from reload_harness import REPO, WAIT_S, Counter, write_plugin


@asynccontextmanager
async def sdk_client(plugins: Path, errlog: Path) -> AsyncIterator[tuple[ClientSession, Counter]]:
    seen = Counter()
    params = StdioServerParameters(command=sys.executable, cwd=str(REPO),
                                   args=["-m", "runtime.cli", "serve", "--stdio", "--policy", "none",
                                         "--plugins", str(plugins)])
    with open(errlog, "w") as err:  # noqa: ASYNC230 (a local file, before anything runs)
        async with stdio_client(params, errlog=err) as (read, write), \
                ClientSession(read, write, message_handler=seen.handler) as session:
            with trio.fail_after(WAIT_S):
                await session.initialize()
            yield session, seen


async def names(session: ClientSession) -> list[str]:
    with trio.fail_after(WAIT_S):
        return [t.name for t in (await session.list_tools()).tools]


async def tools_become(session: ClientSession, seen: Counter, count: int, expected: list[str]) -> None:
    await seen.reaches(count)
    assert await names(session) == expected


def replace_by_rename(plugins: Path, build: Callable[[Path], None]) -> None:
    staged = plugins.with_name(plugins.name + ".new")
    build(staged)
    old = plugins.with_name(plugins.name + ".old")
    os.rename(plugins, old)
    os.rename(staged, plugins)
    shutil.rmtree(old)


async def test_watching_survives_the_folder_removed_made_again_and_swapped(tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    write_plugin(plugins, "alpha", {"a1": "one"})
    async with sdk_client(plugins, tmp_path / "err.log") as (session, seen):
        assert await names(session) == ["a1"]

        shutil.rmtree(plugins)  # removed: the tools go
        await tools_become(session, seen, 1, [])
        write_plugin(plugins, "beta", {"b1": "bee"})  # made again
        await tools_become(session, seen, 2, ["b1"])
        write_plugin(plugins, "gamma", {"g1": "gee"})  # an edit inside the new folder is seen
        await tools_become(session, seen, 3, ["b1", "g1"])

        replace_by_rename(plugins, lambda p: write_plugin(p, "delta", {"d1": "dee"}))  # swapped
        await tools_become(session, seen, 4, ["d1"])
        write_plugin(plugins, "eps", {"e1": "eee"})  # and still watched after the swap
        await tools_become(session, seen, 5, ["d1", "e1"])


async def test_a_folder_missing_at_start_is_watched_for(tmp_path: Path) -> None:
    plugins = tmp_path / "later" / "plugins"
    async with sdk_client(plugins, tmp_path / "err.log") as (session, seen):
        assert await names(session) == []
        write_plugin(plugins, "alpha", {"a1": "one"})
        await tools_become(session, seen, 1, ["a1"])
        write_plugin(plugins, "beta", {"b1": "bee"})
        await tools_become(session, seen, 2, ["a1", "b1"])
    assert "plugin_dir_missing" in (tmp_path / "err.log").read_text()


def test_without_watchfiles_the_daemon_and_doctor_say_so_loudly(tmp_path: Path) -> None:
    """A machine where watchfiles cannot be imported (simulated by a module that refuses to load)."""
    import subprocess

    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "watchfiles.py").write_text("raise ImportError('blocked for this test')\n")
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    plugins = tmp_path / "plugins"
    write_plugin(plugins, "alpha", {"a1": "one"})
    serve = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--stdio", "--policy", "none",
                            "--plugins", str(plugins)], cwd=str(REPO), env=env, input=b"", capture_output=True,
                           timeout=60, check=False)
    err = serve.stderr.decode()
    assert "watcher_unavailable" in err and "blocked for this test" in err and "pip install watchfiles" in err
    doctor = subprocess.run([sys.executable, "-m", "runtime.cli", "doctor"], cwd=str(REPO), env=env,
                            capture_output=True, text=True, timeout=120, check=False)
    assert "File watching (hot reload): UNAVAILABLE" in doctor.stdout, doctor.stdout
