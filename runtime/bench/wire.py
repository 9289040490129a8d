"""MCP messages for the load client: requests pre-encoded around their variable parts, and every
response checked before it counts.

Requests are encoded once per operation into literal byte pieces with holes for the request id
and each argument placeholder (``{{seq}}``, ``{{rand}}``, ``{{uuid}}``, ``{{now_ms}}``; a string
that is exactly ``{{int:NAME}}`` becomes a JSON number), so issuing a call is a join, not a JSON
encode. Responses are decoded with msgspec into Structs that read only what is checked; anything
that does not fit (not JSON, not JSON-RPC 2.0, a result of the wrong shape, an id we never sent) is
an ``invalid`` outcome, never an exception that reaches the load loop.
"""

from __future__ import annotations

import base64
import random
import re
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

LEGACY_PROTOCOL_VERSION = "2025-06-18"
MODERN_PROTOCOL_VERSION = "2026-07-28"
CLIENT_INFO = {"name": "toolcell-bench", "version": "1"}

#: Outcome kinds, each counted apart. ``ok`` is the only success.
OK = "ok"
RPC_ERROR = "rpc_error"
TOOL_ERROR = "tool_error"
INVALID = "invalid"
TIMEOUT = "timeout"
TRANSPORT = "transport"
ERROR_KINDS = (RPC_ERROR, TOOL_ERROR, INVALID, TIMEOUT, TRANSPORT)

_encoder = msgspec.json.Encoder()
_PLACEHOLDER = re.compile(r"\{\{\s*(int:)?\s*(seq|rand|uuid|now_ms)\s*\}\}")
VARIABLES = ("seq", "rand", "uuid", "now_ms")


def modern_meta() -> dict[str, Any]:
    """The ``params._meta`` every 2026-07-28 request carries (that era has no handshake)."""
    return {
        "io.modelcontextprotocol/protocolVersion": MODERN_PROTOCOL_VERSION,
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": CLIENT_INFO,
    }


def message(method: str, params: dict[str, Any] | None, request_id: int | str | None, modern: bool) -> bytes:
    """One JSON-RPC message, compact JSON (no newline). ``request_id`` None makes a notification;
    in the modern era every request's params carry ``_meta``."""
    body: dict[str, Any] = {"jsonrpc": "2.0"}
    if request_id is not None:
        body["id"] = request_id
    body["method"] = method
    if modern and request_id is not None:
        params = {**(params or {}), "_meta": modern_meta()}
    if params is not None:
        body["params"] = params
    return _encoder.encode(body)


def initialize_params() -> dict[str, Any]:
    """Params of the legacy ``initialize`` request."""
    return {"protocolVersion": LEGACY_PROTOCOL_VERSION, "capabilities": {}, "clientInfo": CLIENT_INFO}


def refusal(request_id: Any) -> bytes:
    """The answer to a server-to-client request (sampling, roots, ...): the bench supports none."""
    return _encoder.encode({"jsonrpc": "2.0", "id": request_id,
                            "error": {"code": -32601, "message": "not supported by toolcell bench"}})


# -- templates -----------------------------------------------------------------------------------


class Variables:
    """Values of the placeholders for one request (each drawn only if the template uses it)."""

    __slots__ = ("now_ms", "rand", "seq", "uuid")

    def __init__(self, seq: int, used: frozenset[str]) -> None:
        self.seq = seq
        self.rand = random.getrandbits(31) if "rand" in used else 0
        self.uuid = uuid.uuid4().hex if "uuid" in used else ""
        self.now_ms = int(time.time() * 1000) if "now_ms" in used else 0

    def value(self, name: str) -> str:
        """The text of variable ``name``."""
        if name == "uuid":
            return self.uuid
        return str(getattr(self, name))


def render_text(template: str, variables: Variables) -> str:
    """``template`` with its placeholders filled in (for expected texts and header values)."""
    return _PLACEHOLDER.sub(lambda m: variables.value(m.group(2)), template)


def placeholders(text: str) -> set[str]:
    """The variable names a string uses."""
    return {m.group(2) for m in _PLACEHOLDER.finditer(text)}


