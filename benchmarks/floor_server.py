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

import msgspec
import trio

from limit_server import Server as LimitServer  # the same directory: benchmarks/

HEADER = struct.Struct(">I")
INLINE = "--inline" in sys.argv


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
        #: Call id -> what its answer goes to: the request id (``--inline``), or (event, box) of its task.
        self.waiting: dict[int, Any] = {}


class Server(LimitServer):
    """``limit_server.Server`` whose calls run in ``workers`` forked worker processes."""

    NAME = "floor"

    def __init__(self, workers: int) -> None:
        super().__init__()
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

    def submit(self, request_id: msgspec.Raw, raw: msgspec.Raw, waiter: Any) -> bool:
        """Check the call and queue it for the next worker in turn (its answer goes to ``waiter``, or
        to ``request_id`` when None); False: refused, answered already."""
        params = self.params(raw)
        if params.name != "echo" or not self.validator.is_valid(params.arguments):
            self.reply(request_id, {"content": [{"type": "text", "text": "invalid"}], "isError": True})
            return False
        self.next_id += 1
        w = self.workers[self.turn]
        self.turn = (self.turn + 1) % len(self.workers)
        w.waiting[self.next_id] = request_id if waiter is None else waiter
        body = self.penc((self.next_id, "echo", params.arguments))
        w.out.append(HEADER.pack(len(body)) + body)
        self.flush_due.set()
        return True

    def start_call(self, nursery: trio.Nursery, request_id: msgspec.Raw, raw: msgspec.Raw) -> None:
        if INLINE:  # no task per call: the worker's reader answers the client
            self.submit(request_id, raw, None)
        else:
            nursery.start_soon(self.call, request_id, raw)

    async def call(self, request_id: msgspec.Raw, raw: msgspec.Raw) -> None:
        done, box = trio.Event(), []
        if self.submit(request_id, raw, (done, box)):
            await done.wait()
            self.reply(request_id, {"content": box[0], "isError": False})

    def start_background(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.flush_calls)
        for w in self.workers:
            nursery.start_soon(self.read_results, w)

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
                waiter = w.waiting.pop(call_id)
                if INLINE:
                    self.reply(waiter, {"content": content, "isError": False})
                else:
                    done, box = waiter
                    box.append(content)
                    done.set()


if __name__ == "__main__":
    count = int(sys.argv[sys.argv.index("--workers") + 1]) if "--workers" in sys.argv else 2
    trio.run(Server(count).serve)
