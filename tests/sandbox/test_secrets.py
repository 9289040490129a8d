"""Secrets a plugin never sees (``runtime.plugin_secrets``, ``runtime.egress_tls``, ``runtime.egress_relay``).

The manifest binds a secret to a host, the operator supplies the value, the worker holds a placeholder,
and the egress proxy puts the value into requests to that host only, over TLS it terminates with the
daemon's own CA. Three levels: the rules (no I/O); the proxy in this process on real sockets and real
TLS; and a real ``toolcell serve`` whose plugin tries every way to learn the value.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import secrets
import socket
import ssl
import sys
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import h11
import msgspec
import pytest
import trio
import trustme

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from stdio_peer import open_toolcell
from stdio_peer import text_of as peer_text

from runtime import egress
from runtime.config import ConfigError, load_config
from runtime.egress_rules import Grant
from runtime.egress_tls import CA_KEY, EgressCA
from runtime.manifest import ManifestError, load_manifest
from runtime.plugin_secrets import (
    Binding,
    Masker,
    PluginSecrets,
    SecretError,
    SecretSource,
    SecretSpec,
    SecretStore,
    read_value,
)
from runtime.plugins import load_plugin
from sandbox.isolation import LAYERS

# -- the rules ----------------------------------------------------------------------------------------


def write_manifest(folder: Path, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "m.py").write_text("")
    (folder / "plugin.toml").write_text('name = "p"\nversion = "1"\nentry = "m"\n' + body)
    return folder


@pytest.mark.parametrize("body, fragment", [
    ('[permissions]\nnetwork = ["api.example.com:443"]\n[secrets.TOKEN]\nhost = "evil.example.net"\n',
     "secrets.TOKEN: host evil.example.net is outside the plugin's network grant (permissions.network allows "
     "api.example.com:443)"),
    ('[secrets.TOKEN]\nhost = "api.example.com"\n', "outside the plugin's network grant (permissions.network allows "
                                                    "nothing)"),
    ('[permissions]\nnetwork = ["*.example.com:443"]\n[secrets.TOKEN]\nhost = "*.example.com"\n',
     "bind a secret to one exact host, not a wildcard"),
    ('[permissions]\nnetwork = ["a.example:443"]\n[secrets.TOKEN]\nhost = "a.example:443"\n', "without a port"),
    ('[permissions]\nnetwork = ["a.example:443"]\n[env]\nset = { TOKEN = "x" }\n[secrets.TOKEN]\nhost = "a.example"\n',
     "TOKEN is also in [env]"),
    ('[permissions]\nnetwork = ["a.example:443"]\n[secrets.SSL_CERT_FILE]\nhost = "a.example"\n',
     "SSL_CERT_FILE is set by toolcell itself"),
    ('[permissions]\nnetwork = ["a.example:443"]\n[secrets.HTTPS_PROXY]\nhost = "a.example"\n',
     "HTTPS_PROXY is set by toolcell itself"),
    ('[permissions]\nnetwork = ["a.example:443"]\n[secrets."BAD NAME"]\nhost = "a.example"\n', "not a variable name"),
    ('[permissions]\nnetwork = ["a.example:443"]\n[secrets.TOKEN]\nhost = "a.example"\nport = 1\n', "secrets.TOKEN.port: unknown key"),
])
def test_a_secret_bound_to_a_host_the_plugin_may_not_reach_or_malformed_is_refused_at_load(
        tmp_path: Path, body: str, fragment: str) -> None:
    with pytest.raises(ManifestError) as info:
        load_manifest(write_manifest(tmp_path / "p", body))
    assert fragment in str(info.value), info.value


def test_a_secret_may_be_bound_to_any_granted_host_a_wildcard_included(tmp_path: Path) -> None:
    m = load_manifest(write_manifest(tmp_path / "p", '[permissions]\nnetwork = ["*.example.com:443", "localhost:8443"]\n'
                                     '[secrets.A]\nhost = "API.Example.com"\n[secrets.B]\nhost = "localhost"\n'))
    assert m.secrets == {"A": SecretSpec("API.Example.com"), "B": SecretSpec("localhost")}


def test_the_operator_supplies_values_from_the_environment_a_file_or_a_systemd_credential(tmp_path: Path) -> None:
    (tmp_path / "gh").write_text("file-value-123\n")
    (tmp_path / "creds").mkdir()
    (tmp_path / "creds" / "gh").write_text("cred-value-456")
    env = {"GH_TOKEN": "env-value-789", "CREDENTIALS_DIRECTORY": str(tmp_path / "creds")}
    assert read_value("T", SecretSource(env="GH_TOKEN"), env) == b"env-value-789"
    assert read_value("T", SecretSource(file=str(tmp_path / "gh")), env) == b"file-value-123"
    assert read_value("T", SecretSource(credential="gh"), env) == b"cred-value-456"


@pytest.mark.parametrize("source, environ, fragment", [
    (SecretSource(env="GH_TOKEN"), {}, "secret T: the daemon's environment has no GH_TOKEN"),
    (SecretSource(file="/nonexistent/gh"), {}, "secret T: the file /nonexistent/gh cannot be read: No such file"),
    (SecretSource(credential="gh"), {}, "$CREDENTIALS_DIRECTORY is not set"),
    (SecretSource(env="V"), {"V": ""}, "is empty"),
    (SecretSource(env="V"), {"V": "abc\r\nX-Injected: 1"}, "holds a line break"),
])
def test_a_missing_or_unusable_operator_value_is_a_clear_error_that_never_shows_the_value(
        source: SecretSource, environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(SecretError) as info:
        read_value("T", source, environ)
    assert fragment in info.value.reason
    assert "X-Injected" not in info.value.reason


def test_the_store_refuses_a_secret_the_operator_has_no_value_for_or_allows_elsewhere(tmp_path: Path) -> None:
    store = SecretStore({"A": SecretSource(env="A_VALUE", hosts=["api.example.com"])}, str(tmp_path),
                        environ={"A_VALUE": "value-of-a"})
    with pytest.raises(SecretError) as info:
        store.for_plugin("p", {"A": SecretSpec("other.example.com"), "B": SecretSpec("api.example.com")})
    assert "secret A: the operator allows it only to api.example.com, not other.example.com" in info.value.reason
    assert "secret B: the operator supplies no value (add it to the daemon's config: [secrets] B = " in \
        info.value.reason
    bound = store.for_plugin("p", {"A": SecretSpec("API.example.com")})
    (binding,) = bound.bindings
    assert binding.host == "api.example.com" and binding.value == b"value-of-a"
    assert "value-of-a" not in repr(bound)
    env = bound.worker_env()
    assert env["A"].startswith("toolcell-secret-") and len(env["A"]) == len("toolcell-secret-") + 32
    assert env["SSL_CERT_FILE"] == env["REQUESTS_CA_BUNDLE"] == env["NODE_EXTRA_CA_CERTS"] == bound.ca.bundle_path
    # Unguessable: another daemon (another key) gives another placeholder; another plugin too.
    assert SecretStore({}, str(tmp_path)).placeholder("p", "A") != store.placeholder("p", "A")
    assert store.placeholder("q", "A") != store.placeholder("p", "A")


def test_a_value_kept_in_a_file_is_read_again_when_the_file_changes_and_kept_when_it_breaks(tmp_path: Path) -> None:
    """A rotated secret (a mounted Kubernetes Secret updated in place) was read once, at the plugin's
    load, and sent until a restart. Each bound connection now takes the file's current value; a file
    that breaks keeps the last good one, said once."""
    from runtime import logs

    value_file = tmp_path / "gh"
    value_file.write_text("first-value-1\n")
    store = SecretStore({"A": SecretSource(file=str(value_file))}, str(tmp_path))
    bound = store.for_plugin("p", {"A": SecretSpec("api.example.com")})
    seen: list[dict[str, Any]] = []
    logs.add_sink(seen.append)
    try:
        assert [b.value for b in bound.for_host("api.example.com")] == [b"first-value-1"]
        value_file.write_text("second-value-22\n")  # another size: a new signature whatever the clock
        (current,) = bound.for_host("api.example.com")
        assert current.value == b"second-value-22" and current.placeholder == bound.bindings[0].placeholder
        assert Masker([current]).feed(b"echo second-value-22 !").startswith(b"echo toolcell-secret-")
        value_file.unlink()
        assert [b.value for b in bound.for_host("api.example.com")] == [b"second-value-22"]
        assert [b.value for b in bound.for_host("api.example.com")] == [b"second-value-22"]
        value_file.write_text("third-value-333\n")
        assert [b.value for b in bound.for_host("api.example.com")] == [b"third-value-333"]
    finally:
        logs.remove_sink(seen.append)
    events = [r["event"] for r in seen]
    assert events.count("secret_reread_failed") == 1 and events.count("secret_value_changed") == 2, events
    assert not any("value-" in json.dumps(r) for r in seen)  # never a value in the log


def test_the_operator_may_name_the_only_plugins_that_may_use_a_secret(tmp_path: Path) -> None:
    store = SecretStore({"A": SecretSource(env="A_VALUE", plugins=["github"])}, str(tmp_path),
                        environ={"A_VALUE": "value-of-a"})
    with pytest.raises(SecretError) as info:
        store.for_plugin("lookalike", {"A": SecretSpec("api.example.com")})
    assert "secret A: the operator allows it only to plugin(s) github, not lookalike" in info.value.reason
    assert "value-of-a" not in info.value.reason
    (binding,) = store.for_plugin("github", {"A": SecretSpec("api.example.com")}).bindings
    assert binding.value == b"value-of-a"
    assert os.stat(tmp_path / CA_KEY).st_mode & 0o777 == 0o600


async def test_a_plugin_whose_secret_has_no_value_is_refused_at_load_with_the_reason(
        tmp_path: Path, nursery: trio.Nursery) -> None:
    folder = write_manifest(tmp_path / "p", '[permissions]\nnetwork = ["api.example.com:443"]\n'
                                            '[secrets.TOKEN]\nhost = "api.example.com"\n')
    plugin = await load_plugin(folder, nursery, "none", str(tmp_path / "state"), 1,
                               secrets=SecretStore({}, str(tmp_path / "state")))
    assert plugin.pool is None and len(plugin.problems) == 1
    assert plugin.problems[0].startswith("secret TOKEN: the operator supplies no value"), plugin.problems


@pytest.mark.parametrize("table, fragment", [
    ({"T": {"env": "A", "file": "/x"}}, "give exactly one of env, file or credential (got env, file)"),
    ({"T": {}}, "give exactly one of env, file or credential (got none)"),
    ({"T": {"file": "relative"}}, "must be an absolute path"),
    ({"T": {"credential": "../x"}}, "is not a credential name"),
    ({"T": {"env": "A", "hosts": ["bad host"]}}, "secrets.T.hosts"),
])
def test_bad_secret_sources_in_the_config_are_refused(tmp_path: Path, table: dict[str, Any], fragment: str) -> None:
    path = tmp_path / "toolcell.toml"
    lines = ["[secrets]"] + [f"{k} = {json.dumps(v).replace(':', ' =')}" for k, v in table.items()]
    path.write_text("\n".join(lines).replace('" =', '" ='))
    with pytest.raises(ConfigError) as info:
        load_config(str(path), {"state_dir": str(tmp_path / "s")})
    assert fragment in str(info.value)


def test_a_value_echoed_back_is_masked_even_across_chunk_boundaries() -> None:
    b = Binding("T", "h", b"toolcell-secret-" + b"0" * 32, b"VALUE-0123456789")
    for cut in range(1, 40):
        data = b"xx VALUE-0123456789 yy VALUE-0123456789"
        m = Masker([b])
        out = m.feed(data[:cut]) + m.feed(data[cut:]) + m.flush()
        assert out == data.replace(b.value, b.placeholder), cut
    m = Masker([b])
    assert b"".join(m.feed(bytes([c])) for c in b"aVALUE-0123456789b") + m.flush() == b"a" + b.placeholder + b"b"


# -- the proxy in this process, real TLS ---------------------------------------------------------------


@pytest.fixture(scope="module")
def upstream_ca() -> trustme.CA:
    return trustme.CA()


@asynccontextmanager
async def echo_server(nursery: trio.Nursery, ca: trustme.CA | None,
                      encoding: str = "") -> AsyncIterator[tuple[int, list[dict[str, Any]]]]:
    """An HTTP(S) server on 127.0.0.1 (certificate for localhost and 127.0.0.1 from ``ca``; plain when
    None) that answers each request with what it received, as JSON; keep-alive. Records every request.
    ``encoding``: the answer is compressed so (gzip, deflate, or a made-up "br"), whatever was asked."""
    seen: list[dict[str, Any]] = []
    ctx = None
    if ca is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ca.issue_cert("localhost", "127.0.0.1").configure_cert(ctx)

    async def handle(stream: trio.abc.Stream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            with trio.fail_after(20):
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive_some(65536))
                        continue
                    if isinstance(event, h11.Request):
                        got = {"target": event.target.decode(), "headers": {n.decode(): v.decode() for n, v in
                                                                          event.headers}, "body": ""}
                    elif isinstance(event, h11.Data):
                        got["body"] += bytes(event.data).decode()
                    elif isinstance(event, h11.EndOfMessage):
                        seen.append(got)
                        body = json.dumps(got).encode()
                        extra = []
                        if encoding:
                            body = gzip.compress(body) if encoding == "gzip" else zlib.compress(body) \
                                if encoding == "deflate" else body
                            extra = [("content-encoding", encoding)]
                        await stream.send_all((conn.send(h11.Response(status_code=200, headers=[
                            ("content-type", "application/json"), ("content-length", str(len(body))), *extra])) or b"")
                            + (conn.send(h11.Data(data=body)) or b"") + (conn.send(h11.EndOfMessage()) or b""))
                        if conn.our_state is h11.MUST_CLOSE:
                            return
                        conn.start_next_cycle()
                    else:
                        return
        except (h11.ProtocolError, trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    if ctx is not None:
        listeners = await nursery.start(functools.partial(trio.serve_ssl_over_tcp, handle, 0, ctx, host="127.0.0.1"))
        port = listeners[0].transport_listener.socket.getsockname()[1]
    else:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
    yield port, seen


@asynccontextmanager
async def proxy(nursery: trio.Nursery, g: Grant, bound: PluginSecrets | None) -> AsyncIterator[int]:
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(16)
    scope = trio.CancelScope()
    nursery.start_soon(egress.serve_proxy, lst, g, "test", 0, scope, bound)
    try:
        yield lst.getsockname()[1]
    finally:
        scope.cancel()


async def https_via(pport: int, authority: str, ctx: ssl.SSLContext, server_hostname: str,
                    requests: list[bytes]) -> tuple[bytes, list[bytes]]:
    """CONNECT through the proxy, TLS with ``ctx``, send each request and read its answer (keep-alive)."""
    with trio.fail_after(20):
        stream = await trio.open_tcp_stream("127.0.0.1", pport)
        async with stream:
            return await _https_on(stream, authority, ctx, server_hostname, requests)


async def _https_on(stream: trio.SocketStream, authority: str, ctx: ssl.SSLContext, server_hostname: str,
                    requests: list[bytes]) -> tuple[bytes, list[bytes]]:
    await stream.send_all(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return head, []
        head += chunk
    if not head.startswith(b"HTTP/1.1 200"):
        while chunk := await stream.receive_some(65536):
            head += chunk
        return head, []
    tls = trio.SSLStream(stream, ctx, server_hostname=server_hostname)
    answers = []
    for req in requests:
        await tls.send_all(req)
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        conn.send(h11.EndOfMessage())
        body = b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await tls.receive_some(65536))
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                break
        answers.append(body)
    await tls.aclose()
    return head, answers


def worker_context(bound: PluginSecrets) -> ssl.SSLContext:
    """What a worker trusts: the bundle its SSL_CERT_FILE names."""
    assert bound.ca is not None
    return ssl.create_default_context(cafile=bound.ca.bundle_path)


VALUE = "real-" + secrets.token_hex(16)


async def test_the_proxy_puts_the_value_into_requests_to_the_bound_host_only_and_masks_it_coming_back(
        nursery: trio.Nursery, tmp_path: Path, upstream_ca: trustme.CA) -> None:
    ca_file = tmp_path / "upstream-ca.pem"
    upstream_ca.cert_pem.write_to_path(str(ca_file))
    store = SecretStore({"TOKEN": SecretSource(env="V")}, str(tmp_path), str(ca_file), environ={"V": VALUE})
    bound = store.for_plugin("test", {"TOKEN": SecretSpec("127.0.0.1")})
    ph = bound.worker_env()["TOKEN"]
    async with echo_server(nursery, upstream_ca) as (port, seen):
        async with proxy(nursery, Grant.parse([f"127.0.0.1:{port}"]), bound) as pport:
            req = (f"GET /q?key={ph} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ph}\r\n"
                   f"Accept-Encoding: gzip\r\n\r\n").encode()
            post = (f"POST /p HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Key: {ph}\r\nContent-Length: {len(ph)}\r\n\r\n{ph}"
                    ).encode()
            head, answers = await https_via(pport, f"127.0.0.1:{port}", worker_context(bound), "127.0.0.1", [req, post])
            assert head.startswith(b"HTTP/1.1 200"), head
    assert seen[0]["target"] == f"/q?key={VALUE}" and seen[0]["headers"]["authorization"] == f"Bearer {VALUE}"
    assert seen[0]["headers"]["accept-encoding"] == "identity"
    assert seen[1]["headers"]["x-key"] == VALUE and seen[1]["body"] == ph  # bodies are not rewritten
    # The echo came back with the placeholder where the value was.
    assert all(VALUE.encode() not in a for a in answers) and ph.encode() in answers[0], answers
    assert json.loads(answers[0])["headers"]["authorization"] == f"Bearer {ph}"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
async def test_a_compressed_echo_of_the_value_is_decoded_and_masked_or_refused(
        nursery: trio.Nursery, tmp_path: Path, upstream_ca: trustme.CA, encoding: str) -> None:
    """A host that compresses although asked for identity must not hand the credential past the mask:
    gzip and deflate are decoded (and sent on decoded, masked); any other coding is refused (502)."""
    ca_file = tmp_path / "upstream-ca.pem"
    upstream_ca.cert_pem.write_to_path(str(ca_file))
    store = SecretStore({"TOKEN": SecretSource(env="V")}, str(tmp_path), str(ca_file), environ={"V": VALUE})
    bound = store.for_plugin("test", {"TOKEN": SecretSpec("127.0.0.1")})
    ph = bound.worker_env()["TOKEN"]
    async with echo_server(nursery, upstream_ca, encoding) as (port, seen):
        async with proxy(nursery, Grant.parse([f"127.0.0.1:{port}"]), bound) as pport:
            req = f"GET /q HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ph}\r\n\r\n".encode()
            head, answers = await https_via(pport, f"127.0.0.1:{port}", worker_context(bound), "127.0.0.1", [req])
    assert seen[0]["headers"]["authorization"] == f"Bearer {VALUE}"  # the host got the value and echoed it
    assert all(VALUE.encode() not in a for a in answers), answers
    assert head.startswith(b"HTTP/1.1 200"), head  # the tunnel itself (the answers are what came through it)
    if encoding == "br":
        assert b"Content-Encoding br, which the relay cannot check" in answers[0], answers
    else:
        assert json.loads(answers[0])["headers"]["authorization"] == f"Bearer {ph}"  # decoded, then masked


@pytest.mark.parametrize("request_head", [
    # Domain fronting: the TLS connection is the bound host's, the request names another site behind
    # the same front (a CDN routes by Host, or by an absolute-form target, which overrides Host).
    "GET /x HTTP/1.1\r\nHost: evil.example\r\nAuthorization: Bearer {ph}\r\n\r\n",
    "GET https://evil.example/x HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {ph}\r\n\r\n",
])
async def test_a_request_inside_the_bound_hosts_tunnel_naming_another_host_gets_no_value(
        nursery: trio.Nursery, tmp_path: Path, upstream_ca: trustme.CA, request_head: str) -> None:
    ca_file = tmp_path / "upstream-ca.pem"
    upstream_ca.cert_pem.write_to_path(str(ca_file))
    store = SecretStore({"TOKEN": SecretSource(env="V")}, str(tmp_path), str(ca_file), environ={"V": VALUE})
    bound = store.for_plugin("test", {"TOKEN": SecretSpec("127.0.0.1")})
    ph = bound.worker_env()["TOKEN"]
    async with echo_server(nursery, upstream_ca) as (port, seen):
        async with proxy(nursery, Grant.parse([f"127.0.0.1:{port}"]), bound) as pport:
            fine = f"GET /ok HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {ph}\r\n\r\n".encode()
            fronted = request_head.format(ph=ph).encode()
            _, answers = await https_via(pport, f"127.0.0.1:{port}", worker_context(bound), "127.0.0.1",
                                         [fine, fronted])
    assert [r["target"] for r in seen] == ["/ok"] and seen[0]["headers"]["authorization"] == f"Bearer {VALUE}"
    assert b"127.0.0.1" in answers[1] and VALUE.encode() not in answers[1]


async def test_a_request_with_both_content_length_and_chunked_is_not_relayed_with_both(
        nursery: trio.Nursery, tmp_path: Path, upstream_ca: trustme.CA) -> None:
    """RFC 9112 6.3: an intermediary removes Content-Length when Transfer-Encoding is there; relayed
    with both, a host (or its front) that reads Content-Length takes the rest of the body as the
    next request: smuggled ahead of the plugin's next request, which carries the value."""
    ca_file = tmp_path / "upstream-ca.pem"
    upstream_ca.cert_pem.write_to_path(str(ca_file))
    store = SecretStore({"TOKEN": SecretSource(env="V")}, str(tmp_path), str(ca_file), environ={"V": VALUE})
    bound = store.for_plugin("test", {"TOKEN": SecretSpec("127.0.0.1")})
    async with echo_server(nursery, upstream_ca) as (port, seen):
        async with proxy(nursery, Grant.parse([f"127.0.0.1:{port}"]), bound) as pport:
            req = (b"POST /p HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
                   b"5\r\nhello\r\n0\r\n\r\n")
            await https_via(pport, f"127.0.0.1:{port}", worker_context(bound), "127.0.0.1", [req])
    assert seen[0]["body"] == "hello"
    assert "content-length" not in seen[0]["headers"], seen[0]["headers"]


