"""What a finished call sends: result shapes per revision, content sanitising, progress and log notifications.

Drives ``Core.call_result`` / ``progress_notification`` / ``log_notification`` with hand-made worker
frames (``sandbox.wire``), exactly as the daemon does after a worker answers.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from protocol_fakes import ALL, MODERN, ConnState, ToolCall, catalog, core_for, entry, initialized, modern_meta, msg

from runtime.protocol.core import Core
from sandbox import wire

PNG_B64 = base64.b64encode(b"\x89PNG\r\n\x1a\nfake").decode()
WAV_B64 = base64.b64encode(b"RIFF....WAVEfmt ").decode()

STRUCTURED = entry("structured", output_schema={"type": "object", "properties": {"sum": {"type": "integer"}},
                                                 "required": ["sum"], "additionalProperties": False})
FREEFORM = entry("freeform")
CAT = catalog([STRUCTURED, FREEFORM])


def start_call(version: str, name: str = "freeform", meta: dict[str, Any] | None = None,
               core: Core | None = None, state: ConnState | None = None) -> tuple[Core, ToolCall]:
    core = core or core_for(CAT)
    params: dict[str, Any] = {"name": name, "arguments": {}}
    if version == MODERN:
        params["_meta"] = modern_meta(**(meta or {}))
        state = state or ConnState()
    else:
        if meta:
            params["_meta"] = meta
        state = state or initialized(core, version)
    action = core.receive(state, msg("tools/call", params, id="call-1"))
    assert isinstance(action, ToolCall), action
    return core, action


def finish(version: str, content: list[Any], *, name: str = "freeform", structured: Any = None,
           has_structured: bool = False, is_error: bool = False, max_output_bytes: int = 1 << 20
           ) -> tuple[dict[str, Any], str | None]:
    core, call = start_call(version, name)
    result = wire.Result(1, content, structured, has_structured, is_error)
    data, bug = core.call_result(call, result, max_output_bytes)
    body = json.loads(data)
    assert body["id"] == "call-1" and "error" not in body
    return body["result"], bug


def text_of(result: dict[str, Any]) -> str:
    return " ".join(item.get("text", "") for item in result["content"])


# -- structured content -------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ALL)
def test_structured_content_is_sent_only_to_revisions_that_define_it(version: str) -> None:
    result, bug = finish(version, [{"type": "text", "text": '{"sum": 3}'}], name="structured",
                         structured={"sum": 3}, has_structured=True)
    assert bug is None
    assert result["content"] == [{"type": "text", "text": '{"sum": 3}'}]
    if version >= "2025-06-18":
        assert result["structuredContent"] == {"sum": 3}
    else:
        assert "structuredContent" not in result
    assert "isError" not in result


def test_modern_results_carry_result_type_and_server_info() -> None:
    result, _ = finish(MODERN, [{"type": "text", "text": "hi"}])
    assert result["resultType"] == "complete"
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "toolcell"


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25", MODERN])
def test_structured_content_that_breaks_the_output_schema_becomes_an_is_error_result(version: str) -> None:
    result, bug = finish(version, [{"type": "text", "text": "x"}], name="structured",
                         structured={"sum": "three"}, has_structured=True)
    assert result["isError"] is True
    assert "structuredContent" not in result
    assert "outputSchema" in text_of(result)
    assert bug is not None and "sum" in bug


def test_a_tool_with_an_output_schema_that_returns_no_structured_content_is_an_error() -> None:
    result, bug = finish("2025-06-18", [{"type": "text", "text": "plain"}], name="structured")
    assert result["isError"] is True
    assert bug is not None and "structuredContent" in bug


def test_an_error_result_from_a_tool_with_an_output_schema_is_not_checked_against_it() -> None:
    result, bug = finish("2025-06-18", [{"type": "text", "text": "it broke"}], name="structured", is_error=True)
    assert bug is None
    assert result == {"content": [{"type": "text", "text": "it broke"}], "isError": True}


def test_structured_content_must_be_an_object_even_without_an_output_schema() -> None:
    result, bug = finish("2025-06-18", [{"type": "text", "text": "[1]"}], structured=[1], has_structured=True)
    assert result["isError"] is True and bug is not None


# -- content sanitising -------------------------------------------------------------------------------


@pytest.mark.parametrize("item,why", [
    ({"type": "image", "data": "not base64!!", "mimeType": "image/png"}, "base64"),
    ({"type": "image", "data": PNG_B64}, "mimeType"),
    ({"type": "image", "data": 12, "mimeType": "image/png"}, "base64"),
    ({"type": "audio", "data": "###", "mimeType": "audio/wav"}, "base64"),
    ({"type": "resource_link", "uri": "file:///x"}, "name"),
    ({"type": "resource_link", "name": "x"}, "uri"),
    ({"type": "resource", "resource": {"uri": "test://r"}}, "text"),
    ({"type": "resource", "resource": {"uri": "test://r", "text": "a", "blob": PNG_B64}}, "text"),
    ({"type": "resource", "resource": {"uri": "test://r", "blob": "@@@"}}, "base64"),
    ({"type": "text"}, "text"),
    # Two keys, like the plain text item kept as decoded, but not one: each is checked in full.
    ({"type": "text", "text": 5}, "text"),
    ({"type": "text", "evil": "x"}, "text"),
    ({"text": "x", "evil": "x"}, "type"),
    ({"type": "video", "text": "x"}, "type"),
    ({"type": "video", "data": PNG_B64}, "type"),
    ("just a string", "object"),
    ({"type": "text", "text": "x", "annotations": {"priority": 7}}, "priority"),
    ({"type": "text", "text": "x", "annotations": {"audience": ["robots"]}}, "audience"),
])
@pytest.mark.parametrize("version", ["2025-03-26", "2025-11-25"])
def test_malformed_content_items_become_an_is_error_result(item: Any, why: str, version: str) -> None:
    result, bug = finish(version, [{"type": "text", "text": "fine"}, item])
    assert result["isError"] is True
    assert len(result["content"]) == 1 and result["content"][0]["type"] == "text"
    assert "content[1]" in text_of(result)
    assert bug is not None and why in bug


def test_content_items_are_rebuilt_without_unknown_fields() -> None:
    result, bug = finish("2025-11-25", [
        {"type": "text", "text": "plain"},
        {"type": "text", "text": "hi", "evil": "<script>"},
        {"type": "text", "text": "hi", "evil": "<script>", "annotations": {"priority": 0.5, "junk": 1}},
        {"type": "image", "data": PNG_B64, "mimeType": "image/png", "extra": [1, 2]},
    ])
    assert bug is None
    assert result["content"] == [
        {"type": "text", "text": "plain"},
        {"type": "text", "text": "hi"},
        {"type": "text", "text": "hi", "annotations": {"priority": 0.5}},
        {"type": "image", "data": PNG_B64, "mimeType": "image/png"},
    ]


def test_valid_rich_content_passes_through_for_2025_11_25() -> None:
    items = [
        {"type": "text", "text": "t"},
        {"type": "image", "data": PNG_B64, "mimeType": "image/png"},
        {"type": "audio", "data": WAV_B64, "mimeType": "audio/wav"},
        {"type": "resource_link", "uri": "file:///a.txt", "name": "a.txt", "mimeType": "text/plain", "size": 3},
        {"type": "resource", "resource": {"uri": "test://r", "mimeType": "text/plain", "text": "body"}},
        {"type": "resource", "resource": {"uri": "test://b", "blob": PNG_B64}},
    ]
    result, bug = finish("2025-11-25", items)
    assert bug is None
    assert result["content"] == items


def test_audio_sent_to_a_2024_11_05_client_becomes_a_text_placeholder() -> None:
    result, bug = finish("2024-11-05", [{"type": "audio", "data": WAV_B64, "mimeType": "audio/wav"}])
    assert bug is None and "isError" not in result
    assert result["content"] == [{"type": "text", "text": result["content"][0]["text"]}]
    assert "audio" in result["content"][0]["text"] and "audio/wav" in result["content"][0]["text"]
    assert WAV_B64 not in json.dumps(result)


def test_audio_reaches_a_2025_03_26_client_unchanged() -> None:
    item = {"type": "audio", "data": WAV_B64, "mimeType": "audio/wav"}
    result, _ = finish("2025-03-26", [item])
    assert result["content"] == [item]


@pytest.mark.parametrize("version", ["2024-11-05", "2025-03-26"])
def test_resource_links_reach_older_clients_as_text(version: str) -> None:
    result, _ = finish(version, [{"type": "resource_link", "uri": "file:///a.txt", "name": "a.txt"}])
    assert result["content"] == [{"type": "text", "text": "[a.txt](file:///a.txt)"}]


def test_last_modified_annotations_are_dropped_for_revisions_without_them() -> None:
    item = {"type": "text", "text": "x", "annotations": {"lastModified": "2025-01-01T00:00:00Z", "priority": 1}}
    old, _ = finish("2025-03-26", [item])
    new, _ = finish("2025-06-18", [item])
    assert old["content"][0]["annotations"] == {"priority": 1}
    assert new["content"][0]["annotations"] == item["annotations"]


def test_a_result_over_the_output_limit_becomes_an_is_error_result() -> None:
    result, bug = finish("2025-11-25", [{"type": "text", "text": "x" * 5000}], max_output_bytes=4096)
    assert result["isError"] is True
    assert "4096" in text_of(result)
    assert len(json.dumps(result)) < 1000
    assert bug is not None


def test_a_tool_error_result_is_an_is_error_result_with_its_message() -> None:
    result, bug = finish("2025-06-18", [{"type": "text", "text": "division by zero"}], is_error=True)
    assert result == {"content": [{"type": "text", "text": "division by zero"}], "isError": True}
    assert bug is None


def test_a_failed_call_is_an_is_error_result_with_the_message() -> None:
    core, call = start_call("2025-11-25")
    body = json.loads(core.call_failed(call, "Tool freeform timed out after 1 s"))
    assert body["id"] == "call-1"
    assert body["result"] == {"content": [{"type": "text", "text": "Tool freeform timed out after 1 s"}],
                              "isError": True}


# -- progress ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ALL)
def test_progress_is_sent_only_when_the_client_gave_a_token(version: str) -> None:
    _, call = start_call(version)
    assert call.progress_token is None
    assert _core().progress_notification(call, wire.Progress(1, 50.0, 100.0, "half")) is None


def _core() -> Core:
    return core_for(CAT)


@pytest.mark.parametrize("token", ["tok-1", 17, 0, ""])
def test_progress_echoes_the_token_with_its_exact_type(token: Any) -> None:
    core, call = start_call("2025-06-18", meta={"progressToken": token})
    data = core.progress_notification(call, wire.Progress(1, 50.0, 100.0, None))
    note = json.loads(data)
    assert note["method"] == "notifications/progress" and "id" not in note
    assert note["params"]["progressToken"] == token and type(note["params"]["progressToken"]) is type(token)
    assert note["params"]["progress"] == 50 and note["params"]["total"] == 100


def test_progress_for_a_modern_call_uses_the_token_from_meta() -> None:
    core, call = start_call(MODERN, meta={"progressToken": "m"})
    note = json.loads(core.progress_notification(call, wire.Progress(1, 1.0, None, "one")))
    assert note["params"] == {"progressToken": "m", "progress": 1, "message": "one"}


@pytest.mark.parametrize("version", ALL)
def test_progress_messages_are_sent_only_from_2025_03_26(version: str) -> None:
    core, call = start_call(version, meta={"progressToken": 1})
    params = json.loads(core.progress_notification(call, wire.Progress(1, 2.0, 3.0, "step two")))["params"]
    if version == "2024-11-05":
        assert "message" not in params
    else:
        assert params["message"] == "step two"


def test_progress_without_a_total_omits_it() -> None:
    core, call = start_call("2025-06-18", meta={"progressToken": 1})
    params = json.loads(core.progress_notification(call, wire.Progress(1, 2.0, None, None)))["params"]
    assert set(params) == {"progressToken", "progress"}


# -- log messages --------------------------------------------------------------------------------------


def _log(core: Core, call: ToolCall, level: str, data: Any = "m", logger: str | None = None) -> dict | None:
    out = core.log_notification(call, wire.Log(1, wire.LOG_LEVELS.index(level), data, logger))
    return None if out is None else json.loads(out)


def test_legacy_log_messages_respect_the_level_set_with_logging_set_level() -> None:
    core = _core()
    state = initialized(core, "2025-06-18")
    core.receive(state, msg("logging/setLevel", {"level": "warning"}))
    _, call = start_call("2025-06-18", core=core, state=state)
    assert _log(core, call, "debug") is None
    assert _log(core, call, "info") is None
    sent = _log(core, call, "warning", {"k": 1}, "plugin.x")
    assert sent == {"jsonrpc": "2.0", "method": "notifications/message",
                    "params": {"level": "warning", "data": {"k": 1}, "logger": "plugin.x"}}
    assert _log(core, call, "emergency")["params"]["level"] == "emergency"


def test_legacy_clients_get_every_level_before_they_set_one() -> None:
    core = _core()
    _, call = start_call("2025-11-25", core=core)
    assert _log(core, call, "debug")["params"]["level"] == "debug"


def test_the_log_level_is_per_connection() -> None:
    core = _core()
    loud, quiet = initialized(core, "2025-06-18"), initialized(core, "2025-06-18")
    core.receive(quiet, msg("logging/setLevel", {"level": "error"}))
    _, loud_call = start_call("2025-06-18", core=core, state=loud)
    _, quiet_call = start_call("2025-06-18", core=core, state=quiet)
    assert _log(core, loud_call, "info") is not None
    assert _log(core, quiet_call, "info") is None


def test_modern_calls_get_no_log_messages_unless_the_request_carried_a_log_level() -> None:
    core, call = start_call(MODERN)
    for level in wire.LOG_LEVELS:
        assert _log(core, call, level) is None
    core, call = start_call(MODERN, meta={"io.modelcontextprotocol/logLevel": "error"})
    assert _log(core, call, "warning") is None
    assert _log(core, call, "error")["params"]["level"] == "error"


def test_log_frames_with_an_out_of_range_level_are_dropped() -> None:
    core, call = start_call("2025-06-18")
    assert core.log_notification(call, wire.Log(1, 99, "x", None)) is None
    assert core.log_notification(call, wire.Log(1, -3, "x", None)) is None


# -- the fast lane for plain text results ---------------------------------------------------------------

PLAIN_RESULTS: list[tuple[list[Any], bool, bool, Any]] = [
    # content, is_error, has_structured, structured
    ([{"type": "text", "text": "hi"}], False, False, None),
    ([{"type": "text", "text": "boom"}], True, False, None),
    ([], False, False, None),
    ([{"type": "text", "text": "a"}, {"type": "text", "text": "é\u2028\"\\\n"}], False, False, None),
    ([{"type": "text", "text": "x" * 4069}], False, False, None),  # its JSON exactly at the limit below (4096)
    ([{"type": "text", "text": "x" * 4070}], False, False, None),  # one byte over
    ([{"type": "text", "text": "hi", "annotations": {"priority": 1, "lastModified": "2025-01-01T00:00:00Z"}}],
     False, False, None),
    ([{"type": "text", "text": "hi", "_meta": {"k": 1}}], False, False, None),
    ([{"type": "text", "text": 5}], False, False, None),
    ([{"type": "text"}, {"type": "text", "text": "ok"}], False, False, None),
    ([{"type": "image", "data": PNG_B64, "mimeType": "image/png"}], False, False, None),
    (["bare string"], False, False, None),
    ([{"type": "text", "text": "hi"}], False, True, {"sum": 1}),
    ([{"type": "text", "text": "hi"}], False, True, "not an object"),
]


@pytest.mark.parametrize("in_task", [False, True])
@pytest.mark.parametrize("version", ALL)
@pytest.mark.parametrize("case", range(len(PLAIN_RESULTS)))
def test_the_plain_text_fast_lane_answers_exactly_what_the_general_checks_do(
        version: str, case: int, in_task: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Core._call_result_body`` takes bare text blocks without the general checks: for every result,
    era, limit edge and task form, the bytes (and the plugin-bug note) are those of the general path."""
    import runtime.protocol.core as core_module

    content, is_error, has_structured, structured = PLAIN_RESULTS[case]
    core, call = start_call(version)

    def body() -> tuple[bytes, str | None]:
        result = wire.Result(1, json.loads(json.dumps(content)), structured, has_structured, is_error)
        return core._call_result_body(call, result, 4096, in_task=in_task)

    fast = body()
    monkeypatch.setattr(core_module, "_plain_text_json", lambda items: None)
    general = body()
    assert fast == general
