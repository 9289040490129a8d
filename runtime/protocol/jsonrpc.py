"""JSON-RPC 2.0 envelopes: decode once, keep ``params`` raw, encode responses as bytes.

Sans-io: no trio here. Inbound bytes are untrusted: msgspec may raise ``DecodeError``,
``RecursionError`` (deep nesting) or ``UnicodeDecodeError``; all become ``-32700``.
"""

from __future__ import annotations

from typing import Any

import msgspec

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
# MCP 2026-07-28
HEADER_MISMATCH = -32020
MISSING_CLIENT_CAPABILITY = -32021
UNSUPPORTED_PROTOCOL_VERSION = -32022
# Implementation-defined server errors live outside the spec's reserved -32000..-32099 band in the
# modern era; "busy" is a transient condition the client may retry.
SERVER_BUSY = -31001
#: The server is shutting down: the request was not run (the client may retry elsewhere or later).
SHUTTING_DOWN = -31002

UNSET = msgspec.UNSET


class Envelope(msgspec.Struct, omit_defaults=True):
    """Any JSON-RPC message. ``params``/``result``/``error`` stay raw until dispatch."""

    jsonrpc: Any = UNSET
    id: Any = UNSET
    method: Any = UNSET
    params: msgspec.Raw = msgspec.Raw(b"")
    result: msgspec.Raw = msgspec.Raw(b"")
    error: msgspec.Raw = msgspec.Raw(b"")


_envelope_decoder = msgspec.json.Decoder(Envelope)
_any_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()
encode = _encoder.encode


class ProtocolError(Exception):
    """A JSON-RPC error to answer with (the client's fault, or ours for -32603)."""

    def __init__(self, code: int, message: str, data: Any = UNSET) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data


def decode_envelope(data: bytes | memoryview) -> Envelope | list[Any]:
    """Decode one message (or, for a batch, the list of raw elements).

    Raises ``ProtocolError(-32700)`` for bytes that are not JSON and ``-32600`` for JSON that is
    not an object or array.
    """
    try:
        return _envelope_decoder.decode(data)
    except msgspec.ValidationError:
        pass  # valid JSON but not an object: maybe a batch
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(PARSE_ERROR, f"Parse error: {_short(exc)}") from None
    try:
        value = _any_decoder.decode(data)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(PARSE_ERROR, f"Parse error: {_short(exc)}") from None
    if isinstance(value, list):
        return value
    raise ProtocolError(INVALID_REQUEST, "Invalid Request: a message must be a JSON object")


def envelope_from_obj(obj: Any) -> Envelope:
    """Turn one already-decoded batch element into an Envelope."""
    if not isinstance(obj, dict):
        raise ProtocolError(INVALID_REQUEST, "Invalid Request: a message must be a JSON object")
    try:
        return _envelope_decoder.decode(_encoder.encode(obj))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise ProtocolError(INVALID_REQUEST, f"Invalid Request: {_short(exc)}") from None


def valid_id(value: Any) -> bool:
    """Request ids are strings or integers (never null, never bool or float)."""
    return (type(value) is int) or (type(value) is str)


def encode_id(value: Any) -> bytes:
    return _encoder.encode(value)


def response(id_bytes: bytes, result: bytes) -> bytes:
    return b'{"jsonrpc":"2.0","id":' + id_bytes + b',"result":' + result + b"}"


def error_response(id_bytes: bytes | None, code: int, message: str, data: Any = UNSET) -> bytes:
    """An error response. ``id_bytes`` None omits the id (2025-11-25+ for unreadable ids)."""
    err: dict[str, Any] = {"code": code, "message": message}
    if data is not UNSET:
        err["data"] = data
    body = _encoder.encode(err)
    if id_bytes is None:
        return b'{"jsonrpc":"2.0","error":' + body + b"}"
    return b'{"jsonrpc":"2.0","id":' + id_bytes + b',"error":' + body + b"}"


def notification(method: str, params: Any) -> bytes:
    return _encoder.encode({"jsonrpc": "2.0", "method": method, "params": params})


def _short(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nesting too deep"
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."