class RequestTemplate:
    """A request encoded once, with holes for the id and the placeholders of its arguments."""

    def __init__(self, method: str, params: dict[str, Any] | None, modern: bool) -> None:
        nonce = secrets.token_hex(6)
        slots: list[str] = []  # variable name per hole; "" is the request id

        def mark(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: mark(v) for k, v in value.items()}
            if isinstance(value, list):
                return [mark(v) for v in value]
            if not isinstance(value, str) or "{{" not in value:
                return value
            whole = _PLACEHOLDER.fullmatch(value)
            if whole is not None and whole.group(1):
                slots.append(whole.group(2))
                return f"@@{nonce}I{len(slots) - 1}@@"

            def sub(m: re.Match[str]) -> str:
                slots.append(m.group(2))
                return f"@@{nonce}S{len(slots) - 1}@@"

            return _PLACEHOLDER.sub(sub, value)

        marked = mark(params) if params is not None else None
        slots.append("")
        id_marker = f"@@{nonce}I{len(slots) - 1}@@"
        encoded = message(method, marked, id_marker, modern)
        pattern = re.compile(rb'"@@' + nonce.encode() + rb'I(\d+)@@"|@@' + nonce.encode() + rb"S(\d+)@@")
        pieces: list[bytes] = []
        holes: list[str] = []
        pos = 0
        for m in pattern.finditer(encoded):
            pieces.append(encoded[pos:m.start()])
            holes.append(slots[int(m.group(1) or m.group(2))])
            pos = m.end()
        pieces.append(encoded[pos:])
        self.pieces = pieces
        self.holes = holes
        self.used = frozenset(h for h in holes if h)
        #: Fast path: only the id varies.
        self.simple = not self.used
        if self.simple:
            self.prefix, self.suffix = pieces[0], pieces[1]

    def render(self, request_id: int, variables: Variables | None) -> bytes:
        """The request bytes for ``request_id`` (``variables`` needed when the template has any)."""
        if self.simple:
            return self.prefix + b"%d" % request_id + self.suffix
        assert variables is not None
        out = [self.pieces[0]]
        for hole, piece in zip(self.holes, self.pieces[1:], strict=False):
            out.append(b"%d" % request_id if not hole else variables.value(hole).encode())
            out.append(piece)
        return b"".join(out)


