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

from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec

from runtime import __version__
from runtime.protocol import eras
from runtime.protocol import jsonrpc as rpc
from runtime.protocol.jsonrpc import ProtocolError
from runtime.protocol.catalog import Catalog, CursorError, ToolEntry
from runtime.protocol.results import PluginOutputError, check_structured, encoded_size, sanitize_content
from runtime.protocol.schemas import describe_validation_error
from sandbox import wire

_enc = msgspec.json.Encoder()


class CallParams(msgspec.Struct):
    name: str
    arguments: Any = None
    meta: Any = msgspec.field(default=None, name="_meta")


class GenericParams(msgspec.Struct):
    meta: Any = msgspec.field(default=None, name="_meta")
    cursor: Any = None
    protocolVersion: Any = None
    capabilities: Any = None
    clientInfo: Any = None
    level: Any = None
    requestId: Any = msgspec.UNSET
    notifications: Any = None


_call_params = msgspec.json.Decoder(CallParams)
_generic_params = msgspec.json.Decoder(GenericParams)


@dataclass
class ConnState:
    """What one stdio connection or legacy HTTP session has negotiated."""

    legacy_version: str | None = None
    initialized: bool = False
    #: Legacy ``logging/setLevel`` threshold (index into LOG_LEVELS); 0 sends everything.
    log_level: int = 0
    client_info: Any = None
    client_capabilities: Any = None


# -- actions -----------------------------------------------------------------------------------


@dataclass
class Reply:
    data: bytes | None  # None: a notification was accepted, nothing to send
    error_code: int | None = None
    modern: bool = False
    request_id: Any = None
    #: A ``tools/call`` answered without running: (the tool name asked for, why) for the audit log.
    refused: tuple[str, str] | None = None


def requested_tool(raw_params: msgspec.Raw) -> str:
    """The tool name a refused ``tools/call`` asked for (clipped), for the audit log only."""
    try:
        name = _name_only.decode(raw_params).name if raw_params else None
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, UnicodeDecodeError, ValueError):
        name = None
    return _clip(name) if isinstance(name, str) else ""


def _refusal(error_code: int | None) -> str:
    return {rpc.INVALID_PARAMS: "invalid_params", rpc.METHOD_NOT_FOUND: "invalid_request",
            rpc.INVALID_REQUEST: "invalid_request"}.get(error_code or 0, "refused")


class _NameOnly(msgspec.Struct):
    name: Any = None


_name_only = msgspec.json.Decoder(_NameOnly)


@dataclass(eq=False)
class ToolCall:
    id_bytes: bytes
    request_id: Any
    entry: ToolEntry
    arguments: dict[str, Any]
    version: str
    progress_token: Any
    log_level: int  # -1: the client wants no log messages
    modern: bool


@dataclass
class Cancel:
    request_id: Any


@dataclass
class Listen:
    id_bytes: bytes
    request_id: Any
    tools_list_changed: bool
    version: str


@dataclass
class Batch:
    actions: list[Any] = field(default_factory=list)


def _clip(value: Any, limit: int = 80) -> str:
    """Client-supplied text quoted in an error message, kept to one short sentence."""
    text = value if isinstance(value, str) else repr(value)
    text = text.encode("unicode_escape").decode("ascii") if not text.isprintable() else text
    return text if len(text) <= limit else text[:limit] + "…"


