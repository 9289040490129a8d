"""The MCP protocol core: messages in, actions out. Sans-io: no trio, no sockets, no clock.

How this works:

* A transport feeds one received message (bytes) and the connection's ``ConnState`` to
  ``Core.receive``; it gets back actions: ``Reply`` (bytes to send now), ``ToolCall`` (run a tool,
  then ask ``Core.call_result`` for the bytes), ``Cancel``, ``Listen``, or ``Batch`` of those.
* The era is chosen per request by how the client opens: a request whose ``params._meta`` carries
  ``io.modelcontextprotocol/protocolVersion`` (or any ``server/discover``) is served statelessly
  under 2026-07-28 rules; anything else follows the legacy handshake negotiated by ``initialize``
  on this connection. Both can be served on one connection.
* Notifications are never answered. Ids are echoed with their exact JSON type. An unreadable id
  gets ``null`` (legacy) or no id (2025-11-25 and later).
"""

from __future__ import annotations

import re

from dataclasses import dataclass
from typing import Any, Callable, assert_never

import msgspec

from runtime import __version__
from runtime.protocol import eras, task_shapes
from runtime.protocol import jsonrpc as rpc
from runtime.protocol.errors import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    InvalidParams,
    InvalidRequest,
    McpError,
    MethodNotFound,
    MissingClientCapability,
    UnsupportedProtocolVersion,
    WorkerFailure,
    call_failure_text,
)
from runtime.protocol.catalog import Catalog, CursorError, ToolEntry
from runtime.protocol.errors import PluginOutputError
from runtime.protocol.results import check_structured, encoded_size, sanitize_content
from runtime.protocol.schemas import describe_validation_error
from sandbox import wire

_enc = msgspec.json.Encoder()
_enc_dec = msgspec.json.Decoder()


class _Params(msgspec.Struct):
    meta: Any = msgspec.field(default=None, name="_meta")


class CallParams(msgspec.Struct):
    name: str
    arguments: Any = None
    meta: Any = msgspec.field(default=None, name="_meta")
    #: 2026-07-28 retry of an ``input_required`` call: the client's answers, by key, and our sealed state.
    inputResponses: Any = None
    requestState: Any = None
    #: 2025-11-25: ``{ttl?}`` asks for the call to run as a task.
    task: Any = None


class InitializeParams(_Params):
    protocolVersion: Any = None
    capabilities: Any = None
    clientInfo: Any = None


class ListParams(_Params):
    cursor: Any = None


class SetLevelParams(_Params):
    level: Any = None


class CancelledParams(_Params):
    requestId: Any = msgspec.UNSET


class ListenParams(_Params):
    notifications: Any = None


class TaskParams(_Params):
    taskId: Any = None
    cursor: Any = None
    inputResponses: Any = None


class OtherParams(_Params):
    """A method toolcell does not serve: only what the HTTP headers mirror is read."""

    name: Any = None
    uri: Any = None
    taskId: Any = None


#: Each method's params, decoded once (field types stay ``Any`` where the core words its own message).
_PARAMS: dict[str, msgspec.json.Decoder[Any]] = {
    "tools/call": msgspec.json.Decoder(CallParams),
    "initialize": msgspec.json.Decoder(InitializeParams),
    "tools/list": msgspec.json.Decoder(ListParams),
    "logging/setLevel": msgspec.json.Decoder(SetLevelParams),
    "notifications/cancelled": msgspec.json.Decoder(CancelledParams),
    "subscriptions/listen": msgspec.json.Decoder(ListenParams),
    **{method: msgspec.json.Decoder(TaskParams) for method in
       ("tasks/get", "tasks/result", "tasks/list", "tasks/cancel", "tasks/update")},
}
_other_params: msgspec.json.Decoder[Any] = msgspec.json.Decoder(OtherParams)
_CALL_PARAMS = _PARAMS["tools/call"]


@dataclass
class ConnState:
    """What one stdio connection or legacy HTTP session has negotiated."""

    legacy_version: str | None = None
    initialized: bool = False
    #: Legacy ``logging/setLevel`` threshold (index into LOG_LEVELS); 0 sends everything.
    log_level: int = 0
    client_info: Any = None
    client_capabilities: Any = None


class Request(msgspec.Struct, frozen=True):
    """One message read once: its params decoded for its method and its era chosen (``Core.parse``).
    ``early`` is the action when it cannot be run as a request (an error to answer, or a client's
    response to a request of ours); then the other fields may be empty."""

    env: rpc.Envelope
    method: str
    is_request: bool
    params: Any = None
    meta: dict[str, Any] | None = None
    modern: bool = False
    early: Action | None = None

    def mirrored(self, field_name: str) -> Any:
        """A params field the 2026-07-28 headers mirror (``name``, ``uri``, ``taskId``), or None."""
        return getattr(self.params, field_name, None)


# -- actions: what the core asks the connection to do ------------------------------------------------


class Reply(msgspec.Struct, frozen=True):
    data: bytes | None  # None: a notification was accepted, nothing to send
    error_code: int | None = None
    modern: bool = False
    request_id: Any = None
    #: A ``tools/call`` answered without running: (the tool name asked for, why) for the audit log.
    refused: tuple[str, str] | None = None


def _plain_text_json(items: list[Any]) -> bytes | None:
    """The JSON of ``items`` if every one is a bare text block (``{"type": "text", "text": str}``:
    clean as it is, see ``sanitize_content``); None for anything else."""
    for item in items:
        if type(item) is not dict or len(item) != 2 or item.get("type") != "text" or type(item.get("text")) is not str:
            return None
    return _enc.encode(items)


