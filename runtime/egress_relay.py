"""HTTP/1.1 through the egress proxy's TLS termination, for a host a plugin's secrets are bound to.

How this works (``runtime.egress`` calls ``relay`` once both TLS handshakes are done):

* One h11 connection faces the plugin (server role), one the real host (client role); requests and
  responses pass one at a time, keep-alive kept, bodies streamed, framing re-made by h11.
* In each request, every placeholder of the host's bindings is replaced by its value in the request
  target and the header values (``plugin_secrets.substitute``); the request body is passed as it is.
  ``Accept-Encoding: identity`` is asked for, so that a response comes back as plain bytes.
* In each response, every value is replaced by its placeholder, in the header values and in the body
  (``plugin_secrets.Masker``, across chunk boundaries): a host that echoes a credential does not hand it
  to the plugin. A masked body changes length, so a response with a body is sent on chunked.
* ``Expect: 100-continue`` is answered here; an ``Upgrade`` (WebSocket) is refused with 501: only
  HTTP/1.1 requests are relayed to a bound host.
* A request must name the host the tunnel was opened to (its ``Host``, and the authority of an
  absolute-form target), else 421: behind a shared front (a CDN routing by ``Host``) the bound
  host's connection could otherwise carry the value to another site (domain fronting).
* ``Content-Length`` beside ``Transfer-Encoding`` is removed (RFC 9112 6.3), so that a host reading
  the length cannot take the rest of a body as a request smuggled ahead of the next one.
* The same idle timeout and byte caps as a tunnel. Whatever goes wrong ends this connection only.
"""

from __future__ import annotations

import urllib.parse
import zlib
from typing import Protocol

import h11
import trio

from runtime.plugin_secrets import Binding, Masker, mask, substitute

RECV_BYTES = 64 * 1024
MAX_HEAD_BYTES = 16 * 1024
_NO_BODY_STATUS = (204, 304)


class Tally(Protocol):
    """What the proxy records of a connection (``runtime.egress._Record``)."""

    outcome: str
    reason: str
    bytes_up: int
    bytes_down: int
    secrets: set[str]


class Prefixed(trio.abc.Stream):
    """``stream`` with ``first`` put back in front (bytes the plugin sent right after its CONNECT)."""

    def __init__(self, stream: trio.abc.Stream, first: bytes) -> None:
        self.stream = stream
        self.first = first

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self.first:
            out, self.first = self.first, b""
            return out
        return bytes(await self.stream.receive_some(max_bytes))

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        pass  # a TLS stream underneath never half-closes

    async def aclose(self) -> None:
        await self.stream.aclose()


class _Ended(Exception):
    """The connection ends here (the reason is in the tally already)."""


class _Side:
    def __init__(self, conn: h11.Connection, stream: trio.abc.Stream, tally: Tally, up: bool, idle_s: float,
                 max_bytes: int) -> None:
        self.conn, self.stream, self.tally, self.up = conn, stream, tally, up
        self.idle_s, self.max_bytes = idle_s, max_bytes

    async def next_event(self) -> object:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            with trio.move_on_after(self.idle_s) as idle:
                data = await self.stream.receive_some(RECV_BYTES)
            if idle.cancelled_caught:
                self.tally.outcome, self.tally.reason = "idle_timeout", f"no bytes for {self.idle_s:g} s"
                raise _Ended
            self.conn.receive_data(bytes(data))

    async def send(self, event: h11.Event) -> None:
        data = self.conn.send(event) or b""
        if self.up:
            self.tally.bytes_up += len(data)
            total = self.tally.bytes_up
        else:
            self.tally.bytes_down += len(data)
            total = self.tally.bytes_down
        if total > self.max_bytes:
            self.tally.outcome, self.tally.reason = "byte_cap", f"more than {self.max_bytes} bytes one way"
            raise _Ended
        await self.stream.send_all(data)


