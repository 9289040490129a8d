"""The floor for a daemon that runs every call in another process: ``limit_server.py`` plus workers.

Everything ``limit_server.py`` does (trio, msgspec, a task per ``tools/call``, a jsonschema-rs check),
and the call itself runs in one of ``--workers`` plain worker processes (no isolation layer, no
deadline, no guard, no result checks; ``--inline``: no task per call either, the worker's reader
answers the client): each call is a msgpack frame on an ``AF_UNIX`` socket pair, the
calls that arrive in one scheduler pass go to a worker in one write, a worker answers the calls it
read in one write. It is what the process hop alone costs on this machine, the least any daemon that
runs calls out of process can spend; toolcell adds isolation, deadlines and checks on top
(``toolcell bench ... "floor=stdio:python benchmarks/floor_server.py"``).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from typing import Any

import jsonschema_rs
import msgspec
import trio

SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
TOOLS = {"tools": [{"name": "echo", "description": "Return the text unchanged.", "inputSchema": SCHEMA}]}
HEADER = struct.Struct(">I")
INLINE = "--inline" in sys.argv


class Params(msgspec.Struct):
    name: str = ""
    arguments: dict[str, Any] = {}
    protocolVersion: str = "2025-06-18"


class Request(msgspec.Struct):
    method: str = ""
    id: msgspec.Raw = msgspec.Raw(b"")
    params: msgspec.Raw = msgspec.Raw(b"")


def split(buf: bytearray) -> list[bytes]:
    out, pos, n = [], 0, len(buf)
    while n - pos >= 4:
        (length,) = HEADER.unpack_from(buf, pos)
        if n - pos - 4 < length:
            break
        out.append(bytes(buf[pos + 4:pos + 4 + length]))
        pos += 4 + length
    del buf[:pos]
    return out


def worker(fd: int) -> None:
    """A worker: read calls, run each, answer every call read in one write."""
    sock = socket.socket(fileno=fd)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(tuple[int, str, dict[str, Any]])
    buf = bytearray()
    while True:
        chunk = sock.recv(1 << 20)
        if not chunk:
            return
        buf += chunk
        out = []
        for frame in split(buf):
            call_id, _tool, args = dec.decode(frame)
            body = enc.encode((call_id, [{"type": "text", "text": args["text"]}]))
            out.append(HEADER.pack(len(body)) + body)
        sock.sendall(b"".join(out))


class Worker:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = trio.socket.from_stdlib_socket(sock)
        self.out: list[bytes] = []
        self.waiting: dict[int, Any] = {}


class Server:
    def __init__(self, workers: int) -> None:
        self.out: list[bytes] = []
        self.wake = trio.Event()
        self.validator = jsonschema_rs.validator_for(SCHEMA)
        self.decode = msgspec.json.Decoder(Request).decode
        self.params = msgspec.json.Decoder(Params).decode
        self.encode = msgspec.json.Encoder().encode
        self.penc = msgspec.msgpack.Encoder().encode
        self.rdec = msgspec.msgpack.Decoder(tuple[int, list[dict[str, Any]]]).decode
        self.workers: list[Worker] = []
        for _ in range(workers):
            ours, theirs = socket.socketpair()
            pid = os.fork()
            if pid == 0:
                ours.close()
                worker(theirs.detach())
                os._exit(0)
            theirs.close()
            self.workers.append(Worker(ours))
        self.next_id = 0
        self.turn = 0
        self.flush_due = trio.Event()

    def reply(self, request_id: msgspec.Raw, result: Any) -> None:
        self.out.append(b'{"jsonrpc":"2.0","id":' + bytes(request_id) + b',"result":' + self.encode(result) + b"}\n")
        self.wake.set()

    def send_call(self, request_id: msgspec.Raw, raw: msgspec.Raw) -> None:
        """``--inline``: no task per call; the reader answers the client when the result comes."""
        params = self.params(raw)
        if params.name != "echo" or not self.validator.is_valid(params.arguments):
            self.reply(request_id, {"content": [{"type": "text", "text": "invalid"}], "isError": True})
            return
        self.next_id += 1
        w = self.workers[self.turn]
        self.turn = (self.turn + 1) % len(self.workers)
        w.waiting[self.next_id] = request_id
        body = self.penc((self.next_id, "echo", params.arguments))
        w.out.append(HEADER.pack(len(body)) + body)
        self.flush_due.set()

    async def call(self, request_id: msgspec.Raw, raw: msgspec.Raw) -> None:
        params = self.params(raw)
        if params.name != "echo" or not self.validator.is_valid(params.arguments):
            self.reply(request_id, {"content": [{"type": "text", "text": "invalid"}], "isError": True})
            return
        self.next_id += 1
        w = self.workers[self.turn]
        self.turn = (self.turn + 1) % len(self.workers)
        done = trio.Event()
        box: list[Any] = []
        w.waiting[self.next_id] = (done, box)
        body = self.penc((self.next_id, "echo", params.arguments))
        w.out.append(HEADER.pack(len(body)) + body)
        self.flush_due.set()
        await done.wait()
        self.reply(request_id, {"content": box[0], "isError": False})

    async def flush_calls(self) -> None:
        while True:
            await self.flush_due.wait()
            self.flush_due = trio.Event()
            for w in self.workers:
                if w.out:
                    data, w.out = b"".join(w.out), []
                    await w.sock.send(data)

    async def read_results(self, w: Worker) -> None:
        buf = bytearray()
        while True:
            buf += await w.sock.recv(1 << 18)
            for frame in split(buf):
                call_id, content = self.rdec(frame)
                if INLINE:
                    self.reply(w.waiting.pop(call_id), {"content": content, "isError": False})
                    continue
                done, box = w.waiting.pop(call_id)
                box.append(content)
                done.set()

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
            nursery.start_soon(self.flush_calls)
            for w in self.workers:
                nursery.start_soon(self.read_results, w)
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
                        if INLINE:
                            self.send_call(msg.id, msg.params)
                        else:
                            nursery.start_soon(self.call, msg.id, msg.params)
                    elif msg.method == "initialize":
                        version = self.params(msg.params).protocolVersion if msg.params else "2025-06-18"
                        self.reply(msg.id, {"protocolVersion": version, "capabilities": {"tools": {}},
                                            "serverInfo": {"name": "floor", "version": "1"}})
                    elif msg.method == "tools/list":
                        self.reply(msg.id, TOOLS)
                    elif msg.method == "ping":
                        self.reply(msg.id, {})


if __name__ == "__main__":
    count = int(sys.argv[sys.argv.index("--workers") + 1]) if "--workers" in sys.argv else 2
    trio.run(Server(count).serve)
