"""Tools that ask: a running call asks the client for input, in plain blocking Python.

::

    from sandbox import tool, current
    from sandbox.asking import CapabilityMissing

    class Confirm(msgspec.Struct):
        confirm: bool

    @tool
    def delete_file(path: str) -> str:
        try:
            answer = current().elicit(f"Delete {path}?", Confirm)
        except CapabilityMissing:
            return "not deleted: this client cannot ask its user"
        if not answer.accepted or not answer.content.confirm:
            return "not deleted"
        ...

``current().elicit(message, schema)`` (form mode: a msgspec Struct type, whose instance comes back
as ``content``, or a JSON schema dict), ``current().elicit_url(url, message)``,
``current().sample(messages, max_tokens=…)``, ``current().roots()`` and ``current().ask(...)`` (several
requests in one round) block until the client answers. How the question travels is the daemon's
business: a request to the client on the call's own stream for clients of revisions 2024-11-05 …
2025-11-25, an ``input_required`` result and a retry for 2026-07-28 clients, the task's
``input_required`` status for a task. Every outcome is a value or one of the exceptions below, all
``ToolError``s: a tool that does not catch them fails its call with a message that says why.

A 2026-07-28 client's retry may come to a daemon that no longer holds the waiting call (it restarted,
or it is another daemon behind a balancer): the tool then runs again from the start and each of its
questions is answered, in order, from the answers the client already gave. A tool that asks should
therefore do its side effects after its questions, or make them idempotent.

Never imports trio.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Union

import msgspec

from sandbox.errors import ToolError
from sandbox.json_schema import inline_refs
from sandbox.wire import InputRequest, InputResponse

__all__ = [
    "ElicitResult",
    "SamplingResult",
    "Root",
    "Elicit",
    "ElicitUrl",
    "Sample",
    "ListRoots",
    "InputUnavailable",
    "CapabilityMissing",
    "ClientRefused",
    "InputTimeout",
    "InputCancelled",
]


class InputUnavailable(ToolError):
    """The client gave no usable answer; ``key`` and ``method`` say to which request."""

    def __init__(self, message: str, key: str = "", method: str = "") -> None:
        super().__init__(message)
        self.key = key
        self.method = method


class CapabilityMissing(InputUnavailable):
    """The client did not declare the capability (``elicitation``, ``sampling``, ``roots``) on this
    request or connection, so it was not asked. Left uncaught, it ends the call with the error the
    client's revision has for it (2026-07-28: -32021 naming the capability)."""

    @property
    def capability(self) -> str:
        return _CAPABILITY.get(self.method, "")


class ClientRefused(InputUnavailable):
    """The client answered with an error, or with something that does not fit what was asked."""


class InputTimeout(InputUnavailable):
    """No answer came in time (the plugin's ``limits.ask_timeout_s``)."""


class InputCancelled(InputUnavailable):
    """The question was withdrawn: the call is being cancelled or the daemon is stopping."""


# -- results -------------------------------------------------------------------------------------


class ElicitResult(msgspec.Struct, frozen=True):
    """The user's answer: ``action`` is "accept" (``content`` holds the form's values: a dict, or an
    instance of the Struct type asked for), "decline" or "cancel"."""

    action: Literal["accept", "decline", "cancel"]
    content: Any = None

    @property
    def accepted(self) -> bool:
        return self.action == "accept"


class SamplingResult(msgspec.Struct, frozen=True):
    """What the client's model said: ``content`` is a content block (or a list of them)."""

    role: str
    content: Any
    model: str = ""
    stop_reason: Union[str, None] = None

    @property
    def text(self) -> str:
        """The text of the (first) text content block, or ""."""
        blocks = self.content if isinstance(self.content, list) else [self.content]
        for block in blocks:
            if isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str):
                return str(block["text"])
        return ""


class Root(msgspec.Struct, frozen=True):
    """A root the client exposes (a ``file://`` URI and an optional name)."""

    uri: str
    name: Union[str, None] = None


# -- requests ------------------------------------------------------------------------------------


class Elicit(msgspec.Struct, frozen=True):
    """Ask the user to fill in a form: ``schema`` is a msgspec Struct type or a JSON schema (a flat
    object of primitive or enum properties, as the protocol requires)."""

    message: str
    schema: Any
    #: The request's key in 2026-07-28 ``inputRequests`` (default: numbered, ``elicit-1``, ...). A key
    #: the client may know in advance lets it answer before it is asked.
    key: str = ""


class ElicitUrl(msgspec.Struct, frozen=True):
    """Send the user to a URL (2025-11-25 URL mode, for what must not pass through the client)."""

    url: str
    message: str
    elicitation_id: str = ""
    key: str = ""


class Sample(msgspec.Struct, frozen=True):
    """Ask the client's model: ``messages`` is a string (one user message) or protocol messages."""

    messages: Any
    max_tokens: int = 1000
    system_prompt: Union[str, None] = None
    temperature: Union[float, None] = None
    stop_sequences: Union[list[str], None] = None
    model_preferences: Union[dict[str, Any], None] = None
    include_context: Union[str, None] = None
    metadata: Union[dict[str, Any], None] = None
    key: str = ""


class ListRoots(msgspec.Struct, frozen=True):
    """Ask which roots the client exposes."""

    key: str = ""


Request = Union[Elicit, ElicitUrl, Sample, ListRoots]
_CAPABILITY = {"elicitation/create": "elicitation", "sampling/createMessage": "sampling", "roots/list": "roots"}


