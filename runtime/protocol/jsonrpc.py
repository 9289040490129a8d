"""JSON-RPC 2.0 envelopes: decode once, keep ``params`` raw, encode responses as bytes.

Sans-io: no trio here. Inbound bytes are untrusted: msgspec may raise ``DecodeError``,
``RecursionError`` (deep nesting) or ``UnicodeDecodeError``; all become ``-32700``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from runtime.protocol.errors import InvalidRequest, McpError, ParseError

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
_encoder = msgspec.json.Encoder()
encode = _encoder.encode


_batch_decoder = msgspec.json.Decoder(list[msgspec.Raw])


def decode_envelope(data: bytes | memoryview) -> Envelope | list[msgspec.Raw]:
    """Decode one message, or for a batch the raw bytes of each element (decoded one by one with
    ``envelope_from_raw``: a batch is read once, never re-encoded).

    Raises ``ParseError`` for bytes that are not JSON and ``InvalidRequest`` for JSON that is
    not an object or array.
    """
    try:
        return _envelope_decoder.decode(data)
    except msgspec.ValidationError:
        pass  # valid JSON but not an object: maybe a batch (msgspec stops at the first token)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise ParseError(f"Parse error: {_short(exc)}") from None
    try:
        return _batch_decoder.decode(data)
    except msgspec.ValidationError:
        raise InvalidRequest("Invalid Request: a message must be a JSON object") from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise ParseError(f"Parse error: {_short(exc)}") from None


def envelope_from_raw(raw: msgspec.Raw) -> Envelope:
    """One element of a batch as an Envelope."""
    try:
        return _envelope_decoder.decode(raw)
    except msgspec.ValidationError:
        raise InvalidRequest("Invalid Request: a message must be a JSON object") from None
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest(f"Invalid Request: {_short(exc)}") from None


def valid_id(value: Any) -> bool:
    """Request ids are strings or integers (never null, never bool or float)."""
    return (type(value) is int) or (type(value) is str)


def encode_id(value: Any) -> bytes:
    return _encoder.encode(value)


def request(request_id: Any, method: str, params: Any) -> bytes:
    """A request of ours to the client."""
    return _encoder.encode({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})


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


def error_reply(id_bytes: bytes | None, error: McpError) -> bytes:
    """The error response for ``error`` (its code and message from the error table)."""
    return error_response(id_bytes, error.code, error.message, error.data)


def notification(method: str, params: Any) -> bytes:
    return _encoder.encode({"jsonrpc": "2.0", "method": method, "params": params})


def _short(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nesting too deep"
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."
