"""The plugin authoring API: what a tool author imports (``from sandbox import tool``).

A tool is a plain typed function::

    from sandbox import tool

    @tool(annotations={"readOnlyHint": True})
    def word_count(text: str) -> int:
        '''Count the words in a text.

        Args:
            text: The text to count.
        '''
        return len(text.split())

* ``inputSchema`` comes from the parameters' type hints (msgspec builds the JSON Schema; ``$ref``
  are inlined), per-parameter descriptions from ``Annotated[..., msgspec.Meta(description=...)]``
  or the docstring's ``Args:`` section, the description from the docstring's first paragraph.
* ``outputSchema`` comes from the return annotation when it is structured (a Struct, dataclass,
  TypedDict or dict); the result is then sent as ``structuredContent`` plus its JSON text.
* Returning ``str`` gives one text item; returning content helpers (``image``, ``audio``,
  ``resource_link``, ``embedded_text``, ``embedded_blob``, ``text``) or a list of them sends those;
  ``ToolResult`` gives full control.
* Raising gives an ``isError`` result carrying the exception's message (never the traceback).
* ``current()`` gives the running call's context: ``progress()`` and ``log()``, and the questions a
  tool may ask its client: ``elicit()``, ``elicit_url()``, ``sample()``, ``roots()``, ``ask()``
  (``sandbox.asking``).

This module runs inside the worker only; it never imports trio.
"""

from __future__ import annotations

import _thread
import base64
import dataclasses
import functools
import inspect
import re
import typing
from typing import Any, Callable

import msgspec

from sandbox import asking
from sandbox.errors import ToolError
from sandbox.json_schema import inline_refs
from sandbox.wire import LOG_LEVELS, Call, Log, Progress

__all__ = [
    "tool",
    "ToolError",
    "ToolResult",
    "CallContext",
    "current",
    "text",
    "image",
    "audio",
    "resource_link",
    "embedded_text",
    "embedded_blob",
    "TOOLS",
]


@dataclasses.dataclass
class ToolResult:
    """Full control over a call's result."""

    content: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    structured: Any = None
    has_structured: bool = False
    is_error: bool = False


# -- content helpers ---------------------------------------------------------------------------


def _b64(data: bytes | str) -> str:
    if isinstance(data, str):
        return data  # assumed already base64; the daemon checks it
    return base64.b64encode(data).decode("ascii")


def text(value: str, *, annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "text", "text": value}
    if annotations:
        item["annotations"] = annotations
    return item


def image(data: bytes | str, mime_type: str = "image/png", *, annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "image", "data": _b64(data), "mimeType": mime_type}
    if annotations:
        item["annotations"] = annotations
    return item


def audio(data: bytes | str, mime_type: str = "audio/wav", *, annotations: dict[str, Any] | None = None) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "audio", "data": _b64(data), "mimeType": mime_type}
    if annotations:
        item["annotations"] = annotations
    return item


def resource_link(
    uri: str,
    name: str,
    *,
    title: str | None = None,
    description: str | None = None,
    mime_type: str | None = None,
    size: int | None = None,
) -> dict[str, Any]:
    item: dict[str, Any] = {"type": "resource_link", "uri": uri, "name": name}
    for key, value in (("title", title), ("description", description), ("mimeType", mime_type), ("size", size)):
        if value is not None:
            item[key] = value
    return item


def embedded_text(uri: str, value: str, mime_type: str = "text/plain") -> dict[str, Any]:
    return {"type": "resource", "resource": {"uri": uri, "mimeType": mime_type, "text": value}}


def embedded_blob(uri: str, data: bytes | str, mime_type: str = "application/octet-stream") -> dict[str, Any]:
    return {"type": "resource", "resource": {"uri": uri, "mimeType": mime_type, "blob": _b64(data)}}


# -- the running call --------------------------------------------------------------------------


