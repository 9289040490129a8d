"""The network grant, enforced outside the plugin: the egress proxy, the empty network namespace, and
``max_processes``.

Three levels: the rules alone (``runtime.egress_rules``, no I/O); the daemon's proxy in this process
on real sockets (``runtime.egress``, with a fake resolver); and, where the process boundary is the
point, a real ``toolcell serve`` with real sandboxed workers, whose plugin tries to get out.
Attacks also run under ``none`` (the canary): there they must succeed.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import h11
import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from sandbox_harness import Worker, text_of
from stdio_peer import REPO, StdioPeer, open_toolcell
from stdio_peer import text_of as peer_text

from runtime import egress
from runtime.egress_rules import Grant, Own, Refused, address_problem, parse_entry, vet
from runtime.manifest import MIN_PROCESSES, ManifestError, load_manifest
from runtime.policy import check_layers
from sandbox.isolation import LAYERS
from sandbox.wire import EgressListener, Limits, Permissions, from_worker_decoder, split_frames

ip = ipaddress.ip_address

# Each tool reports what it got; none of them raises.
NET_PLUGIN = r'''
import http.client
import json
import os
import socket
import urllib.request

from sandbox import tool


def report(ok, detail=""):
    return json.dumps({"ok": bool(ok), "detail": str(detail)[:800]})


def proxy():
    url = os.environ.get("HTTPS_PROXY", "")
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port or 0)


@tool
def env() -> str:
    return json.dumps({k: v for k, v in os.environ.items() if "proxy" in k.lower()})


@tool
def http_get(url: str) -> str:
    """Plain urllib: it finds the proxy in the environment."""
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return report(r.status == 200, r.read(300).decode())
    except Exception as exc:
        return report(False, exc)


@tool
def tunnel_get(host: str, port: int, path: str) -> str:
    """CONNECT through the proxy (what https does), then HTTP inside the tunnel."""
    phost, pport = proxy()
    conn = http.client.HTTPConnection(phost, pport, timeout=10)
    conn.set_tunnel(host, port)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return report(r.status == 200, r.read(300).decode())
    except Exception as exc:
        return report(False, exc)
    finally:
        conn.close()


@tool
def proxy_raw(data: str, host: str = "", port: int = 0) -> str:
    """Send raw bytes (latin-1) to the proxy, or to host:port; return everything until it closes."""
    if not host:
        host, port = proxy()
    got = b""
    try:
        s = socket.create_connection((host, port), timeout=10)
        s.sendall(data.encode("latin-1"))
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        s.close()
    except OSError as exc:
        return json.dumps({"line": "", "raw": repr(exc)})
    return json.dumps({"line": got.split(b"\r\n")[0].decode("latin-1"), "raw": got[:2000].decode("latin-1")})


@tool
def direct_tcp(host: str, port: int) -> str:
    try:
        s = socket.create_connection((host, port), timeout=3)
        s.sendall(b"direct")
        s.close()
        return report(True, "connected")
    except OSError as exc:
        return report(False, repr(exc))


@tool
def udp_echo(host: str, port: int) -> str:
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(2)
        s.sendto(b"ping", (host, port))
        data, _ = s.recvfrom(100)
        return report(data == b"ping", data)
    except OSError as exc:
        return report(False, repr(exc))


@tool
def resolve(name: str) -> str:
    try:
        return report(True, socket.getaddrinfo(name, 80))
    except OSError as exc:
        return report(False, repr(exc))
'''


# -- the rules ---------------------------------------------------------------------------------------


def grant(*entries: str) -> Grant:
    return Grant.parse(entries)


def test_a_grant_matches_exact_names_case_insensitively_and_wildcards_below_their_domain() -> None:
    g = grant("api.example.com:443", "*.cdn.example.org:443", "127.0.0.1:8080", "[2001:db8::1]:80", "localhost:9")
    assert g.match("API.Example.COM.", 443).host == "api.example.com"
    assert g.match("a.b.cdn.example.org", 443).kind == "wildcard"
    assert g.match("127.0.0.1", 8080).kind == "ip"
    assert g.match("2001:db8:0::1", 80).kind == "ip"
    assert g.match("localhost", 9).kind == "localhost"
    for host, port in [("api.example.com", 80), ("cdn.example.org", 443), ("evilcdn.example.org", 443),
                       ("127.0.0.2", 8080), ("localhost", 8080), ("example.com", 443)]:
        with pytest.raises(Refused) as exc:
            g.match(host, port)
        assert exc.value.status == 403


@pytest.mark.parametrize("address, problem", [
    ("127.0.0.1", "loopback"), ("::1", "loopback"), ("169.254.169.254", "link-local"), ("fe80::1", "link-local"),
    ("0.0.0.0", "unspecified"), ("224.0.0.1", "multicast"), ("10.1.2.3", "private"), ("192.168.1.1", "private"),
    ("fd00::2", "private"), ("::ffff:127.0.0.1", "loopback"), ("64:ff9b::a9fe:a9fe", "link-local"),
    ("2002:7f00:1::", "loopback"), ("100.64.0.1", "not globally routable"), ("93.184.216.34", None),
    ("2606:2800:220:1::1", None),
])
def test_every_non_public_address_family_is_recognised(address: str, problem: str | None) -> None:
    assert address_problem(ip(address)) == problem


def test_a_name_is_refused_if_any_of_its_addresses_is_internal_unless_the_grant_names_that_ip() -> None:
    name = parse_entry("api.example.com:443")
    assert vet(name, [ip("93.184.216.34")], Own()) == [ip("93.184.216.34")]
    with pytest.raises(Refused, match="loopback"):
        vet(name, [ip("93.184.216.34"), ip("127.0.0.1")], Own())  # a rebinding-style mixed answer
    with pytest.raises(Refused, match="link-local"):
        vet(name, [ip("169.254.169.254")], Own())
    assert vet(parse_entry("10.0.0.5:443"), [ip("10.0.0.5")], Own()) == [ip("10.0.0.5")]
    assert vet(parse_entry("localhost:80"), [ip("127.0.0.1"), ip("::1")], Own()) == [ip("127.0.0.1"), ip("::1")]
    with pytest.raises(Refused, match="private"):
        vet(parse_entry("localhost:80"), [ip("10.0.0.1")], Own())


def test_the_daemons_own_listening_ports_are_refused_unless_named_by_exact_address() -> None:
    own = Own(frozenset({(ip("0.0.0.0"), 8765), (ip("127.0.0.1"), 9464)}), frozenset({ip("93.184.216.34")}))
    with pytest.raises(Refused, match="daemon's own"):
        vet(parse_entry("localhost:8765"), [ip("127.0.0.1")], own)
    with pytest.raises(Refused, match="daemon's own"):
        vet(parse_entry("myhost.example:8765"), [ip("93.184.216.34")], own)  # a public address of this machine
    with pytest.raises(Refused, match="daemon's own"):
        vet(parse_entry("localhost:9464"), [ip("127.0.0.1")], own)
    assert vet(parse_entry("127.0.0.1:8765"), [ip("127.0.0.1")], own) == [ip("127.0.0.1")]
    assert vet(parse_entry("localhost:8766"), [ip("127.0.0.1")], own) == [ip("127.0.0.1")]


@pytest.mark.parametrize("entry, fragment", [
    ("example.com", "host:port"), ("example.com:0", "1-65535"), ("example.com:70000", "1-65535"),
    ("::1:80", "brackets"), ("[1.2.3.4]:80", "IPv6"), ("*.com:443", "two labels"), ("a*.example.com:1", "wildcard"),
    ("exa mple.com:80", "not a host name"), ("http://example.com:80", "not a URL"),
])
def test_malformed_grant_entries_are_refused_with_the_reason(entry: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        parse_entry(entry)


def test_strict_requires_the_egress_layer_only_from_a_plugin_with_a_grant() -> None:
    assert check_layers("strict", list(LAYERS), [], "p") is None
    assert "egress" in (check_layers("strict", list(LAYERS), [], "p", network=True) or "")
    assert check_layers("strict", [*LAYERS, "egress"], [], "p", network=True) is None
    assert check_layers("compat", list(LAYERS), ["egress"], "p", network=True) is None


# -- manifests ---------------------------------------------------------------------------------------


def write_manifest(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "p.py").write_text("")
    (folder / "plugin.toml").write_text('name = "p"\nversion = "1"\nentry = "p"\n' + body)
    return folder


def test_max_processes_defaults_to_64_and_is_read_from_the_manifest(tmp_path: Path) -> None:
    assert load_manifest(write_manifest(tmp_path / "a", "")).limits.max_processes == 64
    assert load_manifest(write_manifest(tmp_path / "b", "[limits]\nmax_processes = 300\n")).limits.max_processes == 300


@pytest.mark.parametrize("body, fragment", [
    ("[limits]\nmax_processes = 7\n", "limits.max_processes = 7: must be between 8 and 4096"),
    ("[limits]\nmax_processes = 5000\n", "limits.max_processes = 5000: must be between 8 and 4096"),
    ('[limits]\nmax_processes = "many"\n', "limits.max_processes = 'many': must be an integer"),
    ('[permissions]\nnetwork = ["example.com"]\n', "use host:port"),
    ('[permissions]\nnetwork = ["*.com:443"]\n', "wildcard"),
])
def test_bad_limits_and_network_entries_fail_the_manifest_check(tmp_path: Path, body: str, fragment: str) -> None:
    with pytest.raises(ManifestError) as exc:
        load_manifest(write_manifest(tmp_path / "p", body))
    assert fragment in str(exc.value)


@pytest.mark.parametrize("body, fragment", [
    ("x = " + "[" * 2000 + "]" * 2000 + "\n", "nested too deeply"),
    ("[limits]\ntimeout_s = " + "9" * 5000 + "\n", "not valid TOML"),
    ("description = '" + "x" * 300_000 + "'\n", "larger than"),
    ('[env]\nset = { GCONV_PATH = "/plugin/gconv", LOCPATH = "/plugin/locale" }\n', "'GCONV_PATH' may not be passed"),
    ('[env]\nallow = ["GLIBC_TUNABLES"]\n', "'GLIBC_TUNABLES' may not be passed"),
    ('[permissions]\nwrite = ["/srv/shared/esc/.."]\n', "must not contain '..'"),
])
def test_a_hostile_manifest_refuses_its_plugin_with_a_reason_and_raises_nothing_else(
        tmp_path: Path, body: str, fragment: str) -> None:
    """What a plugin author writes in plugin.toml refuses that plugin only: a nesting or a number
    tomllib cannot take (RecursionError, ValueError) used to escape and stop the daemon on a hot
    reload; a variable that makes glibc load code from the plugin's folder before the worker
    isolates (GCONV_PATH, LOCPATH ...) is refused like LD_*."""
    with pytest.raises(ManifestError) as exc:
        load_manifest(write_manifest(tmp_path / "p", body))
    assert fragment in str(exc.value)


def test_a_manifest_that_is_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    folder = write_manifest(tmp_path / "p", "")
    (folder / "plugin.toml").unlink()
    (folder / "plugin.toml").mkdir()
    with pytest.raises(ManifestError) as exc:
        load_manifest(folder)
    assert "not a regular file" in str(exc.value) or "cannot be read" in str(exc.value)


# -- the proxy in this process, on real sockets --------------------------------------------------------


class FakeResolver(trio.abc.HostnameResolver):
    """Names the tests make up, each resolving to chosen addresses (no DNS on these machines)."""

    def __init__(self, names: dict[str, list[str]]) -> None:
        self.names = names

    async def getaddrinfo(self, host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0,
                          flags: int = 0) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name not in self.names:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, int(port)) if ":" not in a else (a, int(port), 0, 0)) for a in self.names[name]]

    async def getnameinfo(self, sockaddr: Any, flags: int) -> Any:
        raise NotImplementedError


@asynccontextmanager
async def http_server(nursery: trio.Nursery) -> AsyncIterator[tuple[int, list[str]]]:
    """A tiny HTTP server on 127.0.0.1: answers ``hello <path>`` and closes; records each request."""
    seen: list[str] = []

    async def handle(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            with trio.fail_after(10):
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive_some(65536))
                        continue
                    if isinstance(event, h11.Request):
                        seen.append(f"{event.method.decode()} {event.target.decode()} "
                                     f"host={dict(event.headers).get(b'host', b'').decode()}")
                        target = event.target
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    elif isinstance(event, h11.ConnectionClosed):
                        return
                body = b"hello " + target
                await stream.send_all(conn.send(h11.Response(status_code=200, headers=[
                    ("content-length", str(len(body))), ("connection", "close")])) or b"")
                await stream.send_all((conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b""))
        except (h11.ProtocolError, trio.BrokenResourceError, trio.TooSlowError):
            pass
        finally:
            await stream.aclose()

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
    yield listeners[0].socket.getsockname()[1], seen


@asynccontextmanager
async def proxy(nursery: trio.Nursery, g: Grant) -> AsyncIterator[int]:
    """``runtime.egress.serve_proxy`` on a listener of our own (as if a worker had handed it over)."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(16)
    port = lst.getsockname()[1]
    scope = trio.CancelScope()
    nursery.start_soon(egress.serve_proxy, lst, g, "test", 0, scope)
    try:
        yield port
    finally:
        scope.cancel()