def requested_tool(raw_params: msgspec.Raw) -> str:
    """The tool name a refused ``tools/call`` asked for (clipped), for the audit log only."""
    try:
        name = _name_only.decode(raw_params).name if raw_params else None
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError, ValueError):
        name = None
    return _clip(name) if isinstance(name, str) else ""


def _refusal(error_code: int | None) -> str:
    return {INVALID_PARAMS: "invalid_params", METHOD_NOT_FOUND: "invalid_request",
            INVALID_REQUEST: "invalid_request"}.get(error_code or 0, "refused")


class _NameOnly(msgspec.Struct):
    name: Any = None


_name_only = msgspec.json.Decoder(_NameOnly)


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
#: W3C ``tracestate``: printable ASCII (and the tabs/spaces around members), at most 512 characters.
_TRACESTATE = re.compile(r"[\x20-\x7e\t]{0,512}")


def valid_tracestate(value: Any) -> bool:
    """A W3C ``tracestate`` made of the characters it may hold (a client's control characters never
    travel on to the tracer, the worker or a log line)."""
    return isinstance(value, str) and _TRACESTATE.fullmatch(value) is not None


def valid_traceparent(value: Any) -> bool:
    """A W3C ``traceparent`` of the right shape (version 00's layout; all-zero ids are invalid)."""
    return (isinstance(value, str) and len(value) == 55 and _TRACEPARENT.fullmatch(value) is not None
            and value[3:35] != "0" * 32 and value[36:52] != "0" * 16 and not value.startswith("ff"))


class ToolCall(msgspec.Struct, frozen=True, eq=False):
    id_bytes: bytes
    request_id: Any
    entry: ToolEntry
    arguments: dict[str, Any]
    version: str
    progress_token: Any
    log_level: int  # -1: the client wants no log messages
    modern: bool
    #: What the client declared it can do (legacy: at initialize; 2026-07-28: on this request).
    client_caps: dict[str, Any] | None = None
    #: 2026-07-28 retry: the client's answers by key (each a result object) and the sealed state it echoes.
    input_responses: dict[str, Any] | None = None
    request_state: str | None = None
    #: Run as a task: "" (no), "now", or "after" (2026-07-28: if not finished after ``task_after_ms``).
    task_mode: str = ""
    task_ttl_ms: int | None = None
    task_after_ms: int = 0
    #: W3C trace context the client put in ``params._meta`` (MCP's convention), checked for shape.
    traceparent: str | None = None
    tracestate: str | None = None


class Cancel(msgspec.Struct, frozen=True):
    request_id: Any


class Listen(msgspec.Struct, frozen=True):
    id_bytes: bytes
    request_id: Any
    tools_list_changed: bool
    version: str
    #: 2026-07-28 tasks extension: ``notifications/tasks`` for these tasks on this stream.
    task_ids: tuple[str, ...] = ()


class Batch(msgspec.Struct, frozen=True):
    actions: tuple[Action, ...]


class ClientResponse(msgspec.Struct, frozen=True):
    """The client's answer to a request of ours (``result`` or ``error``, raw JSON)."""

    request_id: Any
    result: msgspec.Raw | None
    error: msgspec.Raw | None


class TaskRequest(msgspec.Struct, frozen=True):
    """``tasks/get``, ``tasks/result``, ``tasks/list``, ``tasks/cancel`` or ``tasks/update`` (the
    connection answers it from the task store: ``runtime.tasks``)."""

    id_bytes: bytes
    request_id: Any
    method: str
    task_id: str | None
    version: str
    modern: bool
    cursor: Any = None
    input_responses: dict[str, Any] | None = None


#: Everything ``Core.handle`` can return; a connection dispatches it with ``match``.
Action = Reply | ToolCall | Cancel | Listen | Batch | ClientResponse | TaskRequest


# -- outcomes: how a call ended (``runtime.calls``), turned into bytes by ``Core.answer`` -------------


class Completed(msgspec.Struct, frozen=True):
    """The worker returned a result (the tool may still have reported ``isError``)."""

    result: wire.Result


class Failed(msgspec.Struct, frozen=True):
    """The worker could not finish the call: a limit fired, it crashed, it sent garbage."""

    failure: WorkerFailure


class Refused(msgspec.Struct, frozen=True):
    """The call never ran: busy, arguments a worker cannot take, our bug."""

    error: McpError


class Stopped(msgspec.Struct, frozen=True):
    """Shutdown's grace ended while the call ran."""

    reason: str


Outcome = Completed | Failed | Refused | Stopped


#: The most messages one 2025-03-26 JSON-RPC batch may hold; a larger batch is refused whole (-32600).
MAX_BATCH_MESSAGES = 100
#: The most task ids one ``subscriptions/listen`` may name: each one another daemon runs is read from
#: the task store ten times a second while the listen lasts (``runtime.tasks``).
MAX_LISTEN_TASK_IDS = 256
_LEGACY_TASK_METHODS = frozenset({"tasks/get", "tasks/result", "tasks/list", "tasks/cancel"})
_MODERN_TASK_METHODS = frozenset({"tasks/get", "tasks/update", "tasks/cancel"})
_TASKS_REQUIRED: dict[str, Any] = {"requiredCapabilities": {"extensions": {task_shapes.EXTENSION: {}}}}


def _tool_request_error(message: Any) -> InvalidParams:
    """A tool's ``RequestError``: -32602 with its message (untrusted text: clipped)."""
    return InvalidParams(f"Invalid params: {_clip(message, 500)}")


