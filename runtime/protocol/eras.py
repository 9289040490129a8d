"""Protocol revisions: which exist, what each one's wire shapes contain.

Legacy revisions use the ``initialize`` handshake; the modern one (2026-07-28) is stateless.
Shapes are chosen by the revision in force so that no client ever receives a field its revision
does not define (``title``, ``outputSchema``, ``structuredContent``, ``icons``, ...).
"""

from __future__ import annotations

from typing import Any

V2024_11_05 = "2024-11-05"
V2025_03_26 = "2025-03-26"
V2025_06_18 = "2025-06-18"
V2025_11_25 = "2025-11-25"
V2026_07_28 = "2026-07-28"

LEGACY_VERSIONS = (V2024_11_05, V2025_03_26, V2025_06_18, V2025_11_25)
MODERN_VERSIONS = (V2026_07_28,)
ALL_VERSIONS = LEGACY_VERSIONS + MODERN_VERSIONS
LATEST_LEGACY = V2025_11_25
LATEST = V2026_07_28

META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CLIENT_CAPS = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT_INFO = "io.modelcontextprotocol/clientInfo"
META_LOG_LEVEL = "io.modelcontextprotocol/logLevel"
META_SERVER_INFO = "io.modelcontextprotocol/serverInfo"
META_SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"


def rank(version: str) -> int:
    return ALL_VERSIONS.index(version)


def is_modern(version: str) -> bool:
    return version in MODERN_VERSIONS


def negotiate_legacy(requested: Any) -> str:
    """The legacy version to answer an ``initialize`` with."""
    if isinstance(requested, str) and requested in LEGACY_VERSIONS:
        return requested
    return LATEST_LEGACY


# Tool fields each revision defines (beyond name/description/inputSchema).
_TOOL_FIELDS: dict[str, tuple[str, ...]] = {
    V2024_11_05: (),
    V2025_03_26: ("annotations",),
    V2025_06_18: ("annotations", "title", "outputSchema", "_meta"),
    V2025_11_25: ("annotations", "title", "outputSchema", "_meta", "icons", "execution"),
    V2026_07_28: ("annotations", "title", "outputSchema", "_meta", "icons"),
}

#: Revisions whose tool/result shapes are identical share one pre-encoded page cache.
SHAPE_OF = {v: v for v in ALL_VERSIONS}


def tool_fields(version: str) -> tuple[str, ...]:
    return _TOOL_FIELDS[version]


def has_structured_content(version: str) -> bool:
    return rank(version) >= rank(V2025_06_18)


def validation_error_as_result(version: str) -> bool:
    """SEP-1303: from 2025-11-25 argument-validation failures are ``isError`` results."""
    return rank(version) >= rank(V2025_11_25)


def has_progress_message(version: str) -> bool:
    return rank(version) >= rank(V2025_03_26)


def supports_batches(version: str) -> bool:
    return version == V2025_03_26


def omit_unknown_error_id(version: str | None) -> bool:
    """From 2025-11-25 an error whose id could not be read omits ``id`` (older ones send null)."""
    return version is not None and rank(version) >= rank(V2025_11_25)


_CONTENT_TYPES: dict[str, frozenset[str]] = {
    V2024_11_05: frozenset({"text", "image", "resource"}),
    V2025_03_26: frozenset({"text", "image", "audio", "resource"}),
    V2025_06_18: frozenset({"text", "image", "audio", "resource", "resource_link"}),
    V2025_11_25: frozenset({"text", "image", "audio", "resource", "resource_link"}),
    V2026_07_28: frozenset({"text", "image", "audio", "resource", "resource_link"}),
}


