"""The attack suite of the files a plugin folder holds, against a real ``toolcell serve --http``.

Whoever can write a plugin folder chooses what every name in it is. Here each file the daemon reads
from a plugin folder (``tests/hostile_files.py``: the manifest, a plugin's and a PyPI server's
``requirements.lock``, an npm server's ``package-lock.json``, a server's script) is dropped into the
watched folder as a FIFO, a link out of the folder to a secret, a link inside it, a link to a
device, a device node, a directory, a huge file, an empty one and one that is not UTF-8. The hot
reload that follows must refuse each of those plugins with a reason naming what its file is, while
a client of the plugin that was already there keeps being answered (a FIFO used to block the event
loop until someone opened it: no client was answered), and the secret must appear nowhere the
daemon writes (a link to ``/etc/shadow`` used to be read as root and its first line quoted in the
``plugin_refused`` log line and in ``toolcell list``). Nothing is installed: each is refused first.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from hostile_files import SECRET, build
from mcp import types
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from reload_harness import WAIT_S, start_http_daemon, write_plugin


@asynccontextmanager
async def session(url: str) -> AsyncIterator[ClientSession]:
    async with streamable_http_client(url) as (read, write), ClientSession(read, write) as s:
        with trio.fail_after(WAIT_S):
            await s.initialize()
        yield s


async def ping(s: ClientSession) -> str:
    with trio.fail_after(WAIT_S):  # a frozen event loop answers nothing: this is what fails
        result = await s.call_tool("ping", {})
    content = result.content[0]
    assert isinstance(content, types.TextContent)
    return content.text


async def test_hostile_files_dropped_into_a_watched_folder_are_refused_while_the_daemon_keeps_answering(
        tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    write_plugin(plugins, "good", {"ping": "pong"})
    daemon = start_http_daemon(tmp_path, plugins)
    try:
        async with session(daemon.url) as s:
            assert await ping(s) == "pong"
            staging = tmp_path / "staging"
            expected = build(staging, tmp_path / "secret.txt")
            for name in expected:  # each folder appears whole, as a clone or an unpacked archive would
                os.rename(staging / name, plugins / name)
            refused: dict[str, list[str]] = {}
            with trio.fail_after(WAIT_S * 3):
                while set(refused) != set(expected):
                    assert await ping(s) == "pong"  # answered all along, FIFOs never opened by anyone
                    await trio.sleep(0.05)
                    refused = {e["plugin"]: e["problems"] for e in daemon.logs.events("plugin_refused")}
            assert await ping(s) == "pong"
    finally:
        daemon.stop()
    for name, says in expected.items():
        reasons = " ".join(refused[name])
        assert says is None or says in reasons, (name, refused[name])
    log = daemon.logs.path.read_text(errors="replace")
    assert SECRET not in log
    assert not daemon.logs.events("internal_error")