async def test_the_placeholder_sent_to_another_host_or_over_plain_http_stays_a_placeholder(
        nursery: trio.Nursery, tmp_path: Path, upstream_ca: trustme.CA) -> None:
    store = SecretStore({"TOKEN": SecretSource(env="V")}, str(tmp_path), environ={"V": VALUE})
    bound = store.for_plugin("test", {"TOKEN": SecretSpec("bound.example")})
    ph = bound.worker_env()["TOKEN"]
    async with echo_server(nursery, upstream_ca) as (tls_port, seen), echo_server(nursery, None) as (plain, p_seen):
        async with proxy(nursery, Grant.parse([f"127.0.0.1:{tls_port}", f"127.0.0.1:{plain}"]), bound) as pport:
            ctx = ssl.create_default_context()
            upstream_ca.configure_trust(ctx)
            req = f"GET /{ph} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ph}\r\n\r\n".encode()
            head, answers = await https_via(pport, f"127.0.0.1:{tls_port}", ctx, "127.0.0.1", [req])
            assert head.startswith(b"HTTP/1.1 200") and answers, head
            stream = await trio.open_tcp_stream("127.0.0.1", pport)
            async with stream:
                await stream.send_all(f"GET http://127.0.0.1:{plain}/{ph} HTTP/1.1\r\nHost: x\r\n"
                                      f"Authorization: Bearer {ph}\r\n\r\n".encode())
                got = b""
                with trio.fail_after(10):
                    while chunk := await stream.receive_some(65536):
                        got += chunk
    assert seen == [{"target": f"/{ph}", "headers": {"host": "x", "authorization": f"Bearer {ph}"}, "body": ""}]
    assert p_seen[0]["target"] == f"/{ph}" and p_seen[0]["headers"]["authorization"] == f"Bearer {ph}"
    assert VALUE not in json.dumps(seen + p_seen)


