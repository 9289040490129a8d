"""Fixture tools of the official MCP conformance suite (``@modelcontextprotocol/conformance``).

Names, texts and content shapes follow the suite's server scenarios (``src/scenarios/server/
tools.ts`` and ``json-schema-2020-12.ts``) and its reference "everything" server. They are served
through the sandbox like any other plugin. ``test_sampling`` / ``test_elicitation`` need
server-to-client requests and are not implemented here yet.
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

from sandbox import ToolError, audio, current, embedded_text, image, tool

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
