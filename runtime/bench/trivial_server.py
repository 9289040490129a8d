"""A trivial MCP server shipped with the bench: the client's ceiling, and every kind of bad server.

It answers inline (no tasks, no threads), over stdio or Streamable HTTP/1.1 (one ``epoll``
thread), both eras, with tools that return their ``text`` argument. Whatever rate the bench
reaches against it is what the client itself can drive: ``toolcell bench`` measures it beside
the targets and warns when a target comes close. It checks almost nothing; it is not a reference
implementation. Flags make it misbehave on purpose, for the bench's own tests::

    python -m runtime.bench.trivial_server [--http --port N] [--tools echo,other] [--page-size N]
        [--error-every N] [--always-error] [--die-after N] [--stall-after N]
        [--pause-at N --pause-ms MS] [--delay-ms MS] [--garbage-every N]
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import sys
import time
from typing import Any

import msgspec


class CallParams(msgspec.Struct):
    """``tools/call`` and ``tools/list`` params: only the fields this server reads."""

    name: str = ""
    arguments: dict[str, Any] = {}
    cursor: str | None = None


class Request(msgspec.Struct):
    """An incoming message; ``id`` stays raw so it is echoed with its exact JSON type."""

    method: str = ""
    id: msgspec.Raw = msgspec.Raw(b"")
    params: msgspec.Raw = msgspec.Raw(b"")


SERVER_INFO = {"name": "toolcell-bench-trivial", "version": "1"}
_decode_batch = msgspec.json.Decoder(list[Request]).decode
_decode_line = msgspec.json.Decoder(Request).decode
_decode_params = msgspec.json.Decoder(CallParams).decode
_encode = msgspec.json.Encoder().encode


class Behaviour(msgspec.Struct):
    """What the server does (and how it misbehaves)."""

    tools: list[str] = msgspec.field(default_factory=lambda: ["echo"])
    page_size: int = 0
    error_every: int = 0
    always_error: bool = False
    die_after: int = 0
    stall_after: int = 0
    pause_at: int = 0
    pause_ms: int = 0
    delay_ms: int = 0
    garbage_every: int = 0


class Trivial:
    """The request handler; one per process."""

    def __init__(self, how: Behaviour) -> None:
        self.how = how
        self.calls = 0
        self.tools = [{"name": name, "description": "Return the text unchanged.",
                       "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}}}
                      for name in how.tools]
        self.names = set(how.tools)

    def reply(self, request_id: msgspec.Raw, result: Any = None, error: Any = None) -> bytes:
        body = {"error": error} if error is not None else {"result": result}
        return b'{"jsonrpc":"2.0","id":' + bytes(request_id) + b"," + _encode(body)[1:]

    def handle(self, msg: Request) -> bytes | None:
        """The answer to one message (None: nothing to send)."""
        if not msg.id:
            return None
        method = msg.method
        if method == "tools/call":
            return self.call(msg.id, msg.params)
        if method == "initialize":
            result = {"protocolVersion": "2025-06-18", "capabilities": {"tools": {}}, "serverInfo": SERVER_INFO}
            return self.reply(msg.id, result)
        if method == "tools/list":
            return self.list_page(msg.id, msg.params)
        if method == "server/discover":
            return self.reply(msg.id, {"resultType": "complete", "supportedVersions": ["2026-07-28", "2025-06-18"],
                                       "capabilities": {"tools": {}}, "ttlMs": 0, "cacheScope": "private",
                                       "_meta": {"io.modelcontextprotocol/serverInfo": SERVER_INFO}})
        if method == "ping":
            return self.reply(msg.id, {})
        return self.reply(msg.id, error={"code": -32601, "message": f"Method not found: {method}"})

    def list_page(self, request_id: msgspec.Raw, raw: msgspec.Raw) -> bytes:
        params = _decode_params(raw) if raw else CallParams()
        size = self.how.page_size or len(self.tools) or 1
        start = int(params.cursor) if params.cursor and params.cursor.isdigit() else 0
        result: dict[str, Any] = {"tools": self.tools[start:start + size]}
        if start + size < len(self.tools):
            result["nextCursor"] = str(start + size)
        return self.reply(request_id, result)

    def call(self, request_id: msgspec.Raw, raw: msgspec.Raw) -> bytes | None:
        how = self.how
        self.calls += 1
        n = self.calls
        if how.stall_after and n > how.stall_after:
            return None
        if how.pause_at and n == how.pause_at:
            time.sleep(how.pause_ms / 1000)
        if how.delay_ms:
            time.sleep(how.delay_ms / 1000)
        params = _decode_params(raw) if raw else CallParams()
        if params.name not in self.names:
            return self.reply(request_id, error={"code": -32602, "message": f"Unknown tool: {params.name}"})
        if how.always_error:
            return self.reply(request_id, error={"code": -32603, "message": "this server always fails"})
        if how.garbage_every and n % how.garbage_every == 0:
            return b'{"jsonrpc":"2.0","id":' + bytes(request_id) + b',"result":{"content":"not a list"}}'
        if how.error_every and n % how.error_every == 0:
            return self.reply(request_id, {"content": [{"type": "text", "text": "injected"}], "isError": True})
        if how.error_every and n % how.error_every == 1 and n > 1:
            return self.reply(request_id, error={"code": -32603, "message": "injected"})
        text = params.arguments.get("text", "ok")
        return self.reply(request_id, {"content": [{"type": "text", "text": text if isinstance(text, str) else "ok"}]})

    def died(self) -> bool:
        return bool(self.how.die_after) and self.calls >= self.how.die_after


def _decode(complete: bytes) -> list[Request]:
    try:
        return _decode_batch(b"[" + complete.replace(b"\n", b",") + b"]")
    except msgspec.DecodeError:
        out = []
        for line in complete.split(b"\n"):
            if line.strip():
                try:
                    out.append(_decode_line(line))
                except msgspec.DecodeError:
                    pass
        return out


def serve_stdio(server: Trivial, in_fd: int = 0, out_fd: int = 1) -> None:
    """Answer stdin on stdout until EOF; every chunk of complete lines gets one write."""
    buf = b""
    while chunk := os.read(in_fd, 1 << 20):
        buf += chunk
        cut = buf.rfind(b"\n")
        if cut < 0:
            continue
        answers = []
        for msg in _decode(buf[:cut]):
            answer = server.handle(msg)
            if answer is not None:
                answers.append(answer + b"\n")
            if server.died():
                _write(out_fd, b"".join(answers))
                os._exit(3)
        buf = buf[cut + 1:]
        _write(out_fd, b"".join(answers))


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_HEAD_END = b"\r\n\r\n"


def _response(status: int, body: bytes, extra: bytes = b"") -> bytes:
    reason = {200: b"OK", 202: b"Accepted", 400: b"Bad Request", 404: b"Not Found"}.get(status, b"Status")
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n"
            % (status, reason, len(body), extra)) + body


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip() or 0)
    return 0


def serve_http(server: Trivial, port: int) -> None:
    """Streamable HTTP/1.1 on 127.0.0.1:``port``, keep-alive, JSON responses, one epoll thread."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(1024)
    listener.setblocking(False)
    print(f"trivial MCP server at http://127.0.0.1:{listener.getsockname()[1]}/mcp", file=sys.stderr, flush=True)
    ep = select.epoll()
    ep.register(listener.fileno(), select.EPOLLIN)
    socks: dict[int, socket.socket] = {}
    bufs: dict[int, bytes] = {}
    session = b"mcp-session-id: trivial-session-0123456789abcdef\r\n"
    while True:
        for fd, _ in ep.poll():
            if fd == listener.fileno():
                while True:
                    try:
                        sock, _ = listener.accept()
                    except BlockingIOError:
                        break
                    sock.setblocking(False)
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    socks[sock.fileno()] = sock
                    bufs[sock.fileno()] = b""
                    ep.register(sock.fileno(), select.EPOLLIN)
                continue
            sock = socks[fd]
            try:
                chunk = sock.recv(1 << 16)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                chunk = b""
            if not chunk:
                ep.unregister(fd)
                sock.close()
                del socks[fd], bufs[fd]
                continue
            buf = bufs[fd] + chunk
            out = []
            while True:
                end = buf.find(_HEAD_END)
                if end < 0:
                    break
                length = _content_length(buf[:end])
                if len(buf) < end + 4 + length:
                    break
                body = buf[end + 4:end + 4 + length]
                buf = buf[end + 4 + length:]
                try:
                    msg = _decode_line(body)
                except msgspec.DecodeError:
                    out.append(_response(400, b'{"jsonrpc":"2.0","id":null,"error":{"code":-32700,"message":"parse error"}}'))
                    continue
                answer = server.handle(msg)
                if answer is None:
                    if msg.id:
                        continue  # stalled: never answer
                    out.append(_response(202, b""))
                    continue
                out.append(_response(200, answer, session if msg.method == "initialize" else b""))
                if server.died():
                    _write_sock(sock, b"".join(out))
                    os._exit(3)
            bufs[fd] = buf
            if out:
                _write_sock(sock, b"".join(out))


