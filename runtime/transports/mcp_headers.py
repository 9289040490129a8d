"""2026-07-28 Streamable HTTP request headers checked against the JSON-RPC body. Sans-io.

``MCP-Protocol-Version`` must equal ``_meta["io.modelcontextprotocol/protocolVersion"]``,
``Mcp-Method`` the body's ``method``, ``Mcp-Name`` its ``params.name`` / ``uri`` / ``taskId``,
and every ``Mcp-Param-{Name}`` a tool argument whose schema property carries ``x-mcp-header``.
Values may come as ``=?base64?...?=`` (UTF-8 inside) and are decoded before comparing; integers
compare numerically. Any failure is a ``HeaderMismatch`` (JSON-RPC -32020, HTTP 400).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from typing import Any


from runtime.protocol import eras
from runtime.protocol.errors import HeaderMismatch
from runtime.protocol.catalog import ToolEntry
from runtime.protocol.core import Request

_INT = re.compile(r"-?[0-9]{1,20}")
_NAME_FIELDS = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri",
                "tasks/get": "taskId", "tasks/update": "taskId", "tasks/cancel": "taskId"}



def decode_value(raw: bytes, header: str) -> str:
    """A header value as text: optional whitespace trimmed, the base64 form decoded."""
    text = raw.decode("latin-1").strip(" \t")
    for ch in text:
        if not (" " <= ch <= "~"):
            raise HeaderMismatch(f"{header} contains characters that must be sent base64-encoded (=?base64?...?=)")
    if text.startswith("=?base64?") and text.endswith("?=") and len(text) >= 11:
        try:
            return base64.b64decode(text[9:-2], validate=True).decode("utf-8")
        except (binascii.Error, ValueError):
            raise HeaderMismatch(f"{header} is not valid base64 of UTF-8 text") from None
    return text


def check(req: Request, version: bytes | None, method_header: bytes | None, name_header: bytes | None,
          param_headers: dict[bytes, bytes], lookup: Callable[[str], ToolEntry | None]) -> None:
    """Raise ``HeaderMismatch`` unless the headers agree with the body (read once, by ``Core.parse``)."""
    try:
        _check(req, version, method_header, name_header, param_headers, lookup)
    except HeaderMismatch as exc:
        raise HeaderMismatch(f"Header mismatch: {exc.message}") from None


def _check(req: Request, version: bytes | None, method_header: bytes | None, name_header: bytes | None,
           param_headers: dict[bytes, bytes], lookup: Callable[[str], ToolEntry | None]) -> None:
    method = req.method
    if version is None:
        raise HeaderMismatch("MCP-Protocol-Version header is required")
    body_version = req.meta.get(eras.META_VERSION) if req.meta is not None else None
    if isinstance(body_version, str) and decode_value(version, "MCP-Protocol-Version") != body_version:
        raise HeaderMismatch(f"MCP-Protocol-Version header does not match _meta[{eras.META_VERSION!r}] ({body_version})")
    if method_header is None:
        if req.is_request:
            raise HeaderMismatch("Mcp-Method header is required")
    elif decode_value(method_header, "Mcp-Method") != method:
        raise HeaderMismatch(f"Mcp-Method header does not match the body's method ({method})")
    field = _NAME_FIELDS.get(method)
    expected = req.mirrored(field) if field is not None else None
    if isinstance(expected, str):
        if name_header is None:
            raise HeaderMismatch(f"Mcp-Name header is required for {method}")
        if decode_value(name_header, "Mcp-Name") != expected:
            raise HeaderMismatch(f"Mcp-Name header does not match params.{field}")
    name = req.mirrored("name")
    if method == "tools/call" and isinstance(name, str):
        entry = lookup(name)
        if entry is not None and entry.checked.headers:
            _check_params(entry, req.mirrored("arguments"), param_headers)


def _check_params(entry: ToolEntry, args: Any, param_headers: dict[bytes, bytes]) -> None:
    if args is not None and not isinstance(args, dict):
        return
    args = args or {}
    for hname, (prop, _kind) in entry.checked.headers.items():
        header = f"Mcp-Param-{hname}"
        raw = param_headers.get(hname.lower().encode("latin-1"))
        value = args.get(prop)
        if value is None:
            if raw is not None:
                raise HeaderMismatch(f"{header} header sent but argument {prop!r} is absent")
            continue
        if raw is None:
            raise HeaderMismatch(f"{header} header is required when argument {prop!r} is present")
        text = decode_value(raw, header)
        if type(value) is bool:
            ok = text == ("true" if value else "false")
        elif type(value) is int:
            ok = bool(_INT.fullmatch(text)) and int(text) == value
        elif isinstance(value, str):
            ok = text == value
        else:
            ok = True  # a type the schema forbids: argument validation reports it
        if not ok:
            raise HeaderMismatch(f"{header} header does not match argument {prop!r}")