def _level_index(level: Any) -> int:
    if not isinstance(level, str) or level not in wire.LOG_LEVELS:
        raise ProtocolError(rpc.INVALID_PARAMS, f"Invalid log level {_clip(level, 40)}; use one of: {', '.join(wire.LOG_LEVELS)}")
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

    def receive(self, state: ConnState, data: bytes | memoryview, catalog: Catalog | None = None) -> Any:
        """Handle one received message (or batch). Returns one action or a ``Batch``."""
        try:
            env = rpc.decode_envelope(data)
        except ProtocolError as exc:
            return self._error(state, None, exc, modern=False)
        if isinstance(env, list):
            return self._batch(state, env, catalog)
        return self.handle(state, env, catalog)

    def handle(self, state: ConnState, env: rpc.Envelope, catalog: Catalog | None = None) -> Any:
        """Handle one decoded envelope."""
        method = env.method
        has_id = env.id is not msgspec.UNSET
        if method is msgspec.UNSET:
            if has_id and (env.result or env.error):
                return Reply(None)  # a response from the client: we send no requests, so ignore it
            return self._error(state, env.id if has_id and rpc.valid_id(env.id) else None,
                               ProtocolError(rpc.INVALID_REQUEST, "Invalid Request: missing method"), modern=False)
        if env.jsonrpc != "2.0" or not isinstance(method, str):
            idv = env.id if has_id and rpc.valid_id(env.id) else None
            return self._error(state, idv, ProtocolError(rpc.INVALID_REQUEST, "Invalid Request: jsonrpc must be \"2.0\" and method a string"), modern=False)
        if not has_id:
            return self._notification(state, method, env.params)
        if not rpc.valid_id(env.id):
            return self._error(state, None, ProtocolError(rpc.INVALID_REQUEST, "Invalid Request: id must be a string or an integer"), modern=False)
        id_bytes = rpc.encode_id(env.id)
        modern = False
        try:
            if method == "tools/call":
                params = self._decode(_call_params, env.params, required=True)
            else:
                params = self._decode(_generic_params, env.params, required=False)
            meta = params.meta if params is not None else None
            if meta is not None and not isinstance(meta, dict):
                raise ProtocolError(rpc.INVALID_PARAMS, "Invalid params: _meta must be an object")
            modern = method == "server/discover" or (meta is not None and eras.META_VERSION in meta)
            if modern:
                action = self._modern(state, env, id_bytes, method, params, meta, catalog)
            else:
                action = self._legacy(state, env, id_bytes, method, params, meta, catalog)
        except ProtocolError as exc:
            action = self._error(state, env.id, exc, modern=modern)
        if method == "tools/call" and type(action) is Reply and action.refused is None:
            action.refused = (requested_tool(env.params), _refusal(action.error_code))
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
            raise ProtocolError(
                rpc.INVALID_PARAMS,
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
                                   log_level=state.log_level)
        if method == "logging/setLevel":
            state.log_level = _level_index(params.level if params is not None else None)
            return Reply(rpc.response(id_bytes, b"{}"))
        raise ProtocolError(rpc.METHOD_NOT_FOUND, f"Method not found: {_clip(method)}")

    def _initialize(self, state: ConnState, id_bytes: bytes, params: Any) -> Reply:
        if params is None or not isinstance(params.protocolVersion, str):
            raise ProtocolError(rpc.INVALID_PARAMS, "Invalid params: initialize needs protocolVersion (a string)")
        if params.capabilities is not None and not isinstance(params.capabilities, dict):
            raise ProtocolError(rpc.INVALID_PARAMS, "Invalid params: capabilities must be an object")
        version = eras.negotiate_legacy(params.protocolVersion)
        state.legacy_version = version
        state.client_info = params.clientInfo
        state.client_capabilities = params.capabilities or {}
        info = self.server_info if eras.rank(version) < eras.rank(eras.V2025_06_18) else (
            {**self.server_info, "title": "toolcell"} if version == eras.V2025_06_18 else self._server_info_full
        )
        result: dict[str, Any] = {
            "protocolVersion": version,
            "capabilities": eras.server_capabilities(),
            "serverInfo": info,
        }
        if self.instructions:
            result["instructions"] = self.instructions
        return Reply(rpc.response(id_bytes, _enc.encode(result)))

    # -- modern era ----------------------------------------------------------------------------

    def _modern(self, state: ConnState, env: rpc.Envelope, id_bytes: bytes, method: str, params: Any,
                meta: Any, catalog: Catalog | None) -> Any:
        if meta is None:
            raise ProtocolError(rpc.INVALID_PARAMS, f"Invalid params: params._meta with {eras.META_VERSION} and {eras.META_CLIENT_CAPS} is required")
        version = meta.get(eras.META_VERSION)
        if not isinstance(version, str):
            raise ProtocolError(rpc.INVALID_PARAMS, f"Invalid params: _meta[{eras.META_VERSION!r}] is required")
        if version not in eras.MODERN_VERSIONS:
            raise ProtocolError(
                rpc.UNSUPPORTED_PROTOCOL_VERSION,
                f"Unsupported protocol version: {version}",
                data={"supported": list(reversed(eras.ALL_VERSIONS)), "requested": version},
            )
        caps = meta.get(eras.META_CLIENT_CAPS)
        if not isinstance(caps, dict):
            raise ProtocolError(rpc.INVALID_PARAMS, f"Invalid params: _meta[{eras.META_CLIENT_CAPS!r}] must be an object")
        if method == "server/discover":
            body = _enc.encode({
                "supportedVersions": list(reversed(eras.ALL_VERSIONS)),
                "capabilities": eras.server_capabilities(),
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
            return self._tool_call(env, id_bytes, params, version, meta, catalog, modern=True, log_level=log_level)
        if method == "subscriptions/listen":
            notes = params.notifications
            if notes is not None and not isinstance(notes, dict):
                raise ProtocolError(rpc.INVALID_PARAMS, "Invalid params: notifications must be an object")
            wanted = bool((notes or {}).get("toolsListChanged"))
            return Listen(id_bytes, env.id, wanted, version)
        raise ProtocolError(rpc.METHOD_NOT_FOUND, f"Method not found: {_clip(method)}")

    def _wrap_modern(self, body: bytes) -> bytes:
        """Add ``resultType`` and the serverInfo ``_meta`` to a result object's JSON."""
        inner = body[1:-1]
        return b'{"resultType":"complete",' + (inner + b"," if inner else b"") + self._modern_meta + b"}"

    def subscription_ack(self, listen: Listen) -> bytes:
        notes = {"toolsListChanged": True} if listen.tools_list_changed else {}
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
            raise ProtocolError(rpc.INVALID_PARAMS, f"Invalid params: {exc}") from None

    def _tool_call(self, env: rpc.Envelope, id_bytes: bytes, params: CallParams, version: str, meta: Any,
                   catalog: Catalog | None, modern: bool, log_level: int) -> Any:
        cat = catalog or self._catalog()
        entry = cat.get(params.name) if isinstance(params.name, str) else None
        if entry is None:
            raise ProtocolError(rpc.INVALID_PARAMS, f"Unknown tool: {_clip(params.name)}")
        args = params.arguments
        if args is None:
            args = {}
        elif not isinstance(args, dict):
            raise ProtocolError(rpc.INVALID_PARAMS, "Invalid params: arguments must be an object")
        token = None
        if meta is not None:
            token = meta.get("progressToken")
            if token is not None and not rpc.valid_id(token):
                raise ProtocolError(rpc.INVALID_PARAMS, "Invalid params: progressToken must be a string or an integer")
        call = ToolCall(id_bytes, env.id, entry, args, version, token, log_level, modern)
        try:
            problem = describe_validation_error(entry.checked.validator, args)
        except (ValueError, RecursionError):
            problem = "arguments are nested too deeply to validate"
        if problem is not None:
            message = f"Invalid arguments for tool {entry.name}: {problem}"
            if eras.validation_error_as_result(version):
                return Reply(self._result_bytes(call, [{"type": "text", "text": message}], None, True), modern=modern,
                             refused=(entry.name, "invalid_arguments"))
            raise ProtocolError(rpc.INVALID_PARAMS, message)
        return call

    def _notification(self, state: ConnState, method: str, raw_params: msgspec.Raw) -> Any:
        if method == "notifications/initialized":
            state.initialized = True
        elif method == "notifications/cancelled":
            try:
                params = self._decode(_generic_params, raw_params, required=True)
            except ProtocolError:
                return Reply(None)  # malformed cancellations are ignored, never answered
            if params is not None and rpc.valid_id(params.requestId):
                return Cancel(params.requestId)
        return Reply(None)

    def _batch(self, state: ConnState, items: list[Any], catalog: Catalog | None) -> Any:
        version = state.legacy_version
        if not items:
            return self._error(state, None, ProtocolError(rpc.INVALID_REQUEST, "Invalid Request: empty batch"), modern=False)
        if version is None or not eras.supports_batches(version):
            why = f"protocol {version}" if version else "this connection (not initialized for 2025-03-26)"
            return self._error(state, None, ProtocolError(rpc.INVALID_REQUEST, f"Invalid Request: JSON-RPC batches are not supported in {why}"), modern=False)
        batch = Batch()
        for item in items:
            try:
                env = rpc.envelope_from_obj(item)
            except ProtocolError as exc:
                batch.actions.append(self._error(state, None, exc, modern=False))
                continue
            if env.method == "initialize" and env.id is not msgspec.UNSET:
                idv = env.id if rpc.valid_id(env.id) else None
                batch.actions.append(self._error(state, idv, ProtocolError(rpc.INVALID_REQUEST, "Invalid Request: initialize must not be part of a batch"), modern=False))
                continue
            action = self.handle(state, env, catalog)
            if type(action) is Listen:
                # A stream-long subscription has no single answer a batch could carry.
                action = self._error(state, action.request_id, ProtocolError(
                    rpc.INVALID_REQUEST, "Invalid Request: subscriptions/listen must not be part of a batch"), modern=False)
            batch.actions.append(action)
        return batch

    def too_large(self, state: ConnState, limit_bytes: int) -> bytes:
        """The answer to a message over the size limit (its id unread: ``null`` or none, by revision)."""
        reply = self._error(state, None, ProtocolError(rpc.INVALID_REQUEST,
                                                       f"Message exceeds the {limit_bytes}-byte limit and was discarded"),
                            modern=False)
        assert reply.data is not None
        return reply.data

    @staticmethod
    def _decode(decoder: Any, raw: msgspec.Raw, required: bool) -> Any:
        if not raw:
            if required:
                raise ProtocolError(rpc.INVALID_PARAMS, "Invalid params: params are required")
            return None
        try:
            return decoder.decode(raw)
        except msgspec.ValidationError as exc:
            raise ProtocolError(rpc.INVALID_PARAMS, f"Invalid params: {exc}") from None
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError, ValueError):
            raise ProtocolError(rpc.INVALID_PARAMS, "Invalid params: not decodable") from None

    def _error(self, state: ConnState, request_id: Any, exc: ProtocolError, modern: bool) -> Reply:
        if request_id is None:
            version = eras.V2026_07_28 if modern else state.legacy_version
            id_bytes = None if eras.omit_unknown_error_id(version) else b"null"
        else:
            id_bytes = rpc.encode_id(request_id)
        return Reply(rpc.error_response(id_bytes, exc.code, exc.message, exc.data), exc.code, modern, request_id)

    # -- results and notifications of a running call -------------------------------------------

    def call_result(self, call: ToolCall, result: wire.Result, max_output_bytes: int) -> tuple[bytes, str | None]:
        """The response for a finished call, and a plugin-bug description for the log (or None)."""
        bug: str | None = None
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
            data = self._result_bytes(call, content, structured, result.is_error)
        except PluginOutputError as exc:
            bug = str(exc)
            data = self._result_bytes(call, [{"type": "text", "text": f"Tool {call.entry.name} produced invalid output: {exc}"}], None, True)
        return data, bug

    def call_failed(self, call: ToolCall, message: str) -> bytes:
        """An ``isError`` result for a call its worker could not finish (timeout, crash, ...)."""
        return self._result_bytes(call, [{"type": "text", "text": message}], None, True)

    def call_error(self, call: ToolCall, code: int, message: str, data: Any = rpc.UNSET) -> bytes:
        return rpc.error_response(call.id_bytes, code, message, data)

    def _result_bytes(self, call: ToolCall, content: list[dict[str, Any]], structured: Any, is_error: bool) -> bytes:
        version = call.version
        obj: dict[str, Any] = {"content": eras.shape_content(version, content)}
        if structured is not None and eras.has_structured_content(version):
            obj["structuredContent"] = structured
        if is_error:
            obj["isError"] = True
        body = _enc.encode(obj)
        if call.modern:
            body = self._wrap_modern(body)
        return rpc.response(call.id_bytes, body)

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
