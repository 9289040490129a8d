"""Daemon <-> worker frames: length-prefixed msgpack, tagged-union Structs.

Both sides import this module; it must stay free of trio (and of anything slow to import).

Framing: a 4-byte big-endian unsigned length, then that many bytes of msgpack. The channel is a
dedicated ``AF_UNIX`` stream socket (never the plugin's stdout), passed to the worker as an fd.

Conversation:

1. daemon -> worker: one ``Init`` frame (configuration travels over the fd, never argv or env).
2. worker -> daemon: ``Ready`` (tools it found, isolation layers it actually applied) or ``LoadFailed``.
   A worker whose plugin holds a network grant first sends one ``EgressListener`` frame, with its
   proxy's listening socket attached (``SCM_RIGHTS``), before any plugin code runs.
3. daemon -> worker: ``Call`` frames, possibly several in one write when the pool is saturated; the
   worker runs them one at a time, in order, and answers each with zero or more ``Progress`` / ``Log``
   frames, exactly one ``Result``, then ``CallReturned``; a pooled worker's runtime usually writes the
   two as one ``ResultReturned`` frame, and always before it starts its next call (so the daemon knows
   which call runs: the one whose deadline runs, the only one a crash or timeout may fail).
   A ``CancelCall`` for a call that has not started makes the worker answer it at once, unrun.
   ``Result`` is the answer, relayed to the client at once; ``CallReturned`` is the worker's runtime
   saying that the call's code has returned (per_call: that its processes are all dying). Plugin
   code can write a ``Result`` of its own mid-call (it shares the process with the runtime), so only
   ``CallReturned`` frees the worker: until then it is busy and the call's deadline runs (past it the
   worker is killed, whatever was answered), and a second ``Result`` for the call ends the worker.
4. A running call may need input from the client (a tool that asks: ``sandbox.asking``): the worker
   sends one ``Ask`` frame (a round of ``InputRequest``s, each under a key unique within the call)
   and blocks until the daemon sends the matching ``Answer`` (one ``InputResponse`` per key: the
   client's result, or why there is none). The daemon relays the requests to the client in the
   form the client's protocol revision uses; the call's deadline does not run while it waits.
5. daemon -> worker: ``Shutdown`` (or the daemon simply kills it).

Frames from a worker are untrusted: the daemon decodes them with a size cap and strict types and
treats anything else as the plugin misbehaving.
"""

from __future__ import annotations

import struct
from typing import Annotated, Any, Union

import msgspec

