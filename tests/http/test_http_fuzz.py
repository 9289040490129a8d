"""Fuzz of the HTTP front end: random requests of both eras, legacy batches and garbage. Every request
with an id gets exactly one well-formed answer carrying that id; nothing takes the daemon down."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx2
from http_harness import make_plugins, open_http
from httpkit import ACCEPT_BOTH, modern_body, modern_headers


def answers_in(response: httpx2.Response) -> list[dict[str, Any]]:
    """The JSON-RPC messages of a response, JSON or SSE (notifications left out)."""
    if response.status_code == 202 or not response.content:
        return []
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        out = []
        for block in response.text.split("\n\n"):
            data = "".join(line[5:].strip() for line in block.splitlines() if line.startswith("data:"))
            if data:
                out.append(json.loads(data))
        messages = out
    else:
        body = response.json()
        messages = body if isinstance(body, list) else [body]
    return [m for m in messages if "method" not in m]


async def test_fuzz_every_http_request_with_an_id_gets_exactly_one_answer(tmp_path: Path) -> None:
    rng = random.Random(1124)
    plugins = make_plugins(tmp_path / "plugins")
    async with open_http(plugins, tmp_path / "state") as srv:
        async with httpx2.AsyncClient(timeout=20) as client:
            init = await client.post(srv.url, json={"jsonrpc": "2.0", "id": "init", "method": "initialize", "params": {
                "protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "f", "version": "1"}}},
                headers={"accept": ACCEPT_BOTH})
            sid = init.headers["mcp-session-id"]
            legacy = {"accept": ACCEPT_BOTH, "content-type": "application/json", "mcp-session-id": sid,
                      "mcp-protocol-version": "2025-03-26"}
            for n in range(120):
                rid = f"q{n}"
                kind = rng.choice(["modern_call", "modern_list", "modern_bad", "legacy_call", "legacy_unknown",
                                   "batch", "garbage", "deep"])
                expected: list[str] = [rid]
                if kind == "modern_call":
                    r = await client.post(srv.url, content=modern_body(
                        "tools/call", {"name": "a_echo", "arguments": {"text": rid}}, id=rid),
                        headers=modern_headers("tools/call", "a_echo"))
                elif kind == "modern_list":
                    r = await client.post(srv.url, content=modern_body("tools/list", id=rid),
                                          headers=modern_headers("tools/list"))
                elif kind == "modern_bad":
                    r = await client.post(srv.url, content=modern_body("tools/call", {"name": 7}, id=rid),
                                          headers=modern_headers("tools/call"))
                elif kind == "legacy_call":
                    r = await client.post(srv.url, json={"jsonrpc": "2.0", "id": rid, "method": "tools/call",
                                                         "params": {"name": "a_echo", "arguments": {"text": rid}}},
                                          headers=legacy)
                elif kind == "legacy_unknown":
                    r = await client.post(srv.url, json={"jsonrpc": "2.0", "id": rid, "method": "no/such"},
                                          headers=legacy)
                elif kind == "batch":
                    members = [{"jsonrpc": "2.0", "id": f"{rid}.{k}", "method": rng.choice(["ping", "tools/list"])}
                               for k in range(rng.randint(1, 4))]
                    members.append({"jsonrpc": "2.0", "method": "notifications/initialized"})
                    expected = [m["id"] for m in members if "id" in m]
                    r = await client.post(srv.url, json=members, headers=legacy)
                elif kind == "garbage":
                    body = rng.choice([b"{", b"[]", b"\xff\xfe", b"null", b'{"id": 1', bytes(rng.randrange(256)
                                                                                             for _ in range(40))])
                    r = await client.post(srv.url, content=body, headers=legacy)
                    assert r.status_code in (400, 404, 415), (body, r.status_code, r.text)
                    continue
                else:
                    deep = {"jsonrpc": "2.0", "id": rid, "method": "tools/call", "params": {"name": "a_echo",
                            "arguments": {"text": "x", "deep": json.loads("[" * 500 + "]" * 500)}}}
                    r = await client.post(srv.url, content=json.dumps(deep).encode(), headers=legacy)
                got = [m.get("id") for m in answers_in(r)]
                assert sorted(got) == sorted(expected), (kind, r.status_code, r.text[:300])
            ok = await client.post(srv.url, content=modern_body("tools/call", {"name": "a_echo",
                                                                               "arguments": {"text": "alive"}}),
                                   headers=modern_headers("tools/call", "a_echo"))
            assert ok.json()["result"]["content"][0]["text"] == "alive"
