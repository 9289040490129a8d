"""Source of the test plugins the daemon tests load (written into ``tmp_path`` by ``make_plugin``)."""

from __future__ import annotations

#: General-purpose misbehaving tools. Every tool that might be killed reports its pid first
#: (through a progress message, so the test can check that process afterwards).
PROBE = r'''
import os
import stat
import sys
import time

from sandbox import ToolResult, current, tool


def _say_pid():
    current().progress(1, None, f"pid={os.getpid()}")


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@tool
def pid() -> str:
    """The worker's process id."""
    return str(os.getpid())


@tool
def crash(code: int = 3) -> str:
    """Exit the worker process abruptly."""
    _say_pid()
    os._exit(code)


def _ipc_fd():
    candidates = [3] + [int(n) for n in os.listdir("/proc/self/fd") if int(n) > 3]
    for fd in candidates:
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                return fd
        except OSError:
            pass
    raise RuntimeError("no IPC socket found")


@tool
def garbage() -> str:
    """Write a malformed frame (valid length prefix, invalid msgpack) on the IPC channel."""
    os.write(_ipc_fd(), b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1")
    time.sleep(0.2)
    return "sent garbage"


@tool
def big(size: int) -> str:
    """Return ``size`` characters."""
    return "x" * size


@tool
def slow(seconds: float) -> str:
    """Report the pid, then sleep."""
    _say_pid()
    time.sleep(seconds)
    return f"slept {seconds}"


@tool
def chatty(steps: int = 3) -> str:
    """Report progress and log at every step."""
    ctx = current()
    for i in range(1, steps + 1):
        ctx.progress(i, steps, f"step {i} of {steps}")
        ctx.log("debug", f"debug {i}")
        ctx.log("warning", {"step": i}, "probe")
    return "chatty done"


@tool
def fail(message: str) -> str:
    """Raise an exception with ``message``."""
    def inner():
        raise ValueError(message)
    inner()


@tool
def noisy() -> str:
    """Print to stdout and stderr (including a forged JSON-RPC response), then answer."""
    print("plugin chatter on stdout " * 50)
    sys.stdout.flush()
    os.write(1, b'{"jsonrpc":"2.0","id":1,"result":{"forged":true}}\n')
    print("plugin chatter on stderr", file=sys.stderr)
    return "quiet result"


@tool
def add(a: int, b: int) -> int:
    """Add two integers (structured output)."""
    return a + b


@tool(output_schema={"type": "object", "properties": {"v": {"type": "string"}}, "required": ["v"]})
def deep(depth: int) -> ToolResult:
    """Return structured content nested ``depth`` levels deep (which breaks the outputSchema)."""
    value = []
    for _ in range(depth):
        value = [value]
    return ToolResult(content=[{"type": "text", "text": "deep"}], structured={"v": value}, has_structured=True)
'''

#: Tools for deadline tests (the plugin's timeout is short).
DEADLINE = r'''
import os
import time

from sandbox import current, tool


@tool
def sleepy(seconds: float) -> str:
    """Report the pid, then sleep past the deadline."""
    current().progress(1, None, f"pid={os.getpid()}")
    time.sleep(seconds)
    return "woke up"


@tool
def escape() -> str:
    """Double-fork a grandchild into its own session, report its pid, then hang."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            os.close(r)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            time.sleep(120)
            os._exit(0)
        os._exit(0)
    os.close(w)
    os.waitpid(child, 0)
    grandchild = int(os.read(r, 64))
    current().progress(1, None, f"pid={grandchild}")
    time.sleep(120)
    return "never"


@tool
def escape_quietly() -> str:
    """Like ``escape``, but the grandchild detaches its stdio (as a proper daemon would)."""
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        os.setsid()
        grandchild = os.fork()
        if grandchild == 0:
            os.close(r)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.write(w, str(os.getpid()).encode())
            os.close(w)
            time.sleep(120)
            os._exit(0)
        os._exit(0)
    os.close(w)
    os.waitpid(child, 0)
    grandchild = int(os.read(r, 64))
    current().progress(1, None, f"pid={grandchild}")
    time.sleep(120)
    return "never"


@tool
def quick() -> str:
    """Answer at once."""
    return "quick"


@tool
def flood_channel(seconds: float) -> str:
    """Keep the daemon's end of this worker's channel full of valid progress frames (written straight
    to the IPC socket, past the SDK and its budget) for ``seconds``."""
    import stat
    import struct

    import msgspec

    fd = next(fd for fd in [3] + sorted(int(n) for n in os.listdir("/proc/self/fd"))
              if fd >= 3 and stat.S_ISSOCK(os.fstat(fd).st_mode))
    body = msgspec.msgpack.encode(["progress", current().call_id, 1.0, None, None])
    chunk = (struct.pack(">I", len(body)) + body) * (1 << 14)
    end = time.time() + seconds
    while time.time() < end:
        view = memoryview(chunk)
        while view:
            view = view[os.write(fd, view):]
    return "flooded"
'''

#: One worker, one queue slot.
SINGLE = r'''
import time

from sandbox import tool


@tool
def hold(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "held"
'''

#: A second, well-behaved plugin (to check that one plugin's trouble never reaches another).
NEIGHBOUR = r'''
import time

from sandbox import tool


@tool
def wait_then_answer(seconds: float) -> str:
    """Sleep, then answer."""
    time.sleep(seconds)
    return "neighbour answered"
'''

#: Tools that run into the per-call resource limits (rlimits apply under every policy).
LIMITED = r'''
import os

from sandbox import tool


@tool
def hog(mb: int) -> str:
    """Allocate ``mb`` MiB."""
    block = bytearray(mb * 1024 * 1024)
    return f"allocated {len(block)}"


@tool
def spin() -> str:
    """Burn CPU until stopped."""
    n = 0
    while True:
        n += 1


@tool
def open_many(count: int) -> str:
    """Open ``count`` files at once."""
    handles = [open(os.devnull) for _ in range(count)]
    return f"opened {len(handles)}"


@tool
def write_big(mb: int) -> str:
    """Write ``mb`` MiB to a file in the scratch directory."""
    with open("big.bin", "wb") as f:
        f.write(b"\0" * (mb * 1024 * 1024))
    return "written"


@tool
def fine() -> str:
    """Answer."""
    return "fine"
'''

#: Looks at its own process: environment, pid, state kept between calls.
INTROSPECT = r'''
import os

from sandbox import tool

CALLS = []


@tool
def environment() -> dict[str, str]:
    """The worker's environment."""
    return dict(os.environ)


@tool
def remember() -> str:
    """Count the calls this process has served, and say which process it is."""
    CALLS.append(1)
    return f"{os.getpid()}:{len(CALLS)}"
'''

#: A tool that leaves a thread running (its worker retires after answering), and a plain one.
RETIRING = r'''
import os
import threading
import time

from sandbox import tool


@tool
def hold(seconds: float) -> str:
    time.sleep(seconds)
    return "held"


@tool
def leave_thread() -> str:
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
    return "thread left"


@tool
def whoami() -> str:
    return str(os.getpid())
'''

#: At import (before its worker is ready), pass descriptors to the daemon over the IPC socket: 400
#: messages of one byte and four descriptors each, which together make one (garbage) frame. Only one
#: descriptor is ever expected; the frame then fails the plugin's start.
FD_PUSHER = r'''
import os
import socket
import struct

from sandbox import tool

channel = socket.socket(fileno=os.dup(3))
channel.send(struct.pack(">I", 400))
for _ in range(400):
    socket.send_fds(channel, [b"\\x00"], [0, 1, 2, 3])


@tool
def never() -> str:
    return "never"
'''