async def exchange(port: int, data: bytes, *, then: bytes = b"", timeout: float = 10) -> bytes:
    """Send ``data`` (and ``then`` once the head is answered) to 127.0.0.1:port; everything until EOF."""
    with trio.fail_after(timeout):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(data)
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    return got
                got += chunk
            if then and got.startswith(b"HTTP/1.1 200"):
                await stream.send_all(then)
            while chunk := await stream.receive_some(65536):
                got += chunk
            return got


def connect_request(authority: str) -> bytes:
    return f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode()


async def test_connect_tunnels_to_a_granted_destination_and_forwards_plain_http(nursery: trio.Nursery) -> None:
    async with http_server(nursery) as (port, seen), proxy(nursery, grant(f"127.0.0.1:{port}")) as pport:
        got = await exchange(pport, connect_request(f"127.0.0.1:{port}"),
                             then=b"GET /via-tunnel HTTP/1.1\r\nHost: x\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200 Connection established\r\n\r\nHTTP/1.1 200")
        assert got.endswith(b"hello /via-tunnel")
        got = await exchange(pport, f"GET http://127.0.0.1:{port}/plain?q=1 HTTP/1.1\r\nHost: evil\r\n"
                                    "Proxy-Authorization: secret\r\n\r\n".encode())
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"hello /plain?q=1")
        # The origin server saw origin-form targets and the URL's authority as Host, not the plugin's.
        assert seen == ["GET /via-tunnel host=x", f"GET /plain?q=1 host=127.0.0.1:{port}"]


