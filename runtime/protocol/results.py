"""Result policy: what a worker's answer may carry before it reaches a client.

Plugin output is untrusted. Content items are rebuilt field by field from what the protocol
defines (unknown fields are dropped, base64 is checked, required fields must be present), the
``structuredContent`` is checked against the tool's ``outputSchema``, and the whole result is capped
in size. A violation is the plugin's bug: the client gets an ``isError`` result saying so, the
daemon log gets the details.
"""

from __future__ import annotations

import binascii
from typing import Any

import msgspec

from runtime.protocol.errors import PluginOutputError

from runtime.protocol.schemas import describe_validation_error

_encoder = msgspec.json.Encoder()




def _check_b64(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise PluginOutputError(f"{where} must be a base64 string")
    try:
        binascii.a2b_base64(value, strict_mode=True)
    except (binascii.Error, ValueError):
        raise PluginOutputError(f"{where} is not valid base64") from None
    return value


def _str(item: dict[str, Any], key: str, where: str, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value and key != "text"):
        raise PluginOutputError(f"{where}.{key} must be a non-empty string")
    return value


def _annotations(value: Any, where: str) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PluginOutputError(f"{where}.annotations must be an object")
    out: dict[str, Any] = {}
    aud = value.get("audience")
    if aud is not None:
        if not (isinstance(aud, list) and all(a in ("user", "assistant") for a in aud)):
            raise PluginOutputError(f"{where}.annotations.audience must list 'user'/'assistant'")
        out["audience"] = aud
    prio = value.get("priority")
    if prio is not None:
        if type(prio) not in (int, float) or not (0 <= prio <= 1):
            raise PluginOutputError(f"{where}.annotations.priority must be a number from 0 to 1")
        out["priority"] = prio
    modified = value.get("lastModified")
    if modified is not None:
        if not isinstance(modified, str):
            raise PluginOutputError(f"{where}.annotations.lastModified must be an ISO 8601 string")
        out["lastModified"] = modified
    return out or None


def sanitize_item(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise PluginOutputError(f"{where} must be an object")
    kind = item.get("type")
    out: dict[str, Any]
    if kind == "text":
        out = {"type": "text", "text": _str(item, "text", where)}
    elif kind in ("image", "audio"):
        out = {"type": kind, "data": _check_b64(item.get("data"), f"{where}.data"), "mimeType": _str(item, "mimeType", where)}
    elif kind == "resource_link":
        out = {"type": "resource_link", "uri": _str(item, "uri", where), "name": _str(item, "name", where)}
        for key in ("title", "description", "mimeType"):
            if item.get(key) is not None:
                out[key] = _str(item, key, where)
        size = item.get("size")
        if size is not None:
            if type(size) is not int or size < 0:
                raise PluginOutputError(f"{where}.size must be a non-negative integer")
            out["size"] = size
    elif kind == "resource":
        res = item.get("resource")
        rwhere = f"{where}.resource"
        if not isinstance(res, dict):
            raise PluginOutputError(f"{rwhere} must be an object")
        clean: dict[str, Any] = {"uri": _str(res, "uri", rwhere)}
        if res.get("mimeType") is not None:
            clean["mimeType"] = _str(res, "mimeType", rwhere)
        has_text, has_blob = "text" in res, "blob" in res
        if has_text == has_blob:
            raise PluginOutputError(f"{rwhere} needs exactly one of 'text' or 'blob'")
        if has_text:
            clean["text"] = _str(res, "text", rwhere)
        else:
            clean["blob"] = _check_b64(res.get("blob"), f"{rwhere}.blob")
        out = {"type": "resource", "resource": clean}
    else:
        raise PluginOutputError(f"{where}.type {kind!r} is not a content type")
    ann = _annotations(item.get("annotations"), where)
    if ann:
        out["annotations"] = ann
    meta = item.get("_meta")
    if isinstance(meta, dict):
        out["_meta"] = meta
    return out


def sanitize_content(items: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        # The common item, a text block with nothing else, is already clean: kept as it is (a
        # fresh dict decoded from the worker's frame, shared with nobody).
        if type(item) is dict and len(item) == 2 and item.get("type") == "text" and type(item.get("text")) is str:
            out.append(item)
        else:
            out.append(sanitize_item(item, f"content[{i}]"))
    return out


def check_structured(output_validator: Any, structured: Any) -> None:
    """Raise ``PluginOutputError`` unless ``structured`` conforms to the tool's outputSchema."""
    if not isinstance(structured, dict):
        raise PluginOutputError("structuredContent must be a JSON object")
    try:
        problem = describe_validation_error(output_validator, structured)
    except (ValueError, RecursionError):
        raise PluginOutputError("structuredContent is nested too deeply to check") from None
    if problem is not None:
        raise PluginOutputError(f"structuredContent does not match the tool's outputSchema: {problem}")


def encoded_size(value: Any) -> int:
    try:
        return len(_encoder.encode(value))
    except (ValueError, RecursionError, TypeError, OverflowError):
        raise PluginOutputError("the result cannot be encoded as JSON (too deep or not JSON data)") from None
