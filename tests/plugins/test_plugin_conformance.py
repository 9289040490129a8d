from __future__ import annotations

import base64
import io
import json
import struct
import time
import wave
import zlib

import pytest

from sandbox.wire import LOG_LEVELS, Log, Progress


@pytest.fixture(scope="module")
def cf(load_plugin):
    return load_plugin("conformance")


def test_simple_text(cf):
    out = cf.call("test_simple_text")
    assert out.result.content == [{"type": "text", "text": "This is a simple text response for testing."}]
    assert not out.result.is_error and not out.result.has_structured


def _png_chunks(data: bytes):
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, kind
        chunks.append((kind, body))
        pos += 12 + length
    return chunks


def test_image_content_is_a_valid_png(cf):
    (item,) = cf.call("test_image_content").result.content
    assert item["type"] == "image" and item["mimeType"] == "image/png"
    chunks = _png_chunks(base64.b64decode(item["data"], validate=True))
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, colour = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (width, height, depth, colour) == (1, 1, 8, 2)
    assert zlib.decompress(chunks[1][1]) == b"\x00\xff\x00\x00"  # one red pixel


def test_audio_content_is_a_valid_wav(cf):
    (item,) = cf.call("test_audio_content").result.content
    assert item["type"] == "audio" and item["mimeType"] == "audio/wav"
    raw = base64.b64decode(item["data"], validate=True)
    assert raw[:4] == b"RIFF" and raw[8:12] == b"WAVE"
    with wave.open(io.BytesIO(raw)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 8000)
        assert w.getnframes() == 800 and len(w.readframes(800)) == 1600


def test_embedded_resource(cf):
    assert cf.call("test_embedded_resource").result.content == [
        {
            "type": "resource",
            "resource": {
                "uri": "test://embedded-resource",
                "mimeType": "text/plain",
                "text": "This is an embedded resource content.",
            },
        }
    ]


def test_multiple_content_types(cf):
    content = cf.call("test_multiple_content_types").result.content
    assert [c["type"] for c in content] == ["text", "image", "resource"]
    assert content[0]["text"] == "Multiple content types test:"
    assert content[1]["mimeType"] == "image/png"
    assert content[2]["resource"]["uri"] == "test://mixed-content-resource"
    assert json.loads(content[2]["resource"]["text"]) == {"test": "data", "value": 123}


def test_tool_with_logging_sends_three_spaced_messages(cf):
    start = time.monotonic()
    out = cf.call("test_tool_with_logging", log_level=0)  # the client set level "debug"
    elapsed = time.monotonic() - start
    logs = [f for f in out.frames if isinstance(f, Log)]
    assert [(LOG_LEVELS[f.level], f.data) for f in logs] == [
        ("info", "Tool execution started"),
        ("info", "Tool processing data"),
        ("info", "Tool execution completed"),
    ]
    assert elapsed >= 0.09
    assert out.text == "Tool with logging executed successfully"
    # Without logging/setLevel (or above info) nothing is sent.
    assert cf.call("test_tool_with_logging").frames == []
    assert cf.call("test_tool_with_logging", log_level=LOG_LEVELS.index("warning")).frames == []


def test_tool_with_progress(cf):
    out = cf.call("test_tool_with_progress", progress=True)
    progress = [f for f in out.frames if isinstance(f, Progress)]
    assert [(p.progress, p.total) for p in progress] == [(0, 100), (50, 100), (100, 100)]
    assert progress[1].message == "Completed step 50 of 100"
    assert not out.result.is_error
    assert cf.call("test_tool_with_progress").frames == []  # no progressToken: no notifications


def test_error_handling_is_an_iserror_result(cf):
    out = cf.call("test_error_handling")
    assert out.result.is_error
    assert out.result.content == [{"type": "text", "text": "This tool intentionally returns an error for testing"}]


def test_json_schema_2020_12_tool_schema_is_preserved(cf):
    tdef = cf.tools["json_schema_2020_12_tool"]
    s = tdef.input_schema
    assert s["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert s["type"] == "object" and s["additionalProperties"] is False
    assert s["$defs"]["address"]["$anchor"] == "addressDef"
    assert s["properties"]["address"]["$ref"] == "#/$defs/address"
    assert s["allOf"][0]["anyOf"] == [{"required": ["phone"]}, {"required": ["email"]}]
    assert {"if", "then", "else"} <= s.keys()
    assert tdef.description == "Tool with JSON Schema 2020-12 features"


def test_json_schema_2020_12_tool_call(cf):
    out = cf.call(
        "json_schema_2020_12_tool",
        name="Ann",
        contactMethod="email",
        email="ann@example.com",
        address={"street": "1 Main St", "city": "Springfield"},
    )
    assert out.text.startswith("Received: ")
    assert json.loads(out.text[len("Received: ") :])["address"]["city"] == "Springfield"


def test_fixture_descriptions_match_reference_server(cf):
    assert cf.tools["test_simple_text"].description == "Tests simple text content response"
    assert cf.tools["test_error_handling"].description == "Tests error response handling"
    with_arguments = {"json_schema_2020_12_tool", "test_sampling", "test_elicitation", "test_custom_headers", "greet",
                      "slow_compute", "confirm_delete"}
    for name, tdef in cf.tools.items():
        if name not in with_arguments:
            assert tdef.input_schema == {"type": "object", "properties": {}, "additionalProperties": False}
    assert cf.tools["test_sampling"].input_schema["required"] == ["prompt"]
    assert cf.tools["test_elicitation"].input_schema["required"] == ["message"]
