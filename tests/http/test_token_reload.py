"""Bearer tokens read again on ``SIGHUP`` (``toolcell reload``): a leaked token is revoked without a
restart. A real ``toolcell serve --http`` whose config names a ``tokens_file``; the signal goes to
the pid of the daemon this test started."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import httpx2
from http_harness import ServerProcess, sha, start_server, stop_server

OLD, NEW = "tok-old-0123456789", "tok-new-0123456789"


def _tokens(*pairs: tuple[str, str]) -> str:
    return "".join(f'[[tokens]]\nprincipal = "{p}"\nsha256 = "{sha(t)}"\n\n' for p, t in pairs)


def _post(server: ServerProcess, token: str, session: str | None = None) -> httpx2.Response:
    body: dict[str, object] = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
    headers = {"authorization": f"Bearer {token}", "accept": "application/json, text/event-stream"}
    if session is not None:
        body = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}
        headers |= {"mcp-session-id": session, "mcp-protocol-version": "2025-06-18"}
    return httpx2.post(server.url, json=body, headers=headers, timeout=10)


def _status(server: ServerProcess, token: str) -> int:
    return _post(server, token).status_code


def _open_get_stream(server: ServerProcess, token: str, session: str) -> socket.socket:
    """A legacy session's GET stream, its response head read."""
    host, port = server.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(f"GET /mcp HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
                 f"Accept: text/event-stream\r\nMcp-Session-Id: {session}\r\n"
                 f"Mcp-Protocol-Version: 2025-06-18\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200"), head
    return sock


def _ends(sock: socket.socket, within_s: float = 20.0) -> bool:
    """Whether the stream ends (its last chunk, or the connection's end) within ``within_s`` (a bound
    on the wait, whatever keep-alive comments the stream sends meanwhile)."""
    seen = b""
    deadline = time.monotonic() + within_s
    try:
        while not seen.endswith(b"0\r\n\r\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            sock.settimeout(left)
            data = sock.recv(4096)
            if not data:
                break
            seen += data
    except TimeoutError:
        return False
    finally:
        sock.close()
    return True


def _sighup_and_wait_for(server: ServerProcess, event: str) -> str:
    seen = server.stderr_path.read_text().count(event)
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # a bounded wait for the daemon's own log line, not a timing
        text = server.stderr_path.read_text()
        if text.count(event) > seen:
            return text
        time.sleep(0.05)
    raise AssertionError(f"no {event} after SIGHUP:\n{server.stderr_path.read_text()[-3000:]}")


def test_sighup_reads_the_tokens_again_and_keeps_them_when_the_file_is_wrong(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(_tokens(("old", OLD)))
    server = start_server(tmp_path, f'policy = "none"\n\n[http]\ntokens_file = "{tokens}"\n')
    try:
        assert _status(server, NEW) == 401
        session = _post(server, OLD).headers["mcp-session-id"]
        assert _post(server, OLD, session).status_code == 200
        stream = _open_get_stream(server, OLD, session)
        tokens.write_text(_tokens(("new", NEW)))  # OLD leaked: revoked, NEW handed out
        _sighup_and_wait_for(server, '"tokens_reloaded"')
        assert _status(server, OLD) == 401  # a match remembered before is forgotten too
        assert _post(server, OLD, session).status_code == 401  # and its session with it
        assert _ends(stream)  # and the stream its principal opened
        assert _status(server, NEW) == 200
        tokens.write_text("[[tokens]]\nprincipal = 3\n")  # broken: the tokens in use stay
        text = _sighup_and_wait_for(server, '"tokens_reload_failed"')
        assert "http.tokens[0]" in text.rsplit('"tokens_reload_failed"', 1)[1].splitlines()[0]
        assert _status(server, NEW) == 200
        tokens.write_text("")  # no token at all would let anyone in: refused, the tokens in use stay
        text = _sighup_and_wait_for(server, '"tokens_reload_failed"')
        assert "would let anyone in" in text.rsplit('"tokens_reload_failed"', 1)[1].splitlines()[0]
        assert _status(server, NEW) == 200 and _status(server, OLD) == 401
    finally:
        stop_server(server)


def test_a_daemon_that_started_without_tokens_does_not_take_them_on_sighup() -> None:
    """Tokens switch authentication on: a daemon serving every client on loopback keeps doing so until
    a restart (its address was allowed for that), and one that checks tokens never stops."""
    from runtime.auth import Authenticator
    from runtime.http_config import HttpConfig, Token

    open_daemon = Authenticator(HttpConfig())
    assert open_daemon.replace_tokens([Token(principal="p", sha256=sha(NEW))]) is not None
    assert open_daemon.authenticate(None) is not None  # still lets every client in
    checking = Authenticator(HttpConfig(tokens=[Token(principal="p", sha256=sha(OLD))]))
    assert checking.authenticate(f"Bearer {OLD}".encode()) is not None
    assert "would let anyone in" in (checking.replace_tokens([]) or "")
    assert checking.authenticate(f"Bearer {OLD}".encode()) is not None and checking.authenticate(None) is None