class CallContext:
    """The call being run. The worker installs one per call; ``current()`` returns it."""

    __slots__ = ("call_id", "_send", "_want_progress", "_log_level", "_last_progress", "_exchange", "_asker_",
                 "traceparent")

    def __init__(self, call_id: int, send: Callable[[Any], None], want_progress: bool, log_level: int,
                 exchange: Callable[[int, list[Any]], list[Any]] | None = None, traceparent: str = "") -> None:
        self.call_id = call_id
        #: The W3C ``traceparent`` of this call's span in the daemon ("" when the daemon does not trace):
        #: give it to your own OpenTelemetry tracer as the parent of the spans you make.
        self.traceparent = traceparent
        self._send = send
        self._want_progress = want_progress
        self._log_level = log_level
        self._last_progress: float | None = None
        self._exchange = exchange
        self._asker_: asking.Asker | None = None

    @property
    def _asker(self) -> asking.Asker:
        """Made at the first question (most calls ask nothing)."""
        if self._asker_ is None:
            # ``exchange(call_id, requests)`` serves every call of the worker: bound here to this call's id,
            # so a context kept past its call still asks only for its own call.
            exchange = self._exchange
            self._asker_ = asking.Asker(None if exchange is None else functools.partial(exchange, self.call_id))
        return self._asker_

    def progress(self, progress: float, total: float | None = None, message: str | None = None) -> None:
        """Report progress. Sent only if the client asked for it; must increase."""
        if not self._want_progress:
            return
        if self._last_progress is not None and progress <= self._last_progress:
            return  # the protocol requires progress to increase; drop non-increasing reports
        self._last_progress = progress
        self._send(Progress(self.call_id, float(progress), None if total is None else float(total), message))

    def log(self, level: str, data: Any, logger: str | None = None) -> None:
        """Send a log message to the client (``notifications/message``) if its level allows."""
        try:
            severity = LOG_LEVELS.index(level)
        except ValueError:
            raise ValueError(f"unknown log level {level!r}; use one of {', '.join(LOG_LEVELS)}") from None
        if self._log_level < 0 or severity < self._log_level:
            return
        self._send(Log(self.call_id, severity, data, logger))

    # -- asking the client (``sandbox.asking``): each blocks until the answer comes ----------------

    def elicit(self, message: str, schema: Any, *, key: str = "") -> asking.ElicitResult:
        """Ask the user to fill in a form (``schema``: a msgspec Struct type or a JSON schema)."""
        result: asking.ElicitResult = self._asker.ask([asking.Elicit(message, schema, key)])[0]
        return result

    def elicit_url(self, url: str, message: str, elicitation_id: str = "", *, key: str = "") -> asking.ElicitResult:
        """Send the user to ``url`` (URL mode; only clients that declared ``elicitation.url``)."""
        result: asking.ElicitResult = self._asker.ask([asking.ElicitUrl(url, message, elicitation_id, key)])[0]
        return result

    def sample(self, messages: Any, *, max_tokens: int = 1000, system_prompt: str | None = None,
               temperature: float | None = None, stop_sequences: list[str] | None = None,
               model_preferences: dict[str, Any] | None = None, include_context: str | None = None,
               metadata: dict[str, Any] | None = None, key: str = "") -> asking.SamplingResult:
        """Ask the client's model (``messages``: a string, or protocol messages)."""
        request = asking.Sample(messages, max_tokens, system_prompt, temperature, stop_sequences, model_preferences,
                                include_context, metadata, key)
        result: asking.SamplingResult = self._asker.ask([request])[0]
        return result

    def roots(self, *, key: str = "") -> list[asking.Root]:
        """The roots the client exposes."""
        result: list[asking.Root] = self._asker.ask([asking.ListRoots(key)])[0]
        return result

    def ask(self, *requests: asking.Request) -> list[Any]:
        """Several requests in one round (``asking.Elicit``, ``ElicitUrl``, ``Sample``, ``ListRoots``);
        their values in order."""
        return self._asker.ask(list(requests))


_current: CallContext | None = None
#: The running call and what its context sends and asks with, until ``current()`` first needs the
#: context: most tools never ask for it, so it is made then (``_begin_call``), not for every call.
_running: tuple[Call, Callable[[Any], None], Callable[[int, list[Any]], list[Any]] | None] | None = None
_making = _thread.allocate_lock()


def current() -> CallContext:
    """The context of the call being run (progress and logging)."""
    global _current
    ctx = _current
    if ctx is None:
        with _making:  # one context per call, even if two threads of the call ask at once
            ctx = _current
            if ctx is None:
                if _running is None:
                    raise RuntimeError("current() is only available while a tool call is running")
                call, send, exchange = _running
                ctx = _current = CallContext(call.id, send, call.progress, call.log_level, exchange, call.traceparent)
    return ctx


def _begin_call(call: Call, send: Callable[[Any], None],
                exchange: Callable[[int, list[Any]], list[Any]] | None) -> None:
    """``call`` runs now: ``current()`` returns its context (made at the first ``current()``)."""
    global _current, _running
    _current = None
    _running = (call, send, exchange)


def _end_call() -> None:
    global _current, _running
    _current = None
    _running = None


# -- tool definitions --------------------------------------------------------------------------


@dataclasses.dataclass
class ToolDef:
    name: str
    fn: Callable[..., Any]
    description: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any] | None
    title: str | None
    annotations: dict[str, Any] | None
    icons: list[dict[str, Any]] | None
    meta: dict[str, Any] | None
    #: Converts the JSON arguments into the function's typed keyword arguments.
    args_type: Any
    #: True when the return annotation is structured (structuredContent is sent).
    structured: bool
    #: True when the function's return value must be wrapped as {"result": value}.
    wrap_result: bool
    is_async: bool
    #: Tasks: "forbidden", "optional" or "required", and when a 2026-07-28 call becomes one.
    task_support: str = "forbidden"
    task_after_ms: int | None = None


#: Tools registered by the plugin being loaded, in definition order.
TOOLS: list[ToolDef] = []

