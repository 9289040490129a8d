"""MCP wire helpers for the load generator: pre-encoded requests and cheap response decoding.

The hot path of a load client is "write N requests, read N responses". Two things keep it
cheap enough that the client is never the bottleneck:

- Requests are encoded once into a prefix and a suffix around the id, so issuing a call is
  two byte concatenations and a ``%d`` (no JSON encoding per call).
- Responses arrive as newline-delimited JSON. A whole chunk of complete lines is turned into
  one JSON array (``[`` + lines joined by ``,`` + ``]``) and decoded by msgspec in a single
  call into small Structs that read only ``id``, ``method``, ``error`` and ``result.isError``
  and skip everything else. stdio MCP forbids embedded newlines, so the join is safe; if a
  server emits blank or broken lines we fall back to decoding line by line.
"""

from __future__ import annotations

from typing import Any

import msgspec

LEGACY_PROTOCOL_VERSION = "2025-06-18"
MODERN_PROTOCOL_VERSION = "2026-07-28"
CLIENT_INFO = {"name": "toolcell-loadgen", "version": "0.1"}

_ID_PLACEHOLDER = "__loadgen_id_placeholder__"
_encoder = msgspec.json.Encoder()


class CallResult(msgspec.Struct):
    """The only part of a ``tools/call`` result the load loop looks at."""

    isError: bool = False


class ErrorObject(msgspec.Struct):
    """A JSON-RPC error object."""

    code: int = 0
    message: str = ""


class Incoming(msgspec.Struct, omit_defaults=True):
    """Any message from the server: a response, a notification or a server-to-client request."""

    id: int | str | None = None
    method: str | None = None
    result: CallResult | None = None
    error: ErrorObject | None = None


_batch_decoder = msgspec.json.Decoder(list[Incoming])
_line_decoder = msgspec.json.Decoder(Incoming)
_any_decoder = msgspec.json.Decoder()


def modern_meta() -> dict[str, Any]:
    """The ``params._meta`` every 2026-07-28 request must carry (no handshake in that era)."""
    return {
        "io.modelcontextprotocol/protocolVersion": MODERN_PROTOCOL_VERSION,
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": CLIENT_INFO,
    }


def encode_message(message: dict[str, Any]) -> bytes:
    """Encode one JSON-RPC message as a stdio line (compact JSON plus ``\\n``)."""
    return _encoder.encode(message) + b"\n"


def request(method: str, params: dict[str, Any] | None, request_id: int | str, modern: bool) -> bytes:
    """Encode one request line; in modern mode ``params._meta`` is added."""
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if modern:
        params = {**(params or {}), "_meta": modern_meta()}
    if params is not None:
        message["params"] = params
    return encode_message(message)


def refusal(request_id: int | str) -> bytes:
    """The reply to a server-to-client request (sampling, roots, ...): 'method not found'."""
    error = {"code": -32601, "message": "not supported by loadgen"}
    return encode_message({"jsonrpc": "2.0", "id": request_id, "error": error})


def initialize_params() -> dict[str, Any]:
    """Params of the legacy ``initialize`` request (protocol version 2025-06-18, no capabilities)."""
    return {"protocolVersion": LEGACY_PROTOCOL_VERSION, "capabilities": {}, "clientInfo": CLIENT_INFO}


def initialized_notification() -> bytes:
    """The ``notifications/initialized`` line that completes the legacy handshake."""
    return encode_message({"jsonrpc": "2.0", "method": "notifications/initialized"})


class CallTemplate:
    """A ``tools/call`` request pre-encoded around its id, for issuing calls without encoding JSON."""

    def __init__(self, tool: str, arguments: dict[str, Any], modern: bool) -> None:
        line = request("tools/call", {"name": tool, "arguments": arguments}, _ID_PLACEHOLDER, modern)
        prefix, sep, suffix = line.partition(_encoder.encode(_ID_PLACEHOLDER))
        if not sep:
            raise AssertionError("id placeholder not found in the encoded request")
        self.prefix = prefix
        self.suffix = suffix
        self.line_bytes = len(line) - len(sep)

    def one(self, request_id: int) -> bytes:
        """Return the request line for ``request_id``."""
        return self.prefix + b"%d" % request_id + self.suffix

    def many(self, first_id: int, count: int) -> bytes:
        """Return ``count`` request lines with consecutive ids starting at ``first_id``."""
        prefix, suffix = self.prefix, self.suffix
        return b"".join([prefix + b"%d" % i + suffix for i in range(first_id, first_id + count)])


def decode_lines(complete: bytes) -> list[Incoming]:
    """Decode a run of complete newline-delimited messages (no trailing newline) in one call."""
    try:
        return _batch_decoder.decode(b"[" + complete.replace(b"\n", b",") + b"]")
    except msgspec.DecodeError:
        out: list[Incoming] = []
        for line in complete.split(b"\n"):
            if line.strip():
                try:
                    out.append(_line_decoder.decode(line))
                except msgspec.DecodeError:
                    out.append(Incoming(error=ErrorObject(-32700, "client could not decode: " + repr(line[:200]))))
        return out


def decode_any(line: bytes) -> Any:
    """Decode one message into plain Python objects (for the handshake and probes, not the hot path)."""
    return _any_decoder.decode(line)
