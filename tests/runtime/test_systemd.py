"""The systemd protocols (``runtime.systemd``): sd_notify to a fake ``NOTIFY_SOCKET`` and socket
activation from a fake ``LISTEN_FDS``, in-process and against a real ``toolcell serve`` process, and
the shipped units checked by ``systemd-analyze verify`` where it is installed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

from runtime import systemd

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "deploy" / "systemd"


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    """A datagram socket standing in for the service manager's notify socket."""
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.settimeout(60)
        yield path, sock


def test_notify_sends_one_datagram_with_every_assignment(notify_socket: tuple[str, socket.socket]) -> None:
    path, sock = notify_socket
    assert systemd.Notifier(path).notify("READY=1", "STATUS=serving 3 tools")
    assert sock.recv(4096) == b"READY=1\nSTATUS=serving 3 tools"


def test_notify_reaches_an_abstract_socket() -> None:
    name = f"toolcell-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(10)
        assert systemd.Notifier("@" + name).notify("STOPPING=1")
        assert sock.recv(4096) == b"STOPPING=1"


def test_notify_without_a_manager_or_with_a_gone_one_does_nothing(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not systemd.Notifier.from_environment().notify("READY=1")
    assert not systemd.Notifier("relative/path").notify("READY=1")
    assert not systemd.Notifier(str(tmp_path / "nobody-listens")).notify("READY=1")


def test_the_notify_socket_is_taken_out_of_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                           notify_socket: tuple[str, socket.socket]) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket[0])
    notifier = systemd.Notifier.from_environment()
    assert "NOTIFY_SOCKET" not in os.environ  # what the daemon starts does not inherit it
    assert notifier.notify("READY=1")


