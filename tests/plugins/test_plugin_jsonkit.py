from __future__ import annotations

import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from sandbox import ToolError

DOC = json.dumps(
    {
        "users": [{"name": "Ann", "email": "a@x", "tags": ["x"]}, {"name": "Bob", "email": "b@x"}],
        "a.b": {"c~d/e": 1},
        "": "empty key",
    }
)


@pytest.fixture(scope="module")
def jk(load_plugin):
    return load_plugin("jsonkit")


def values(result):
    return [m.value for m in result.matches]


# -- path language -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/users/0/name", ["Ann"]),
        ("users[0].name", ["Ann"]),
        ("$.users[1].email", ["b@x"]),
        ("users[-1].name", ["Bob"]),
        ("users.1.name", ["Bob"]),
        ("users[*].email", ["a@x", "b@x"]),
        ("$.users.*.name", ["Ann", "Bob"]),
        ('["a.b"]["c~d/e"]', [1]),
        ("['a.b'].*", [1]),
        ("/a.b/c~0d~1e", [1]),
        ("#/users/0/tags/0", ["x"]),
        ("/", ["empty key"]),
        ("users[5].name", []),
        ("/users/-", []),
        ("/users/01", []),
        ("users[0].name.first", []),
    ],
)
def test_query_paths(jk, path, expected):
    assert values(jk.module.query(DOC, path)) == expected


def test_query_whole_document_and_locations(jk):
    for root in ("", "$"):
        r = jk.module.query(DOC, root)
        assert r.count == 1 and r.matches[0].value == json.loads(DOC) and r.matches[0].pointer == ""
    r = jk.module.query(DOC, "users[*].tags[0]")
    assert [(m.pointer, m.path) for m in r.matches] == [("/users/0/tags/0", "users[0].tags[0]")]
    r = jk.module.query(DOC, "/a.b/c~0d~1e")
    assert r.matches[0].path == '["a.b"]["c~d/e"]'


def test_query_max_results(jk):
    r = jk.module.query(json.dumps(list(range(50))), "[*]", max_results=5)
    assert r.count == 5 and r.truncated and values(r) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("users[0", "unclosed"),
        ("users..name", "recursive descent"),
        ("users[abc]", "inside \\[\\]"),
        ("users.", "expected a name"),
        ("$foo", "unexpected"),
        ("/a~2b", "~"),
        ("users[0]name", "unexpected"),
    ],
)
def test_query_path_syntax_errors(jk, path, message):
    with pytest.raises(ToolError, match=message):
        jk.module.query(DOC, path)


def test_query_big_integers_cross_the_channel(jk):
    out = jk.call("query", document='{"n": 1180591620717411303424}', path="n")
    assert out.structured["matches"][0]["value"] == pytest.approx(1.1805916207174113e21)


# -- validate / format ----------------------------------------------------------------------------


def test_validate(jk):
    ok = jk.module.validate('{"a": 1, "a": 2, "b": [1, {"c": null}]}')
    assert ok.valid and ok.type == "object" and ok.depth == 3 and ok.duplicate_keys == ["a"]
    bad = jk.module.validate('{\n  "a": 1,\n}')
    assert not bad.valid and (bad.line, bad.column) == (3, 1) and "double quotes" in bad.error
    for text, err in (("[NaN]", "NaN"), ("[1e999]", "too large"), ("", "Expecting value"), ("{} x", "Extra data")):
        assert err in jk.module.validate(text).error
    assert jk.module.validate('"just a string"').type == "string"


def test_format(jk):
    assert jk.module.format_json('{"b": 1, "a": [1, 2]}', indent=0) == '{"b":1,"a":[1,2]}'
    assert (
        jk.module.format_json('{"b": 1, "a": [1]}', indent=2, sort_keys=True) == '{\n  "a": [\n    1\n  ],\n  "b": 1\n}'
    )
    assert jk.module.format_json('["é"]', 0) == '["é"]'
    assert jk.module.format_json('["é"]', 0, ascii_only=True) == '["\\u00e9"]'
    assert jk.module.format_json("[123456789012345678901234567890]", 0) == "[123456789012345678901234567890]"
    with pytest.raises(ToolError, match="not valid JSON: .* line 1 column 2"):
        jk.module.format_json("{,}")


def test_limits(jk):
    with pytest.raises(ToolError, match="nested more than"):
        jk.module.query("[" * 300 + "]" * 300, "")
    with pytest.raises(ToolError, match="too large"):
        jk.module.format_json(" " * 4_000_001)


# -- diff ------------------------------------------------------------------------------------------


