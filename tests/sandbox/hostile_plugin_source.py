"""Source of the hostile plugin the daemon-side tests load (written into ``tmp_path`` by ``make_plugin``).

Each tool attacks the trusted side (the daemon) through what a worker may send: values that are
deep, huge, many or fast, and hand-made frames written straight onto the worker's IPC channel.
"""

HOSTILE = r'''
import os
import stat
import struct
import time
import uuid

import msgspec

from sandbox import current, tool


#: Tells one worker from another (inside its pid namespace every worker is pid 1).
INSTANCE = uuid.uuid4().hex


def _nested(depth):
    value = "bottom"
    for _ in range(depth):
        value = {"d": [value]}
    return value


def _ipc_fd():
    for fd in [3] + [int(n) for n in os.listdir("/proc/self/fd") if int(n) > 3]:
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                return fd
        except OSError:
            pass
    raise RuntimeError("no IPC socket found")


def _frame(obj):
    body = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(body)) + body


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@tool
def deep_log(depth: int) -> str:
    """Log a message whose data is nested ``depth`` levels deep."""
    current().log("error", _nested(depth))
    return "logged"


@tool
def deep_result(depth: int) -> dict:
    """Return structured content nested ``depth`` levels deep."""
    return {"v": _nested(depth)}


@tool
def raw_frames(kind: str, count: int = 1) -> str:
    """Write hand-made frames for the running call straight onto the IPC channel."""
    ctx = current()
    call_id = ctx.call_id
    fd = _ipc_fd()
    if kind == "deep_log":
        # Built by hand: 5,000 nested one-element arrays (msgspec would refuse to encode it).
        body = b"\x95\xa3log" + msgspec.msgpack.encode(call_id) + b"\x04" + b"\x91" * 5000 + b"\xa1x\xc0"
        frame = struct.pack(">I", len(body)) + body
    elif kind == "bad_key_log":
        frame = _frame(["log", call_id, 4, {1.5: "float key"}, None])
    elif kind == "ext_log":
        frame = _frame(["log", call_id, 4, msgspec.msgpack.Ext(5, b"xx"), None])
    elif kind == "nan_progress":
        frame = _frame(["progress", call_id, float("nan"), float("inf"), "x"])
    elif kind == "huge_int_log":
        frame = _frame(["log", call_id, 4, 2 ** 63 + 5, None])
    elif kind == "bad_level":
        frame = _frame(["log", call_id, 99, "x", None])
    elif kind == "surrogate_log":
        body = b"\x95\xa3log" + msgspec.msgpack.encode(call_id) + b"\x04\xa2\xed\xa0\xc0"
        frame = struct.pack(">I", len(body)) + body
    elif kind == "wrong_id_log":
        frame = _frame(["log", call_id + 1000, 4, "not yours", None])
    elif kind == "ready_again":
        frame = _frame(["ready", 1, [], [], []])
    elif kind == "returned_early":  # the runtime's "the call's code returned", before any answer
        frame = _frame(["returned", call_id])
    elif kind == "truncated":
        frame = struct.pack(">I", 1000) + b"\x95"
    else:
        raise ValueError(kind)
    data = frame * count
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    time.sleep(0.3)
    return "sent"


@tool
def instance() -> str:
    """Which worker process this is."""
    return INSTANCE


@tool
def forge_result(sleep_s: float, returned: bool = False, merged: bool = False) -> str:
    """Answer this call early with a Result written straight onto the IPC channel (and, with
    ``returned``, the runtime's CallReturned too; with ``merged``, both as one ResultReturned frame),
    then keep running: sleep ``sleep_s``."""
    call_id = current().call_id
    content = [{"type": "text", "text": "forged by " + INSTANCE}]
    data = _frame(["result_returned" if merged else "result", call_id, content])
    if returned:
        data += _frame(["returned", call_id])
    fd = _ipc_fd()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    time.sleep(sleep_s)
    return "returned"


@tool
def fd_list() -> dict:
    """Every descriptor this process holds and what it points to (the listing's own one, closed by the
    time it is read back, is left out)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[name] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
    return out


@tool
def log_flood(count: int, size: int) -> str:
    """Send ``count`` log messages of ``size`` characters as fast as possible."""
    ctx = current()
    blob = "x" * size
    for i in range(count):
        ctx.log("error", {"i": i, "blob": blob})
    return "flooded"


@tool
def progress_flood(count: int, size: int) -> str:
    """Send ``count`` progress notifications with ``size``-character messages."""
    ctx = current()
    blob = "p" * size
    for i in range(count):
        ctx.progress(i + 1, None, blob)
    return "flooded"
'''
