"""Helpers for the tests of tools that ask: an in-process daemon on HTTP (its internals reachable:
``daemon.mrtr``), raw 2026-07-28 requests over httpx, the capabilities a client declares."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import trio

MODERN = "2026-07-28"
ALL_CAPS: dict[str, Any] = {"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {}}
WAIT_S = 30.0


@dataclass
class Served:
    daemon: Any
    url: str


@asynccontextmanager
async def serve_http(plugins: Path | list[Path], state_dir: Path, **config: Any) -> AsyncIterator[Served]:
    """A daemon (real worker processes, policy none unless given) with an HTTP listener on 127.0.0.1,
    in this trio run. ``config``: fields of ``runtime.config.Config`` (state_key_file, max_parked_calls, ...)."""
    from runtime.config import Config
    from runtime.daemon import open_daemon
    from runtime.http_config import HttpConfig
    from runtime.transports.listeners import serve_http as listen_http

    http = HttpConfig(**config.pop("http", {}))
    settings: dict[str, Any] = {"policy": "none", "min_workers": 1, "watch": False}
    settings.update(config)
    folders = plugins if isinstance(plugins, list) else [plugins]
    cfg = Config(plugins=[str(p) for p in folders], state_dir=str(state_dir), http=http, **settings)
    async with open_daemon(cfg) as daemon, trio.open_nursery() as nursery:
        shutdown = trio.Event()
        urls = await nursery.start(partial(listen_http, daemon, http, listen=("127.0.0.1", 0), shutdown=shutdown))
        try:
            yield Served(daemon, urls[0])
        finally:
            shutdown.set()


async def poll_until(predicate: Any, within_s: float = 20.0) -> None:
    """Wait (bounded) until ``predicate()`` holds, for state that has no event to wait on."""
    with trio.fail_after(within_s):
        while True:
            if predicate():
                return
            await trio.sleep(0.02)


def meta(caps: dict[str, Any] | None) -> dict[str, Any]:
    return {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": {} if caps is None else caps}


def call_params(name: str, arguments: dict[str, Any] | None = None, *, caps: dict[str, Any] | None = None,
                responses: Any = None, state: Any = None) -> dict[str, Any]:
    """``tools/call`` params of a 2026-07-28 request (and of its retry: ``responses``, ``state``)."""
    params: dict[str, Any] = {"name": name, "arguments": arguments or {}, "_meta": meta(caps)}
    if responses is not None:
        params["inputResponses"] = responses
    if state is not None:
        params["requestState"] = state
    return params


class ModernHttp:
    """Raw 2026-07-28 ``tools/call`` requests (each a stateless POST) to one endpoint."""

    def __init__(self, client: httpx2.AsyncClient, url: str) -> None:
        self.client = client
        self.url = url
        self._next_id = 0

    async def call(self, name: str, arguments: dict[str, Any] | None = None, *, caps: dict[str, Any] | None = None,
                   responses: Any = None, state: Any = None, id: Any = None) -> tuple[int, dict[str, Any]]:
        """(HTTP status, the JSON-RPC response)."""
        self._next_id += 1
        request_id = self._next_id if id is None else id
        body = {"jsonrpc": "2.0", "id": request_id, "method": "tools/call",
                "params": call_params(name, arguments, caps=caps, responses=responses, state=state)}
        headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
                   "mcp-protocol-version": MODERN, "mcp-method": "tools/call", "mcp-name": name}
        with trio.fail_after(WAIT_S):
            r = await self.client.post(self.url, content=json.dumps(body).encode(), headers=headers)
        message = r.json()
        assert message["id"] == request_id, message
        return r.status_code, message


@asynccontextmanager
async def modern_http(url: str) -> AsyncIterator[ModernHttp]:
    async with httpx2.AsyncClient(timeout=WAIT_S) as client:
        yield ModernHttp(client, url)


def result_text(message: dict[str, Any]) -> str:
    result = message["result"]
    assert result.get("resultType", "complete") == "complete", message
    return " ".join(c.get("text", "") for c in result["content"] if c.get("type") == "text")


def starts_marker(tmp_path: Path) -> Path:
    """An empty file a sandboxed tool may append its starts to (``starts`` reads them back)."""
    marker = tmp_path / "starts"
    marker.touch()
    marker.chmod(0o666)  # the sandboxed worker may run as another user
    return marker


def starts(marker: Path) -> list[int]:
    """The pids that started a tool which records its starts in ``marker`` (one line each)."""
    try:
        return [int(line) for line in marker.read_text().split()]
    except FileNotFoundError:
        return []


NAME = {"action": "accept", "content": {"name": "Ann"}}
HELLO = {"role": "assistant", "content": {"type": "text", "text": "hello Ann"}, "model": "test-model"}
ROOTS = {"roots": [{"uri": "file:///work", "name": "work"}]}
