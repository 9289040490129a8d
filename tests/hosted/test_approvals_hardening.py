"""Approvals compare what the sandbox applies: real paths, the kind of each environment variable,
every part of a manifest that changes what a plugin can do or consume; and an approvals file that
cannot be trusted holds every plugin. No processes here: these are the pure parts."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from runtime import approvals
from runtime.manifest import Manifest
from sandbox.wire import Limits


def manifest(**fields: Any) -> Manifest:
    base: dict[str, Any] = {"name": "srv", "version": "1.0.0", "kind": "server", "prefix": "srv_",
                            "server": {"package": "npm:x@1.0.0"}}
    base.update(fields)
    return msgspec.convert(base, Manifest)


def approved(state: Path, folder: Path, m: Manifest) -> None:
    folder.mkdir(exist_ok=True)
    approvals.record(str(state), m, str(folder), "test")


def test_a_path_through_a_symlink_or_dotdot_asks_for_more(tmp_path: Path) -> None:
    shared, target = tmp_path / "shared", tmp_path / "target"
    shared.mkdir()
    (target / "sub").mkdir(parents=True)
    # What the plugin can make with its write grant: a symlink out of /shared.
    (shared / "esc").symlink_to(target / "sub")
    ok = approvals.grants(manifest(permissions={"write": [str(shared)]}))
    for asked in (f"{shared}/esc/..", f"{shared}/esc", f"{shared}/esc/x"):
        for kind in ("read", "write"):
            more = approvals.exceeds(approvals.grants(manifest(permissions={kind: [asked]})), ok)
            assert more and more[0].startswith(f"+ {kind} {asked}"), (asked, more)
    assert approvals.exceeds(approvals.grants(manifest(permissions={"read": [f"{shared}/plain/../plain"]})), ok)
    assert approvals.exceeds(approvals.grants(manifest(permissions={"write": [f"{shared}/a/b"]})), ok) == []


def test_a_symlinked_path_approved_as_such_is_held_once_it_leads_elsewhere(tmp_path: Path) -> None:
    state, folder = tmp_path / "state", tmp_path / "p"
    (tmp_path / "data").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "data")
    m = manifest(permissions={"write": [str(link)]})
    approved(state, folder, m)
    assert approvals.check(m, folder, str(state)) is None
    link.unlink()
    link.symlink_to("/etc")
    held = approvals.check(m, folder, str(state))
    assert held is not None and f"+ write {link} (leads to /etc)" in held
    # Where it led when approved is recorded with it.
    assert approvals.load(str(state))[approvals.key(folder)]["grants"]["real"] == {str(link): str(tmp_path / "data")}


def test_an_env_name_moving_from_set_to_allow_asks_for_more() -> None:
    ok = approvals.grants(manifest(env={"set": {"API_KEY": "dummy"}, "allow": ["TZ"]}))
    moved = approvals.grants(manifest(env={"allow": ["API_KEY", "TZ"]}))
    assert approvals.exceeds(moved, ok) == ["env API_KEY: a fixed value -> the daemon's own value (env.allow)"]
    # The other way round asks for nothing: a fixed value carries none of the daemon's.
    assert approvals.exceeds(approvals.grants(manifest(env={"set": {"TZ": "UTC", "API_KEY": "dummy"}})), ok) == []


def test_an_old_merged_env_approval_counts_as_fixed_values_only(tmp_path: Path) -> None:
    state, folder = tmp_path / "state", tmp_path / "p"
    m = manifest(env={"set": {"API_KEY": "dummy"}})
    approved(state, folder, m)
    data = json.loads((state / "approvals.json").read_text())
    g = data["plugins"][approvals.key(folder)]["grants"]
    for new in ("env_allow", "env_set"):
        g.pop(new, None)
    assert g["env"] == ["API_KEY"]
    (state / "approvals.json").write_text(json.dumps(data))
    assert approvals.check(m, folder, str(state)) is None
    held = approvals.check(manifest(env={"allow": ["API_KEY"]}), folder, str(state))
    assert held is not None and "env API_KEY: a fixed value -> the daemon's own value" in held


@pytest.mark.parametrize("change, expected", [
    ({"server": {"package": "npm:x@1.0.0", "args": ["/"]}}, "server.args: [] -> ['/']"),
    ({"server": {"package": "npm:x@1.0.0", "bin": "other"}}, "server.bin: '' -> 'other'"),
    ({"server": {"package": "npm:x@1.0.0", "instances": 8}}, "server.instances: 1 -> 8"),
    ({"server": {"package": "npm:x@1.0.0", "per_principal": True}}, "server.per_principal: false -> true (up to 16 principals start servers of their own)"),
    ({"kind": "plugin", "server": None, "entry": "m", "dependencies": ["requests"]}, "+ dependency requests"),
    ({"kind": "plugin", "server": None, "entry": "m", "allow_source_builds": True},
     "allow_source_builds: false -> true"),
    ({"name": "aaa"}, "name: 'srv' -> 'aaa'"),
    ({"prefix": ""}, "prefix: 'srv_' -> ''"),
    ({"prefix": "other_"}, "prefix: 'srv_' -> 'other_'"),
])
def test_every_part_that_changes_what_a_plugin_can_do_or_consume_is_compared(
        change: dict[str, Any], expected: str) -> None:
    before = {"kind": "plugin", "server": None, "entry": "m"} if change.get("kind") == "plugin" else {}
    assert expected in approvals.exceeds(approvals.grants(manifest(**change)), approvals.grants(manifest(**before)))


def test_less_or_the_same_asks_for_nothing() -> None:
    ok = approvals.grants(manifest(server={"package": "npm:x@1.0.0", "instances": 4, "per_principal": True,
                                           "max_principals": 32}))
    less = manifest(prefix="srv_x_", server={"package": "npm:x@1.0.0", "instances": 2, "per_principal": True,
                                             "max_principals": 8})
    assert approvals.exceeds(approvals.grants(less), ok) == []
    more = manifest(server={"package": "npm:x@1.0.0", "instances": 4, "per_principal": True, "max_principals": 64})
    assert approvals.exceeds(approvals.grants(more), ok) == ["server.max_principals: 32 -> 64"]


def test_an_approval_from_before_these_fields_holds_only_what_it_could_not_have_shown(tmp_path: Path) -> None:
    state, folder = tmp_path / "state", tmp_path / "p"
    m = manifest()
    approved(state, folder, m)
    data = json.loads((state / "approvals.json").read_text())
    entry = data["plugins"][approvals.key(folder)]
    old_fields = {"read", "write", "network", "env", "limits", "runs"}
    entry["grants"] = {k: v for k, v in entry["grants"].items() if k in old_fields}
    (state / "approvals.json").write_text(json.dumps(data))
    # The name was recorded beside the grants; the prefix was not, so it is approved once.
    held = approvals.check(m, folder, str(state))
    assert held is not None and "prefix: (not recorded) -> 'srv_'" in held and "name:" not in held
    entry["grants"]["prefix"] = "srv_"
    (state / "approvals.json").write_text(json.dumps(data))
    assert approvals.check(m, folder, str(state)) is None
    # Fields it did not record count as approved at their least.
    held = approvals.check(manifest(server={"package": "npm:x@1.0.0", "args": ["/srv"], "instances": 2}), folder,
                           str(state))
    assert held is not None and "server.args: (not recorded) -> ['/srv']" in held and "server.instances: 1 -> 2" in held


@pytest.mark.parametrize("spoil", ["chmod", "json", "entry", "type"])
def test_an_approvals_file_that_cannot_be_trusted_holds_every_plugin(tmp_path: Path, spoil: str) -> None:
    state, folder = tmp_path / "state", tmp_path / "p"
    approved(state, folder, manifest())
    file = state / "approvals.json"
    data = json.loads(file.read_text())
    if spoil == "chmod":
        file.chmod(0o666)
    elif spoil == "json":
        file.write_text("{nope")
    elif spoil == "entry":  # a record that is not one must not let its plugin load unwatched
        data["plugins"][approvals.key(folder)] = {"name": "srv"}
        file.write_text(json.dumps(data))
    else:  # a string where a list of paths belongs would approve every path holding its letters
        data["plugins"][approvals.key(folder)]["grants"]["write"] = "/"
        file.write_text(json.dumps(data))
    for plugin in (folder, tmp_path / "unrecorded"):
        held = approvals.check(manifest(), plugin, str(state))
        assert held is not None and held.startswith(approvals.HELD) and "cannot be trusted" in held, held
    assert os.stat(file).st_size > 0


# -- every manifest field, changed both ways after an approval ---------------------------------------------


def _leaves(info: Any, prefix: str) -> set[str]:
    """Every field path of a Struct type: ``table.field``, ``table.*.field`` under a dict of Structs."""
    if isinstance(info, msgspec.inspect.UnionType):
        structs = [t for t in info.types if isinstance(t, msgspec.inspect.StructType)]
        if structs:
            return _leaves(structs[0], prefix)
    if isinstance(info, msgspec.inspect.DictType) and isinstance(info.value_type, msgspec.inspect.StructType):
        return _leaves(info.value_type, prefix + "*.")
    if isinstance(info, msgspec.inspect.StructType):
        return set().union(*(_leaves(f.type, f"{prefix}{f.name}.") for f in info.fields))
    return {prefix.rstrip(".")}


def test_every_manifest_field_is_classified_by_the_approvals_table() -> None:
    fields = _leaves(msgspec.inspect.type_info(Manifest), "")
    assert "server.per_principal" in fields and "limits.max_parked" in fields and "tools.*.task_support" in fields
    assert fields - set(approvals.FIELDS) == set(), "classify these in runtime.approvals.FIELDS"
    assert set(approvals.FIELDS) - fields == set(), "FIELDS names fields a manifest does not have"


PLUGIN: dict[str, Any] = {"name": "srv", "version": "1.0.0", "entry": "m", "prefix": "srv_"}
SERVER: dict[str, Any] = {"name": "srv", "version": "1.0.0", "kind": "server", "prefix": "srv_",
                          "server": {"package": "npm:x@1.0.0"}}
LIMIT_DEFAULTS = msgspec.structs.asdict(Limits())

#: field -> (base, narrower, wider, what the reason says, whether going back is a widening too).
WIDENINGS: dict[str, tuple[dict[str, Any], dict[str, Any], dict[str, Any], str, bool]] = {
    "name": (SERVER, {}, {"name": "other"}, "name: 'srv' -> 'other'", True),
    "prefix": (SERVER, {"prefix": "srv_x_"}, {}, "prefix: 'srv_x_' -> 'srv_'", False),
    "permissions.read": (SERVER, {"permissions": {"read": ["/srv/a"]}}, {"permissions": {"read": ["/srv"]}},
                         "+ read /srv", False),
    "permissions.write": (SERVER, {"permissions": {"write": ["/srv/a"], "read": ["/srv"]}},
                          {"permissions": {"write": ["/srv"]}}, "+ write /srv", False),
    "permissions.network": (SERVER, {}, {"permissions": {"network": ["a.example:443"]}}, "+ network a.example:443",
                            False),
    "env.allow": (SERVER, {}, {"env": {"allow": ["TZ"]}}, "+ env TZ", False),
    "env.set": (SERVER, {}, {"env": {"set": {"TZ": "UTC"}}}, "+ env TZ", False),
    **{f"limits.{k}": (PLUGIN, {}, {"limits": {k: v * 2}}, f"limits.{k}: {v:g} -> {v * 2:g}", False)
       for k, v in LIMIT_DEFAULTS.items()},
    "kind": (PLUGIN, {}, SERVER, "runs: None -> 'npm:x@1.0.0'", True),
    "server.command": ({**SERVER, "server": {"command": ["/bin/x"]}}, {}, {"server": {"command": ["/bin/y"]}},
                       "runs: ['/bin/x'] -> ['/bin/y']", True),
    "server.package": (SERVER, {}, {"server": {"package": "npm:y@1.0.0"}}, "runs: 'npm:x@1.0.0' -> 'npm:y@1.0.0'",
                       True),
    "server.bin": (SERVER, {}, {"server": {"bin": "other"}}, "server.bin: '' -> 'other'", True),
    "server.args": (SERVER, {}, {"server": {"args": ["/"]}}, "server.args: [] -> ['/']", True),
    "server.instances": (SERVER, {}, {"server": {"instances": 4}}, "server.instances: 1 -> 4", False),
    "server.per_principal": (SERVER, {"server": {"per_principal": True}}, {},
                             "server.per_principal: true -> false (every principal shares one server's state)", True),
    "server.max_principals": (SERVER, {"server": {"per_principal": True, "max_principals": 8}},
                              {"server": {"per_principal": True, "max_principals": 32}},
                              "server.max_principals: 8 -> 32", False),
    "server.cancel_grace_s": (SERVER, {}, {"server": {"cancel_grace_s": 10.0}}, "server.cancel_grace_s: 2 -> 10",
                              False),
    "server.start_timeout_s": (SERVER, {}, {"server": {"start_timeout_s": 60.0}}, "server.start_timeout_s: 30 -> 60",
                               False),
    "isolation": (PLUGIN, {"isolation": "per_call"}, {}, "isolation: 'per_call' -> 'pooled'", False),
    "dependencies": (PLUGIN, {}, {"dependencies": ["six"]}, "+ dependency six", False),
    "allow_source_builds": (PLUGIN, {}, {"allow_source_builds": True}, "allow_source_builds: false -> true", False),
    "secrets.*.host": (SERVER, {"secrets": {"TOKEN": {"host": "a.example"}}}, {"secrets": {"TOKEN": {"host": "b.example"}}},
                       "secret TOKEN: sent to a.example -> b.example", True),
}
#: field -> (base, another value): changes an approval does not look at.
UNCOVERED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "version": (PLUGIN, {"version": "9.9.9"}),
    "entry": (PLUGIN, {"entry": "other"}),
    "description": (SERVER, {"description": "words"}),
    "tools.*.task_support": (PLUGIN, {"tools": {"t": {"task_support": "required"}}}),
    "tools.*.task_after_ms": (PLUGIN, {"tools": {"t": {"task_after_ms": 5}}}),
}


def _merged(base: dict[str, Any], change: dict[str, Any]) -> Manifest:
    if base is PLUGIN and change.get("kind") == "server":
        return msgspec.convert(change, Manifest)
    out = {**base}
    for k, v in change.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return msgspec.convert(out, Manifest)


def test_the_both_ways_cases_cover_the_table_exactly() -> None:
    assert {f for f, rule in approvals.FIELDS.items() if isinstance(rule, approvals.Covered)} == set(WIDENINGS)
    assert {f for f, rule in approvals.FIELDS.items() if isinstance(rule, approvals.NotCovered)} == set(UNCOVERED)


@pytest.mark.parametrize("field", sorted(WIDENINGS))
def test_a_widening_change_after_approval_is_held_naming_the_field_and_a_narrowing_one_loads(
        tmp_path: Path, field: str) -> None:
    base, narrow, wide, reason, back_widens = WIDENINGS[field]
    state, folder = tmp_path / "state", tmp_path / "p"
    narrower, wider = _merged(base, narrow), _merged(base, wide)
    approved(state, folder, narrower)
    assert approvals.check(narrower, folder, str(state)) is None
    held = approvals.check(wider, folder, str(state))
    assert held is not None and held.startswith(approvals.HELD) and reason in held, held
    assert f"toolcell approve {wider.name}" in held
    approved(state, folder, wider)
    back = approvals.check(narrower, folder, str(state))
    assert (back is not None) == back_widens, back


@pytest.mark.parametrize("field", sorted(UNCOVERED))
def test_a_change_to_a_field_that_reaches_nothing_loads_without_approval(tmp_path: Path, field: str) -> None:
    base, change = UNCOVERED[field]
    state, folder = tmp_path / "state", tmp_path / "p"
    approved(state, folder, _merged(base, {}))
    assert approvals.check(_merged(base, change), folder, str(state)) is None


def test_a_changed_fixed_value_is_held_and_never_recorded_in_plaintext(tmp_path: Path) -> None:
    state, folder = tmp_path / "state", tmp_path / "p"
    secret = "s3cr3t-value-never-on-disk"
    m = manifest(env={"set": {"API_KEY": secret, "LANG": "C.UTF-8"}})
    approved(state, folder, m)
    assert approvals.check(m, folder, str(state)) is None
    assert secret not in (state / "approvals.json").read_text()
    assert os.stat(state / approvals.KEY_FILE).st_mode & 0o777 == 0o600
    held = approvals.check(manifest(env={"set": {"API_KEY": "another", "LANG": "C.UTF-8"}}), folder, str(state))
    assert held is not None and "env API_KEY: a different fixed value" in held and "another" not in held, held
    assert "LANG" not in held
    # Fewer fixed values, or the same: nothing to approve.
    assert approvals.check(manifest(env={"set": {"API_KEY": secret}}), folder, str(state)) is None
    # Without its key, a recorded value cannot be compared: held, never waved through.
    (state / approvals.KEY_FILE).unlink()
    held = approvals.check(m, folder, str(state))
    assert held is not None and "approvals key" in held
    # A key others could read is not trusted.
    approved(state, folder, m)
    (state / approvals.KEY_FILE).chmod(0o644)
    held = approvals.check(m, folder, str(state))
    assert held is not None and "cannot be trusted" in held


def test_an_approval_recorded_before_values_and_isolation_were_compared_is_approved_once_more(tmp_path: Path) -> None:
    state, folder = tmp_path / "state", tmp_path / "p"
    server = manifest(env={"set": {"API_KEY": "dummy"}})
    pooled = _merged(PLUGIN, {})
    for m, gone, expected in ((server, "env_values", "env API_KEY: its fixed value (not recorded)"),
                              (pooled, "isolation", "isolation: (not recorded) -> 'pooled'")):
        approved(state, folder, m)
        data = json.loads((state / "approvals.json").read_text())
        del data["plugins"][approvals.key(folder)]["grants"][gone]
        (state / "approvals.json").write_text(json.dumps(data))
        held = approvals.check(m, folder, str(state))
        assert held is not None and expected in held and "older toolcell" in held and "toolcell approve srv" in held
        approved(state, folder, m)
        assert approvals.check(m, folder, str(state)) is None
    # An old record of a plugin that runs each call in a fresh process asks nothing: that is the narrowest.
    per_call = _merged(PLUGIN, {"isolation": "per_call"})
    approved(state, folder, per_call)
    data = json.loads((state / "approvals.json").read_text())
    del data["plugins"][approvals.key(folder)]["grants"]["isolation"]
    (state / "approvals.json").write_text(json.dumps(data))
    assert approvals.check(per_call, folder, str(state)) is None


def test_a_new_secret_binding_is_held_and_one_dropped_loads(tmp_path: Path) -> None:
    state, folder = tmp_path / "state", tmp_path / "p"
    one = _merged(SERVER, {"secrets": {"TOKEN": {"host": "a.example"}}})
    two = _merged(SERVER, {"secrets": {"TOKEN": {"host": "a.example"}, "OTHER": {"host": "a.example"}}})
    approved(state, folder, one)
    held = approvals.check(two, folder, str(state))
    assert held is not None and "+ secret OTHER sent to a.example" in held and "TOKEN" not in held, held
    assert approvals.check(_merged(SERVER, {}), folder, str(state)) is None
    assert "secrets:  TOKEN -> a.example" in "\n".join(approvals.describe(one))
    # Approved before secrets were recorded: a binding is approved once more.
    data = json.loads((state / "approvals.json").read_text())
    del data["plugins"][approvals.key(folder)]["grants"]["secrets"]
    (state / "approvals.json").write_text(json.dumps(data))
    held = approvals.check(one, folder, str(state))
    assert held is not None and "+ secret TOKEN sent to a.example" in held, held