def test_leaf_certificates_are_kept_for_a_bounded_number_of_hosts(tmp_path: Path) -> None:
    """A secret bound to ``*.example.com`` lets a plugin CONNECT to any number of subdomains: each
    made a leaf and a TLS context, kept for the daemon's life."""
    ca = EgressCA(str(tmp_path))
    bound = getattr(EgressCA, "LEAVES_MAX", 256)
    for i in range(bound + 20):
        ca.server_context(f"h{i}.example.com")
    assert len(ca._leaves) == bound
    assert ca.server_context("h0.example.com") is not None  # an evicted host just gets a new leaf


async def test_a_bound_host_whose_certificate_fails_gets_nothing_and_the_plugin_a_502(
        nursery: trio.Nursery, tmp_path: Path, upstream_ca: trustme.CA) -> None:
    # No operator CA file: the host's certificate (from a CA the system does not know) is refused.
    store = SecretStore({"TOKEN": SecretSource(env="V")}, str(tmp_path), environ={"V": VALUE})
    bound = store.for_plugin("test", {"TOKEN": SecretSpec("127.0.0.1")})
    async with echo_server(nursery, upstream_ca) as (port, seen), \
            proxy(nursery, Grant.parse([f"127.0.0.1:{port}"]), bound) as pport:
        head, answers = await https_via(pport, f"127.0.0.1:{port}", worker_context(bound), "127.0.0.1", [b"x"])
    assert head.startswith(b"HTTP/1.1 502") and b"nothing was sent" in head and b"certificate" in head, head
    assert seen == [] and answers == []


