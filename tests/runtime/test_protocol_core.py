"""The sans-io protocol core (``runtime.protocol.core.Core``): both eras, JSON-RPC rules, tool calls.

No processes, no trio: bytes in, actions out.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from protocol_fakes import (
    ALL,
    LEGACY,
    MODERN,
    PLAIN,
    RICH,
    TYPED,
    Batch,
    Cancel,
    ConnState,
    Listen,
    Reply,
    ToolCall,
    catalog,
    core_for,
    decode,
    entry,
    error_of,
    initialized,
    many,
    modern_meta,
    msg,
    note,
    result_of,
)

from runtime.protocol import jsonrpc as rpc
from runtime.protocol.core import ClientResponse, Core
from sandbox import wire

SUPPORTED = {"2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25", "2026-07-28"}


# -- legacy lifecycle ------------------------------------------------------------------------------


@pytest.mark.parametrize("version", LEGACY)
def test_initialize_answers_with_the_legacy_version_the_client_asked_for(version: str) -> None:
    core, state = core_for(), ConnState()
    result = result_of(core.receive(state, msg("initialize", {"protocolVersion": version, "capabilities": {},
                                                              "clientInfo": {"name": "c", "version": "1"}})))
    assert result["protocolVersion"] == version
    assert state.legacy_version == version
    assert result["serverInfo"]["name"] == "toolcell"
    assert isinstance(result["serverInfo"]["version"], str)
    # Implementation fields follow the revision: title from 2025-06-18, description from 2025-11-25.
    assert ("title" in result["serverInfo"]) == (version >= "2025-06-18")
    assert ("description" in result["serverInfo"]) == (version >= "2025-11-25")


@pytest.mark.parametrize("requested", ["1999-01-01", "2025-01-01", "2026-07-28", "garbage"])
def test_initialize_with_an_unknown_version_offers_the_latest_legacy_version(requested: str) -> None:
    core, state = core_for(), ConnState()
    result = result_of(core.receive(state, msg("initialize", {"protocolVersion": requested, "capabilities": {}})))
    assert result["protocolVersion"] == "2025-11-25"


@pytest.mark.parametrize("params", [None, {}, {"protocolVersion": 5}, {"protocolVersion": "2025-06-18",
                                                                          "capabilities": []}])
def test_initialize_without_a_usable_protocol_version_is_invalid_params(params: object) -> None:
    core, state = core_for(), ConnState()
    assert error_of(core.receive(state, msg("initialize", params)))["code"] == -32602
    assert state.legacy_version is None


def test_initialize_advertises_tools_and_logging_capabilities() -> None:
    core, state = core_for(), ConnState()
    result = result_of(core.receive(state, msg("initialize", {"protocolVersion": "2025-06-18", "capabilities": {}})))
    caps = result["capabilities"]
    assert isinstance(caps["tools"], dict)
    assert caps["logging"] == {}


def test_initialize_carries_instructions_when_configured() -> None:
    core, state = core_for(instructions="Use the tools wisely."), ConnState()
    result = result_of(core.receive(state, msg("initialize", {"protocolVersion": "2025-03-26", "capabilities": {}})))
    assert result["instructions"] == "Use the tools wisely."


def test_ping_answers_an_empty_result_even_before_initialize() -> None:
    core, state = core_for(), ConnState()
    assert decode(core.receive(state, msg("ping", id=7))) == {"jsonrpc": "2.0", "id": 7, "result": {}}
    state = initialized(core, "2025-06-18")
    assert result_of(core.receive(state, msg("ping", id="p"))) == {}


def test_initialized_notification_is_recorded_and_not_answered() -> None:
    core, state = core_for(), ConnState()
    core.receive(state, msg("initialize", {"protocolVersion": "2025-06-18", "capabilities": {}}))
    assert state.initialized is False
    assert core.receive(state, note("notifications/initialized")) == Reply(None)
    assert state.initialized is True


def test_tools_list_before_initialize_is_an_error_not_a_result() -> None:
    core, state = core_for(), ConnState()
    err = error_of(core.receive(state, msg("tools/list", {})))
    assert err["code"] == -32602
    assert "initialize" in err["message"]


@pytest.mark.parametrize("level", ["debug", "info", "notice", "warning", "error", "critical", "alert", "emergency"])
def test_logging_set_level_accepts_every_syslog_level(level: str) -> None:
    core = core_for()
    state = initialized(core, "2025-06-18")
    assert result_of(core.receive(state, msg("logging/setLevel", {"level": level}))) == {}


@pytest.mark.parametrize("params", [{"level": "loud"}, {"level": 3}, {"level": None}, {}, None, {"level": "INFO"}])
def test_logging_set_level_with_an_invalid_level_is_invalid_params(params: object) -> None:
    core = core_for()
    state = initialized(core, "2025-06-18")
    before = state.log_level
    assert error_of(core.receive(state, msg("logging/setLevel", params)))["code"] == -32602
    assert state.log_level == before


# -- tools/list shapes per revision ------------------------------------------------------------------


def _listed(core: Core, state: ConnState, params: dict | None = None) -> dict:
    return result_of(core.receive(state, msg("tools/list", params if params is not None else {})))


def _rich_tool(version: str) -> dict:
    core = core_for()
    if version == MODERN:
        tools = result_of(core.receive(ConnState(), msg("tools/list", {"_meta": modern_meta()})))["tools"]
    else:
        tools = _listed(core, initialized(core, version))["tools"]
    return next(t for t in tools if t["name"] == "rich")


def test_tools_list_for_2024_11_05_has_only_name_description_and_input_schema() -> None:
    assert set(_rich_tool("2024-11-05")) == {"name", "description", "inputSchema"}


def test_tools_list_for_2025_03_26_adds_annotations_but_no_title_or_output_schema() -> None:
    tool = _rich_tool("2025-03-26")
    assert set(tool) == {"name", "description", "inputSchema", "annotations"}
    assert tool["annotations"]["readOnlyHint"] is True


def test_tools_list_for_2025_06_18_adds_title_output_schema_and_meta_but_no_icons() -> None:
    tool = _rich_tool("2025-06-18")
    assert set(tool) == {"name", "title", "description", "inputSchema", "outputSchema", "annotations", "_meta"}
    assert tool["title"] == "Rich Tool"
    assert tool["outputSchema"]["required"] == ["sum"]


@pytest.mark.parametrize("version", ["2025-11-25", MODERN])
def test_tools_list_from_2025_11_25_carries_icons_too(version: str) -> None:
    tool = _rich_tool(version)
    assert set(tool) == {"name", "title", "description", "inputSchema", "outputSchema", "annotations", "_meta", "icons"}
    assert tool["icons"][0]["src"] == "https://example.com/icon.png"
    assert "execution" not in tool


@pytest.mark.parametrize("version", ALL)
def test_tools_list_keeps_input_schema_exactly_as_declared(version: str) -> None:
    tool = _rich_tool(version)
    assert tool["inputSchema"] == {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def test_tools_are_listed_sorted_by_name_whatever_order_they_were_loaded_in() -> None:
    core = core_for(catalog([TYPED, RICH, PLAIN]))
    names = [t["name"] for t in _listed(core, initialized(core, "2025-06-18"))["tools"]]
    assert names == ["plain", "rich", "typed"]


def test_repeated_listings_are_byte_identical_across_connections() -> None:
    core = core_for(catalog(many(30), page_size=7))
    a, b = initialized(core, "2025-06-18"), initialized(core, "2025-06-18")
    first = core.receive(a, msg("tools/list", {}, id=5)).data
    assert core.receive(a, msg("tools/list", {}, id=5)).data == first
    assert core.receive(b, msg("tools/list", {}, id=5)).data == first
    cursor = json.loads(first)["result"]["nextCursor"]
    second = core.receive(a, msg("tools/list", {"cursor": cursor}, id=6)).data
    assert core.receive(b, msg("tools/list", {"cursor": cursor}, id=6)).data == second


# -- pagination ------------------------------------------------------------------------------------


def _walk(core: Core, state: ConnState, modern: bool = False) -> tuple[list[str], list[str]]:
    names: list[str] = []
    cursors: list[str] = []
    cursor = None
    for _ in range(1000):
        params: dict = {} if cursor is None else {"cursor": cursor}
        if modern:
            params["_meta"] = modern_meta()
        page = result_of(core.receive(state, msg("tools/list", params)))
        names += [t["name"] for t in page["tools"]]
        cursor = page.get("nextCursor")
        if cursor is None:
            return names, cursors
        assert isinstance(cursor, str) and cursor
        cursors.append(cursor)
    raise AssertionError("pagination never ended")


@pytest.mark.parametrize("modern", [False, True])
def test_pagination_with_a_small_page_size_visits_every_tool_once_in_order(modern: bool) -> None:
    entries = many(23)
    core = core_for(catalog(entries, page_size=4))
    state = ConnState() if modern else initialized(core, "2025-11-25")
    names, cursors = _walk(core, state, modern)
    assert names == sorted(e.name for e in entries)
    assert len(cursors) == 5  # 23 tools in pages of 4: six pages, five cursors


def test_a_listing_that_fits_one_page_has_no_next_cursor() -> None:
    core = core_for(catalog(many(4), page_size=4))
    page = _listed(core, initialized(core, "2025-06-18"))
    assert len(page["tools"]) == 4
    assert "nextCursor" not in page


def test_a_cursor_stays_valid_and_gives_the_same_page_every_time() -> None:
    core = core_for(catalog(many(10), page_size=3))
    state = initialized(core, "2025-06-18")
    cursor = _listed(core, state)["nextCursor"]
    first = _listed(core, state, {"cursor": cursor})
    _listed(core, state, {"cursor": first["nextCursor"]})  # walking on does not invalidate it
    again = _listed(core, state, {"cursor": cursor})
    assert again == first
    assert [t["name"] for t in first["tools"]] == ["tool0003", "tool0004", "tool0005"]


@pytest.mark.parametrize("cursor", ["garbage", "", "!!!!", 123, ["x"], {"a": 1},
                                    "WzEsLTUsIngiXQ", "WzEsMCwiIl0", "x" * 600])
def test_an_invalid_cursor_is_invalid_params(cursor: object) -> None:
    # "WzEsLTUsIngiXQ" is base64 of [1,-5,"x"] (negative offset), "WzEsMCwiIl0" of [1,0,""] (zero offset).
    core = core_for(catalog(many(10), page_size=3))
    state = initialized(core, "2025-06-18")
    err = error_of(core.receive(state, msg("tools/list", {"cursor": cursor})))
    assert err["code"] == -32602


def test_an_invalid_cursor_is_invalid_params_for_modern_clients_too() -> None:
    core = core_for(catalog(many(10), page_size=3))
    err = error_of(core.receive(ConnState(), msg("tools/list", {"cursor": "nope", "_meta": modern_meta()})))
    assert err["code"] == -32602


def test_a_cursor_from_an_older_catalog_continues_after_the_last_name_seen() -> None:
    old = catalog(many(9), page_size=3, version=1)
    current = {"cat": old}
    core = Core(lambda: current["cat"])
    state = initialized(core, "2025-06-18")
    page1 = _listed(core, state)
    assert [t["name"] for t in page1["tools"]] == ["tool0000", "tool0001", "tool0002"]
    # A reload: one tool sorts before the cursor (the client will learn of it via list_changed),
    # one after it, and the old page boundary moved.
    current["cat"] = catalog(many(9) + [entry("tool0000a"), entry("tool0002a")], page_size=3, version=2)
    page2 = _listed(core, state, {"cursor": page1["nextCursor"]})
    assert [t["name"] for t in page2["tools"]] == ["tool0002a", "tool0003", "tool0004"]
    rest, _ = _walk_from(core, state, page2.get("nextCursor"))
    assert rest == ["tool0005", "tool0006", "tool0007", "tool0008"]


def test_a_cursor_from_an_older_catalog_whose_last_tool_was_removed_still_continues() -> None:
    current = {"cat": catalog(many(6), page_size=2, version=1)}
    core = Core(lambda: current["cat"])
    state = initialized(core, "2025-06-18")
    page1 = _listed(core, state)
    current["cat"] = catalog([e for e in many(6) if e.name != "tool0001"], page_size=2, version=2)
    page2 = _listed(core, state, {"cursor": page1["nextCursor"]})
    assert [t["name"] for t in page2["tools"]] == ["tool0002", "tool0003"]


def _walk_from(core: Core, state: ConnState, cursor: str | None) -> tuple[list[str], int]:
    names: list[str] = []
    pages = 0
    while cursor is not None:
        page = _listed(core, state, {"cursor": cursor})
        names += [t["name"] for t in page["tools"]]
        cursor = page.get("nextCursor")
        pages += 1
        assert pages < 100
    return names, pages


# -- the modern era (2026-07-28) ---------------------------------------------------------------------


def test_server_discover_describes_the_server_without_a_handshake() -> None:
    core = core_for(instructions="hello")
    result = result_of(core.receive(ConnState(), msg("server/discover", {"_meta": modern_meta()})))
    assert result["resultType"] == "complete"
    assert set(result["supportedVersions"]) == SUPPORTED
    assert result["supportedVersions"][0] == MODERN
    assert isinstance(result["capabilities"]["tools"], dict)
    assert type(result["ttlMs"]) is int and result["ttlMs"] >= 0
    assert result["cacheScope"] in ("public", "private")
    assert result["instructions"] == "hello"
    info = result["_meta"]["io.modelcontextprotocol/serverInfo"]
    assert info["name"] == "toolcell" and isinstance(info["version"], str)


def test_modern_tools_list_carries_result_type_caching_hints_and_server_info() -> None:
    core = core_for(list_ttl_ms=1234)
    result = result_of(core.receive(ConnState(), msg("tools/list", {"_meta": modern_meta()})))
    assert result["resultType"] == "complete"
    assert result["ttlMs"] == 1234
    assert result["cacheScope"] == "public"
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "toolcell"
    assert [t["name"] for t in result["tools"]] == ["plain", "rich", "typed"]


def test_every_page_of_a_modern_listing_carries_the_same_cache_scope() -> None:
    core = core_for(catalog(many(7), page_size=3))
    scopes, cursor = [], None
    while True:
        params: dict = {"_meta": modern_meta()}
        if cursor:
            params["cursor"] = cursor
        page = result_of(core.receive(ConnState(), msg("tools/list", params)))
        scopes.append(page["cacheScope"])
        assert "ttlMs" in page and page["resultType"] == "complete"
        cursor = page.get("nextCursor")
        if cursor is None:
            break
    assert len(scopes) == 3 and len(set(scopes)) == 1


def test_modern_requests_need_no_initialize_and_leave_the_connection_legacy_free() -> None:
    core, state = core_for(), ConnState()
    result_of(core.receive(state, msg("tools/list", {"_meta": modern_meta()})))
    assert state.legacy_version is None
    # ...and a later legacy request on the same connection still needs the handshake.
    assert error_of(core.receive(state, msg("tools/list", {})))["code"] == -32602


@pytest.mark.parametrize("meta", [
    {"io.modelcontextprotocol/protocolVersion": MODERN},  # no clientCapabilities
    {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": None},
    {"io.modelcontextprotocol/protocolVersion": MODERN, "io.modelcontextprotocol/clientCapabilities": "all"},
    {"io.modelcontextprotocol/protocolVersion": 20260728, "io.modelcontextprotocol/clientCapabilities": {}},
])
@pytest.mark.parametrize("method", ["tools/list", "server/discover", "tools/call"])
def test_a_modern_request_missing_a_required_meta_key_is_invalid_params(meta: dict, method: str) -> None:
    params: dict = {"_meta": meta}
    if method == "tools/call":
        params["name"] = "plain"
    err = error_of(Core(lambda: catalog()).receive(ConnState(), msg(method, params, id="m1")))
    assert err["code"] == -32602
    assert decode(Core(lambda: catalog()).receive(ConnState(), msg(method, params, id="m1")))["id"] == "m1"


@pytest.mark.parametrize("params", [None, {}, {"_meta": {}}, {"_meta": "x"}])
def test_server_discover_without_meta_is_invalid_params(params: object) -> None:
    err = error_of(core_for().receive(ConnState(), msg("server/discover", params)))
    assert err["code"] == -32602


def test_client_info_is_optional_for_modern_requests() -> None:
    meta = modern_meta()
    assert "io.modelcontextprotocol/clientInfo" not in meta
    result_of(core_for().receive(ConnState(), msg("server/discover", {"_meta": meta})))


@pytest.mark.parametrize("version", ["2099-01-01", "2025-06-18", "2025-11-25", "draft"])
@pytest.mark.parametrize("method", ["tools/list", "server/discover", "tools/call"])
def test_an_unsupported_modern_version_is_32022_with_supported_and_requested(version: str, method: str) -> None:
    params: dict = {"_meta": modern_meta(version)}
    if method == "tools/call":
        params["name"] = "plain"
    body = decode(core_for().receive(ConnState(), msg(method, params, id=41)))
    assert body["id"] == 41
    err = body["error"]
    assert err["code"] == -32022
    assert err["data"]["requested"] == version
    assert MODERN in err["data"]["supported"]
    assert set(err["data"]["supported"]) <= SUPPORTED


@pytest.mark.parametrize("method", ["ping", "initialize", "logging/setLevel", "resources/subscribe",
                                    "resources/unsubscribe", "prompts/list", "no/such/method"])
def test_removed_or_unknown_methods_are_method_not_found_for_modern_requests(method: str) -> None:
    params: dict = {"_meta": modern_meta()}
    if method == "initialize":
        params.update({"protocolVersion": MODERN, "capabilities": {}})
    if method == "logging/setLevel":
        params["level"] = "info"
    state = ConnState()
    body = decode(core_for().receive(state, msg(method, params, id="r")))
    assert body["error"]["code"] == -32601
    assert body["id"] == "r"
    assert state.legacy_version is None


def test_modern_tool_calls_see_log_messages_only_when_they_opt_in() -> None:
    core = core_for()
    quiet = core.receive(ConnState(), msg("tools/call", {"name": "plain", "_meta": modern_meta()}))
    assert isinstance(quiet, ToolCall) and quiet.modern and quiet.log_level == -1
    chatty = core.receive(ConnState(), msg("tools/call", {"name": "plain", "_meta": modern_meta(
        **{"io.modelcontextprotocol/logLevel": "warning"})}))
    assert isinstance(chatty, ToolCall) and chatty.log_level == 3


def test_a_modern_tool_call_with_an_invalid_log_level_is_invalid_params() -> None:
    err = error_of(core_for().receive(ConnState(), msg("tools/call", {"name": "plain", "_meta": modern_meta(
        **{"io.modelcontextprotocol/logLevel": "verbose"})})))
    assert err["code"] == -32602


def test_subscriptions_listen_is_acknowledged_with_the_listen_id_verbatim() -> None:
    core = core_for()
    action = core.receive(ConnState(), msg("subscriptions/listen", {"_meta": modern_meta(),
                                                                     "notifications": {"toolsListChanged": True}},
                                           id="sub-1"))
    assert isinstance(action, Listen)
    ack = json.loads(core.subscription_ack(action))
    assert ack["method"] == "notifications/subscriptions/acknowledged"
    assert ack["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "sub-1"
    assert ack["params"]["notifications"] == {"toolsListChanged": True}
    end = json.loads(core.subscription_end(action))
    assert end["id"] == "sub-1" and end["result"]["resultType"] == "complete"


def test_a_listen_names_a_bounded_number_of_task_ids() -> None:
    """Each task id another daemon runs is read from the store ten times a second while the listen
    lasts: a listen of thousands of ids would keep the daemon polling its store in a hot loop."""
    core = core_for()
    meta = modern_meta(**{"io.modelcontextprotocol/clientCapabilities": {
        "extensions": {"io.modelcontextprotocol/tasks": {}}}})

    def listen(count: int) -> Any:
        return core.receive(ConnState(), msg("subscriptions/listen", {"_meta": meta, "notifications": {
            "taskIds": [f"t-{i:09d}" for i in range(count)]}}, id="sub-1"))

    assert isinstance(listen(256), Listen)
    err = error_of(listen(5000))
    assert err["code"] == -32602 and "at most 256 task ids" in err["message"]


# -- JSON-RPC rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("request_id", [1, "1", 0, -7, 2**53, "", "a b", "ünï"])
def test_ids_are_echoed_with_their_exact_json_type(request_id: object) -> None:
    core = core_for()
    body = decode(core.receive(ConnState(), msg("ping", id=request_id)))
    assert body["id"] == request_id and type(body["id"]) is type(request_id)
    err = decode(core.receive(ConnState(), msg("nope", id=request_id)))
    assert err["id"] == request_id and type(err["id"]) is type(request_id)


def test_string_one_and_integer_one_are_different_ids() -> None:
    core = core_for()
    assert b'"id":"1"' in core.receive(ConnState(), msg("ping", id="1")).data
    assert b'"id":1,' in core.receive(ConnState(), msg("ping", id=1)).data


@pytest.mark.parametrize("data", [
    note("notifications/initialized"),
    note("notifications/unknown"),
    note("notifications/progress", {"progressToken": 1, "progress": 5}),
    note("notifications/roots/list_changed"),
    note("ping"),
    note("tools/list", {}),
    note("tools/call", {"name": "plain"}),
    note("initialize", {"protocolVersion": "2025-06-18"}),
    note("notifications/cancelled", "not an object"),
    note("notifications/cancelled", {"requestId": None}),
    note("notifications/cancelled", {"requestId": 1.5}),
])
def test_notifications_are_never_answered(data: bytes) -> None:
    core = core_for()
    for state in (ConnState(), initialized(core, "2025-06-18")):
        assert core.receive(state, data) == Reply(None)


def test_a_notification_never_runs_a_tool_nor_initializes() -> None:
    core, state = core_for(), ConnState()
    assert core.receive(state, note("initialize", {"protocolVersion": "2025-06-18", "capabilities": {}})) == Reply(None)
    assert state.legacy_version is None


@pytest.mark.parametrize("request_id", [5, "five"])
def test_cancelled_notification_becomes_a_cancel_action_for_that_id(request_id: object) -> None:
    action = core_for().receive(ConnState(), note("notifications/cancelled", {"requestId": request_id,
                                                                               "reason": "user"}))
    assert action == Cancel(request_id)


def test_a_response_sent_by_the_client_is_read_as_its_answer_to_one_of_our_requests_never_answered() -> None:
    core = core_for()
    ok = core.receive(ConnState(), b'{"jsonrpc":"2.0","id":"toolcell-3","result":{"roots":[]}}')
    assert isinstance(ok, ClientResponse) and ok.request_id == "toolcell-3" and ok.error is None
    assert core.read_client_response(ok, "roots-1") == wire.InputResponse("roots-1", "result", {"roots": []})
    bad = core.receive(ConnState(), b'{"jsonrpc":"2.0","id":3,"error":{"code":1,"message":"no"}}')
    assert isinstance(bad, ClientResponse) and bad.result is None
    answer = core.read_client_response(bad, "k")
    assert answer.outcome == "error" and "no" in answer.message
    not_object = core.receive(ConnState(), b'{"jsonrpc":"2.0","id":3,"result":[1]}')
    assert isinstance(not_object, ClientResponse)
    assert core.read_client_response(not_object, "k").outcome == "error"


@pytest.mark.parametrize("data", [b"{", b"not json", b'{"jsonrpc":"2.0",}', b"\xff\xfe", b'{"a":1}x', b"[1,"])
def test_invalid_json_is_a_parse_error(data: bytes) -> None:
    body = decode(core_for().receive(ConnState(), data))
    assert body["error"]["code"] == -32700
    assert body["id"] is None  # no readable id; legacy-or-unknown era sends null


def test_a_parse_error_on_a_2025_11_25_connection_omits_the_id() -> None:
    core = core_for()
    state = initialized(core, "2025-11-25")
    body = decode(core.receive(state, b"{oops"))
    assert body["error"]["code"] == -32700
    assert "id" not in body


@pytest.mark.parametrize("data", [b"42", b'"str"', b"null", b"true", b"3.5"])
def test_json_that_is_not_an_object_is_an_invalid_request(data: bytes) -> None:
    err = error_of(core_for().receive(ConnState(), data))
    assert err["code"] == -32600


@pytest.mark.parametrize("raw_id", ["null", "1.5", "true", "false", "{}", "[1]", "1e3"])
def test_ids_of_the_wrong_type_are_an_invalid_request(raw_id: str) -> None:
    data = b'{"jsonrpc":"2.0","id":' + raw_id.encode() + b',"method":"ping"}'
    body = decode(core_for().receive(ConnState(), data))
    assert body["error"]["code"] == -32600
    assert body["id"] is None


@pytest.mark.parametrize("data", [
    b'{"id":1,"method":"ping"}',
    b'{"jsonrpc":"1.0","id":1,"method":"ping"}',
    b'{"jsonrpc":2.0,"id":1,"method":"ping"}',
    b'{"jsonrpc":"2.0","id":1,"method":7}',
    b'{"jsonrpc":"2.0","id":1}',
    b'{"jsonrpc":"2.0","id":1,"method":null}',
    b"{}",
])
def test_messages_that_are_not_valid_requests_are_an_invalid_request_that_keeps_a_readable_id(data: bytes) -> None:
    body = decode(core_for().receive(ConnState(), data))
    assert body["error"]["code"] == -32600
    if b'"id":1' in data:
        assert body["id"] == 1


@pytest.mark.parametrize("method", ["no/such", "tools/get", "resources/list", "prompts/get", "completion/complete",
                                    "Tools/List", ""])
def test_unknown_methods_are_method_not_found(method: str) -> None:
    core = core_for()
    state = initialized(core, "2025-06-18")
    err = error_of(core.receive(state, msg(method, {})))
    assert err["code"] == -32601


def test_params_that_are_not_an_object_are_invalid_params() -> None:
    core = core_for()
    state = initialized(core, "2025-06-18")
    for params in ([1, 2], "x", 3):
        assert error_of(core.receive(state, msg("tools/list", params)))["code"] == -32602
        assert error_of(core.receive(state, msg("tools/call", params)))["code"] == -32602


def test_unknown_params_fields_are_ignored() -> None:
    core = core_for()
    state = initialized(core, "2025-06-18")
    page = _listed(core, state, {"futureField": {"x": 1}})
    assert len(page["tools"]) == 3


# -- tools/call --------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ALL)
def test_calling_an_unknown_tool_is_invalid_params(version: str) -> None:
    core = core_for()
    if version == MODERN:
        state, params = ConnState(), {"name": "ghost", "_meta": modern_meta()}
    else:
        state, params = initialized(core, version), {"name": "ghost"}
    err = error_of(core.receive(state, msg("tools/call", params)))
    assert err["code"] == -32602
    assert "ghost" in err["message"]


@pytest.mark.parametrize("params", [{}, {"name": 5}, {"arguments": {}}, {"name": "plain", "arguments": [1]},
                                    {"name": "plain", "arguments": "x"},
                                    {"name": "plain", "_meta": {"progressToken": 1.5}},
                                    {"name": "plain", "_meta": {"progressToken": True}},
                                    {"name": "plain", "_meta": []}])
def test_a_malformed_tools_call_is_invalid_params(params: dict) -> None:
    core = core_for()
    state = initialized(core, "2025-06-18")
    assert error_of(core.receive(state, msg("tools/call", params)))["code"] == -32602


def test_a_valid_call_becomes_a_tool_call_action_with_everything_the_runner_needs() -> None:
    core = core_for()
    state = initialized(core, "2025-06-18")
    action = core.receive(state, msg("tools/call", {"name": "typed", "arguments": {"count": 2},
                                                    "_meta": {"progressToken": "tok"}}, id="c1"))
    assert isinstance(action, ToolCall)
    assert action.entry is TYPED and action.arguments == {"count": 2}
    assert action.request_id == "c1" and action.id_bytes == b'"c1"'
    assert action.progress_token == "tok" and action.version == "2025-06-18" and not action.modern


@pytest.mark.parametrize(("tracestate", "kept"), [
    ("vendor=abc,other=x y", True),
    ('a=b,\n{"level":"error","event":"forged"}', False),  # would reach a log line verbatim
    ("a=\x1b[2Jb", False),
    ("a=\u00e9", False),
    ("a=" + "b" * 600, False),
])
def test_meta_tracestate_is_kept_only_when_it_is_printable_ascii(tracestate: str, kept: bool) -> None:
    core = core_for()
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    action = core.receive(initialized(core, "2025-06-18"), msg("tools/call", {
        "name": "plain", "_meta": {"traceparent": parent, "tracestate": tracestate}}))
    assert isinstance(action, ToolCall) and action.traceparent == parent
    assert action.tracestate == (tracestate if kept else None)


def test_missing_arguments_mean_an_empty_object() -> None:
    core = core_for()
    action = core.receive(initialized(core, "2025-06-18"), msg("tools/call", {"name": "plain"}))
    assert isinstance(action, ToolCall) and action.arguments == {}


@pytest.mark.parametrize("version", ["2024-11-05", "2025-03-26", "2025-06-18"])
def test_invalid_arguments_are_invalid_params_up_to_2025_06_18(version: str) -> None:
    core = core_for()
    state = initialized(core, version)
    err = error_of(core.receive(state, msg("tools/call", {"name": "typed", "arguments": {"count": "three"}})))
    assert err["code"] == -32602
    assert "count" in err["message"]


@pytest.mark.parametrize("version", ["2025-11-25", MODERN])
def test_invalid_arguments_are_an_is_error_result_naming_the_field_from_2025_11_25(version: str) -> None:
    core = core_for()
    if version == MODERN:
        state, extra = ConnState(), {"_meta": modern_meta()}
    else:
        state, extra = initialized(core, version), {}
    result = result_of(core.receive(state, msg("tools/call", {"name": "typed", "arguments": {"count": -1}, **extra})))
    assert result["isError"] is True
    assert "count" in result["content"][0]["text"]
    assert ("resultType" in result) == (version == MODERN)


@pytest.mark.parametrize("arguments,field", [({}, "count"), ({"count": 1, "extra": True}, "extra"),
                                             ({"count": 1, "label": 5}, "label")])
def test_validation_messages_name_the_offending_field(arguments: dict, field: str) -> None:
    core = core_for()
    result = result_of(core.receive(initialized(core, "2025-11-25"),
                                    msg("tools/call", {"name": "typed", "arguments": arguments})))
    assert result["isError"] is True
    assert field in result["content"][0]["text"]


# -- batches (2025-03-26 only) -------------------------------------------------------------------------


def test_a_batch_on_a_2025_03_26_connection_gives_one_action_per_member() -> None:
    core = core_for()
    state = initialized(core, "2025-03-26")
    batch = json.dumps([
        {"jsonrpc": "2.0", "id": 1, "method": "ping"},
        {"jsonrpc": "2.0", "method": "notifications/unknown"},
        {"jsonrpc": "2.0", "id": "two", "method": "tools/list"},
        {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "plain"}},
        {"jsonrpc": "2.0", "id": 4, "method": "no/such"},
    ]).encode()
    action = core.receive(state, batch)
    assert isinstance(action, Batch)
    kinds = [type(a) for a in action.actions]
    assert kinds == [Reply, Reply, Reply, ToolCall, Reply]
    assert decode(action.actions[0])["id"] == 1
    assert action.actions[1].data is None
    assert decode(action.actions[2])["id"] == "two"
    assert action.actions[3].request_id == 3
    assert decode(action.actions[4])["error"]["code"] == -32601


def test_initialize_inside_a_batch_is_refused() -> None:
    core = core_for()
    state = initialized(core, "2025-03-26")
    batch = json.dumps([{"jsonrpc": "2.0", "id": 9, "method": "initialize",
                         "params": {"protocolVersion": "2025-06-18", "capabilities": {}}},
                        {"jsonrpc": "2.0", "id": 10, "method": "ping"}]).encode()
    action = core.receive(state, batch)
    assert isinstance(action, Batch)
    refused = decode(action.actions[0])
    assert refused["id"] == 9 and refused["error"]["code"] == -32600
    assert state.legacy_version == "2025-03-26"  # the batched initialize changed nothing
    assert decode(action.actions[1])["result"] == {}


def test_non_object_batch_members_get_their_own_invalid_request_error() -> None:
    core = core_for()
    action = core.receive(initialized(core, "2025-03-26"), b'[1, {"jsonrpc":"2.0","id":2,"method":"ping"}]')
    assert isinstance(action, Batch)
    assert decode(action.actions[0])["error"]["code"] == -32600
    assert decode(action.actions[1])["id"] == 2


@pytest.mark.parametrize("version", [None, "2024-11-05", "2025-06-18", "2025-11-25"])
def test_batches_are_rejected_outside_2025_03_26(version: str | None) -> None:
    core = core_for()
    state = ConnState() if version is None else initialized(core, version)
    action = core.receive(state, b'[{"jsonrpc":"2.0","id":1,"method":"ping"}]')
    assert isinstance(action, Reply)
    assert error_of(action)["code"] == -32600


def test_an_empty_batch_is_an_invalid_request() -> None:
    core = core_for()
    assert error_of(core.receive(initialized(core, "2025-03-26"), b"[]"))["code"] == -32600


# -- the catalog's page cache ----------------------------------------------------------------------------


def test_a_page_is_encoded_once_per_catalog_version_and_revision() -> None:
    cat = catalog(many(250), page_size=100)
    first, cursor = cat.page("2025-06-18")
    again, cursor_again = cat.page("2025-06-18")
    assert again is first and cursor_again == cursor
    second, _ = cat.page("2025-06-18", cursor)
    assert cat.page("2025-06-18", cursor)[0] is second
    assert cat.page("2024-11-05")[0] is not first  # another revision, another shape


def test_ten_thousand_tools_list_completely_and_identically_every_time() -> None:
    entries = many(10_000)
    core = core_for(catalog(entries, page_size=100))
    state = initialized(core, "2025-11-25")
    first_walk, cursors = _walk(core, state)
    assert first_walk == [e.name for e in entries]
    assert len(cursors) == 99
    pages_a = [core.receive(state, msg("tools/list", {"cursor": c})).data for c in cursors[:5]]
    pages_b = [core.receive(state, msg("tools/list", {"cursor": c})).data for c in cursors[:5]]
    assert pages_a == pages_b


def test_a_cursor_past_the_end_of_a_shrunken_catalog_ends_the_listing() -> None:
    current = {"cat": catalog(many(20), page_size=5, version=1)}
    core = Core(lambda: current["cat"])
    state = initialized(core, "2025-06-18")
    cursor = None
    for _ in range(3):
        page = _listed(core, state, {} if cursor is None else {"cursor": cursor})
        cursor = page["nextCursor"]
    current["cat"] = catalog(many(10), page_size=5, version=2)
    page = _listed(core, state, {"cursor": cursor})
    assert page["tools"] == [] and "nextCursor" not in page


# -- the fast lane for a legacy tools/call ---------------------------------------------------------

_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
CALL_MESSAGES: list[bytes] = [
    msg("tools/call", {"name": "typed", "arguments": {"count": 1}}),
    msg("tools/call", {"name": "typed", "arguments": {"count": 1}}, id="s-1"),
    msg("tools/call", {"name": "typed", "arguments": {"count": -1}}),
    msg("tools/call", {"name": "typed", "arguments": {"label": "no count"}}),
    msg("tools/call", {"name": "typed", "arguments": [1]}),
    msg("tools/call", {"name": "plain"}),
    msg("tools/call", {"name": "plain", "arguments": None}),
    msg("tools/call", {"name": "nope", "arguments": {}}),
    msg("tools/call", {"name": 5, "arguments": {}}),
    msg("tools/call", {"arguments": {}}),
    msg("tools/call", None),
    msg("tools/call", [1, 2]),
    msg("tools/call", "text"),
    msg("tools/call", {"name": "plain", "arguments": {}}, id=1.5),
    msg("tools/call", {"name": "plain", "arguments": {}}, id=True),
    msg("tools/call", {"name": "plain", "arguments": {}}, id=[1]),
    msg("tools/call", {"name": "plain", "arguments": {}}, id=None),
    b'{"jsonrpc":"2.0","id":null,"method":"tools/call","params":{"name":"plain","arguments":{}}}',
    b'{"jsonrpc":"1.0","id":1,"method":"tools/call","params":{"name":"plain","arguments":{}}}',
    b'{"id":1,"method":"tools/call","params":{"name":"plain","arguments":{}}}',
    b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"plain","arguments":{}},"extra":1}',
    msg("tools/call", {"name": "plain", "arguments": {}, "_meta": {"progressToken": "p"}}),
    msg("tools/call", {"name": "plain", "arguments": {}, "_meta": {"progressToken": 1.5}}),
    msg("tools/call", {"name": "plain", "arguments": {}, "_meta": []}),
    msg("tools/call", {"name": "plain", "arguments": {}, "_meta": {"traceparent": _TRACEPARENT, "tracestate": "a=b"}}),
    msg("tools/call", {"name": "plain", "arguments": {}, "_meta": {"traceparent": "garbage"}}),
    msg("tools/call", {"name": "plain", "arguments": {}, "_meta": modern_meta()}),
    msg("tools/call", {"name": "plain", "arguments": {}, "task": {"ttl": 1000}}),
    msg("tools/call", {"name": "rich", "arguments": {"x": 1}}),
    msg("tools/call", {"name": "rich", "arguments": {"x": "1"}}),
    b'{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"plain","arguments":{"a":' + b"[" * 900
    + b"]" * 900 + b"}}}",
]


def _comparable(action: Any) -> Any:
    if isinstance(action, ToolCall):
        return ("ToolCall", msgspec.structs.astuple(action))
    return action


@pytest.mark.parametrize("version", LEGACY)
@pytest.mark.parametrize("case", range(len(CALL_MESSAGES)))
def test_a_legacy_tools_call_gets_the_same_action_from_the_fast_lane_as_from_parse_and_run(
        version: str, case: int) -> None:
    """``Core.receive`` takes a well-formed legacy ``tools/call`` without ``parse``/``run``'s general
    steps: whatever the message (valid, refused, malformed, modern ``_meta``, odd ids), the action is
    the one the general path gives."""
    core = core_for()
    data = CALL_MESSAGES[case]
    fast = core.receive(initialized(core, version), data)
    state = initialized(core, version)
    env = rpc.decode_envelope(data)
    assert not isinstance(env, list)
    general = core.run(state, core.parse(state, env))
    assert _comparable(fast) == _comparable(general)