async def test_refused_destinations_get_403_with_the_reason_and_are_never_dialled(nursery: trio.Nursery) -> None:
    trio.socket.set_custom_hostname_resolver(FakeResolver({
        "metadata.test": ["169.254.169.254"], "rebind.test": ["93.184.216.34", "127.0.0.1"],
        "internal.test": ["10.0.0.5"], "v6.test": ["::ffff:127.0.0.1"],
    }))
    try:
        async with http_server(nursery) as (port, seen):
            g = grant(f"127.0.0.1:{port}", "metadata.test:80", f"rebind.test:{port}", "internal.test:443",
                      f"v6.test:{port}")
            async with proxy(nursery, g) as pport:
                for authority, reason in [
                    (f"127.0.0.1:{port + 1 if port < 65535 else 1}", b"not in the plugin's network grant"),
                    (f"localhost:{port}", b"not in the plugin's network grant"),
                    ("169.254.169.254:80", b"not in the plugin's network grant"),
                    ("metadata.test:80", b"link-local"),
                    (f"rebind.test:{port}", b"loopback"),
                    ("internal.test:443", b"private"),
                    (f"v6.test:{port}", b"loopback"),
                ]:
                    got = await exchange(pport, connect_request(authority))
                    assert got.startswith(b"HTTP/1.1 403 Forbidden"), (authority, got)
                    assert reason in got, (authority, got)
                got = await exchange(pport, b"GET http://metadata.test/latest/meta-data HTTP/1.1\r\nHost: x\r\n\r\n")
                assert got.startswith(b"HTTP/1.1 403") and b"link-local" in got
        assert seen == []
    finally:
        trio.socket.set_custom_hostname_resolver(None)