def test_the_ca_is_made_once_per_state_dir_kept_private_and_reused(tmp_path: Path) -> None:
    first = EgressCA(str(tmp_path))
    again = EgressCA(str(tmp_path))
    assert first.certificate_pem == again.certificate_pem
    assert os.stat(tmp_path / CA_KEY).st_mode & 0o777 == 0o600
    assert os.stat(first.bundle_path).st_mode & 0o777 == 0o644
    assert first.certificate_pem in Path(first.bundle_path).read_bytes()
    (tmp_path / CA_KEY).chmod(0o644)
    with pytest.raises(Exception, match="private to it"):
        EgressCA(str(tmp_path))


# -- a real daemon, a plugin that looks for the value --------------------------------------------------

SNOOP_PLUGIN = r'''
import gc
import json
import os
import re
import ssl
import urllib.request

from sandbox import tool

PREFIX = b"tcsecret-"


@tool
def environment() -> str:
    return json.dumps(dict(os.environ))


@tool
def https_get(url: str, token_header: str = "", verify: bool = True) -> str:
    """urllib through HTTPS_PROXY; the header value is the placeholder from the environment."""
    headers = {"Authorization": "Bearer " + os.environ["API_TOKEN"]} if token_header else {}
    req = urllib.request.Request(url, headers=headers)
    ctx = ssl.create_default_context() if verify else ssl._create_unverified_context()
    try:
        with urllib.request.urlopen(req, timeout=20, context=ctx) as r:
            return json.dumps({"status": r.status, "body": r.read().decode()})
    except Exception as exc:
        return json.dumps({"status": 0, "body": repr(exc)[:500]})


@tool
def scan_memory() -> str:
    """Everything this process can read of its own memory: /proc/self/mem over every readable mapping
    (and every str/bytes object the collector knows). Returns each occurrence of PREFIX with what follows."""
    found, how, errors = set(), [], []
    try:
        with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
            total = 0
            for line in maps:
                parts = line.split()
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if "r" not in parts[1] or (len(parts) > 5 and parts[5] in ("[vvar]", "[vsyscall]")):
                    continue
                try:
                    mem.seek(lo)
                    data = mem.read(hi - lo)
                except (OSError, OverflowError, ValueError) as exc:
                    errors.append(f"{parts[0]}: {exc}"[:80])
                    continue
                total += len(data)
                found.update(m.group().decode("ascii", "replace") for m in re.finditer(re.escape(PREFIX) + rb"[0-9a-z-]{0,40}", data))
            how.append(f"/proc/self/mem: {total} bytes")
    except OSError as exc:
        how.append(f"/proc/self/mem unreadable: {exc}")
    n = 0
    for obj in gc.get_objects():
        for item in (obj if isinstance(obj, (list, tuple, dict)) else [obj]):
            for value in ((item, obj[item]) if isinstance(obj, dict) else (item,)):
                if isinstance(value, str):
                    value = value.encode("utf-8", "replace")
                if isinstance(value, (bytes, bytearray)) and PREFIX in value:
                    n += 1
                    found.update(m.group().decode("ascii", "replace") for m in re.finditer(re.escape(PREFIX) + rb"[0-9a-z-]{0,40}", bytes(value)))
    how.append(f"gc: {n} objects")
    return json.dumps({"found": sorted(found), "how": how, "errors": errors[:5]})
'''