def rewrite_request(request: h11.Request, bindings: tuple[Binding, ...]
                    ) -> tuple[bytes, list[tuple[bytes, bytes]], set[str]]:
    """The target and headers with the values put in (``Accept-Encoding`` set to identity, ``Expect``
    dropped: answered here); the names of the secrets put in."""
    used: set[str] = set()
    target, names = substitute(bytes(request.target), bindings)
    used.update(names)
    headers = []
    chunked = any(name == b"transfer-encoding" for name, _ in request.headers)
    for name, value in request.headers:
        if name in (b"accept-encoding", b"expect") or (chunked and name == b"content-length"):
            continue
        value, names = substitute(bytes(value), bindings)
        used.update(names)
        headers.append((bytes(name), value))
    headers.append((b"accept-encoding", b"identity"))
    return target, headers, used


def _names_host(request: h11.Request, host: str) -> bool:
    """Whether ``request``'s ``Host`` (and an absolute-form target's authority) name ``host``."""
    target = bytes(request.target)
    if not target.startswith(b"/") and target != b"*":
        if urllib.parse.urlsplit(target.decode("latin-1")).hostname != host:
            return False
    value = next((bytes(v) for n, v in request.headers if n == b"host"), b"")
    try:
        named = urllib.parse.urlsplit("//" + value.decode("ascii")).hostname
    except (UnicodeDecodeError, ValueError):
        return False
    return named is not None and named.removesuffix(".") == host


class _Decoder:
    """A response body's ``Content-Encoding`` undone as it streams (gzip or deflate), so that the
    masker sees the bytes the plugin would: a host that compresses although asked for ``identity``
    must not hand an echoed credential past the mask. Output is capped (a decompression bomb ends
    the exchange like any other byte cap)."""

    def __init__(self, encoding: bytes, cap: int) -> None:
        # gzip and zlib headers are told apart by zlib itself (32 + 15); bare deflate is retried raw.
        self.raw = False
        self.encoding = encoding
        self.z = zlib.decompressobj(32 + 15)
        self.left = cap

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        while data:
            try:
                chunk = self.z.decompress(data, 65536)
            except zlib.error:
                if self.raw or self.encoding != b"deflate" or out:
                    raise
                self.raw, self.z = True, zlib.decompressobj(-15)
                continue
            out += chunk
            self.left -= len(chunk)
            if self.left < 0:
                raise zlib.error("the decoded body is larger than the relay's byte cap")
            data = self.z.unconsumed_tail
            if not chunk and not data:
                break
        return bytes(out)


#: Encodings the relay can undo (and so mask); anything else from a bound host is refused.
_DECODABLE = frozenset({b"gzip", b"x-gzip", b"deflate"})


def _content_encoding(response: h11.Response) -> bytes | None:
    """The response's ``Content-Encoding`` (lower case, ``identity`` as None); several codings joined."""
    codings = [c.strip().lower() for n, v in response.headers if bytes(n) == b"content-encoding"
               for c in bytes(v).split(b",") if c.strip()]
    codings = [c for c in codings if c != b"identity"]
    return b",".join(codings) if codings else None


def response_headers(response: h11.Response | h11.InformationalResponse, bindings: tuple[Binding, ...],
                     method: bytes) -> list[tuple[bytes, bytes]]:
    headers = [(bytes(n), mask(bytes(v), bindings)) for n, v in response.headers]
    if isinstance(response, h11.InformationalResponse) or method == b"HEAD" or \
            response.status_code in _NO_BODY_STATUS:
        return headers
    # A masked body may change length: sent on chunked (h11 falls back to close for an HTTP/1.0 peer);
    # a compressed one is sent decoded (``_Decoder``).
    headers = [(n, v) for n, v in headers if n not in (b"content-length", b"transfer-encoding", b"content-encoding")]
    return headers + [(b"transfer-encoding", b"chunked")]


async def relay(client: trio.abc.Stream, upstream: trio.abc.Stream, bindings: tuple[Binding, ...], tally: Tally,
                *, host: str, idle_s: float, max_bytes: int) -> None:
    """Relay requests from ``client`` to ``upstream`` (the real ``host``, normalized) until either side
    ends (see the module doc)."""
    down = _Side(h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES), client, tally, False, idle_s,
                 max_bytes)
    up = _Side(h11.Connection(h11.CLIENT), upstream, tally, True, idle_s, max_bytes)
    try:
        while await _one_exchange(down, up, bindings, tally, host):
            try:
                down.conn.start_next_cycle()
                up.conn.start_next_cycle()
            except h11.LocalProtocolError:
                return
    except _Ended:
        return
    except h11.RemoteProtocolError as exc:
        tally.outcome, tally.reason = "bad_request", f"malformed HTTP inside the TLS connection: {exc}"
        await _refuse(down, 400, tally.reason)