def _listening(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", port))
    sock.listen(8)
    return sock


def test_sockets_passed_to_another_process_are_not_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LISTEN_PID", str(os.getpid() + 1))
    monkeypatch.setenv("LISTEN_FDS", "1")
    assert systemd.listen_sockets() == []
    assert "LISTEN_FDS" not in os.environ and "LISTEN_PID" not in os.environ


#: Where the in-process tests put "passed" sockets (systemd's fd 3 may be in use in a test process).
PASSED_AT = 900


def _pass(monkeypatch: pytest.MonkeyPatch, socks: list[socket.socket], names: str | None = None) -> None:
    """Put ``socks`` at consecutive fds as systemd would, and the variables that describe them."""
    monkeypatch.setattr(systemd, "LISTEN_FDS_START", PASSED_AT)
    for i, sock in enumerate(socks):
        os.dup2(sock.fileno(), PASSED_AT + i)
    monkeypatch.setenv("LISTEN_PID", str(os.getpid()))
    monkeypatch.setenv("LISTEN_FDS", str(len(socks)))
    if names is not None:
        monkeypatch.setenv("LISTEN_FDNAMES", names)


def test_passed_sockets_come_with_their_names(monkeypatch: pytest.MonkeyPatch) -> None:
    with _listening() as first, _listening() as second:
        _pass(monkeypatch, [first, second], "http:")
        passed = systemd.listen_sockets()
        try:
            assert [name for name, _ in passed] == ["http", f"fd{PASSED_AT + 1}"]
            assert [s.fileno() for _, s in passed] == [PASSED_AT, PASSED_AT + 1]
            assert [s.getsockname() for _, s in passed] == [first.getsockname(), second.getsockname()]
            assert all(not s.get_inheritable() and not s.getblocking() for _, s in passed)
            assert "LISTEN_FDS" not in os.environ and "LISTEN_FDNAMES" not in os.environ
        finally:
            for _, s in passed:
                s.close()


def test_a_passed_socket_that_does_not_listen_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as unbound:
        _pass(monkeypatch, [unbound], "http")
        try:
            with pytest.raises(ValueError, match=f"passed socket http .fd {PASSED_AT}. is not a listening stream"):
                systemd.listen_sockets()
        finally:
            os.close(PASSED_AT)


# -- a real daemon, started the way systemd starts it -------------------------------------------------


def _start_activated(tmp_path: Path, listener: socket.socket, notify_path: str,
                     config_text: str = 'policy = "none"\n') -> subprocess.Popen[bytes]:
    """``toolcell serve --http`` with ``listener`` as fd 3 and LISTEN_PID naming the daemon itself:
    a small launcher moves the socket to fd 3, exports its own pid and execs the daemon in its place,
    as systemd does after fork."""
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    config = tmp_path / "toolcell.toml"
    config.write_text(config_text + f'state_dir = "{tmp_path / "state"}"\n')
    env = dict(os.environ, PYTHONPATH=str(REPO), NOTIFY_SOCKET=notify_path, LISTEN_FDS="1", LISTEN_FDNAMES="http")
    fd = listener.fileno()
    launcher = (f"import os, sys; os.dup2({fd}, 3); os.close({fd}); os.environ['LISTEN_PID'] = str(os.getpid()); "
                "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])")
    with open(tmp_path / "stderr.log", "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-c", launcher, "-m", "runtime.cli", "serve", "--config", str(config),
             "--plugins", str(plugins), "--no-watch", "--http"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, pass_fds=(fd,), env=env,
            cwd=str(REPO))


def _messages_until(sock: socket.socket, wanted: bytes) -> list[bytes]:
    seen = []
    while True:
        message = sock.recv(4096)
        seen.append(message)
        if wanted in message.split(b"\n"):
            return seen


def test_a_socket_activated_daemon_serves_the_passed_socket_and_notifies_ready_then_stopping(
        tmp_path: Path, notify_socket: tuple[str, socket.socket]) -> None:
    path, notifications = notify_socket
    listener = _listening()
    port = listener.getsockname()[1]
    proc = _start_activated(tmp_path, listener, path)
    listener.close()  # only the daemon holds the socket now
    try:
        ready = _messages_until(notifications, b"READY=1")
        assert any(m.startswith(b"READY=1\nSTATUS=serving ") for m in ready)
        # Nothing else bound that port: what answers is the daemon, on the socket it was given.
        health = httpx2.get(f"http://127.0.0.1:{port}/healthz", timeout=30)
        assert health.status_code == 200 and health.json()["status"] == "ready"
        proc.send_signal(signal.SIGTERM)
        stopping = _messages_until(notifications, b"STOPPING=1")
        assert stopping[-1].startswith(b"STOPPING=1")
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    log = (tmp_path / "stderr.log").read_text()
    assert f"MCP endpoint http://127.0.0.1:{port}/mcp" in log


def test_a_passed_public_socket_without_tokens_is_refused_before_serving(
        tmp_path: Path, notify_socket: tuple[str, socket.socket]) -> None:
    path, notifications = notify_socket
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("0.0.0.0", 0))
    listener.listen(8)
    proc = _start_activated(tmp_path, listener, path)
    listener.close()
    try:
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert "refusing to serve 0.0.0.0 without authentication" in (tmp_path / "stderr.log").read_text()
    notifications.settimeout(0)
    with pytest.raises(BlockingIOError):
        notifications.recv(4096)  # never said READY=1


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_the_shipped_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify resolves ExecStart=; point it at this checkout's interpreter through a copy of the unit.
    service = (UNITS / "toolcell.service").read_text()
    assert "ExecStart=/opt/toolcell/bin/toolcell " in service
    fake = tmp_path / "opt" / "toolcell" / "bin"
    fake.mkdir(parents=True)
    shutil.copy(UNITS / "toolcell.socket", tmp_path / "toolcell.socket")
    (tmp_path / "toolcell.service").write_text(service.replace("/opt/toolcell/bin/toolcell", sys.executable))
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", str(tmp_path / "toolcell.socket"),
                           str(tmp_path / "toolcell.service")], capture_output=True, text=True, timeout=120,
                          check=False)
    output = proc.stdout + proc.stderr
    # Without a running systemd (a container, CI), verify still parses every directive and reports
    # unknown ones and bad values; lines about the manager itself are not about the units.
    problems = [line for line in output.splitlines() if "toolcell" in line and "Failed to" not in line
                or "Unknown key" in line or "Invalid" in line or "Failed to parse" in line]
    assert not problems, output