def _write_sock(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            select.select([], [sock], [], 5)
        except OSError:
            return


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve until stdin ends (stdio) or the process is stopped (HTTP)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--http", action="store_true", help="serve Streamable HTTP instead of stdio")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--tools", default="echo", help="comma-separated tool names")
    parser.add_argument("--page-size", type=int, default=0, help="tools per tools/list page (0: one page)")
    parser.add_argument("--error-every", type=int, default=0, help="every Nth call isError, every N+1th a JSON-RPC error")
    parser.add_argument("--always-error", action="store_true", help="every call is a JSON-RPC error")
    parser.add_argument("--die-after", type=int, default=0, help="exit (code 3) after N calls")
    parser.add_argument("--stall-after", type=int, default=0, help="answer no call after the first N")
    parser.add_argument("--pause-at", type=int, default=0, help="pause before answering call N ...")
    parser.add_argument("--pause-ms", type=int, default=0, help="... for this long (nothing is read meanwhile)")
    parser.add_argument("--delay-ms", type=int, default=0, help="answer every call after this long, one at a time")
    parser.add_argument("--garbage-every", type=int, default=0, help="every Nth call gets a malformed result")
    args = parser.parse_args(argv)
    how = Behaviour(tools=[t for t in args.tools.split(",") if t], page_size=args.page_size,
                    error_every=args.error_every, always_error=args.always_error, die_after=args.die_after,
                    stall_after=args.stall_after, pause_at=args.pause_at, pause_ms=args.pause_ms,
                    delay_ms=args.delay_ms, garbage_every=args.garbage_every)
    try:
        if args.http:
            serve_http(Trivial(how), args.port)
        else:
            serve_stdio(Trivial(how))
    except (BrokenPipeError, KeyboardInterrupt):
        sys.exit(0)


if __name__ == "__main__":
    main()