def _require_tasks_extension(caps: Any) -> None:
    """2026-07-28: tasks are only for a request whose client declared the extension (-32021)."""
    extensions = caps.get("extensions") if isinstance(caps, dict) else None
    if not (isinstance(extensions, dict) and task_shapes.EXTENSION in extensions):
        raise MissingClientCapability(
            f"Missing required client capability: the {task_shapes.EXTENSION} extension", _TASKS_REQUIRED)


def _clip(value: Any, limit: int = 80) -> str:
    """Client-supplied text quoted in an error message, kept to one short sentence."""
    text = value if isinstance(value, str) else repr(value)
    text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    return text if len(text) <= limit else text[:limit] + "…"


def _level_index(level: Any) -> int:
    if not isinstance(level, str) or level not in wire.LOG_LEVELS:
        raise InvalidParams(f"Invalid log level {_clip(level, 40)}; use one of: {', '.join(wire.LOG_LEVELS)}")
    return wire.LOG_LEVELS.index(level)


class Core:
    """Serves the tools feature for both eras. ``catalog`` is a callable returning the current one."""

    def __init__(self, catalog: Callable[[], Catalog], *, list_ttl_ms: int = 60_000, instructions: str | None = None,
                 server_name: str = "toolcell") -> None:
        self._catalog = catalog
        self.list_ttl_ms = list_ttl_ms
        self.instructions = instructions
        self.server_info = {"name": server_name, "version": __version__}
        self._server_info_full = {
            **self.server_info,
            "title": "toolcell",
            "description": "Runs MCP tools from plugins, each call in an isolated worker process",
        }
        self._modern_meta = b'"_meta":{"' + eras.META_SERVER_INFO.encode() + b'":' + _enc.encode(self._server_info_full) + b"}"

    # -- entry points --------------------------------------------------------------------------

    def receive(self, state: ConnState, data: bytes | memoryview, catalog: Catalog | None = None) -> Action:
        """Handle one received message (or batch): decode, parse, run. Returns one action or a ``Batch``."""
        try:
            env = rpc.decode_envelope(data)
        except McpError as exc:
            return self._error(state, None, exc, modern=False)
        if isinstance(env, list):
            return self._batch(state, env, catalog)
        if env.method == "tools/call" and state.legacy_version is not None:
            action = self._legacy_call(state, env, catalog)
            if action is not None:
                return action
        return self.run(state, self.parse(state, env), catalog)

    def _legacy_call(self, state: ConnState, env: rpc.Envelope, catalog: Catalog | None) -> Action | None:
        """A well-formed legacy ``tools/call`` (the common request) the way ``parse`` and ``run`` take
        it, without their general steps; None for anything else (malformed params, a 2026-07-28
        ``_meta``, a bad id), which they handle."""
        request_id = env.id
        if env.jsonrpc != "2.0" or not (type(request_id) is int or type(request_id) is str) or not env.params:
            return None
        try:
            params = _CALL_PARAMS.decode(env.params)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError):
            return None
        meta = params.meta
        if meta is not None and (not isinstance(meta, dict) or eras.META_VERSION in meta):
            return None
        version = state.legacy_version
        assert version is not None
        action: Action
        try:
            action = self._tool_call(env, rpc.encode_id(request_id), params, version, meta, catalog, modern=False,
                                     log_level=state.log_level, client_caps=state.client_capabilities)
        except McpError as exc:
            action = self._error(state, request_id, exc, modern=False)
        if type(action) is Reply:
            return self._refused_call(env, action)
        return action

    def handle_decoded(self, state: ConnState, env: rpc.Envelope | list[msgspec.Raw],
                       catalog: Catalog | None = None) -> Action:
        if isinstance(env, list):
            return self._batch(state, env, catalog)
        return self.run(state, self.parse(state, env), catalog)

    def handle(self, state: ConnState, env: rpc.Envelope, catalog: Catalog | None = None) -> Action:
        """Handle one decoded envelope."""
        return self.run(state, self.parse(state, env), catalog)

    def parse(self, state: ConnState, env: rpc.Envelope) -> Request:
        """Read one envelope once: validate it, decode its params for its method, choose its era
        (``server/discover``, or a protocol version in ``params._meta``: 2026-07-28; else legacy).
        A transport may look at the result (the HTTP headers are checked against it) before ``run``."""
        method = env.method
        has_id = env.id is not msgspec.UNSET
        if method is msgspec.UNSET:
            if has_id and (env.result or env.error):
                # The client answers a request of ours (a tool asked it something).
                return Request(env, "", False, early=ClientResponse(env.id, env.result or None, env.error or None))
            return Request(env, "", has_id, early=self._error(state, env.id if has_id and rpc.valid_id(env.id) else None,
                           InvalidRequest("Invalid Request: missing method"), modern=False))
        if env.jsonrpc != "2.0" or not isinstance(method, str):
            idv = env.id if has_id and rpc.valid_id(env.id) else None
            return Request(env, "", has_id, early=self._error(
                state, idv, InvalidRequest("Invalid Request: jsonrpc must be \"2.0\" and method a string"), modern=False))
        if not has_id:
            try:
                params = self._decode(_PARAMS.get(method, _other_params), env.params, required=False)
            except McpError:
                params = None  # a malformed notification is ignored, never answered
            meta = params.meta if params is not None and isinstance(params.meta, dict) else None
            return Request(env, method, False, params, meta, meta is not None and eras.META_VERSION in meta)
        if not rpc.valid_id(env.id):
            return Request(env, method, True, early=self._error(
                state, None, InvalidRequest("Invalid Request: id must be a string or an integer"), modern=False))
        try:
            params = self._decode(_PARAMS.get(method, _other_params), env.params, required=method == "tools/call")
            meta = params.meta if params is not None else None
            if meta is not None and not isinstance(meta, dict):
                raise InvalidParams("Invalid params: _meta must be an object")
        except McpError as exc:
            reply = self._error(state, env.id, exc, modern=False)
            if method == "tools/call":
                reply = msgspec.structs.replace(reply, refused=(requested_tool(env.params), _refusal(reply.error_code)))
            return Request(env, method, True, early=reply)
        modern = method == "server/discover" or (meta is not None and eras.META_VERSION in meta)
        return Request(env, method, True, params, meta, modern)

    def run(self, state: ConnState, req: Request, catalog: Catalog | None = None) -> Action:
        """Do what a parsed message asks (see ``parse``)."""
        if req.early is not None:
            return req.early
        if not req.is_request:
            return self._notification(state, req.method, req.params)
        env = req.env
        id_bytes = rpc.encode_id(env.id)
        action: Action
        try:
            if req.modern:
                action = self._modern(state, env, id_bytes, req.method, req.params, req.meta, catalog)
            else:
                action = self._legacy(state, env, id_bytes, req.method, req.params, req.meta, catalog)
        except McpError as exc:
            action = self._error(state, env.id, exc, modern=req.modern)
        if type(action) is Reply:
            return self._refused_call(env, action)
        return action

    @staticmethod
    def _refused_call(env: rpc.Envelope, action: Action) -> Action:
        """A ``tools/call`` answered without running carries what it asked for (the audit log's)."""
        if env.method == "tools/call" and type(action) is Reply and action.refused is None:
            return msgspec.structs.replace(action, refused=(requested_tool(env.params), _refusal(action.error_code)))
        return action

    # -- legacy era ----------------------------------------------------------------------------

    def _legacy(self, state: ConnState, env: rpc.Envelope, id_bytes: bytes, method: str, params: Any,
                meta: Any, catalog: Catalog | None) -> Any:
        if method == "initialize":
            return self._initialize(state, id_bytes, params)
        if method == "ping":
            return Reply(rpc.response(id_bytes, b"{}"))
        version = state.legacy_version
        if version is None:
            raise InvalidParams(
                "Not initialized: send initialize first, or use protocol 2026-07-28 by putting "
                f"{eras.META_VERSION} and {eras.META_CLIENT_CAPS} in params._meta",
            )
        if method == "tools/list":
            cat = catalog or self._catalog()
            tools, next_cursor = self._page(cat, version, params.cursor if params is not None else None)
            body = b'{"tools":' + tools
            if next_cursor is not None:
                body += b',"nextCursor":' + _enc.encode(next_cursor)
            return Reply(rpc.response(id_bytes, body + b"}"))
        if method == "tools/call":
            return self._tool_call(env, id_bytes, params, version, meta, catalog, modern=False,
                                   log_level=state.log_level, client_caps=state.client_capabilities)
        if method == "logging/setLevel":
            state.log_level = _level_index(params.level if params is not None else None)
            return Reply(rpc.response(id_bytes, b"{}"))
        if method in _LEGACY_TASK_METHODS and eras.has_core_tasks(version):
            return self._task_request(env, id_bytes, method, params, version, modern=False)
        raise MethodNotFound(f"Method not found: {_clip(method)}")

    def _initialize(self, state: ConnState, id_bytes: bytes, params: Any) -> Reply:
        if params is None or not isinstance(params.protocolVersion, str):
            raise InvalidParams("Invalid params: initialize needs protocolVersion (a string)")
        if params.capabilities is not None and not isinstance(params.capabilities, dict):
            raise InvalidParams("Invalid params: capabilities must be an object")
        version = eras.negotiate_legacy(params.protocolVersion)
        state.legacy_version = version
        state.client_info = params.clientInfo
        state.client_capabilities = params.capabilities or {}
        info = self.server_info if eras.rank(version) < eras.rank(eras.V2025_06_18) else (
            {**self.server_info, "title": "toolcell"} if version == eras.V2025_06_18 else self._server_info_full
        )
        result: dict[str, Any] = {
            "protocolVersion": version,
            "capabilities": eras.server_capabilities(version),
            "serverInfo": info,
        }
        if self.instructions:
            result["instructions"] = self.instructions
        return Reply(rpc.response(id_bytes, _enc.encode(result)))

    # -- modern era ----------------------------------------------------------------------------

    def _modern(self, state: ConnState, env: rpc.Envelope, id_bytes: bytes, method: str, params: Any,
                meta: Any, catalog: Catalog | None) -> Any:
        if meta is None:
            raise InvalidParams(f"Invalid params: params._meta with {eras.META_VERSION} and {eras.META_CLIENT_CAPS} is required")
        version = meta.get(eras.META_VERSION)
        if not isinstance(version, str):
            raise InvalidParams(f"Invalid params: _meta[{eras.META_VERSION!r}] is required")
        if version not in eras.MODERN_VERSIONS:
            raise UnsupportedProtocolVersion(
                f"Unsupported protocol version: {version}",
                data={"supported": list(reversed(eras.ALL_VERSIONS)), "requested": version},
            )
        caps = meta.get(eras.META_CLIENT_CAPS)
        if not isinstance(caps, dict):
            raise InvalidParams(f"Invalid params: _meta[{eras.META_CLIENT_CAPS!r}] must be an object")
        if method == "server/discover":
            body = _enc.encode({
                "supportedVersions": list(reversed(eras.ALL_VERSIONS)),
                "capabilities": eras.server_capabilities(eras.V2026_07_28),
                **({"instructions": self.instructions} if self.instructions else {}),
                "ttlMs": self.list_ttl_ms,
                "cacheScope": "public",
            })
            return Reply(rpc.response(id_bytes, self._wrap_modern(body)), modern=True)
        if method == "tools/list":
            cat = catalog or self._catalog()
            tools, next_cursor = self._page(cat, version, params.cursor)
            scope = b'"private"' if catalog is not None and catalog is not self._catalog() else b'"public"'
            body = b'{"tools":' + tools
            if next_cursor is not None:
                body += b',"nextCursor":' + _enc.encode(next_cursor)
            body += b',"ttlMs":' + str(self.list_ttl_ms).encode() + b',"cacheScope":' + scope + b"}"
            return Reply(rpc.response(id_bytes, self._wrap_modern(body)), modern=True)
        if method == "tools/call":
            level = meta.get(eras.META_LOG_LEVEL)
            log_level = -1 if level is None else _level_index(level)
            return self._tool_call(env, id_bytes, params, version, meta, catalog, modern=True, log_level=log_level,
                                   client_caps=caps)
        if method == "subscriptions/listen":
            notes = params.notifications
            if notes is not None and not isinstance(notes, dict):
                raise InvalidParams("Invalid params: notifications must be an object")
            wanted = bool((notes or {}).get("toolsListChanged"))
            task_ids = (notes or {}).get("taskIds")
            if task_ids is not None:
                _require_tasks_extension(caps)
                if not isinstance(task_ids, list) or not all(isinstance(t, str) and 0 < len(t) <= 128 for t in task_ids):
                    raise InvalidParams("Invalid params: notifications.taskIds must be a list of task ids")
                if len(set(task_ids)) > MAX_LISTEN_TASK_IDS:
                    raise InvalidParams(f"Invalid params: notifications.taskIds: at most {MAX_LISTEN_TASK_IDS} task "
                                        "ids in one listen")
            return Listen(id_bytes, env.id, wanted, version, tuple(dict.fromkeys(task_ids or ())))
        if method in _MODERN_TASK_METHODS:
            _require_tasks_extension(caps)
            return self._task_request(env, id_bytes, method, params, version, modern=True)
        raise MethodNotFound(f"Method not found: {_clip(method)}")

    def _wrap_modern(self, body: bytes) -> bytes:
        """Add ``resultType`` and the serverInfo ``_meta`` to a result object's JSON."""
        inner = body[1:-1]
        return b'{"resultType":"complete",' + (inner + b"," if inner else b"") + self._modern_meta + b"}"

    def subscription_ack(self, listen: Listen) -> bytes:
        notes: dict[str, Any] = {"toolsListChanged": True} if listen.tools_list_changed else {}
        if listen.task_ids:
            notes["taskIds"] = list(listen.task_ids)
        return rpc.notification("notifications/subscriptions/acknowledged",
                                {"_meta": {eras.META_SUBSCRIPTION_ID: listen.request_id}, "notifications": notes})

    def subscription_list_changed(self, listen: Listen) -> bytes:
        return rpc.notification("notifications/tools/list_changed",
                                {"_meta": {eras.META_SUBSCRIPTION_ID: listen.request_id}})

    def subscription_end(self, listen: Listen) -> bytes:
        body = b'{"_meta":{"' + eras.META_SUBSCRIPTION_ID.encode() + b'":' + listen.id_bytes + b"}}"
        return rpc.response(listen.id_bytes, b'{"resultType":"complete",' + body[1:])

    # -- shared pieces -------------------------------------------------------------------------

    def _page(self, cat: Catalog, version: str, cursor: Any) -> tuple[bytes, str | None]:
        try:
            return cat.page(version, cursor)
        except CursorError as exc:
            raise InvalidParams(f"Invalid params: {exc}") from None

    def _tool_call(self, env: rpc.Envelope, id_bytes: bytes, params: CallParams, version: str, meta: Any,
                   catalog: Catalog | None, modern: bool, log_level: int, client_caps: Any = None) -> Any:
        cat = catalog or self._catalog()
        entry = cat.get(params.name) if isinstance(params.name, str) else None
        if entry is None:
            raise InvalidParams(f"Unknown tool: {_clip(params.name)}")
        args = params.arguments
        if args is None:
            args = {}
        elif not isinstance(args, dict):
            raise InvalidParams("Invalid params: arguments must be an object")
        token = traceparent = tracestate = None
        if meta is not None:
            token = meta.get("progressToken")
            if token is not None and not rpc.valid_id(token):
                raise InvalidParams("Invalid params: progressToken must be a string or an integer")
            traceparent = meta.get("traceparent")
            if traceparent is not None:
                # A malformed one is ignored, as W3C trace context says (never an error for the call).
                traceparent = traceparent if valid_traceparent(traceparent) else None
                tracestate = meta.get("tracestate") if traceparent is not None else None
                if not valid_tracestate(tracestate):
                    tracestate = None
        responses = state_text = None
        if modern:
            responses = params.inputResponses
            if responses is not None and (not isinstance(responses, dict)
                                          or not all(isinstance(v, dict) for v in responses.values())):
                raise InvalidParams("Invalid params: inputResponses must map each key to the client's result object")
            state_text = params.requestState
            if state_text is not None and not isinstance(state_text, str):
                raise InvalidParams("Invalid params: requestState must be the string the server sent")
        if entry.checked.spec.task_support == "forbidden" and (modern or params.task is None):
            task_mode, task_ttl_ms, task_after_ms = "", None, 0  # the common case: never a task
        else:
            task_mode, task_ttl_ms, task_after_ms = self._task_wish(entry, params, version, modern, client_caps)
        call = ToolCall(id_bytes, env.id, entry, args, version, token, log_level, modern,
                        client_caps if isinstance(client_caps, dict) else None, responses, state_text,
                        task_mode, task_ttl_ms, task_after_ms, traceparent, tracestate)
        try:
            problem = describe_validation_error(entry.checked.validator, args)
        except (ValueError, RecursionError):
            problem = "arguments are nested too deeply to validate"
        if problem is not None:
            message = f"Invalid arguments for tool {entry.name}: {problem}"
            if eras.validation_error_as_result(version):
                return Reply(self._result_bytes(call, [{"type": "text", "text": message}], None, True), modern=modern,
                             refused=(entry.name, "invalid_arguments"))
            raise InvalidParams(message)
        return call

    @staticmethod
    def _task_wish(entry: ToolEntry, params: CallParams, version: str, modern: bool,
                   client_caps: Any) -> tuple[str, int | None, int]:
        """Whether this call runs as a task (mode, requested ttl, ms before it becomes one), or the
        error that refuses it (the tool's ``task_support`` against what the client asked or declared)."""
        spec = entry.checked.spec
        support = spec.task_support
        if modern:
            caps = client_caps if isinstance(client_caps, dict) else {}
            extensions = caps.get("extensions")
            declared = isinstance(extensions, dict) and task_shapes.EXTENSION in extensions
            if not declared:
                if support == "required":
                    raise MissingClientCapability(
                        f"Missing required client capability: tool {entry.name} runs only as a task "
                        f"(declare the {task_shapes.EXTENSION} extension)", _TASKS_REQUIRED)
                return "", None, 0
            if support == "forbidden":
                return "", None, 0
            after = spec.task_after_ms or 0
            return ("after" if after > 0 else "now"), None, after
        if not eras.has_core_tasks(version):
            return "", None, 0
        wish = params.task
        if wish is None:
            if support == "required":
                raise MethodNotFound(f"Tool {entry.name} must be called as a task (params.task)")
            return "", None, 0
        if not isinstance(wish, dict):
            raise InvalidParams("Invalid params: task must be an object")
        if support == "forbidden":
            raise MethodNotFound(f"Tool {entry.name} does not support task-augmented calls")
        ttl = wish.get("ttl")
        if ttl is not None and (type(ttl) is not int or ttl < 0):
            raise InvalidParams("Invalid params: task.ttl must be a non-negative integer (ms)")
        return "now", ttl, 0

    def _task_request(self, env: rpc.Envelope, id_bytes: bytes, method: str, params: Any, version: str,
                      modern: bool) -> TaskRequest:
        task_id = params.taskId if params is not None else None
        if method == "tasks/list":
            return TaskRequest(id_bytes, env.id, method, None, version, modern, params.cursor if params else None)
        if not isinstance(task_id, str) or not task_id:
            raise InvalidParams("Invalid params: taskId (a string) is required")
        responses = None
        if method == "tasks/update":
            responses = params.inputResponses
            if not isinstance(responses, dict) or not all(isinstance(v, dict) for v in responses.values()):
                raise InvalidParams("Invalid params: inputResponses must map each key to the client's result object")
        return TaskRequest(id_bytes, env.id, method, task_id, version, modern, None, responses)

    def task_reply(self, request: TaskRequest, body: bytes) -> bytes:
        """The response to a tasks/* request whose result object is ``body``."""
        if request.modern:
            return rpc.response(request.id_bytes, body[:-1] + b"," + self._modern_meta + b"}")
        return rpc.response(request.id_bytes, body)

    def task_created(self, call: ToolCall, view: task_shapes.TaskView) -> bytes:
        """The answer to a ``tools/call`` that became a task."""
        if call.modern:
            body = task_shapes.modern_create_result(view)
            return rpc.response(call.id_bytes, body[:-1] + b"," + self._modern_meta + b"}")
        return rpc.response(call.id_bytes, task_shapes.legacy_create_result(view))

    def outcome_body(self, call: ToolCall, outcome: Outcome, max_output_bytes: int
                     ) -> tuple[bytes | None, McpError | None, str | None]:
        """What a call's outcome comes to, as a result object's JSON or an error (for a task to
        keep), and a plugin-bug description for the log. Result objects carry no ``resultType``
        wrapping beyond what their era defines."""
        match outcome:
            case Completed(result) if result.missing_capability is not None and call.modern:
                return None, self._missing_capability(call, result.missing_capability), None
            case Completed(result) if result.request_error is not None:
                return None, _tool_request_error(result.request_error), None
            case Refused(error):
                return None, error, None
            case Completed(result):
                body, bug = self._call_result_body(call, result, max_output_bytes, in_task=True)
                return body, None, bug
            case Failed(failure):
                text = call_failure_text(call.entry.name, failure)
                return self._result_body(call, [{"type": "text", "text": text}], None, True, True), None, None
            case Stopped(reason):
                text = f"Tool {call.entry.name} was stopped: {reason}"
                return self._result_body(call, [{"type": "text", "text": text}], None, True, True), None, None
            case _:
                assert_never(outcome)

    def _notification(self, state: ConnState, method: str, params: Any) -> Action:
        if method == "notifications/initialized":
            state.initialized = True
        elif method == "notifications/cancelled":
            if isinstance(params, CancelledParams) and rpc.valid_id(params.requestId):
                return Cancel(params.requestId)
        return Reply(None)

    def _batch(self, state: ConnState, items: list[msgspec.Raw], catalog: Catalog | None) -> Action:
        version = state.legacy_version
        if not items:
            return self._error(state, None, InvalidRequest("Invalid Request: empty batch"), modern=False)
        if version is None or not eras.supports_batches(version):
            why = f"protocol {version}" if version else "this connection (not initialized for 2025-03-26)"
            return self._error(state, None, InvalidRequest(f"Invalid Request: JSON-RPC batches are not supported in {why}"), modern=False)
        if len(items) > MAX_BATCH_MESSAGES:
            return self._error(state, None, InvalidRequest(
                f"Invalid Request: a batch may hold at most {MAX_BATCH_MESSAGES} messages ({len(items)} sent)"), modern=False)
        actions: list[Action] = []
        for item in items:
            try:
                env = rpc.envelope_from_raw(item)
            except McpError as exc:
                actions.append(self._error(state, None, exc, modern=False))
                continue
            if env.method == "initialize" and env.id is not msgspec.UNSET:
                idv = env.id if rpc.valid_id(env.id) else None
                actions.append(self._error(state, idv, InvalidRequest("Invalid Request: initialize must not be part of a batch"), modern=False))
                continue
            action = self.handle(state, env, catalog)
            if type(action) is Listen:
                # A stream-long subscription has no single answer a batch could carry.
                action = self._error(state, action.request_id, InvalidRequest(
                    "Invalid Request: subscriptions/listen must not be part of a batch"), modern=False)
            actions.append(action)
        return Batch(tuple(actions))

    def too_large(self, state: ConnState, limit_bytes: int) -> bytes:
        """The answer to a message over the size limit (its id unread: ``null`` or none, by revision)."""
        reply = self._error(state, None, InvalidRequest(
                                                       f"Message exceeds the {limit_bytes}-byte limit and was discarded"),
                            modern=False)
        assert reply.data is not None
        return reply.data

    @staticmethod
    def _decode(decoder: Any, raw: msgspec.Raw, required: bool) -> Any:
        if not raw:
            if required:
                raise InvalidParams("Invalid params: params are required")
            return None
        try:
            return decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise InvalidParams(f"Invalid params: {exc}") from None
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError):
            raise InvalidParams("Invalid params: not decodable") from None

    def _error(self, state: ConnState, request_id: Any, exc: McpError, modern: bool) -> Reply:
        if request_id is None:
            version = eras.V2026_07_28 if modern else state.legacy_version
            id_bytes = None if eras.omit_unknown_error_id(version) else b"null"
        else:
            id_bytes = rpc.encode_id(request_id)
        return Reply(rpc.error_response(id_bytes, exc.code, exc.message, exc.data), exc.code, modern, request_id)

    # -- results and notifications of a running call -------------------------------------------

    def call_result(self, call: ToolCall, result: wire.Result, max_output_bytes: int) -> tuple[bytes, str | None]:
        """The response for a finished call, and a plugin-bug description for the log (or None)."""
        body, bug = self._call_result_body(call, result, max_output_bytes)
        return rpc.response(call.id_bytes, body), bug

    def _call_result_body(self, call: ToolCall, result: wire.Result, max_output_bytes: int,
                          in_task: bool = False) -> tuple[bytes, str | None]:
        bug: str | None = None
        if not result.has_structured and call.entry.checked.output_validator is None:
            # The common result, text blocks only and nothing structured: checked, measured and
            # encoded in one pass (the same bytes ``_result_body`` makes; text needs no shaping
            # in any era).
            plain = _plain_text_json(result.content)
            if plain is not None and len(plain) <= max_output_bytes:
                body = b'{"content":' + plain + (b',"isError":true}' if result.is_error else b"}")
                if call.modern and not in_task:
                    body = self._wrap_modern(body)
                elif call.modern:
                    body = b'{"resultType":"complete",' + body[1:]
                return body, None
        try:
            content = sanitize_content(result.content)
            structured = None
            validator = call.entry.checked.output_validator
            if not result.is_error:
                if validator is not None:
                    if not result.has_structured:
                        raise PluginOutputError("the tool declares an outputSchema but returned no structuredContent")
                    check_structured(validator, result.structured)
                    structured = result.structured
                elif result.has_structured:
                    if not isinstance(result.structured, dict):
                        raise PluginOutputError("structuredContent must be a JSON object")
                    structured = result.structured
            size = encoded_size(content) + (encoded_size(structured) if structured is not None else 0)
            if size > max_output_bytes:
                raise PluginOutputError(f"the result is {size} bytes, over the tool's {max_output_bytes}-byte limit")
            data = self._result_body(call, content, structured, result.is_error, in_task)
        except PluginOutputError as exc:
            bug = str(exc)
            data = self._result_body(call, [{"type": "text", "text": f"Tool {call.entry.name} produced invalid output: {exc}"}],
                                     None, True, in_task)
        return data, bug

    def input_required(self, call: ToolCall, requests: list[wire.InputRequest], request_state: str | None) -> bytes:
        """A 2026-07-28 ``input_required`` result: the questions still open, and our sealed state."""
        body: dict[str, Any] = {"resultType": "input_required",
                                "inputRequests": {r.key: {"method": r.method, "params": r.params} for r in requests}}
        if request_state is not None:
            body["requestState"] = request_state
        data = _enc.encode(body)
        return rpc.response(call.id_bytes, data[:-1] + b"," + self._modern_meta + b"}")

    def answer(self, call: ToolCall, outcome: Outcome, max_output_bytes: int) -> tuple[bytes, str | None]:
        """The response for a call's outcome, and a plugin-bug description for the log (or None)."""
        if type(outcome) is Completed:  # the common case first, without the pattern machinery
            result = outcome.result
            if result.missing_capability is None and result.request_error is None:
                return self.call_result(call, result, max_output_bytes)
        match outcome:
            case Completed(result) if result.missing_capability is not None and call.modern:
                return self.call_error(call, self._missing_capability(call, result.missing_capability)), None
            case Completed(result) if result.request_error is not None:
                return self.call_error(call, _tool_request_error(result.request_error)), None
            case Completed(result):
                return self.call_result(call, result, max_output_bytes)
            case Failed(failure):
                return self.call_failed(call, call_failure_text(call.entry.name, failure)), None
            case Refused(error):
                return self.call_error(call, error), None
            case Stopped(reason):
                return self.call_failed(call, f"Tool {call.entry.name} was stopped: {reason}"), None
            case _:
                assert_never(outcome)

    @staticmethod
    def _missing_capability(call: ToolCall, capability: str) -> MissingClientCapability:
        if capability not in eras.INPUT_CAPABILITIES:
            capability = "sampling"
        return MissingClientCapability(f"Missing required client capability: {capability} "
                                       f"(tool {call.entry.name} needs it)", {"requiredCapabilities": {capability: {}}})

    @staticmethod
    def error_code(call: ToolCall, outcome: Outcome) -> int | None:
        """The JSON-RPC error code ``answer`` gives ``outcome``, or None when it is a result."""
        if type(outcome) is Refused:
            return outcome.error.code
        if type(outcome) is Completed and outcome.result.missing_capability is not None and call.modern:
            return MissingClientCapability.code
        if type(outcome) is Completed and outcome.result.request_error is not None:
            return InvalidParams.code
        return None

    def call_failed(self, call: ToolCall, message: str) -> bytes:
        """An ``isError`` result for a call its worker could not finish (timeout, crash, ...)."""
        return self._result_bytes(call, [{"type": "text", "text": message}], None, True)

    def call_error(self, call: ToolCall, error: McpError) -> bytes:
        return rpc.error_reply(call.id_bytes, error)

    def _result_bytes(self, call: ToolCall, content: list[dict[str, Any]], structured: Any, is_error: bool) -> bytes:
        return rpc.response(call.id_bytes, self._result_body(call, content, structured, is_error))

    def _result_body(self, call: ToolCall, content: list[dict[str, Any]], structured: Any, is_error: bool,
                     in_task: bool = False) -> bytes:
        """A ``CallToolResult`` object; ``in_task``: kept in a task (2026-07-28: ``resultType`` but no
        serverInfo ``_meta``)."""
        version = call.version
        obj: dict[str, Any] = {"resultType": "complete"} if call.modern and in_task else {}
        obj["content"] = eras.shape_content(version, content)
        if structured is not None and eras.has_structured_content(version):
            obj["structuredContent"] = structured
        if is_error:
            obj["isError"] = True
        body = _enc.encode(obj)
        if call.modern and not in_task:
            body = self._wrap_modern(body)
        return body

    def progress_notification(self, call: ToolCall, frame: wire.Progress) -> bytes | None:
        if call.progress_token is None:
            return None
        params: dict[str, Any] = {"progressToken": call.progress_token, "progress": frame.progress}
        if frame.total is not None:
            params["total"] = frame.total
        if frame.message is not None and eras.has_progress_message(call.version):
            params["message"] = frame.message
        return rpc.notification("notifications/progress", params)

    def log_notification(self, call: ToolCall, frame: wire.Log) -> bytes | None:
        if call.log_level < 0 or not (0 <= frame.level < len(wire.LOG_LEVELS)) or frame.level < call.log_level:
            return None
        params: dict[str, Any] = {"level": wire.LOG_LEVELS[frame.level], "data": frame.data}
        if frame.logger is not None:
            params["logger"] = frame.logger
        return rpc.notification("notifications/message", params)

    def list_changed(self) -> bytes:
        return rpc.notification("notifications/tools/list_changed", {})

    # -- a tool asking its client (legacy server->client requests) ------------------------------

    @staticmethod
    def server_request(server_id: str, request: wire.InputRequest, version: str,
                       meta: dict[str, Any] | None = None) -> bytes:
        """The JSON-RPC request that asks a legacy client what a tool asked (shaped for ``version``)."""
        params = eras.shape_input_request(version, request.method, request.params)
        if meta:
            params = {**params, "_meta": meta}
        return rpc.request(server_id, request.method, params)

    @staticmethod
    def read_client_response(response: ClientResponse, key: str) -> wire.InputResponse:
        """A client's answer to one of our requests as the tool will read it."""
        if response.error is not None:
            try:
                error = _enc_dec.decode(response.error)
                message = error.get("message") if isinstance(error, dict) else None
            except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError):
                message = None
            text = f"the client answered with an error: {_clip(message, 300)}" if isinstance(message, str) else \
                "the client answered with an error"
            return wire.InputResponse(key, "error", message=text)
        try:
            result = _enc_dec.decode(response.result) if response.result is not None else None
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError):
            result = None
        if not isinstance(result, dict):
            return wire.InputResponse(key, "error", message="the client's answer was not a JSON object")
        result.pop("_meta", None)
        return wire.InputResponse(key, "result", result)