def test_diff_is_a_json_patch(jk):
    out = jk.call(
        "diff",
        a='{"a": 1, "b": [1, 2, 3, 4], "c": {"d": true}, "gone": 0}',
        b='{"a": 1.0, "b": [1, 5], "c": {"d": 1}, "e": null}',
    )
    s = out.structured
    assert not s["equal"] and s["count"] == 6
    assert s["changes"] == [
        {"op": "remove", "path": "/gone", "old": 0},
        {"op": "replace", "path": "/b/1", "value": 5, "old": 2},
        {"op": "remove", "path": "/b/3", "old": 4},
        {"op": "remove", "path": "/b/2", "old": 3},
        {"op": "replace", "path": "/c/d", "value": 1, "old": True},
        {"op": "add", "path": "/e", "value": None},
    ]


def test_diff_equal_and_truncated(jk):
    assert jk.module.diff('{"x": [1, {"y": 2}]}', '{"x":[1,{"y":2.0}]}').equal
    r = jk.module.diff(json.dumps(list(range(20))), "[]", max_changes=3)
    assert r.truncated and r.count == 3


def _apply_patch(doc, changes):
    """A minimal RFC 6902 applier (add/remove/replace) to check the diff really is a patch."""
    import copy

    doc = copy.deepcopy(doc)
    for ch in changes:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in ch.path.split("/")[1:]]
        if not parts:
            doc = ch.value
            continue
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        last = parts[-1]
        if isinstance(parent, list):
            idx = len(parent) if last == "-" else int(last)
            if ch.op == "add":
                parent.insert(idx, ch.value)
            elif ch.op == "remove":
                del parent[idx]
            else:
                parent[idx] = ch.value
        elif ch.op == "remove":
            del parent[last]
        else:
            parent[last] = ch.value
    return doc


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=150, deadline=None)
@given(json_values, json_values)
def test_diff_patch_turns_a_into_b(jk, a, b):
    r = jk.module.diff(json.dumps(a), json.dumps(b))
    # JSON equality, not Python's: false != 0 (json.dumps tells them apart; no floats are generated).
    assert r.equal == (json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True))
    assert _apply_patch(a, r.changes) == b


# -- flatten / unflatten ------------------------------------------------------------------------------


def test_flatten_paths_and_pointers(jk):
    doc = '{"a": {"b": [1, {"c": 2}], "empty": {}, "none": []}, "x.y": "z"}'
    f = jk.module.flatten(doc)
    assert f.entries == {"a.b[0]": 1, "a.b[1].c": 2, "a.empty": {}, "a.none": [], '["x.y"]': "z"}
    p = jk.module.flatten(doc, "pointer")
    assert p.entries == {"/a/b/0": 1, "/a/b/1/c": 2, "/a/empty": {}, "/a/none": [], "/x.y": "z"}
    assert jk.module.flatten("5").entries == {"": 5}


def test_unflatten(jk):
    assert jk.module.unflatten({"a.b[0]": 1, "a.b[1].c": 2}).document == {"a": {"b": [1, {"c": 2}]}}
    assert jk.module.unflatten({"a[2]": 1, "a[0].x": 2}).document == {"a": [{"x": 2}, None, 1]}
    assert jk.module.unflatten({"/0/a": 1, "/-": 5}).document == [{"a": 1}, 5]
    assert jk.module.unflatten('{"k": true}').document == {"k": True}
    assert jk.module.unflatten({"$": 7}).document == 7
    for entries, message in (
        ({"a": 1, "a.b": 2}, "conflicts with another entry: a number is already there, an object is needed"),
        ({"x[*]": 1}, "wildcards"),
        ({"a[-1]": 1}, "negative"),
        ({"a": 1, "": 2}, "only entry"),
        ({"a[100001]": 1}, "array index above"),
        ({"a.b": 1, "a[0]": 2}, "conflicts"),
        ({"a": [], "a.b": 1}, "an array is already there, an object is needed"),
        ({"a.b": 1, "a.b.c": 1}, "a number is already there"),
    ):
        with pytest.raises(ToolError, match=message):
            jk.module.unflatten(entries)


def _keys(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _keys(v)
    elif isinstance(value, list):
        for v in value:
            yield from _keys(v)


@settings(max_examples=150, deadline=None)
@given(json_values, st.sampled_from(["path", "pointer"]))
def test_flatten_unflatten_round_trip(jk, value, style):
    if style == "pointer":  # documented ambiguity: pointer segments "0" or "-" build arrays
        assume(not any(k.isdigit() or k == "-" for k in _keys(value)))
    text = json.dumps(value)
    entries = jk.module.flatten(text, style).entries
    assert jk.module.unflatten(entries, style).document == value
    for path, leaf in entries.items():  # every flattened key is a valid query path
        assert values(jk.module.query(text, path)) == [leaf]


def test_unflatten_through_worker_with_type_key(jk):
    # A document that looks like a content item must still come back as structured data.
    out = jk.call("unflatten", entries={"type": "text", "text": "hi"})
    assert out.structured == {"document": {"type": "text", "text": "hi"}}
