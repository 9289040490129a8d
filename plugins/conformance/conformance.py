"""Fixture tools of the official MCP conformance suite (``@modelcontextprotocol/conformance``).

Names, texts and content shapes follow the suite's server scenarios (``src/scenarios/server/
tools.ts`` and ``json-schema-2020-12.ts``) and its reference "everything" server. They are served
through the sandbox like any other plugin. The tools that ask (``test_sampling``,
``test_elicitation``, ``test_input_required_result_*``, ...) use ``current().elicit/sample/roots``:
the daemon turns their questions into requests to a legacy client or into 2026-07-28
``input_required`` results, so one tool serves both eras.
"""

from __future__ import annotations

import io
import json
import math
import struct
import time
import wave
import zlib
from typing import Any

from sandbox import RequestError, ToolError, audio, current, embedded_text, image, tool
from sandbox.asking import CapabilityMissing, Elicit, ListRoots, Sample

FIXTURE = {"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False}
STEP_DELAY_S = 0.05


def make_png(width: int = 1, height: int = 1, rgb: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    """A valid truecolour PNG filled with one colour (signature, IHDR, IDAT, IEND, real CRCs)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    row = b"\x00" + bytes(rgb) * width  # filter type 0 (None) per scanline
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(row * height, 9))
        + chunk(b"IEND", b"")
    )


def make_wav(duration_s: float = 0.1, rate: int = 8000, freq: float = 440.0) -> bytes:
    """A valid 16-bit mono PCM WAV holding a short sine tone."""
    frames = int(duration_s * rate)
    samples = b"".join(struct.pack("<h", int(12000 * math.sin(2 * math.pi * freq * i / rate))) for i in range(frames))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples)
    return buf.getvalue()


PNG = make_png()
WAV = make_wav()


@tool(description="Tests simple text content response", annotations=FIXTURE)
def test_simple_text() -> str:
    return "This is a simple text response for testing."


@tool(description="Tests image content response", annotations=FIXTURE)
def test_image_content() -> list[dict[str, Any]]:
    return [image(PNG, "image/png")]


@tool(description="Tests audio content response", annotations=FIXTURE)
def test_audio_content() -> list[dict[str, Any]]:
    return [audio(WAV, "audio/wav")]


@tool(description="Tests embedded resource content response", annotations=FIXTURE)
def test_embedded_resource() -> list[dict[str, Any]]:
    return [embedded_text("test://embedded-resource", "This is an embedded resource content.", "text/plain")]


@tool(description="Tests response with multiple content types (text, image, resource)", annotations=FIXTURE)
def test_multiple_content_types() -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": "Multiple content types test:"},
        image(PNG, "image/png"),
        embedded_text(
            "test://mixed-content-resource",
            json.dumps({"test": "data", "value": 123}, separators=(",", ":")),
            "application/json",
        ),
    ]


@tool(description="Tests tool that emits log messages during execution", annotations=FIXTURE)
def test_tool_with_logging() -> str:
    ctx = current()
    ctx.log("info", "Tool execution started")
    time.sleep(STEP_DELAY_S)
    ctx.log("info", "Tool processing data")
    time.sleep(STEP_DELAY_S)
    ctx.log("info", "Tool execution completed")
    return "Tool with logging executed successfully"


@tool(description="Tests tool that reports progress notifications", annotations=FIXTURE)
def test_tool_with_progress() -> str:
    ctx = current()
    for i, step in enumerate((0, 50, 100)):
        if i:
            time.sleep(STEP_DELAY_S)
        ctx.progress(step, 100, f"Completed step {step} of 100")
    return "Tool with progress executed successfully"


@tool(description="Tests error response handling", annotations=FIXTURE)
def test_error_handling() -> str:
    raise ToolError("This tool intentionally returns an error for testing")


#: The suite checks that $schema, $defs (with "address" and its $anchor), additionalProperties:
#: false, allOf/anyOf and if/then/else survive tools/list unchanged (SEP-1613, SEP-2106).
JSON_SCHEMA_2020_12: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {
        "address": {
            "$anchor": "addressDef",
            "type": "object",
            "properties": {
                "street": {"type": "string", "description": "Street and number"},
                "city": {"type": "string", "description": "City"},
            },
        }
    },
    "properties": {
        "name": {"type": "string", "description": "The contact's name"},
        "address": {"$ref": "#/$defs/address", "description": "The contact's postal address"},
        "contactMethod": {"type": "string", "enum": ["phone", "email"], "description": "How to reach the contact"},
        "phone": {"type": "string", "description": "Phone number (required when contactMethod is phone)"},
        "email": {"type": "string", "description": "Email address (required otherwise)"},
    },
    "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
    "if": {"properties": {"contactMethod": {"const": "phone"}}, "required": ["contactMethod"]},
    "then": {"required": ["phone"]},
    "else": {"required": ["email"]},
    "additionalProperties": False,
}


@tool(
    description="Tool with JSON Schema 2020-12 features",
    input_schema=JSON_SCHEMA_2020_12,
    annotations=FIXTURE,
)
def json_schema_2020_12_tool(
    name: str | None = None,
    address: dict[str, Any] | None = None,
    contactMethod: str | None = None,
    phone: str | None = None,
    email: str | None = None,
) -> str:
    received = {
        k: v
        for k, v in (
            ("name", name),
            ("address", address),
            ("contactMethod", contactMethod),
            ("phone", phone),
            ("email", email),
        )
        if v is not None
    }
    return "Received: " + json.dumps(received, sort_keys=True)


# -- tools that ask (legacy: requests on the call's stream; 2026-07-28: input_required and a retry) --


@tool(description="Tests server-initiated sampling (sampling/createMessage)", annotations=FIXTURE)
def test_sampling(prompt: str) -> str:
    """Tests server-initiated sampling.

    Args:
        prompt: The prompt sent to the client's model.
    """
    answer = current().sample(prompt, max_tokens=100)
    return f"LLM response: {answer.text}"


@tool(description="Tests server-initiated elicitation (elicitation/create)", annotations=FIXTURE)
def test_elicitation(message: str) -> str:
    """Tests server-initiated elicitation.

    Args:
        message: The message shown to the user.
    """
    schema = {"type": "object", "properties": {
        "username": {"type": "string", "description": "User's response"},
        "email": {"type": "string", "description": "User's email address"},
    }, "required": ["username", "email"]}
    answer = current().elicit(message, schema)
    return f"User response: action={answer.action}, content={json.dumps(answer.content, sort_keys=True)}"


@tool(description="Tests elicitation with default values for every primitive type (SEP-1034)", annotations=FIXTURE)
def test_elicitation_sep1034_defaults() -> str:
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "description": "User name", "default": "John Doe"},
        "age": {"type": "integer", "description": "User age", "default": 30},
        "score": {"type": "number", "description": "User score", "default": 95.5},
        "status": {"type": "string", "description": "User status", "enum": ["active", "inactive", "pending"],
                   "default": "active"},
        "verified": {"type": "boolean", "description": "Verification status", "default": True},
    }}
    answer = current().elicit("Please review and update the form fields with defaults", schema)
    return f"Elicitation completed: action={answer.action}, content={json.dumps(answer.content, sort_keys=True)}"


@tool(description="Tests elicitation with every enum form (SEP-1330)", annotations=FIXTURE)
def test_elicitation_sep1330_enums() -> str:
    schema = {"type": "object", "properties": {
        "untitledSingle": {"type": "string", "description": "Choose an option", "enum": ["option1", "option2", "option3"]},
        "titledSingle": {"type": "string", "description": "Choose a titled option", "oneOf": [
            {"const": "value1", "title": "First Option"}, {"const": "value2", "title": "Second Option"},
            {"const": "value3", "title": "Third Option"}]},
        "legacyEnum": {"type": "string", "description": "Choose a legacy option", "enum": ["opt1", "opt2", "opt3"],
                       "enumNames": ["Option One", "Option Two", "Option Three"]},
        "untitledMulti": {"type": "array", "description": "Choose multiple options",
                          "items": {"type": "string", "enum": ["option1", "option2", "option3"]}},
        "titledMulti": {"type": "array", "description": "Choose multiple titled options", "items": {"anyOf": [
            {"const": "value1", "title": "First Choice"}, {"const": "value2", "title": "Second Choice"},
            {"const": "value3", "title": "Third Choice"}]}},
    }}
    answer = current().elicit("Please select options from the enum fields", schema)
    return f"Elicitation completed: action={answer.action}, content={json.dumps(answer.content, sort_keys=True)}"


NAME_FORM = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
OK_FORM = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@tool(description="Asks the user's name (input_required, key user_name), then greets them", annotations=FIXTURE)
def test_input_required_result_elicitation() -> str:
    answer = current().elicit("What is your name?", NAME_FORM, key="user_name")
    if not answer.accepted or not isinstance(answer.content, dict) or not isinstance(answer.content.get("name"), str):
        raise ToolError(f"no name given (action={answer.action})")
    return f"Hello, {answer.content['name']}!"


@tool(description="Asks the client's model a question (input_required with sampling)", annotations=FIXTURE)
def test_input_required_result_sampling() -> str:
    answer = current().sample("What is the capital of France?", max_tokens=100, key="capital_question")
    return f"The model said: {answer.text}"


@tool(description="Asks the client for its roots (input_required with roots/list)", annotations=FIXTURE)
def test_input_required_result_list_roots() -> str:
    roots = current().roots(key="client_roots")
    return "Roots: " + ", ".join(f"{r.name or ''} <{r.uri}>" for r in roots)


@tool(description="Asks for a confirmation; the retry carries the server's requestState", annotations=FIXTURE)
def test_input_required_result_request_state() -> str:
    answer = current().elicit("Please confirm", OK_FORM, key="confirm")
    ok = answer.accepted and isinstance(answer.content, dict) and answer.content.get("ok") is True
    return "state-ok: confirmed" if ok else "state-ok: not confirmed"


@tool(description="Asks three questions in one round: a form, the model, the roots", annotations=FIXTURE)
def test_input_required_result_multiple_inputs() -> str:
    name, greeting, roots = current().ask(
        Elicit("What is your name?", NAME_FORM, key="user_name"),
        Sample("Write a short greeting", max_tokens=50, key="greeting"),
        ListRoots(key="client_roots"),
    )
    who = name.content.get("name") if name.accepted and isinstance(name.content, dict) else "someone"
    return f"{greeting.text} {who} ({len(roots)} roots)"


@tool(description="Asks in two rounds: a name, then a favourite colour", annotations=FIXTURE)
def test_input_required_result_multi_round() -> str:
    ctx = current()
    name = ctx.elicit("What is your name?", NAME_FORM, key="step1")
    color_form = {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}
    color = ctx.elicit("What is your favourite colour?", color_form, key="step2")
    who = name.content.get("name") if isinstance(name.content, dict) else "?"
    hue = color.content.get("color") if isinstance(color.content, dict) else "?"
    return f"{who} likes {hue}"


@tool(description="Asks for a confirmation whose requestState must come back untouched", annotations=FIXTURE)
def test_input_required_result_tampered_state() -> str:
    answer = current().elicit("Please confirm", OK_FORM, key="confirm")
    return f"confirmed: {answer.action}"


@tool(description="Asks only what the client declared: a form if it can, else its model", annotations=FIXTURE)
def test_input_required_result_capabilities() -> str:
    ctx = current()
    try:
        answer = ctx.elicit("What is your name?", NAME_FORM, key="user_name")
        return f"form: {answer.action}"
    except CapabilityMissing:
        reply = ctx.sample("What is a good name?", max_tokens=50, key="name_suggestion")
        return f"model: {reply.text}"


@tool(description="Needs sampling; a client without it gets -32021 (missing capability)", annotations=FIXTURE)
def test_missing_capability() -> str:
    return current().sample("Say hello", max_tokens=20, key="hello").text


@tool(description="Asks at once (a 2026-07-28 client gets input_required, never a request)", annotations=FIXTURE)
def test_streaming_elicitation() -> str:
    answer = current().elicit("Continue?", OK_FORM, key="continue")
    return f"continued: {answer.action}"


@tool(description="Logs once; a 2026-07-28 client hears it only when it asked for a log level", annotations=FIXTURE)
def test_logging_tool() -> str:
    current().log("info", "test_logging_tool ran")
    return "logged"


@tool(
    description="Echoes arguments mirrored into Mcp-Param-* headers (x-mcp-header, SEP-2243)",
    input_schema={"type": "object", "properties": {
        "region": {"type": "string", "description": "Routed region", "x-mcp-header": "Region"},
        "priority": {"type": "integer", "minimum": -1000000, "maximum": 1000000, "x-mcp-header": "Priority",
                     "description": "Priority, mirrored too"},
        "verbose": {"type": "boolean", "x-mcp-header": "Verbose", "description": "Verbose output"},
        "query": {"type": "string", "description": "The query (not mirrored)"},
    }, "required": ["region", "priority", "query"]},
    annotations=FIXTURE,
)
def test_custom_headers(region: str, priority: int, query: str, verbose: bool | None = None) -> str:
    return f"region={region} priority={priority} query={query} verbose={verbose}"


# -- tasks (2026-07-28 extension io.modelcontextprotocol/tasks; 2025-11-25 core tasks) ----------------


@tool(description="Greets someone (never a task)", annotations=FIXTURE)
def greet(name: str) -> str:
    """Greets someone.

    Args:
        name: Who to greet.
    """
    return f"Hello, {name}!"


@tool(description="Computes slowly; runs as a task when the client can take one", annotations=FIXTURE,
      task_support="optional")
def slow_compute(seconds: float = 1.0, label: str = "") -> str:
    """Sleeps, then answers.

    Args:
        seconds: How long the computation takes.
        label: A label echoed in the result.
    """
    time.sleep(max(0.0, min(float(seconds), 600.0)))
    return f"computed {label or 'result'} after {seconds} s"


@tool(description="A job that fails with a tool error (isError), only as a task", annotations=FIXTURE,
      task_support="required")
def failing_job() -> str:
    time.sleep(1.0)
    raise ToolError("the job failed (as designed)")


@tool(description="A job whose request turns out invalid: a protocol error, so the task ends failed",
      annotations=FIXTURE, task_support="optional")
def protocol_error_job() -> str:
    time.sleep(0.5)
    raise RequestError("the job's request is invalid (as designed)")


CONFIRM_FORM = {"type": "object", "properties": {"confirm": {"type": "boolean", "description": "Delete it?"}},
                "required": ["confirm"]}


@tool(description="Asks before deleting a file (a task waits in input_required)", annotations=FIXTURE,
      task_support="optional")
def confirm_delete(filename: str) -> str:
    """Asks for a confirmation, then reports.

    Args:
        filename: The file to delete (nothing is deleted: a fixture).
    """
    answer = current().elicit(f"Delete {filename}?", CONFIRM_FORM)
    confirmed = answer.accepted and isinstance(answer.content, dict) and answer.content.get("confirm") is True
    return f"Deleted {filename}" if confirmed else f"Kept {filename}"


@tool(description="Asks two questions at once (a task lists both, then the one left)", annotations=FIXTURE,
      task_support="optional")
def multi_input() -> str:
    name, confirm = current().ask(
        Elicit("What is your name?", {"type": "object", "properties": {"name": {"type": "string"}}}),
        Elicit("Proceed?", {"type": "object", "properties": {"confirm": {"type": "boolean"}}}),
    )
    who = name.content.get("name") if name.accepted and isinstance(name.content, dict) else "someone"
    ok = confirm.accepted and isinstance(confirm.content, dict) and confirm.content.get("confirm") is True
    return f"{who}: {'proceeding' if ok else 'stopped'}"


@tool(description="Asks first (input_required), then works long enough to become a task", annotations=FIXTURE,
      task_support="required", task_after_ms=300)
def test_tool_with_task() -> str:
    answer = current().elicit("What is your name?", NAME_FORM, key="user_name")
    name = answer.content.get("name") if answer.accepted and isinstance(answer.content, dict) else "someone"
    time.sleep(1.5)
    return f"Hello, {name}! Your task is done."