async def _refuse(down: _Side, status: int, text: str) -> None:
    if down.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
        return
    body = (text + "\n").encode()
    try:
        await down.send(h11.Response(status_code=status, headers=[("content-type", "text/plain; charset=utf-8"),
                                                                   ("content-length", str(len(body))),
                                                                   ("connection", "close")]))
        await down.send(h11.Data(data=body))
        await down.send(h11.EndOfMessage())
    except (h11.LocalProtocolError, _Ended, trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def _one_exchange(down: _Side, up: _Side, bindings: tuple[Binding, ...], tally: Tally, host: str) -> bool:
    """One request and its response; whether the connection may carry another."""
    request = await down.next_event()
    if not isinstance(request, h11.Request):
        return False
    if any(name == b"upgrade" for name, _ in request.headers):
        await _refuse(down, 501, "protocol upgrades are not relayed to a host a secret is bound to")
        return False
    if not _names_host(request, host):
        tally.outcome, tally.reason = "refused", f"a request inside the tunnel to {host} named another host"
        await _refuse(down, 421, f"this connection carries requests for {host} only: its Host header (and an "
                                 "absolute-form target) must name it")
        return False
    target, headers, used = rewrite_request(request, bindings)
    tally.secrets |= used
    if down.conn.they_are_waiting_for_100_continue:
        await down.send(h11.InformationalResponse(status_code=100, headers=[]))
    await up.send(h11.Request(method=request.method, target=target, headers=headers))
    while True:
        event = await down.next_event()
        if isinstance(event, h11.Data):
            await up.send(h11.Data(data=bytes(event.data)))
        elif isinstance(event, h11.EndOfMessage):
            await up.send(h11.EndOfMessage())
            break
        else:
            return False
    masker = Masker(bindings)
    decoder: _Decoder | None = None
    try:
        while True:
            event = await up.next_event()
            if isinstance(event, h11.InformationalResponse):
                if event.status_code != 100:
                    await down.send(h11.InformationalResponse(status_code=event.status_code, headers=response_headers(
                        event, bindings, request.method), reason=event.reason))
            elif isinstance(event, h11.Response):
                encoding = _content_encoding(event)
                has_body = request.method != b"HEAD" and event.status_code not in _NO_BODY_STATUS
                if encoding is not None and has_body:
                    if encoding not in _DECODABLE:
                        tally.outcome, tally.reason = "refused", (
                            f"the host answered with Content-Encoding {encoding.decode('latin-1')[:40]}, which the "
                            "relay cannot check for the secret (it asked for identity)")
                        await _refuse(down, 502, tally.reason)
                        return False
                    decoder = _Decoder(encoding, up.max_bytes)
                await down.send(h11.Response(status_code=event.status_code, reason=event.reason,
                                             headers=response_headers(event, bindings, request.method)))
            elif isinstance(event, h11.Data):
                data = bytes(event.data)
                try:
                    data = decoder.feed(data) if decoder is not None else data
                except zlib.error as exc:
                    tally.outcome, tally.reason = "unreachable", f"the host's compressed answer does not decode: {exc}"
                    return False  # the response has begun: the connection ends mid-body
                chunk = masker.feed(data)
                if chunk:
                    await down.send(h11.Data(data=chunk))
            elif isinstance(event, h11.EndOfMessage):
                tail = masker.flush()
                if tail:
                    await down.send(h11.Data(data=tail))
                await down.send(h11.EndOfMessage())
                break
            else:
                tally.outcome, tally.reason = "unreachable", "the host closed the connection before its answer"
                await _refuse(down, 502, tally.reason)
                return False
    except h11.RemoteProtocolError as exc:
        tally.outcome, tally.reason = "unreachable", f"the host's answer is not HTTP/1.1: {exc}"
        await _refuse(down, 502, tally.reason)
        return False
    return down.conn.our_state is h11.DONE and up.conn.our_state is h11.DONE and \
        down.conn.their_state is h11.DONE and up.conn.their_state is h11.DONE
