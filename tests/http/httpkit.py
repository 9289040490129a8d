"""Raw HTTP helpers for the transport tests: request builders for both eras and an SSE parser."""

from __future__ import annotations

import json
from typing import Any

import httpx2

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
ACCEPT_BOTH = "application/json, text/event-stream"


def meta(**extra: Any) -> dict[str, Any]:
    return {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": {},
            **extra}


def modern_headers(method: str, name: str | None = None, token: str | None = None, **extra: str | None) -> dict[str, str]:
    h: dict[str, Any] = {"content-type": "application/json", "accept": ACCEPT_BOTH, "mcp-protocol-version": MODERN,
                         "mcp-method": method}
    if name is not None:
        h["mcp-name"] = name
    if token is not None:
        h["authorization"] = f"Bearer {token}"
    for key, value in extra.items():
        h[key.replace("_", "-")] = value
    return {k: v for k, v in h.items() if v is not None}


def modern_body(method: str, params: dict[str, Any] | None = None, id: Any = 1, **meta_extra: Any) -> bytes:
    params = dict(params or {})
    params["_meta"] = meta(**meta_extra)
    return json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode()


def modern_post(client: httpx2.Client, url: str, method: str, params: dict[str, Any] | None = None, *,
                token: str | None = None, id: Any = 1, headers: dict[str, str | None] | None = None,
                meta_extra: dict[str, Any] | None = None) -> httpx2.Response:
    name = (params or {}).get("name") if method == "tools/call" else None
    h = modern_headers(method, name, token)
    for key, value in (headers or {}).items():
        if value is None:
            h.pop(key, None)
        else:
            h[key] = value
    return client.post(url, content=modern_body(method, params, id, **(meta_extra or {})), headers=h)


def legacy_headers(token: str | None = None, session: str | None = None, version: str | None = LEGACY,
                   accept: str = ACCEPT_BOTH) -> dict[str, str]:
    h = {"content-type": "application/json", "accept": accept}
    if token is not None:
        h["authorization"] = f"Bearer {token}"
    if session is not None:
        h["mcp-session-id"] = session
    if version is not None:
        h["mcp-protocol-version"] = version
    return h


def initialize(client: httpx2.Client, url: str, token: str | None = None, version: str = LEGACY) -> str:
    body = {"jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    r = client.post(url, json=body, headers=legacy_headers(token, version=None))
    assert r.status_code == 200, r.text
    sid = r.headers["mcp-session-id"]
    r2 = client.post(url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                     headers=legacy_headers(token, sid, version))
    assert r2.status_code == 202
    return sid


def rpc(method: str, params: dict[str, Any] | None = None, id: Any = 1) -> dict[str, Any]:
    msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if id is not None:
        msg["id"] = id
    if params is not None:
        msg["params"] = params
    return msg


def sse_messages(text: str) -> list[dict[str, Any]]:
    """JSON-RPC messages of an SSE body (``data:`` lines; comments and other fields ignored)."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].lstrip() for line in block.split("\n") if line.startswith("data:")]
        if data and "".join(data):
            out.append(json.loads("\n".join(data)))
    return out


def messages(response: httpx2.Response) -> list[dict[str, Any]]:
    """Every JSON-RPC message of a response, whether it came as JSON or SSE."""
    ctype = response.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        return sse_messages(response.text)
    return [response.json()]
