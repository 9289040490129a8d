"""The worker's half of the egress proxy (the daemon's half, which does everything else, is
``runtime.egress``).

In the worker's fresh, empty network namespace, while it still holds ``CAP_NET_ADMIN`` there (before
the identity switch, the user namespace and seccomp): bring ``lo`` up, listen on 127.0.0.1:<any>,
send the listening socket to the daemon over the IPC channel (``SCM_RIGHTS`` with an
``EgressListener`` frame) and close our copy, so no process in the sandbox can accept on it. Then
point the proxy variables of the environment at it, before the plugin is imported. Never imports trio.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

from sandbox.wire import EgressListener, encode_frame

HOST = "127.0.0.1"
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1
_IFREQ = struct.Struct("16sh22x")
#: Set to ``http://127.0.0.1:<port>``; urllib, requests, httpx, curl and pip read these.
PROXY_VARS = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy")
NO_PROXY_VARS = ("NO_PROXY", "no_proxy")


def loopback_up() -> None:
    """``ip link set lo up`` in this network namespace (needs CAP_NET_ADMIN over it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifr = fcntl.ioctl(s, SIOCGIFFLAGS, _IFREQ.pack(b"lo", 0))
        flags = _IFREQ.unpack(ifr)[1]
        if not flags & IFF_UP:
            fcntl.ioctl(s, SIOCSIFFLAGS, _IFREQ.pack(b"lo", flags | IFF_UP))


def hand_over(ipc_fd: int) -> int:
    """Listen on 127.0.0.1:<any>, pass the socket to the daemon, close ours. Returns the port."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((HOST, 0))
        listener.listen(128)
        port = int(listener.getsockname()[1])
        frame = encode_frame(EgressListener(port))
        chan = socket.socket(fileno=os.dup(ipc_fd))
        try:
            sent = socket.send_fds(chan, [frame], [listener.fileno()])
        finally:
            chan.close()
        if sent != len(frame):
            raise OSError(f"egress hand-over: sent {sent} of {len(frame)} bytes")
        return port
    finally:
        listener.close()


def set_proxy_env(port: int) -> None:
    url = f"http://{HOST}:{port}"
    for name in PROXY_VARS:
        os.environ[name] = url
    for name in NO_PROXY_VARS:
        os.environ[name] = ""