def header_value(value: Any) -> str:
    """A value as the 2026-07-28 ``Mcp-Name``/``Mcp-Param-*`` headers carry it (base64 form when
    it is not plain visible ASCII)."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, int):
        text = str(value)
    else:
        text = str(value)
    plain = (text == text.strip() and all(0x20 < ord(c) < 0x7F or c == " " for c in text)
             and not (text.startswith("=?base64?") and text.endswith("?=")))
    if plain:
        return text
    return "=?base64?" + base64.b64encode(text.encode()).decode() + "?="


# -- responses -----------------------------------------------------------------------------------


class RpcError(msgspec.Struct):
    """A JSON-RPC error object (code and message required, as the spec says)."""

    code: int
    message: str


class Envelope(msgspec.Struct):
    """Any message from the server; ``result`` stays raw until we know what it answers."""

    jsonrpc: Any = None
    id: Any = None
    method: Any = None
    result: msgspec.Raw = msgspec.Raw(b"")
    error: RpcError | None = None


class Content(msgspec.Struct):
    """One content item of a tool result: its type, and its text when it is text."""

    type: str
    text: str | None = None


class CallResult(msgspec.Struct):
    """What a ``tools/call`` result must contain."""

    content: list[Content]
    isError: bool = False
    structuredContent: msgspec.Raw = msgspec.Raw(b"")
    resultType: str | None = None


class ToolInfo(msgspec.Struct):
    """One tool of a ``tools/list`` page."""

    name: str
    inputSchema: dict[str, Any]


class ListResult(msgspec.Struct):
    """A ``tools/list`` page."""

    tools: list[ToolInfo]
    nextCursor: str | None = None
    resultType: str | None = None


_envelope = msgspec.json.Decoder(Envelope)
_envelopes = msgspec.json.Decoder(list[Envelope])
_lenient_id = msgspec.json.Decoder(dict[str, Any])
_call_result = msgspec.json.Decoder(CallResult)
_list_result = msgspec.json.Decoder(ListResult)
_any = msgspec.json.Decoder()


def decode_lines(lines: bytes) -> list[Envelope | Garbage]:
    """Decode newline-separated messages (a chunk of a stdio stream, no trailing newline) in one
    msgspec call; if any line does not decode, fall back to one line at a time."""
    try:
        return list(_envelopes.decode(b"[" + lines.replace(b"\n", b",") + b"]"))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return [decode_one(line) for line in lines.split(b"\n") if line.strip()]


class Garbage:
    """A message that is not a JSON-RPC message we can read; ``id`` if one could still be found."""

    __slots__ = ("id", "reason")

    def __init__(self, reason: str, request_id: Any = None) -> None:
        self.reason = reason
        self.id = request_id


def decode_one(data: bytes) -> Envelope | Garbage:
    """Decode one message; never raises."""
    try:
        return _envelope.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        request_id = None
        try:
            loose = _lenient_id.decode(data)
            request_id = loose.get("id")
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass
        return Garbage(f"not a JSON-RPC message ({str(exc)[:120]}): {data[:160]!r}", request_id)
    except RecursionError:
        return Garbage(f"nested too deeply: {data[:160]!r}")


class CallCheck:
    """What a ``tools/call`` response must show to count as ``ok`` (beyond the MCP shape)."""

    __slots__ = ("contains", "expect_error", "schema")

    def __init__(self, contains: str | None = None, schema: Callable[[Any], bool] | None = None,
                 expect_error: bool = False) -> None:
        self.contains = contains
        self.schema = schema
        self.expect_error = expect_error


def check_envelope(env: Envelope) -> tuple[str, str | None]:
    """(kind, detail) for the JSON-RPC part of a response: ``ok`` means a result to look into."""
    if env.jsonrpc != "2.0":
        return INVALID, f"jsonrpc is {env.jsonrpc!r}, not '2.0'"
    has_result = len(env.result) > 0
    if env.error is not None:
        if has_result:
            return INVALID, "both result and error"
        return RPC_ERROR, f"{env.error.code}: {env.error.message[:200]}"
    if not has_result:
        return INVALID, "neither result nor error"
    return OK, None


def check_call(env: Envelope, check: CallCheck | None, expected_text: str | None) -> tuple[str, str | None]:
    """Classify a ``tools/call`` response: ok, rpc_error, tool_error or invalid (with why)."""
    kind, detail = check_envelope(env)
    if kind != OK:
        return kind, detail
    try:
        result = _call_result.decode(env.result)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return INVALID, f"not a CallToolResult: {exc}"
    if result.resultType not in (None, "complete"):
        return INVALID, f"resultType {result.resultType!r} (the bench answers no input requests)"
    expect_error = check is not None and check.expect_error
    if result.isError and not expect_error:
        return TOOL_ERROR, _text(result)[:200]
    if expect_error and not result.isError:
        return INVALID, "expected an isError result"
    if expected_text is not None:
        text = _text(result)
        if text != expected_text:
            return INVALID, f"text {text[:80]!r} is not the expected {expected_text[:80]!r}"
    if check is None:
        return OK, None
    if check.contains is not None:
        text = _text(result)
        if check.contains not in text:
            return INVALID, f"text {text[:80]!r} does not contain {check.contains[:80]!r}"
    if check.schema is not None:
        if len(result.structuredContent) == 0:
            return INVALID, "no structuredContent to check against the schema"
        try:
            value = _any.decode(result.structuredContent)
        except (msgspec.DecodeError, RecursionError):
            return INVALID, "structuredContent is not JSON"
        if not check.schema(value):
            return INVALID, "structuredContent does not match the expected schema"
    return OK, None


def _text(result: CallResult) -> str:
    return "".join(c.text for c in result.content if c.type == "text" and c.text is not None)


def check_list_page(env: Envelope) -> tuple[str, str | None, ListResult | None]:
    """Classify one ``tools/list`` page; the decoded page when it is fine."""
    kind, detail = check_envelope(env)
    if kind != OK:
        return kind, detail, None
    try:
        page = _list_result.decode(env.result)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return INVALID, f"not a ListToolsResult: {exc}", None
    except RecursionError:
        return INVALID, "ListToolsResult nested too deeply", None
    return OK, None, page


def decode_value(data: bytes | msgspec.Raw) -> Any:
    """Plain Python objects (slow path: handshakes and probes only)."""
    return _any.decode(data)


def tool_names(pages: Sequence[ListResult]) -> list[str]:
    """Every tool name of a walk."""
    return [tool.name for page in pages for tool in page.tools]