def _schema_of(schema: Any) -> tuple[dict[str, Any], Any]:
    """(the JSON schema to send, the type to convert accepted content to, or None)."""
    if isinstance(schema, dict):
        return schema, None
    if isinstance(schema, type) and issubclass(schema, msgspec.Struct):
        generated = inline_refs(msgspec.json.schema(schema))
        generated.pop("$defs", None)
        return generated, schema
    raise TypeError("elicit(): schema must be a msgspec Struct type or a JSON schema dict")


def _messages_of(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": {"type": "text", "text": messages}}]
    if isinstance(messages, list):
        return [m if isinstance(m, dict) else msgspec.to_builtins(m) for m in messages]
    raise TypeError("sample(): messages must be a string or a list of protocol messages")


def to_wire(request: Request, key: str) -> tuple[InputRequest, Any]:
    """The frame for one request, and how to read its answer (a converter)."""
    if isinstance(request, Elicit):
        schema, struct_type = _schema_of(request.schema)
        params: dict[str, Any] = {"mode": "form", "message": request.message, "requestedSchema": schema}
        return InputRequest(key, "elicitation/create", params), ("elicit", struct_type)
    if isinstance(request, ElicitUrl):
        params = {"mode": "url", "message": request.message, "url": request.url,
                  "elicitationId": request.elicitation_id or key}
        return InputRequest(key, "elicitation/create", params), ("elicit", None)
    if isinstance(request, Sample):
        params = {"messages": _messages_of(request.messages), "maxTokens": int(request.max_tokens)}
        for name, value in (("systemPrompt", request.system_prompt), ("temperature", request.temperature),
                            ("stopSequences", request.stop_sequences), ("modelPreferences", request.model_preferences),
                            ("includeContext", request.include_context), ("metadata", request.metadata)):
            if value is not None:
                params[name] = value
        return InputRequest(key, "sampling/createMessage", params), ("sample", None)
    if isinstance(request, ListRoots):
        return InputRequest(key, "roots/list", {}), ("roots", None)
    raise TypeError(f"cannot ask for {type(request).__name__}; use Elicit, ElicitUrl, Sample or ListRoots")


def from_wire(response: InputResponse, method: str, reader: Any) -> Any:
    """The tool's value for one answer, or the exception that says why there is none."""
    key = response.key
    if response.outcome == "declined_capability":
        raise CapabilityMissing(response.message or f"the client does not support {method}", key, method)
    if response.outcome == "timeout":
        raise InputTimeout(response.message or f"the client did not answer {method} in time", key, method)
    if response.outcome == "cancelled":
        raise InputCancelled(response.message or f"{method} was cancelled", key, method)
    if response.outcome != "result":
        raise ClientRefused(response.message or f"the client refused {method}", key, method)
    kind, struct_type = reader
    try:
        if kind == "elicit":
            answer = msgspec.convert(response.result, ElicitResult)
            if answer.action == "accept" and struct_type is not None:
                answer = ElicitResult("accept", msgspec.convert(answer.content or {}, struct_type, strict=False))
            return answer
        if kind == "sample":
            raw = response.result if isinstance(response.result, dict) else {}
            return SamplingResult(role=str(raw.get("role", "")), content=raw.get("content"),
                                  model=str(raw.get("model", "")),
                                  stop_reason=raw.get("stopReason") if isinstance(raw.get("stopReason"), str) else None)
        raw_roots = response.result.get("roots") if isinstance(response.result, dict) else None
        return msgspec.convert(raw_roots, list[Root])
    except msgspec.ValidationError as exc:
        raise ClientRefused(f"the client's answer to {method} does not fit what was asked: {exc}", key, method) from None


class Asker:
    """A call's side of asking: numbers its requests, sends a round, reads the answers."""

    __slots__ = ("_exchange", "_asked", "_keys")

    def __init__(self, exchange: Callable[[list[InputRequest]], list[InputResponse]] | None) -> None:
        self._exchange = exchange
        self._asked = 0
        #: Every key asked so far in this call: a key names one question for the call's whole life.
        self._keys: set[str] = set()

    def ask(self, requests: list[Request]) -> list[Any]:
        """Send ``requests`` as one round; block until every one has an answer. Values in order;
        the first request without a usable answer raises (see the module docstring)."""
        if not requests:
            return []
        frames: list[InputRequest] = []
        readers: list[Any] = []
        for request in requests:
            method_key = {Elicit: "elicit", ElicitUrl: "elicit", Sample: "sample", ListRoots: "roots"}.get(type(request))
            if method_key is None:
                raise TypeError(f"cannot ask for {type(request).__name__}; use Elicit, ElicitUrl, Sample or ListRoots")
            self._asked += 1
            key = request.key or f"{method_key}-{self._asked}"
            if not (0 < len(key) <= 64 and key.isascii() and key.isprintable()):
                raise ValueError(f"ask(): key {key[:80]!r} must be 1-64 printable ASCII characters")
            if key in self._keys or any(f.key == key for f in frames):
                raise ValueError(f"ask(): key {key!r} was already asked in this call; each question needs its own key")
            frame, reader = to_wire(request, key)
            frames.append(frame)
            readers.append(reader)
        self._keys.update(f.key for f in frames)
        if self._exchange is None:
            raise CapabilityMissing("this call cannot ask its client anything", frames[0].key, frames[0].method)
        responses = {r.key: r for r in self._exchange(frames)}
        values = []
        for frame, reader in zip(frames, readers, strict=True):
            response = responses.get(frame.key) or InputResponse(frame.key, "error", message="no answer")
            values.append(from_wire(response, frame.method, reader))
        return values
