"""A tiny, fast MCP stdio server with one ``echo`` tool, answering inline (no tasks, no threads).

It exists to test the benchmark harness without the real daemon and to measure the load
generator's own ceiling: whatever rate the client reaches against this server is a floor on
what the client can drive. It speaks both eras (an ``initialize`` handshake or 2026-07-28
requests with ``_meta``) but checks almost nothing; it is not a reference implementation.

    python benchmarks/fake_server.py [--error-every N]

``--error-every N`` turns every Nth ``tools/call`` into an ``isError`` result, and every
(N+1)th into a JSON-RPC error, so the harness's error counting can be checked.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import msgspec


class CallParams(msgspec.Struct):
    """``tools/call`` params: only the fields this server reads."""

    name: str = ""
    arguments: dict[str, Any] = {}


class Request(msgspec.Struct):
    """An incoming message; ``id`` stays raw so it is echoed with its exact JSON type."""

    method: str = ""
    id: msgspec.Raw = msgspec.Raw()  # empty when absent (a notification)
    params: msgspec.Raw = msgspec.Raw()


TOOL = {
    "name": "echo",
    "description": "Return the text unchanged.",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
}
SERVER_INFO = {"name": "fake-echo", "version": "0.1"}

_decode_batch = msgspec.json.Decoder(list[Request]).decode
_decode_line = msgspec.json.Decoder(Request).decode
_decode_params = msgspec.json.Decoder(CallParams).decode
_encode = msgspec.json.Encoder().encode


def _reply(request_id: msgspec.Raw, result: Any = None, error: Any = None) -> bytes:
    body = {"error": error} if error is not None else {"result": result}
    return b'{"jsonrpc":"2.0","id":' + bytes(request_id) + b"," + _encode(body)[1:] + b"\n"


class EchoServer:
    """The request handler; one instance per process."""

    def __init__(self, error_every: int) -> None:
        self.error_every = error_every
        self.calls = 0

    def handle(self, msg: Request) -> bytes:
        """Return the response line for one request ('' for notifications)."""
        if not msg.id:
            return b""
        if msg.method == "tools/call":
            return self.call(msg.id, msg.params)
        if msg.method == "initialize":
            result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": SERVER_INFO}
            return _reply(msg.id, result)
        if msg.method == "tools/list":
            return _reply(msg.id, {"tools": [TOOL]})
        if msg.method == "ping":
            return _reply(msg.id, {})
        return _reply(msg.id, error={"code": -32601, "message": f"Method not found: {msg.method}"})

    def call(self, request_id: msgspec.Raw, raw_params: msgspec.Raw) -> bytes:
        """Answer ``tools/call`` for ``echo`` (and inject errors if asked)."""
        self.calls += 1
        params = _decode_params(raw_params) if raw_params else CallParams()
        if params.name != "echo":
            return _reply(request_id, error={"code": -32602, "message": f"Unknown tool: {params.name}"})
        if self.error_every and self.calls % self.error_every == 0:
            return _reply(request_id, {"content": [{"type": "text", "text": "injected"}], "isError": True})
        if self.error_every and self.calls % self.error_every == 1 and self.calls > 1:
            return _reply(request_id, error={"code": -32603, "message": "injected"})
        text = params.arguments.get("text", "")
        return _reply(request_id, {"content": [{"type": "text", "text": text}], "isError": False})


def _decode(complete: bytes) -> list[Request]:
    try:
        return _decode_batch(b"[" + complete.replace(b"\n", b",") + b"]")
    except msgspec.DecodeError:
        return [_decode_line(line) for line in complete.split(b"\n") if line.strip()]


def serve(server: EchoServer, in_fd: int = 0, out_fd: int = 1) -> None:
    """Read requests until EOF; answer every chunk of complete lines with one write."""
    buf = b""
    while chunk := os.read(in_fd, 1 << 20):
        buf += chunk
        cut = buf.rfind(b"\n")
        if cut < 0:
            continue
        out = b"".join([server.handle(msg) for msg in _decode(buf[:cut])])
        buf = buf[cut + 1 :]
        view = memoryview(out)
        while view:
            view = view[os.write(out_fd, view) :]


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve stdin/stdout until EOF."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--error-every", type=int, default=0, help="inject an error every N calls")
    args = parser.parse_args(argv)
    try:
        serve(EchoServer(args.error_every))
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)


if __name__ == "__main__":
    main()