HEADER = struct.Struct(">I")
#: Largest frame either side accepts. Results are additionally capped per plugin.
MAX_FRAME_BYTES = 64 * 1024 * 1024


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Per-plugin resource limits (also the ``[limits]`` table of a manifest). Bounds are declared
    on the fields (``runtime.declared_bounds`` words a manifest's violations)."""

    timeout_s: Annotated[float, msgspec.Meta(ge=0.001, le=86400)] = 30.0
    memory_mb: Annotated[int, msgspec.Meta(ge=16, le=1 << 20)] = 512
    cpu_s: Annotated[int, msgspec.Meta(ge=1, le=86400)] = 60
    max_concurrency: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 4
    max_output_bytes: Annotated[int, msgspec.Meta(ge=1024, le=256 << 20)] = 1024 * 1024
    max_open_files: Annotated[int, msgspec.Meta(ge=16, le=65536)] = 256
    max_file_size_mb: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 64
    max_queue: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 256
    #: Processes and threads of the worker, itself included (cgroup ``pids.max``, RLIMIT_NPROC). A
    #: worker is two processes (its reaper outside the pid namespace, and pid 1) before any fork; a
    #: per_call zygote keeps a relay and a warm call process besides the running one.
    max_processes: Annotated[int, msgspec.Meta(ge=8, le=4096)] = 64
    #: Progress and log notifications relayed to the client per call; later ones are dropped.
    #: Their bytes also count against ``max_output_bytes`` (the call's one budget for all it sends).
    max_notifications: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 1000
    #: Largest single progress or log notification (as sent by the worker); a larger one is truncated.
    max_notification_bytes: Annotated[int, msgspec.Meta(ge=256, le=16 << 20)] = 64 * 1024
    #: How long a call that asked its client something (``sandbox.asking``) waits for the answer;
    #: its ``timeout_s`` does not run meanwhile. A 2026-07-28 call parked for its client's retry
    #: waits at most this long too.
    ask_timeout_s: Annotated[float, msgspec.Meta(ge=0.01, le=86400)] = 300.0
    #: Questions one call may ask its client in all (0: its tools may not ask).
    max_asks: Annotated[int, msgspec.Meta(ge=0, le=10_000)] = 64
    #: 2026-07-28 calls of this plugin held (each on its worker) for their client's retry; beyond it a
    #: call that asks is stopped and its retry runs the tool again from the start.
    max_parked: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 2


class Permissions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a plugin asked for in its manifest. Everything is denied unless listed."""

    #: ``host:port`` entries the plugin may connect to, only through the daemon's egress proxy
    #: (``runtime.egress_rules`` says what an entry matches).
    network: list[str] = []
    #: Extra paths readable by the plugin.
    read: list[str] = []
    #: Extra paths readable and writable by the plugin.
    write: list[str] = []


class Init(msgspec.Struct, tag="init", frozen=True, array_like=True):
    """First frame to a worker: everything it needs to isolate itself and load the plugin."""

    plugin_name: str
    plugin_dir: str
    entry: str
    sys_path: list[str]
    env: dict[str, str]
    limits: Limits
    permissions: Permissions
    #: Isolation policy profile: "strict", "compat" or "none".
    policy: str = "none"
    #: Scratch directory the worker uses as its cwd (created by the daemon).
    scratch_dir: str = ""
    #: Isolation mode: "pooled" or "per_call" (zygote forks a child per call).
    mode: str = "pooled"
    #: Only list tools, then exit (used by ``toolcell check`` / ``list``).
    describe_only: bool = False
    #: A hosted MCP server (``sandbox.hosted``): the argv to execute once isolated, instead of
    #: importing a plugin. Empty for a plugin.
    command: list[str] = []
    #: Files and trees the hosted command needs to read and execute (its executable, interpreter, package).
    command_read: list[str] = []


class Call(msgspec.Struct, tag="call", frozen=True, array_like=True):
    id: int
    tool: str
    arguments: dict[str, Any]
    #: True when the client asked for progress (sent a progressToken).
    progress: bool = False
    #: Minimum syslog severity (0 = debug ... 7 = emergency) the client wants, or -1 for none.
    log_level: int = -1
    #: The call's W3C trace context (its ``tools/call`` span) when the daemon traces: plugin code
    #: reads it as ``current().traceparent`` to make child spans. Empty when tracing is off.
    traceparent: str = ""


class CancelCall(msgspec.Struct, tag="cancel", frozen=True, array_like=True):
    """Drop a call that was sent but has not started; the worker answers it with a cancelled Result."""

    id: int


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True, array_like=True):
    pass


#: What a tool may ask a client for (the legacy server->client requests; MRTR ``inputRequests``).
INPUT_METHODS = ("elicitation/create", "sampling/createMessage", "roots/list")
#: Why an ``InputResponse`` carries no result.
ANSWER_OUTCOMES = ("result", "declined_capability", "error", "timeout", "cancelled")


class InputResponse(msgspec.Struct, frozen=True, array_like=True):
    """The answer to one ``InputRequest``: ``outcome`` "result" (``result`` is the client's result
    object), "declined_capability" (the client did not declare the capability), "error" (the client
    answered with an error: ``message``), "timeout" (no answer in time) or "cancelled"."""

    key: str
    outcome: str
    result: Any = None
    message: str = ""


class Answer(msgspec.Struct, tag="answer", frozen=True, array_like=True):
    """The answers to the running call's ``Ask``, one per key it asked."""

    id: int
    responses: list[InputResponse]


ToWorker = Union[Init, Call, CancelCall, Shutdown, Answer]


class ToolSpec(msgspec.Struct, frozen=True):
    """A tool definition as the plugin declared it (untrusted until the daemon checks it)."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = {}
    output_schema: Union[dict[str, Any], None] = None
    title: Union[str, None] = None
    annotations: Union[dict[str, Any], None] = None
    icons: Union[list[dict[str, Any]], None] = None
    meta: Union[dict[str, Any], None] = None
    #: Tasks (long-running calls): "forbidden" (the default), "optional" or "required".
    task_support: str = "forbidden"
    #: 2026-07-28: run the call inline and make it a task only if it has not finished after this
    #: many ms (None: a task at once, when the client declared the tasks extension).
    task_after_ms: Union[int, None] = None


class Ready(msgspec.Struct, tag="ready", frozen=True, array_like=True):
    pid: int
    tools: list[ToolSpec]
    #: Isolation layers the worker actually applied, before importing plugin code.
    layers: list[str] = []
    #: Layers the policy wanted but the machine could not provide (compat profile only).
    missing: list[str] = []


class EgressListener(msgspec.Struct, tag="egress", frozen=True, array_like=True):
    """The worker's egress proxy socket (listening on 127.0.0.1:``port`` in its own network
    namespace) rides along with this frame as ``SCM_RIGHTS``; the daemon accepts on it."""

    port: int


class LoadFailed(msgspec.Struct, tag="load_failed", frozen=True, array_like=True):
    error: str
    #: Where it failed: "isolation", "import", "definition".
    stage: str = "import"


class Progress(msgspec.Struct, tag="progress", frozen=True, array_like=True):
    id: int
    progress: float
    total: Union[float, None] = None
    message: Union[str, None] = None


class Log(msgspec.Struct, tag="log", frozen=True, array_like=True):
    id: int
    level: int
    data: Any
    logger: Union[str, None] = None


class Result(msgspec.Struct, tag="result", frozen=True, array_like=True):
    id: int
    content: list[dict[str, Any]]
    structured: Any = None
    has_structured: bool = False
    is_error: bool = False
    #: For an error raised by the tool: the traceback, for the daemon log only (never the client).
    traceback: Union[str, None] = None
    #: The worker ends after this result (the call left something running): send it nothing more.
    retire: Union[str, None] = None
    #: per_call: the call's process was killed by SIGKILL before it answered (the daemon asks the
    #: worker's cgroup whether that was the memory limit).
    killed: bool = False
    #: The tool ended because the client lacks a capability it needed ("elicitation", "sampling",
    #: "roots"): a 2026-07-28 client hears -32021 naming it, an older one an ``isError`` result.
    missing_capability: Union[str, None] = None
    #: The tool raised ``RequestError``: the request is answered -32602 with this message.
    request_error: Union[str, None] = None
    #: How long the worker took over the call (arguments in, tool, result built), in ns: the
    #: daemon's metrics split a call's time into queue, channel and worker with it.
    run_ns: int = 0
    #: Of ``run_ns``, the time the call spent blocked (sleeping, waiting on I/O or on its client), not
    #: running or waiting for a CPU: the pool sizes itself by it (``runtime.execution.pool``). An
    #: estimate, and the plugin's word: it can only move the pool within ``max_concurrency``.
    blocked_ns: int = 0


class CallReturned(msgspec.Struct, tag="returned", frozen=True, array_like=True):
    """After the call's ``Result``: the worker's runtime has the control back (the call's code returned,
    or, per_call, its processes are all dying); the worker is free for its next call."""

    id: int


class ResultReturned(Result, tag="result_returned", frozen=True, array_like=True):
    """A ``Result`` and its ``CallReturned`` in one frame: what a pooled worker's runtime writes for a
    call whose code has returned (its usual answer), so the daemon reads, checks and dispatches one
    frame per call instead of two. It means exactly the two frames: plugin code in a pooled worker
    can forge it as it can forge ``CallReturned`` (the limit ``sandbox.wire`` states); a per_call
    zygote never relays it from a call's process (only ``Result`` passes), so there only R frees the
    worker."""


class InputRequest(msgspec.Struct, frozen=True, array_like=True):
    """One thing a tool asks the client for: ``method`` is one of ``INPUT_METHODS``, ``params`` its
    params as the 2025-11-25 revision words them. ``key`` is unique within the call (the worker
    numbers them in order, so a call run again from the start asks under the same keys)."""

    key: str
    method: str
    params: dict[str, Any]


class Ask(msgspec.Struct, tag="ask", frozen=True, array_like=True):
    """The running call needs input: one round of requests; the call waits for the ``Answer``."""

    id: int
    requests: list[InputRequest]


FromWorker = Union[Ready, LoadFailed, Progress, Log, Result, ResultReturned, CallReturned, EgressListener, Ask]

LOG_LEVELS = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")

_encoder = msgspec.msgpack.Encoder()
to_worker_decoder = msgspec.msgpack.Decoder(ToWorker)
from_worker_decoder = msgspec.msgpack.Decoder(FromWorker)


def encode_frame(msg: Any) -> bytes:
    """Encode one frame, length prefix included."""
    body = _encoder.encode(msg)
    return HEADER.pack(len(body)) + body


def _frame_spans(buf: bytearray, max_frame: int, max_count: int) -> tuple[list[tuple[int, int]], int]:
    """Where the complete frame bodies (at most ``max_count``) at the front of ``buf`` are, and where
    the first incomplete one starts. Raises ``ValueError`` for a frame longer than ``max_frame``."""
    spans: list[tuple[int, int]] = []
    pos = 0
    n = len(buf)
    while n - pos >= 4 and len(spans) < max_count:
        (length,) = HEADER.unpack_from(buf, pos)
        if length > max_frame:
            raise ValueError(f"frame of {length} bytes exceeds the {max_frame}-byte cap")
        end = pos + 4 + length
        if end > n:
            break
        spans.append((pos + 4, end))
        pos = end
    return spans, pos


def split_frames(buf: bytearray, max_frame: int = MAX_FRAME_BYTES, max_count: int = 1 << 30) -> list[bytes]:
    """Remove and return the complete frame bodies (at most ``max_count``) at the front of ``buf``.

    Raises ``ValueError`` for a frame longer than ``max_frame`` (the peer is broken or hostile).
    """
    spans, pos = _frame_spans(buf, max_frame, max_count)
    out = [bytes(buf[start:end]) for start, end in spans]
    if pos:
        del buf[:pos]
    return out


def decode_frames(buf: bytearray, decoder: msgspec.msgpack.Decoder[Any], max_frame: int = MAX_FRAME_BYTES) -> list[Any]:
    """``split_frames`` and ``decoder.decode`` of each body in one pass, without a copy of each body:
    remove the complete frames at the front of ``buf`` and return them decoded. The same cap
    (``ValueError``) and the decoder's own strictness; if a frame fails to decode, its error is raised
    and ``buf`` is left as it was."""
    spans, pos = _frame_spans(buf, max_frame, 1 << 30)
    with memoryview(buf) as view:
        out = [decoder.decode(view[start:end]) for start, end in spans]
    if pos:
        del buf[:pos]
    return out