@pytest.mark.parametrize("request_bytes, status", [
    (b"garbage\r\n\r\n", b"400"),
    (b"CONNECT nonsense HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
    (b"CONNECT [::1:80 HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
    (b"CONNECT exa$mple.com:80 HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
    (b"GET /relative HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
    (b"GET https://example.com/ HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
    (b"GET http://user:pw@example.com/ HTTP/1.1\r\nHost: x\r\n\r\n", b"400"),
    (b"\x00\xff\xfe" * 50 + b"\r\n\r\n", b"400"),
    (b"GET http://example.com/ HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 100_000 + b"\r\n\r\n", b"431"),
], ids=["garbage", "connect-no-port", "connect-bad-v6", "connect-bad-name", "origin-form", "https-url",
        "credentials", "binary", "huge-head"])
async def test_malformed_requests_get_an_error_status_and_the_proxy_keeps_serving(
        nursery: trio.Nursery, request_bytes: bytes, status: bytes) -> None:
    async with http_server(nursery) as (port, _), proxy(nursery, grant(f"127.0.0.1:{port}")) as pport:
        got = await exchange(pport, request_bytes)
        assert got.split(b" ")[1] == status, got
        got = await exchange(pport, f"GET http://127.0.0.1:{port}/after HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert got.endswith(b"hello /after")


async def test_a_slow_head_times_out_an_idle_tunnel_is_closed_and_connections_are_bounded(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(egress, "HEAD_TIMEOUT_S", 0.3)
    monkeypatch.setattr(egress, "IDLE_TIMEOUT_S", 0.3)
    monkeypatch.setattr(egress, "MAX_CONNECTIONS", 2)
    async with http_server(nursery) as (port, _), proxy(nursery, grant(f"127.0.0.1:{port}")) as pport:
        assert (await exchange(pport, b"CONNECT 127.0.0.1")).startswith(b"HTTP/1.1 408")
        # A tunnel nobody uses: the proxy closes it (the exchange would otherwise wait for EOF).
        got = await exchange(pport, connect_request(f"127.0.0.1:{port}"), timeout=5)
        assert got == b"HTTP/1.1 200 Connection established\r\n\r\n"
        held = [await trio.open_tcp_stream("127.0.0.1", pport) for _ in range(2)]
        await trio.sleep(0.05)
        assert (await exchange(pport, connect_request(f"127.0.0.1:{port}"))).startswith(b"HTTP/1.1 503")
        for s in held:
            await s.aclose()


async def test_a_tunnel_stops_at_its_byte_cap(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(egress, "MAX_TUNNEL_BYTES", 1000)
    async with http_server(nursery) as (port, seen), proxy(nursery, grant(f"127.0.0.1:{port}")) as pport:
        big = b"GET /big HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 5000 + b"\r\n\r\n"
        got = await exchange(pport, connect_request(f"127.0.0.1:{port}"), then=big)
        assert got == b"HTTP/1.1 200 Connection established\r\n\r\n"
        assert seen == []


def test_adopt_listener_accepts_only_a_listening_loopback_tcp_socket() -> None:
    good = socket.socket()
    good.bind(("127.0.0.1", 0))
    good.listen(1)
    port = good.getsockname()[1]
    adopted = egress.adopt_listener([os.dup(good.fileno())], port)
    adopted.close()
    good.close()
    unbound = socket.socket()
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    r, w = os.pipe()
    for fd, p in [(os.dup(unbound.fileno()), 0), (os.dup(udp.fileno()), udp.getsockname()[1]), (r, 1)]:
        with pytest.raises(ValueError):
            egress.adopt_listener([fd], p)
        with pytest.raises(OSError):
            os.fstat(fd)  # consumed (closed) either way
    unbound.close()
    udp.close()
    os.close(w)


async def test_start_proxy_refuses_a_socket_without_a_grant_or_a_second_one_and_serves_a_granted_one() -> None:
    """The one place both the plugin pools and hosted servers take a worker's proxy socket: a plugin
    without a grant, a second socket, or a socket that is not the named listener is the worker's
    fault (``garbage``); a good one is served until its scope is cancelled, and then closed."""
    from runtime.protocol.errors import WorkerFailure

    def listener() -> tuple[socket.socket, int]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        return sock, sock.getsockname()[1]

    granted = grant("127.0.0.1:1")
    async with trio.open_nursery() as nursery:
        for g, already in [(Grant([]), False), (granted, True)]:
            sock, port = listener()
            fds = [os.dup(sock.fileno())]
            with pytest.raises(WorkerFailure) as refused:
                egress.start_proxy(nursery, g, "p", 1, fds, port, already)
            assert refused.value.kind == "garbage" and "no grant" in str(refused.value)
            assert len(fds) == 1  # not taken: the owner of ``fds`` closes it
            os.close(fds[0])
            sock.close()
        r, w = os.pipe()
        with pytest.raises(WorkerFailure) as refused:
            egress.start_proxy(nursery, granted, "p", 1, [r], 1, False)
        assert refused.value.kind == "garbage" and "not a socket" in str(refused.value)
        os.close(w)
        sock, port = listener()
        scope = egress.start_proxy(nursery, granted, "p", 1, [os.dup(sock.fileno())], port, False)
        sock.close()
        with trio.fail_after(5):
            client = await trio.open_tcp_stream("127.0.0.1", port)  # the proxy accepts
            await client.aclose()
        scope.cancel()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # closed with its scope


# -- real workers (the harness): the worker's half -----------------------------------------------------


class EgressWorker(Worker):
    """The harness worker, also receiving the listening socket a granted worker hands over."""

    egress_port = 0
    listener: socket.socket | None = None

    def ready(self, timeout_s: float = 10.0) -> Any:
        import select
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            frames = split_frames(self.buf, max_count=1)
            if frames:
                msg = from_worker_decoder.decode(frames[0])
                if isinstance(msg, EgressListener):
                    self.egress_port = msg.port
                    continue
                return msg
            r, _, _ = select.select([self.sock], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                raise TimeoutError("no frame from the worker in time")
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, 4)
            if not data:
                raise EOFError("worker closed the channel")
            for fd in fds:
                if self.listener is None:
                    self.listener = socket.socket(fileno=fd)
                else:
                    os.close(fd)
            self.buf += data

    def close(self) -> str:
        if self.listener is not None:
            self.listener.close()
        return super().close()


BREAK_LOOPBACK = ("import sandbox.isolation.egress as _eg\n"
                  "def _broken():\n    raise OSError(1, 'test: lo cannot be brought up')\n"
                  "_eg.loopback_up = _broken")
NO_LANDLOCK = "import sandbox.isolation.landlock as _ll; _ll.abi_version = lambda: 0"


@pytest.fixture(scope="module")
def net_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from sandbox_harness import write_plugin

    return write_plugin(tmp_path_factory.mktemp("net") / "plugin", NET_PLUGIN, entry="net_plugin")


@pytest.fixture
def egress_worker(net_plugin: Path) -> Iterator[Callable[..., EgressWorker]]:
    workers: list[EgressWorker] = []

    def start(policy: str = "strict", **kwargs: Any) -> EgressWorker:
        w = EgressWorker(net_plugin, policy=policy, entry="net_plugin", **kwargs)
        workers.append(w)
        return w

    yield start
    for w in workers:
        w.close()


@pytest.fixture
def host_listener() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv.getsockname()[1]
    srv.close()


def out(w: Worker, tool: str, **args: Any) -> Any:
    result = w.call(tool, **args)
    assert not result.is_error, text_of(result)
    return json.loads(text_of(result))


def test_a_granted_worker_hands_over_a_loopback_listener_from_its_own_empty_network_namespace(
        egress_worker: Callable[..., EgressWorker], require: Any, host_listener: int) -> None:
    require(*LAYERS)
    w = egress_worker("strict", permissions=Permissions(network=[f"127.0.0.1:{host_listener}"]))
    ready = w.ready()
    assert ready.layers == [*LAYERS, "egress"], ready
    assert w.listener is not None and w.listener.getsockname() == ("127.0.0.1", w.egress_port)
    assert w.listener.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
    proxy_url = f"http://127.0.0.1:{w.egress_port}"
    assert out(w, "env") == {"HTTP_PROXY": proxy_url, "HTTPS_PROXY": proxy_url, "ALL_PROXY": proxy_url,
                             "http_proxy": proxy_url, "https_proxy": proxy_url, "all_proxy": proxy_url,
                             "NO_PROXY": "", "no_proxy": ""}
    # The host's listener on the same address is not reachable from the worker's namespace ...
    assert not out(w, "direct_tcp", host="127.0.0.1", port=host_listener)["ok"]
    # ... but what it sends to its proxy port arrives here, at the socket it handed over.
    heard: list[bytes] = []

    def answer_once() -> None:
        assert w.listener is not None
        conn, _ = w.listener.accept()
        with conn:
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(4096)
            heard.append(data)
            conn.sendall(b"HTTP/1.1 200 OK\r\n\r\nfrom-the-test")

    w.listener.settimeout(10)
    t = threading.Thread(target=answer_once, daemon=True)
    t.start()
    got = out(w, "proxy_raw", data="CONNECT x.example:1 HTTP/1.1\r\n\r\n")
    t.join(timeout=10)
    assert heard == [b"CONNECT x.example:1 HTTP/1.1\r\n\r\n"]
    assert got["raw"].endswith("from-the-test")


def test_the_empty_network_namespace_alone_stops_direct_connections(
        egress_worker: Callable[..., EgressWorker], require: Any, host_listener: int) -> None:
    # Landlock off (compat): what still stops the plugin is that its namespace has nothing but lo.
    require("namespaces", "seccomp")
    w = egress_worker("compat", prelude=NO_LANDLOCK, permissions=Permissions(network=[f"127.0.0.1:{host_listener}"]))
    ready = w.ready()
    assert "egress" in ready.layers and ready.missing == ["landlock"]
    got = out(w, "direct_tcp", host="127.0.0.1", port=host_listener)
    assert not got["ok"] and "ConnectionRefused" in got["detail"], got
    got = out(w, "direct_tcp", host="192.0.2.1", port=80)
    assert not got["ok"] and "unreachable" in got["detail"], got


@pytest.mark.parametrize("policy", ["strict", "none"])
def test_direct_tcp_and_udp_around_the_proxy_fail(
        policy: str, egress_worker: Callable[..., EgressWorker], require: Any, host_listener: int) -> None:
    if policy == "strict":
        require("namespaces", "landlock", "seccomp")
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(5)
    try:
        w = egress_worker(policy, permissions=Permissions(network=[f"127.0.0.1:{host_listener}"]))
        assert type(w.ready()).__name__ == "Ready"
        tcp = out(w, "direct_tcp", host="127.0.0.1", port=host_listener)

        def echo_once() -> None:
            try:
                data, addr = udp.recvfrom(100)
                udp.sendto(data, addr)
            except OSError:
                pass

        t = threading.Thread(target=echo_once, daemon=True)
        t.start()
        dgram = out(w, "udp_echo", host="127.0.0.1", port=udp.getsockname()[1])
        if policy == "strict":
            assert not tcp["ok"] and not dgram["ok"], (tcp, dgram)
        else:
            assert tcp["ok"] and dgram["ok"], (tcp, dgram)
    finally:
        udp.close()


def test_strict_refuses_a_granted_worker_whose_egress_cannot_be_set_up(
        egress_worker: Callable[..., EgressWorker]) -> None:
    msg = egress_worker("strict", prelude=BREAK_LOOPBACK, permissions=Permissions(network=["example.com:443"])).ready()
    assert type(msg).__name__ == "LoadFailed" and msg.stage == "isolation"
    assert "egress" in msg.error and "lo cannot be brought up" in msg.error


def test_compat_runs_a_granted_worker_without_egress_with_no_network_and_says_so(
        egress_worker: Callable[..., EgressWorker], require: Any, host_listener: int) -> None:
    require("namespaces", "seccomp")
    w = egress_worker("compat", prelude=BREAK_LOOPBACK, permissions=Permissions(network=[f"127.0.0.1:{host_listener}"]))
    ready = w.ready()
    assert type(ready).__name__ == "Ready" and "egress" in ready.missing and "egress" not in ready.layers
    assert w.listener is None and out(w, "env") == {}
    assert not out(w, "direct_tcp", host="127.0.0.1", port=host_listener)["ok"]


NO_NAMESPACES = ("import sandbox.isolation.namespaces as _ns\n"
                 "def _nope(*a, **k):\n    raise OSError(1, 'test: no namespaces')\n"
                 "_ns.enter = _ns.enter_unprivileged = _nope")


def test_compat_without_namespaces_proxies_from_the_host_network_guarded_by_landlock_and_says_so(
        egress_worker: Callable[..., EgressWorker], require: Any, host_listener: int) -> None:
    require("landlock", "seccomp")
    w = egress_worker("compat", prelude=NO_NAMESPACES, permissions=Permissions(network=[f"127.0.0.1:{host_listener}"]))
    ready = w.ready()
    assert type(ready).__name__ == "Ready", ready
    assert "namespaces" in ready.missing and "egress" in ready.missing and "egress" not in ready.layers
    assert w.listener is not None and out(w, "env")["HTTPS_PROXY"] == f"http://127.0.0.1:{w.egress_port}"
    got = out(w, "direct_tcp", host="127.0.0.1", port=host_listener)
    assert not got["ok"] and "Permission denied" in got["detail"], got


def test_an_ungranted_worker_gets_no_proxy_and_no_inet_sockets(
        egress_worker: Callable[..., EgressWorker], require: Any, host_listener: int) -> None:
    require(*LAYERS)
    w = egress_worker("strict")
    assert w.ready().layers == list(LAYERS)
    assert w.listener is None and out(w, "env") == {}
    got = out(w, "direct_tcp", host="127.0.0.1", port=host_listener)
    assert not got["ok"] and "Operation not permitted" in got["detail"], got


# -- max_processes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_processes, forks, reached", [(16, 40, False), (128, 90, True)])
def test_max_processes_bounds_a_fork_loop(
        spawn: Callable[..., Worker], require: Any, max_processes: int, forks: int, reached: bool) -> None:
    # The second case needs more than the old fixed limit of 64: it fails unless the manifest value is used.
    require("cgroup")
    w = spawn("strict", limits=Limits(max_processes=max_processes))
    assert type(w.ready()).__name__ == "Ready"
    got = json.loads(text_of(w.call("fork_bomb", n=forks, timeout_s=30)))
    assert got["ok"] is reached, got
    if not reached:
        assert int(got["detail"].split()[0]) < max_processes


def test_the_smallest_max_processes_still_runs_pooled_and_per_call_workers(
        spawn: Callable[..., Worker], require: Any) -> None:
    require("cgroup")
    for mode in ("pooled", "per_call"):
        w = spawn("strict", mode=mode, limits=Limits(max_processes=MIN_PROCESSES))
        assert type(w.ready()).__name__ == "Ready"
        assert text_of(w.call("counter")) == "1"


# -- a real daemon -------------------------------------------------------------------------------------


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@asynccontextmanager
async def daemon_with(make_plugin: Callable[..., Path], tmp_path: Path, network: list[str], *,
                      policy: str = "strict", isolation: str = "pooled", extra: tuple[str, ...] = ()
                      ) -> AsyncIterator[StdioPeer]:
    manifest: dict[str, Any] = {"isolation": isolation}
    if network:
        manifest["permissions"] = {"network": network}
    plugins = make_plugin("net_plugin", NET_PLUGIN, manifest=manifest)
    async with open_toolcell(plugins, policy=policy, extra=extra, stderr_path=tmp_path / "daemon.log") as peer:
        await peer.initialize("2025-11-25")
        yield peer


async def call(peer: StdioPeer, tool: str, **args: Any) -> Any:
    response = await peer.call(tool, args, timeout=30)
    assert "error" not in response and not response["result"].get("isError"), response
    return json.loads(peer_text(response))


def egress_log(peer: StdioPeer) -> list[dict[str, Any]]:
    out = []
    for line in peer.stderr_path.read_text(errors="replace").splitlines():
        if line.startswith("{") and '"event":"egress"' in line:
            out.append(json.loads(line))
    return out


async def test_through_the_daemon_a_granted_plugin_reaches_exactly_its_listed_destination(
        nursery: trio.Nursery, make_plugin: Callable[..., Path], tmp_path: Path, require: Any) -> None:
    require(*LAYERS)
    async with http_server(nursery) as (port, seen), http_server(nursery) as (other, other_seen):
        async with daemon_with(make_plugin, tmp_path, [f"127.0.0.1:{port}"]) as peer:
            got = await call(peer, "http_get", url=f"http://127.0.0.1:{port}/urllib")
            assert got == {"ok": True, "detail": "hello /urllib"}
            got = await call(peer, "tunnel_get", host="127.0.0.1", port=port, path="/tunnel")
            assert got == {"ok": True, "detail": "hello /tunnel"}
            for url, reason in [(f"http://127.0.0.1:{other}/x", "403"), (f"http://localhost:{port}/x", "403"),
                                ("http://169.254.169.254/latest/meta-data/", "403"), ("http://example.com/", "403")]:
                got = await call(peer, "http_get", url=url)
                assert not got["ok"] and reason in got["detail"], (url, got)
            got = await call(peer, "tunnel_get", host="127.0.0.1", port=other, path="/x")
            assert not got["ok"] and "403" in got["detail"], got
            for data in ["garbage\r\n\r\n", "CONNECT nonsense HTTP/1.1\r\nHost: x\r\n\r\n", "\x00\xff" * 100 + "\r\n\r\n"]:
                assert (await call(peer, "proxy_raw", data=data))["line"].startswith("HTTP/1.1 400")
            got = await call(peer, "http_get", url=f"http://127.0.0.1:{port}/still-serving")
            assert got == {"ok": True, "detail": "hello /still-serving"}
            assert not (await call(peer, "resolve", name="example.com"))["ok"]
        assert seen == [f"GET /urllib host=127.0.0.1:{port}", f"GET /tunnel host=127.0.0.1:{port}",
                        f"GET /still-serving host=127.0.0.1:{port}"]
        assert other_seen == []
    records = egress_log(peer)
    assert [r["outcome"] for r in records if r["outcome"] == "ok"] == ["ok"] * 3
    ok = [r for r in records if r["outcome"] == "ok"]
    assert all(r["plugin"] == "net_plugin" and r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in ok), ok
    assert {r["host"] for r in records if r["outcome"] == "refused"} == {"127.0.0.1", "localhost", "169.254.169.254",
                                                                        "example.com"}


async def test_the_daemons_own_http_port_is_refused_even_to_a_localhost_grant(
        nursery: trio.Nursery, make_plugin: Callable[..., Path], tmp_path: Path, require: Any) -> None:
    require(*LAYERS)
    dport = free_port()
    async with http_server(nursery) as (port, seen), daemon_with(
            make_plugin, tmp_path, [f"localhost:{port}", f"localhost:{dport}"], extra=("--http", f"127.0.0.1:{dport}")
    ) as peer:
        got = await call(peer, "http_get", url=f"http://localhost:{port}/granted")
        assert got == {"ok": True, "detail": "hello /granted"}
        got = await call(peer, "http_get", url=f"http://localhost:{dport}/mcp")
        assert not got["ok"] and "403" in got["detail"], got
        got = await call(peer, "proxy_raw", data=connect_request(f"localhost:{dport}").decode())
        assert got["line"].startswith("HTTP/1.1 403") and "daemon's own listening port" in got["raw"], got
    assert seen == [f"GET /granted host=localhost:{port}"]


@pytest.mark.parametrize("policy", ["strict", "none"])
async def test_through_the_daemon_an_ungranted_plugin_has_no_network_at_all(
        policy: str, make_plugin: Callable[..., Path], tmp_path: Path, require: Any, host_listener: int) -> None:
    if policy == "strict":
        require(*LAYERS)
    async with daemon_with(make_plugin, tmp_path, [], policy=policy) as peer:
        assert (await call(peer, "env")) == {}
        got = await call(peer, "direct_tcp", host="127.0.0.1", port=host_listener)
        assert got["ok"] is (policy == "none"), got


async def test_per_call_workers_reach_the_network_through_the_zygotes_proxy(
        nursery: trio.Nursery, make_plugin: Callable[..., Path], tmp_path: Path, require: Any) -> None:
    require(*LAYERS)
    async with http_server(nursery) as (port, seen), \
            daemon_with(make_plugin, tmp_path, [f"127.0.0.1:{port}"], isolation="per_call") as peer:
        for i in range(3):
            got = await call(peer, "http_get", url=f"http://127.0.0.1:{port}/call{i}")
            assert got == {"ok": True, "detail": f"hello /call{i}"}
    assert len(seen) == 3


def test_check_shows_the_network_grant_as_proxied_and_the_process_limit(make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("net_plugin", NET_PLUGIN, limits={"max_processes": 32},
                          manifest={"permissions": {"network": ["api.example.com:443"]}})
    res = subprocess.run([sys.executable, "-m", "runtime.cli", "check", str(plugins / "net_plugin"), "--policy", "none"],
                         cwd=str(REPO), capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "net(proxied):api.example.com:443" in res.stdout
    assert "procs 32" in res.stdout


def test_a_grant_through_a_symlink_the_plugin_could_have_made_is_refused(tmp_path: Path) -> None:
    """Grants are resolved when a worker starts. With write access to a folder, a plugin can put a
    symlink there; a read or write grant of a path through it would then reach wherever it points
    (here a secret folder). Such a grant fails the worker's start; a symlink elsewhere is followed."""
    from sandbox.isolation import paths
    from sandbox.wire import Init, Limits, Permissions

    shared, secret, real = tmp_path / "shared", tmp_path / "secret", tmp_path / "real"
    for folder in (shared, secret, real):
        folder.mkdir()
    (shared / "cache").symlink_to(secret)  # made by the plugin, which may write in shared
    (tmp_path / "link").symlink_to(real)  # not in anything the plugin may write

    def init(read: list[str], write: list[str]) -> Init:
        return Init(plugin_name="p", plugin_dir=str(tmp_path), entry="p", sys_path=[], env={}, limits=Limits(),
                    permissions=Permissions(read=read, write=write), policy="strict", scratch_dir=str(tmp_path))

    for read, write in (([str(shared / "cache")], [str(shared)]), ([], [str(shared), str(shared / "cache")])):
        with pytest.raises(ValueError, match="leads through the symlink"):
            paths.allowlist(init(read, write))
    allowed = paths.allowlist(init([str(tmp_path / "link")], [str(shared)]))
    assert str(real) in allowed.read and str(shared) in allowed.write
