"""In-process fakes for the sans-io protocol core: catalogs of checked fake tools, message helpers."""

from __future__ import annotations

import json
from typing import Any

from runtime.protocol.core import Batch, Cancel, ClientResponse, ConnState, Core, Listen, Reply, ToolCall
from runtime.protocol.catalog import Catalog, ToolEntry
from runtime.protocol.schemas import check_tool
from sandbox.wire import ToolSpec

MODERN = "2026-07-28"
LEGACY = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
ALL = LEGACY + (MODERN,)
ACTION_TYPES = (Reply, ToolCall, Cancel, Listen, Batch, ClientResponse)

OBJECT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def entry(name: str, *, description: str = "", input_schema: dict[str, Any] | None = None,
          output_schema: dict[str, Any] | None = None, title: str | None = None,
          annotations: dict[str, Any] | None = None, icons: list[dict[str, Any]] | None = None,
          meta: dict[str, Any] | None = None, plugin: str = "fake") -> ToolEntry:
    """A ToolEntry whose definition went through the real checks (``check_tool``)."""
    spec = ToolSpec(name=name, description=description or f"the {name} tool",
                    input_schema=input_schema if input_schema is not None else dict(OBJECT_SCHEMA),
                    output_schema=output_schema, title=title, annotations=annotations, icons=icons, meta=meta)
    checked, problems = check_tool(spec, name)
    assert checked is not None, problems
    return ToolEntry(name, plugin, name, checked)


RICH = entry(
    "rich",
    title="Rich Tool",
    input_schema={"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    output_schema={"type": "object", "properties": {"sum": {"type": "integer"}}, "required": ["sum"]},
    annotations={"readOnlyHint": True, "title": "Rich (annotated)"},
    icons=[{"src": "https://example.com/icon.png", "mimeType": "image/png", "sizes": ["48x48"]}],
    meta={"dev.toolcell/owner": "tests"},
)
PLAIN = entry("plain")
TYPED = entry(
    "typed",
    input_schema={"type": "object", "properties": {"count": {"type": "integer", "minimum": 0},
                                                   "label": {"type": "string"}},
                  "required": ["count"], "additionalProperties": False},
)


def catalog(entries: list[ToolEntry] | None = None, page_size: int = 100, version: int = 1) -> Catalog:
    return Catalog(version, entries if entries is not None else [RICH, PLAIN, TYPED], page_size)


def many(n: int, prefix: str = "tool") -> list[ToolEntry]:
    return [entry(f"{prefix}{i:04d}") for i in range(n)]


def core_for(cat: Catalog | None = None, **kwargs: Any) -> Core:
    fixed = cat if cat is not None else catalog()
    return Core(lambda: fixed, **kwargs)


def msg(method: str, params: Any = None, id: Any = 1) -> bytes:
    obj: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if id is not None:
        obj["id"] = id
    if params is not None:
        obj["params"] = params
    return json.dumps(obj).encode()


def note(method: str, params: Any = None) -> bytes:
    return msg(method, params, id=None)


def modern_meta(version: str = MODERN, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"io.modelcontextprotocol/protocolVersion": version,
                            "io.modelcontextprotocol/clientCapabilities": {}}
    meta.update(extra)
    return meta


def initialized(core: Core, version: str) -> ConnState:
    state = ConnState()
    action = core.receive(state, msg("initialize", {"protocolVersion": version, "capabilities": {},
                                                    "clientInfo": {"name": "t", "version": "0"}}, id=0))
    assert decode(action)["result"]["protocolVersion"] == version
    assert core.receive(state, note("notifications/initialized")) == Reply(None)
    return state


def decode(action: Any) -> Any:
    """The JSON a Reply sends (asserting it is one, with bytes)."""
    assert isinstance(action, Reply), action
    assert action.data is not None, "expected a response, got nothing"
    return json.loads(action.data)


def error_of(action: Any) -> dict[str, Any]:
    body = decode(action)
    assert "error" in body and "result" not in body, body
    return body["error"]


def result_of(action: Any) -> dict[str, Any]:
    body = decode(action)
    assert "result" in body and "error" not in body, body
    return body["result"]


def well_formed(data: bytes) -> list[dict[str, Any]]:
    """Check ``data`` is a JSON-RPC response (or an array of them) and return the objects."""
    assert b"\n" not in data, "a message must fit on one line"
    value = json.loads(data)
    items = value if isinstance(value, list) else [value]
    for item in items:
        assert isinstance(item, dict), item
        assert item.get("jsonrpc") == "2.0", item
        assert ("result" in item) != ("error" in item), item
        if "id" in item:
            assert item["id"] is None or type(item["id"]) in (int, str), item
        if "error" in item:
            err = item["error"]
            assert type(err.get("code")) is int and isinstance(err.get("message"), str), err
        else:
            assert isinstance(item["result"], dict), item
    return items