def shape_content(version: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adapt checked content items to what ``version`` can carry."""
    allowed = _CONTENT_TYPES[version]
    out: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind in allowed:
            if version == V2024_11_05 or version == V2025_03_26:
                ann = item.get("annotations")
                if ann and "lastModified" in ann:
                    item = dict(item)
                    item["annotations"] = {k: v for k, v in ann.items() if k != "lastModified"}
                    if not item["annotations"]:
                        del item["annotations"]
                if "_meta" in item:
                    item = {k: v for k, v in item.items() if k != "_meta"}
            out.append(item)
        elif kind == "resource_link":
            label = item.get("title") or item["name"]
            out.append({"type": "text", "text": f"[{label}]({item['uri']})"})
        else:
            mime = item.get("mimeType", "")
            out.append({"type": "text", "text": f"[{kind} content ({mime}) omitted: protocol {version} cannot carry it]"})
    return out


def has_core_tasks(version: str) -> bool:
    """Tasks in the core protocol: 2025-11-25 only (2026-07-28 moved them into an extension)."""
    return version == V2025_11_25


def server_capabilities(version: str) -> dict[str, Any]:
    caps: dict[str, Any] = {"tools": {"listChanged": True}, "logging": {}}
    if has_core_tasks(version):
        caps["tasks"] = {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
    elif version in MODERN_VERSIONS:
        caps["extensions"] = {"io.modelcontextprotocol/tasks": {}}
    return caps


# -- a tool asking the client: what each revision can carry, and what a client must have declared --

#: The client capabilities a tool's questions need.
INPUT_CAPABILITIES = ("elicitation", "sampling", "roots")


def input_refusal(version: str, caps: dict[str, Any] | None, method: str, params: dict[str, Any]) -> str | None:
    """Why a client of ``version`` that declared ``caps`` cannot be asked ``method`` (None: it can)."""
    caps = caps or {}
    if method == "elicitation/create":
        if rank(version) < rank(V2025_06_18):
            return f"protocol {version} has no elicitation (it came with 2025-06-18)"
        declared = caps.get("elicitation")
        if not isinstance(declared, dict):
            return "the client did not declare the elicitation capability"
        if params.get("mode") == "url":
            if rank(version) < rank(V2025_11_25) and version not in MODERN_VERSIONS:
                return f"protocol {version} has no URL-mode elicitation (it came with 2025-11-25)"
            if not isinstance(declared.get("url"), dict):
                return "the client did not declare URL-mode elicitation (elicitation.url)"
        elif declared and "form" not in declared and isinstance(declared.get("url"), dict):
            return "the client declared only URL-mode elicitation, not forms (elicitation.form)"
        return None
    if method == "sampling/createMessage":
        declared = caps.get("sampling")
        if not isinstance(declared, dict):
            return "the client did not declare the sampling capability"
        context = params.get("includeContext")
        if context not in (None, "none") and not isinstance(declared.get("context"), dict):
            return "the client did not declare sampling.context, which includeContext needs"
        return None
    if method == "roots/list":
        return None if isinstance(caps.get("roots"), dict) else "the client did not declare the roots capability"
    return f"{method} cannot be asked of a client"


def shape_input_request(version: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
    """A tool's request (worded as 2025-11-25 does) in the shape ``version`` defines."""
    if method == "elicitation/create" and version == V2025_06_18:
        return {k: v for k, v in params.items() if k != "mode"}  # 2025-06-18 elicitation is forms only, no mode
    return params


def input_response_problem(method: str, result: Any) -> str | None:
    """What is wrong with a client's answer to ``method`` (None: it has the shape the method defines)."""
    if not isinstance(result, dict):
        return "it is not an object"
    if method == "elicitation/create":
        if result.get("action") not in ("accept", "decline", "cancel"):
            return "an elicitation answer needs action: accept, decline or cancel"
        if "content" in result and result["content"] is not None and not isinstance(result["content"], dict):
            return "an elicitation answer's content must be an object"
        return None
    if method == "sampling/createMessage":
        if not isinstance(result.get("role"), str) or not isinstance(result.get("content"), (dict, list)):
            return "a sampling answer needs a role and content"
        return None
    if method == "roots/list":
        roots = result.get("roots")
        if not isinstance(roots, list) or not all(isinstance(r, dict) and isinstance(r.get("uri"), str) for r in roots):
            return "a roots answer needs roots: a list of objects with a uri"
        return None
    return f"{method} cannot be answered"
