"""The two systemd protocols a service speaks, written out (each is a few lines; libsystemd is not
needed, and the PyPI bindings of it are heavier than the protocols):

* **sd_notify** (``Type=notify``): one datagram per state change, ``READY=1`` once every listener
  is serving, ``STOPPING=1`` when a graceful shutdown starts, sent to the ``AF_UNIX`` datagram socket
  named by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace). Without the
  variable nothing is sent: the daemon runs the same outside systemd.
* **Socket activation** (``toolcell.socket``): the listening sockets arrive already bound as fds 3,
  4, … (``$LISTEN_FDS`` of them, named in ``$LISTEN_FDNAMES``), meant for this process only when
  ``$LISTEN_PID`` is its pid.

Both read their variables once and remove them from the environment, so that nothing the daemon
starts (a worker, a hosted server, an installer) believes the sockets or the notify channel are its.
"""

from __future__ import annotations

import os
import socket
import stat

#: The first passed fd (``SD_LISTEN_FDS_START``).
LISTEN_FDS_START = 3


class Notifier:
    """Sends state changes to the service manager; does nothing when not started by one."""

    def __init__(self, address: str | None) -> None:
        self.address: str | bytes | None = None
        if address and (address.startswith("/") or address.startswith("@")):
            # "@name": Linux's abstract namespace, written with a leading NUL on the wire.
            self.address = b"\0" + address[1:].encode() if address.startswith("@") else address

    @classmethod
    def from_environment(cls) -> Notifier:
        return cls(os.environ.pop("NOTIFY_SOCKET", None))

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; True if sent. A manager that is gone or a full
        socket never stops the daemon: the notification is lost, as with sd_notify(3)."""
        if self.address is None:
            return False
        message = "\n".join(assignments).encode()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.setblocking(False)
                sock.sendto(message, self.address)
        except OSError:
            return False
        return True


def listen_sockets() -> list[tuple[str, socket.socket]]:
    """The listening sockets systemd passed to this process (``sd_listen_fds_with_names``), as
    (name, socket) pairs, non-blocking and close-on-exec; empty when none were passed to us.
    Raises ``ValueError`` for a passed fd that is not a listening stream socket."""
    pid, count = os.environ.pop("LISTEN_PID", ""), os.environ.pop("LISTEN_FDS", "")
    names = os.environ.pop("LISTEN_FDNAMES", "")
    if not pid.isdigit() or int(pid) != os.getpid() or not count.isdigit() or int(count) == 0:
        return []
    labels = names.split(":") if names else []
    out: list[tuple[str, socket.socket]] = []
    for i in range(int(count)):
        fd = LISTEN_FDS_START + i
        label = labels[i] if i < len(labels) and labels[i] else f"fd{fd}"
        try:
            mode = os.fstat(fd).st_mode
        except OSError as exc:
            raise ValueError(f"passed socket {label} (fd {fd}): {exc.strerror}") from None
        if not stat.S_ISSOCK(mode):
            raise ValueError(f"passed fd {fd} ({label}) is not a socket")
        sock = socket.socket(fileno=fd)
        if sock.type != socket.SOCK_STREAM or not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            sock.detach()
            raise ValueError(f"passed socket {label} (fd {fd}) is not a listening stream socket "
                             "(the .socket unit needs ListenStream= and Accept=no)")
        sock.setblocking(False)
        sock.set_inheritable(False)
        out.append((label, sock))
    return out
