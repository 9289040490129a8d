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