async def call(peer: Any, tool: str, **args: Any) -> Any:
    response = await peer.call(tool, args, timeout=60)
    assert "error" not in response and not response["result"].get("isError"), response
    return json.loads(peer_text(response))


async def test_a_plugin_that_dumps_its_environment_and_memory_finds_no_secret_while_its_requests_carry_it(
        nursery: trio.Nursery, make_plugin: Callable[..., Path], tmp_path: Path, require: Any,
        upstream_ca: trustme.CA) -> None:
    require(*LAYERS)
    value = "tcsecret-" + secrets.token_hex(16)
    canary = "tcsecret-canary-" + secrets.token_hex(8)
    ca_file = tmp_path / "upstream-ca.pem"
    upstream_ca.cert_pem.write_to_path(str(ca_file))
    async with echo_server(nursery, upstream_ca) as (port, seen), echo_server(nursery, upstream_ca) as (other, o_seen), \
            echo_server(nursery, None) as (plain, p_seen):
        plugins = make_plugin("snoop", SNOOP_PLUGIN, manifest={}, limits={"max_concurrency": 1})
        manifest = plugins / "snoop" / "plugin.toml"
        manifest.write_text(manifest.read_text() + "\n[env]\nset = { CANARY = \"" + canary + "\" }\n"
                            f"[permissions]\nnetwork = [\"localhost:{port}\", \"127.0.0.1:{other}\", "
                            f"\"localhost:{plain}\"]\n[secrets.API_TOKEN]\nhost = \"localhost\"\n")
        config = tmp_path / "toolcell.toml"
        config.write_text(f'state_dir = "{tmp_path / "state"}"\negress_ca_file = "{ca_file}"\nmin_workers = 1\n'
                          '[secrets]\nAPI_TOKEN = { env = "SNOOP_TEST_VALUE" }\n')
        async with open_toolcell(plugins, policy="strict", extra=("--config", str(config)), env={"SNOOP_TEST_VALUE": value},
                                 stderr_path=tmp_path / "daemon.log") as peer:
            await peer.initialize("2025-11-25")
            env = await call(peer, "environment")
            placeholder = env["API_TOKEN"]
            assert placeholder.startswith("toolcell-secret-") and value not in json.dumps(env)
            assert env["SSL_CERT_FILE"].endswith("egress-ca-bundle.pem")
            # The bound host, over verified TLS: it receives the value, the plugin reads an echo without it.
            got = await call(peer, "https_get", url=f"https://localhost:{port}/bound", token_header="yes")
            assert got["status"] == 200, got
            assert json.loads(got["body"])["headers"]["authorization"] == f"Bearer {placeholder}"
            # Another host (the placeholder sent over an ordinary tunnel), and the bound host over plain HTTP.
            got = await call(peer, "https_get", url=f"https://127.0.0.1:{other}/other", token_header="yes", verify=False)
            assert got["status"] == 200, got
            got = await call(peer, "https_get", url=f"http://localhost:{plain}/plain", token_header="yes")
            assert got["status"] == 200, got
            scan = await call(peer, "scan_memory")
        log = (tmp_path / "daemon.log").read_text()
    # The canary proves the scan sees what the process holds; the value is not among what it saw.
    assert canary in scan["found"], scan
    assert any(h.startswith("/proc/self/mem: ") for h in scan["how"]), scan
    assert not any(f.startswith(value) for f in scan["found"]), scan
    assert seen[0]["headers"]["authorization"] == f"Bearer {value}" and seen[0]["target"] == "/bound"
    assert o_seen[0]["headers"]["authorization"] == f"Bearer {placeholder}"
    assert p_seen[0]["headers"]["authorization"] == f"Bearer {placeholder}"
    assert value not in log
    lines = [json.loads(x) for x in log.splitlines() if x.startswith("{") and '"event":"egress"' in x]
    assert [r.get("secrets") for r in lines if r["kind"] == "connect+secrets"] == [["API_TOKEN"]], lines


def test_the_manifest_keeps_rejecting_unknown_secret_fields() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"host": "a", "value": "x"}, SecretSpec)
