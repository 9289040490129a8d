"""``toolcell check`` and every command reading a config report every manifest and config problem
in one run, each as ``file:line:column: problem`` with what to do about it."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.toml_positions import key_positions

REPO = Path(__file__).resolve().parents[2]

MANIFEST = '''name = "Broken Name!"
version = "1.0"
entyr = "broken"
entry = "broken"

[limits]
timeout_s = 0
memory_mb = "lots"

[permissions]
read = ["/usr/share", 3]
'''


def toolcell(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], check=False, cwd=str(REPO), capture_output=True,
                          text=True, timeout=120)


def test_check_reports_four_kinds_of_mistake_in_one_run_each_with_file_line_and_column(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "plugin.toml").write_text(MANIFEST)
    (folder / "broken.py").write_text("")
    out = toolcell("check", str(folder), "--policy", "none")
    assert out.returncode == 1
    manifest = folder / "plugin.toml"
    for expected in (
        f"{manifest}:1:1: name 'Broken Name!': use 1-64 chars of lowercase letters",  # a semantic check
        f"{manifest}:3:1: entyr: unknown key (did you mean 'entry'?)",  # msgspec stops at this one alone
        f"{manifest}:7:1: limits.timeout_s = 0: must be between",  # a declared bound
        f"{manifest}:8:1: limits.memory_mb = 'lots': must be an integer, not a string",  # a type
        f"{manifest}:11:23: permissions.read[1] = 3: must be a string, not an integer",  # an item of a list
    ):
        assert expected in out.stdout, out.stdout
    assert "5 problem(s)" in out.stdout


def test_a_config_file_with_several_mistakes_is_reported_whole(tmp_path: Path) -> None:
    config = tmp_path / "toolcell.toml"
    config.write_text('page_size = 0\npolicy = "strct"\n\n[http]\nlisten = 5\nlisen = "x"\n\n[tasks]\nheartbeat_s = "x"\n')
    out = toolcell("list", "--config", str(config))
    assert out.returncode == 2
    for expected in (f"{config}:1:1: page_size = 0: must be between 1 and 10000",
                     f"{config}:2:1: policy 'strct': use compat, none or strict",
                     f"{config}:5:1: http.listen = 5: must be a string, not an integer",
                     f"{config}:6:1: http.lisen: unknown key (did you mean 'listen'?)",
                     f"{config}:9:1: tasks.heartbeat_s = 'x': must be a number, not a string"):
        assert expected in out.stderr, out.stderr
    assert "5 problems" in out.stderr


def test_positions_of_keys_tables_inline_tables_arrays_and_arrays_of_tables() -> None:
    source = ('name = "x"  # a comment\ntext = """a\nb = 1\n"""\nenv.set = { LANG = "C", B = { c = 1 } }\n'
              '[permissions]\nread = [\n  "/a",  # one\n  3,\n]\n[[http.tokens]]\nprincipal = "a"\n'
              '[[http.tokens]]\nprincipal = "b"\n[tools."a b"]\ntask_support = 1\n')
    tomllib.loads(source)
    found = key_positions(source)
    assert found[("name",)] == (1, 1) and found[("text",)] == (2, 1) and ("b",) not in found
    assert found[("env", "set", "LANG")] == (5, 13) and found[("env", "set", "B", "c")] == (5, 31)
    assert found[("permissions", "read", 1)] == (9, 3)
    assert found[("http", "tokens", 1, "principal")] == (14, 1)
    assert found[("tools", "a b", "task_support")] == (16, 1)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_the_position_finder_never_fails_on_any_text(source: str) -> None:
    found = key_positions(source)  # hostile or not TOML at all: some positions or none, never an error
    assert all(line >= 1 and column >= 1 for line, column in found.values())


@pytest.mark.parametrize("source, why", [
    ("x = 1" + "0" * 5000 + "\n", "not valid TOML"),  # int() refuses more than 4,300 digits: ValueError
    ("x = " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),  # tomllib recurses: RecursionError
])
def test_a_pathological_config_is_a_config_error_never_a_traceback(tmp_path: Path, source: str, why: str) -> None:
    from runtime.config import ConfigError, load_config

    path = tmp_path / "toolcell.toml"
    path.write_text(source)
    with pytest.raises(ConfigError, match=why):
        load_config(str(path), {})
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(source)
    path.write_text(f'[http]\ntokens_file = "{tokens}"\n')
    with pytest.raises(ConfigError, match=why):
        load_config(str(path), {})


OAUTH = '[http.oauth]\nissuer = "https://id.example.com"\nresource = "https://x.example.com/mcp"\n'


@pytest.mark.parametrize("source, expected", [
    # a bound broken inside an inline table: the key is there, only its value is wrong
    (OAUTH + "new_tokens_per_address = { per_s = -1 }\n",
     ["4:28: http.oauth.new_tokens_per_address.per_s = -1: must be > 0"]),
    # a wrong type inside an inline table
    (OAUTH + 'new_tokens_per_address = { per_s = "x" }\n',
     ["4:28: http.oauth.new_tokens_per_address.per_s = 'x': must be a number, not a string"]),
    # a bound broken in a nested [table]
    ("[http.principal_rate]\nper_s = 0\n", ["2:1: http.principal_rate.per_s = 0: must be > 0"]),
    # ... in a table of tables (a dict entry)
    ('[http]\ntool_rates = { "a" = { per_s = 0, burst = 2 } }\n',
     ["2:24: http.tool_rates.a.per_s = 0: must be > 0"]),
    # ... in an array of tables
    ('[[http.tokens]]\nprincipal = 3\nsha256 = "' + "a" * 64 + '"\n',
     ["2:1: http.tokens[0].principal = 3: must be a string, not an integer"]),
    # a required key of a table really is missing: said once, at its table
    ('[[http.tokens]]\nprincipal = "a"\n', ["1:1: missing required key 'http.tokens[0].sha256'"]),
    # a value left out for its problem is not then judged against another key by its default
    ("[tasks]\ndefault_ttl_ms = 5\nmax_ttl_ms = 2000\n", ["2:1: tasks.default_ttl_ms = 5: must be between 1000"]),
])
def test_a_wrong_value_in_a_nested_table_is_reported_once_and_never_as_a_missing_key(
        tmp_path: Path, source: str, expected: list[str]) -> None:
    from runtime.config import ConfigError, load_config

    path = tmp_path / "toolcell.toml"
    path.write_text(source)
    with pytest.raises(ConfigError) as raised:
        load_config(str(path), {})
    lines = [line.strip() for line in str(raised.value).splitlines() if not line.endswith("problems:")]
    assert len(lines) == len(expected), lines
    for line, want in zip(lines, expected, strict=True):
        assert line.startswith(f"{path}:{want}"), lines