_ARGS_HEADER = re.compile(r"^\s*(Args|Arguments|Parameters):\s*$")


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """First paragraph(s) before an ``Args:`` section, and the per-argument descriptions."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    desc_lines: list[str] = []
    params: dict[str, str] = {}
    i = 0
    while i < len(lines) and not _ARGS_HEADER.match(lines[i]):
        desc_lines.append(lines[i])
        i += 1
    current_name: str | None = None
    for line in lines[i + 1 :]:
        if not line.strip():
            current_name = None
            continue
        if not line.startswith((" ", "\t")):
            break  # next section (Returns:, Raises:)
        m = re.match(r"^\s+(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", line)
        if m and (current_name is None or len(line) - len(line.lstrip()) <= 4):
            current_name = m.group(1).lstrip("*")
            params[current_name] = m.group(2).strip()
        elif current_name is not None:
            params[current_name] = (params[current_name] + " " + line.strip()).strip()
    description = "\n".join(desc_lines).strip()
    # Stop at the first section header such as "Returns:".
    description = re.split(r"\n\s*(Returns|Raises|Yields|Examples?):\s*\n", description)[0].strip()
    return description, params


def _is_structured(tp: Any) -> bool:
    if tp is inspect.Signature.empty or tp is None or tp is type(None):
        return False
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _is_structured(typing.get_args(tp)[0])
    if tp in (str, Any):
        return False
    if isinstance(tp, type) and issubclass(tp, (ToolResult,)):
        return False
    if origin is list:
        args = typing.get_args(tp)
        # list[dict] of content items is content, not structure; be conservative.
        return bool(args) and args[0] not in (dict, Any) and typing.get_origin(args[0]) is not dict
    return True


def _is_object_type(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return _is_object_type(typing.get_args(tp)[0])
    if origin is dict or tp is dict:
        return True
    if isinstance(tp, type) and (
        issubclass(tp, msgspec.Struct) or dataclasses.is_dataclass(tp) or typing.is_typeddict(tp)
    ):
        return True
    return False


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    title: str | None = None,
    annotations: dict[str, Any] | None = None,
    icons: list[dict[str, Any]] | None = None,
    input_schema: dict[str, Any] | None = None,
    output_schema: dict[str, Any] | None = None,
    meta: dict[str, Any] | None = None,
    task_support: str = "forbidden",
    task_after_ms: int | None = None,
) -> Any:
    """Register a function as a tool. Usable bare (``@tool``) or with options (``@tool(...)``).

    ``task_support``: whether a call may run as a task (a long-running call the client polls):
    "forbidden" (default), "optional" or "required". A 2025-11-25 client asks for a task itself; for a
    2026-07-28 client that declared the tasks extension the daemon decides: at once, or, with
    ``task_after_ms``, only if the call has not finished after that many milliseconds (the call's
    questions before then are asked inline)."""
    if task_support not in ("forbidden", "optional", "required"):
        raise ValueError(f"task_support must be forbidden, optional or required, not {task_support!r}")

    def register(func: Callable[..., Any]) -> Callable[..., Any]:
        doc_description, param_docs = _parse_docstring(func.__doc__)
        hints = typing.get_type_hints(func, include_extras=True)
        sig = inspect.signature(func)
        fields: list[Any] = []
        for pname, param in sig.parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {func.__name__}: *args/**kwargs are not supported")
            tp = hints.get(pname, Any)
            if pname in param_docs:
                metas = typing.get_args(tp)[1:] if typing.get_origin(tp) is typing.Annotated else ()
                if not any(isinstance(m, msgspec.Meta) and m.description for m in metas):
                    tp = typing.Annotated[tp, msgspec.Meta(description=param_docs[pname])]
            if param.default is inspect.Parameter.empty:
                fields.append((pname, tp))
            else:
                fields.append((pname, tp, param.default))
        args_type = msgspec.defstruct(f"{func.__name__}_args", fields, kw_only=True, forbid_unknown_fields=False)
        if input_schema is not None:
            schema = input_schema
        else:
            schema = inline_refs(msgspec.json.schema(args_type))
            schema.setdefault("properties", {})
            if not fields:
                schema["additionalProperties"] = False
        ret = hints.get("return", inspect.Signature.empty)
        structured = output_schema is not None or _is_structured(ret)
        wrap = False
        out_schema = output_schema
        if out_schema is None and structured:
            gen = inline_refs(msgspec.json.schema(ret))
            if _is_object_type(ret):
                out_schema = gen
            else:
                # Legacy revisions require an object at the root: wrap scalars and arrays.
                wrap = True
                out_schema = {"type": "object", "properties": {"result": gen}, "required": ["result"]}
        TOOLS.append(
            ToolDef(
                name=name or func.__name__,
                fn=func,
                description=description if description is not None else doc_description,
                input_schema=schema,
                output_schema=out_schema,
                title=title,
                annotations=annotations,
                icons=icons,
                meta=meta,
                args_type=args_type if input_schema is None else None,
                structured=structured,
                wrap_result=wrap,
                is_async=inspect.iscoroutinefunction(func),
                task_support=task_support,
                task_after_ms=task_after_ms,
            )
        )
        return func

    if fn is not None:
        return register(fn)
    return register
