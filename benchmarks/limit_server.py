"""The in-process limit for a tools daemon on trio, over stdio: what serving ``echo`` costs with no worker.

trio + msgspec + one task per ``tools/call`` + a jsonschema-rs check of the arguments, the tool run
inline in that task; newline-delimited JSON-RPC on stdin/stdout, replies written in one batch per
scheduler pass (as toolcell's stdio transport does). No isolation at all: it is the figure a daemon
that runs every call in a sandboxed worker process is held against (``toolcell bench``:
``limit=stdio:python benchmarks/limit_server.py``). ``trivial`` (the bench's own server) answers
inline with no task and no check: the client's ceiling, not this.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import jsonschema_rs
import msgspec
import trio

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TOOLS = {"tools": [{"name": "echo", "description": "Return the text unchanged.", "inputSchema": SCHEMA}]}


class Params(msgspec.Struct):
    name: str = ""
    arguments: dict[str, Any] = {}
    protocolVersion: str = "2025-06-18"


class Request(msgspec.Struct):
    method: str = ""
    id: msgspec.Raw = msgspec.Raw(b"")
    params: msgspec.Raw = msgspec.Raw(b"")


class Server:
    #: ``serverInfo.name`` in the initialize response.
    NAME = "limit"

    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.wake = trio.Event()
        self.validator = jsonschema_rs.validator_for(SCHEMA)
        self.decode = msgspec.json.Decoder(Request).decode
        self.params = msgspec.json.Decoder(Params).decode
        self.encode = msgspec.json.Encoder().encode

    def reply(self, request_id: msgspec.Raw, result: Any) -> None:
        self.out.append(b'{"jsonrpc":"2.0","id":' + bytes(request_id) + b',"result":' + self.encode(result) + b"}\n")
        self.wake.set()

    async def call(self, request_id: msgspec.Raw, raw: msgspec.Raw) -> None:
        params = self.params(raw)
        if params.name != "echo" or not self.validator.is_valid(params.arguments):
            self.reply(request_id, {"content": [{"type": "text", "text": "invalid"}], "isError": True})
            return
        self.reply(request_id, {"content": [{"type": "text", "text": params.arguments["text"]}], "isError": False})

    def start_call(self, nursery: trio.Nursery, request_id: msgspec.Raw, raw: msgspec.Raw) -> None:
        """A ``tools/call``: one task each (``floor_server.py`` changes this)."""
        nursery.start_soon(self.call, request_id, raw)

    def start_background(self, nursery: trio.Nursery) -> None:
        """Tasks a subclass serves beside the reader and the writer (none here)."""

    async def write(self, stdout: trio.lowlevel.FdStream) -> None:
        while True:
            await self.wake.wait()
            self.wake = trio.Event()
            data, self.out = b"".join(self.out), []
            await stdout.send_all(data)

    async def serve(self) -> None:
        stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
        stdout = trio.lowlevel.FdStream(os.dup(sys.stdout.fileno()))
        buf = b""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.write, stdout)
            self.start_background(nursery)
            while True:
                chunk = await stdin.receive_some(1 << 16)
                if not chunk:
                    nursery.cancel_scope.cancel()
                    return
                *lines, buf = (buf + chunk).split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    msg = self.decode(line)
                    if msg.method == "tools/call":
                        self.start_call(nursery, msg.id, msg.params)
                    elif msg.method == "initialize":
                        version = self.params(msg.params).protocolVersion if msg.params else "2025-06-18"
                        self.reply(msg.id, {"protocolVersion": version, "capabilities": {"tools": {}},
                                            "serverInfo": {"name": self.NAME, "version": "1"}})
                    elif msg.method == "tools/list":
                        self.reply(msg.id, TOOLS)
                    elif msg.method == "ping":
                        self.reply(msg.id, {})
                    # notifications (no id) need no answer


if __name__ == "__main__":
    trio.run(Server().serve)
