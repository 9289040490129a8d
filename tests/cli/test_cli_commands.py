"""``toolcell list``, ``toolcell call`` and ``toolcell check``, run as real commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hostile_files import SECRET, build

REPO = Path(__file__).resolve().parents[2]
CONFORMANCE = REPO / "plugins" / "conformance"

GOOD = '''
from sandbox import tool


@tool
def greet(name: str) -> str:
    """Say hello.

    Args:
        name: Who to greet.
    """
    return f"hello {name}"


@tool
def double(n: int) -> int:
    """Twice ``n``."""
    return 2 * n
'''

BROKEN_TOOLS = '''
from sandbox import tool


@tool(name="bad name!")
def bad_name() -> str:
    """A name with a space and a bang."""
    return "x"


@tool(input_schema={"type": "object", "properties": {"x": {"$ref": "https://example.com/schema.json"}}})
def remote_ref(x: str) -> str:
    """Its schema points at the network."""
    return x


@tool(input_schema={"type": "array"})
def not_an_object() -> str:
    """Its inputSchema root is not an object."""
    return "x"


@tool
def fine() -> str:
    """This one is fine."""
    return "fine"
'''


def toolcell(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], check=False, cwd=str(REPO), capture_output=True,
                          text=True, timeout=timeout)


# -- toolcell list --------------------------------------------------------------------------------------


def test_list_prints_a_table_of_tools_with_their_plugin_and_description(make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("greeter", GOOD, prefix="g_")
    out = toolcell("list", "--plugins", str(plugins), "--policy", "none")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["TOOL", "PLUGIN", "DESCRIPTION"]
    assert set(lines[1]) <= {"-", " "}
    rows = {line.split()[0]: line.split() for line in lines[2:] if line.strip() and line.startswith("g_")}
    assert set(rows) == {"g_double", "g_greet"}
    assert rows["g_greet"][1] == "greeter"
    assert "Say hello." in " ".join(rows["g_greet"][2:])
    assert [line.split()[0] for line in lines[2:4]] == ["g_double", "g_greet"]  # sorted by name


def test_list_shows_the_bundled_conformance_tools_under_the_default_policy() -> None:
    out = toolcell("list", "--plugins", str(CONFORMANCE))
    assert out.returncode == 0, out.stderr
    names = {line.split()[0] for line in out.stdout.splitlines()[2:] if line.strip()}
    assert {"test_simple_text", "test_tool_with_progress", "json_schema_2020_12_tool"} <= names


def test_list_json_gives_machine_readable_output(make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("greeter", GOOD)
    out = toolcell("list", "--json", "--plugins", str(plugins), "--policy", "none")
    assert out.returncode == 0, out.stderr
    listing = json.loads(out.stdout)
    tools = listing["tools"]
    assert [t["name"] for t in tools] == ["double", "greet"]
    assert all(t["plugin"] == "greeter" for t in tools)
    assert [(p["name"], p["status"]) for p in listing["plugins"]] == [("greeter", "ok")]


def test_list_json_includes_refused_plugins_with_their_problems(make_plugin: Callable[..., Path]) -> None:
    make_plugin("greeter", GOOD)
    plugins = make_plugin("badtools", BROKEN_TOOLS)
    out = toolcell("list", "--json", "--plugins", str(plugins), "--policy", "none")
    assert out.returncode == 1
    by_name = {p["name"]: p for p in json.loads(out.stdout)["plugins"]}
    assert by_name["greeter"]["status"] == "ok"
    assert by_name["badtools"]["status"] == "refused" and by_name["badtools"]["problems"]


def test_list_and_check_of_hostile_plugin_files_answer_with_every_refusal_and_quote_nothing_foreign(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    """A FIFO named plugin.toml or requirements.lock used to hang ``toolcell list`` and ``check``; a
    lock linked to a secret was read and its first line printed. Every kind of hostile file of
    ``tests/hostile_files.py``: each plugin refused with its reason, nothing of the secret shown."""
    plugins = make_plugin("greeter", GOOD)
    expected = build(plugins, tmp_path / "secret.txt")
    out = toolcell("list", "--json", "--plugins", str(plugins), "--policy", "none", timeout=120)
    assert SECRET not in out.stdout + out.stderr
    by_name = {p["name"]: p for p in json.loads(out.stdout)["plugins"]}
    assert by_name["greeter"]["status"] == "ok"
    for name, says in expected.items():
        assert by_name[name]["status"] == "refused"
        assert says is None or says in " ".join(by_name[name]["problems"]), by_name[name]
    for name in ("manifest-fifo", "pylock-fifo", "pylock-link-out"):
        checked = toolcell("check", str(plugins / name), "--policy", "none", timeout=60)
        assert checked.returncode != 0 and SECRET not in checked.stdout + checked.stderr
        assert expected[name] in checked.stdout + checked.stderr


@pytest.mark.parametrize("command", [["list"], ["call", "echo"], ["serve", "--stdio", "--no-watch"]])
def test_a_plugins_folder_that_does_not_exist_is_an_error(command: list[str], tmp_path: Path) -> None:
    out = toolcell(*command, "--plugins", str(tmp_path / "typo"), "--policy", "none")
    assert out.returncode == 2
    assert "does not exist" in out.stderr and "typo" in out.stderr


def test_check_and_reload_offer_only_flags_that_apply() -> None:
    assert "--plugins" not in toolcell("check", "--help").stdout
    reload_help = toolcell("reload", "--help").stdout
    # reload takes --plugins (which daemons it means), never a policy
    assert "--policy" not in reload_help and "--pid" in reload_help and "--all" in reload_help
    doctor_help = toolcell("doctor", "--help").stdout
    assert "rest" not in doctor_help and "--json" in doctor_help


def test_list_exits_1_and_explains_when_a_plugin_is_refused(make_plugin: Callable[..., Path]) -> None:
    make_plugin("greeter", GOOD)
    plugins = make_plugin("badtools", BROKEN_TOOLS)
    out = toolcell("list", "--plugins", str(plugins), "--policy", "none")
    assert out.returncode == 1
    names = {line.split()[0] for line in out.stdout.splitlines()[2:] if line.strip()}
    assert {"greet", "double"} <= names and "fine" not in names  # a refused plugin serves nothing
    assert "refused" in out.stdout
    assert "badtools" in out.stderr and "remote $ref" in out.stderr


HUGE_DEFINITION = '''
from sandbox import tool


@tool(description="x" * 100_000)
def huge() -> str:
    return "hi"
'''


def test_a_plugin_whose_definitions_exceed_its_output_cap_is_refused_and_the_others_keep_serving(
        make_plugin: Callable[..., Path]) -> None:
    make_plugin("greeter", GOOD)
    plugins = make_plugin("oversized", HUGE_DEFINITION, limits={"max_output_bytes": 1024})
    out = toolcell("list", "--plugins", str(plugins), "--policy", "none")
    assert out.returncode == 1, out.stderr[-2000:]
    names = {line.split()[0] for line in out.stdout.splitlines()[2:] if line.strip()}
    assert {"greet", "double"} <= names and "huge" not in names
    assert "oversized" in out.stderr and "description longer than" in out.stderr
    assert "Traceback" not in out.stderr


# -- toolcell call ----------------------------------------------------------------------------------------


def test_call_runs_one_tool_in_a_worker_and_prints_the_result(make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("greeter", GOOD)
    out = toolcell("call", "greet", '{"name": "world"}', "--plugins", str(plugins), "--policy", "none")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["content"] == [{"type": "text", "text": "hello world"}]
    assert "isError" not in result


def test_call_prints_structured_content_for_structured_tools(make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("greeter", GOOD)
    out = toolcell("call", "double", '{"n": 21}', "--plugins", str(plugins), "--policy", "none")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["structuredContent"] == {"result": 42}


def test_call_exits_1_for_an_error_result_and_2_for_an_unknown_tool() -> None:
    failing = toolcell("call", "test_error_handling", "{}", "--plugins", str(CONFORMANCE), "--policy", "none")
    assert failing.returncode == 1
    assert json.loads(failing.stdout)["isError"] is True
    unknown = toolcell("call", "no_such_tool", "{}", "--plugins", str(CONFORMANCE), "--policy", "none")
    assert unknown.returncode == 2
    assert json.loads(unknown.stdout)["code"] == -32602


def test_an_unknown_tool_gets_the_names_it_may_have_meant_and_no_other_error_line() -> None:
    for _ in range(3):  # the spurious store error came at exit, most times but not every time
        out = toolcell("call", "test_simple_txt", "{}", "--plugins", str(CONFORMANCE), "--policy", "none")
        assert out.returncode == 2
        assert "did you mean: test_simple_text" in out.stderr
        assert '"level":"error"' not in out.stderr, out.stderr


def test_calling_a_tool_of_a_held_plugin_says_it_is_held_and_how_to_approve_it(
        make_plugin: Callable[..., Path], tmp_path: Path) -> None:
    plugins = make_plugin("greeter", GOOD, prefix="g_")
    config = tmp_path / "toolcell.toml"
    state = tmp_path / "state"
    config.write_text(f'state_dir = "{state}"\n')
    common = ["--plugins", str(plugins), "--config", str(config), "--policy", "none"]
    approved = toolcell("approve", "greeter", "--yes", *common)
    assert approved.returncode == 0, approved.stderr
    manifest = plugins / "greeter" / "plugin.toml"
    manifest.write_text(manifest.read_text() + '\n[permissions]\nread = ["/etc"]\n')  # asks for more now
    out = toolcell("call", "g_greet", '{"name": "x"}', *common)
    assert out.returncode == 2
    assert "plugin 'greeter' (its tools begin with 'g_') is held until approved" in out.stderr
    assert "read" in out.stderr and f"toolcell approve greeter --plugins {plugins} --config {config}" in out.stderr
    # the command it suggests, run as shown, is what lets the call through (it named no --config, so it
    # approved in the default state dir and the plugin stayed held)
    suggested = out.stderr.split("approve it with: toolcell ", 1)[1].splitlines()[0].split()
    again = toolcell(*suggested, "--yes", "--policy", "none")
    assert again.returncode == 0, again.stderr
    assert toolcell("call", "g_greet", '{"name": "x"}', *common).returncode == 0


def test_a_call_is_no_replica_two_calls_with_other_plugins_warn_of_no_differing_catalog(tmp_path: Path) -> None:
    """`toolcell call` shares the config's task store, but a one-shot call is not a daemon serving it:
    it published its catalog, and the next call with other plugins (within orphan_after_s) warned
    `catalog_differs` naming the first, long gone."""
    config = tmp_path / "toolcell.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    first = toolcell("call", "math_evaluate", '{"expression": "1+1"}', "--plugins", str(REPO / "plugins" / "mathkit"),
                     "--config", str(config), "--policy", "none")
    assert first.returncode == 0, first.stderr
    second = toolcell("call", "test_simple_text", "{}", "--plugins", str(CONFORMANCE), "--config", str(config),
                      "--policy", "none")
    assert second.returncode == 0, second.stderr
    assert "catalog_differs" not in second.stderr, second.stderr


def test_call_reports_invalid_arguments_naming_the_field(make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("greeter", GOOD)
    out = toolcell("call", "greet", '{"name": 7}', "--plugins", str(plugins), "--policy", "none")
    assert out.returncode == 1
    result = json.loads(out.stdout)
    assert result["isError"] is True and "name" in result["content"][0]["text"]


def test_call_refuses_arguments_that_are_not_json() -> None:
    out = toolcell("call", "test_simple_text", "{nope", "--plugins", str(CONFORMANCE), "--policy", "none")
    assert out.returncode == 2
    assert "not valid JSON" in out.stderr


# -- toolcell check ---------------------------------------------------------------------------------------


def test_check_accepts_a_good_plugin(make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("greeter", GOOD)
    out = toolcell("check", str(plugins / "greeter"), "--policy", "none")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "greeter" in out.stdout and "ok" in out.stdout
    assert "greet" in out.stdout and "double" in out.stdout


def test_check_reports_every_manifest_problem_at_once(make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("broken", GOOD, manifest={"name": "Broken Name!", "prefix": "has space "},
                          limits={"timeout_s": 0, "max_concurrency": 0}, folder="broken")
    out = toolcell("check", str(plugins / "broken"), "--policy", "none")
    assert out.returncode == 1
    report = out.stdout
    for fragment in ("name", "prefix", "timeout_s", "max_concurrency"):
        assert fragment in report, report
    assert "4 problem(s)" in report


def test_check_reports_an_unknown_manifest_field(make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("typo", GOOD, manifest={"entyr": "typo"})
    out = toolcell("check", str(plugins / "typo"), "--policy", "none")
    assert out.returncode == 1
    assert "entyr" in out.stdout


def test_check_reports_every_broken_tool_definition_at_once(make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("badtools", BROKEN_TOOLS)
    out = toolcell("check", str(plugins / "badtools"), "--policy", "none")
    assert out.returncode == 1
    report = out.stdout
    assert "3 problem(s)" in report, report
    assert "bad name!" in report and "1-64 characters" in report
    assert "remote $ref" in report and "https://example.com/schema.json" in report
    assert "not_an_object" in report and "object" in report


def test_check_of_a_folder_reports_every_plugin(make_plugin: Callable[..., Path]) -> None:
    make_plugin("greeter", GOOD)
    make_plugin("badtools", BROKEN_TOOLS)
    plugins = make_plugin("broken", GOOD, limits={"timeout_s": -1})
    out = toolcell("check", str(plugins), "--policy", "none")
    assert out.returncode == 1
    assert "greeter" in out.stdout and "ok" in out.stdout
    assert "badtools: 3 problem(s)" in out.stdout
    assert "timeout_s" in out.stdout


def test_check_of_a_folder_without_plugins_says_so(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    out = toolcell("check", str(tmp_path / "empty"), "--policy", "none")
    assert out.returncode == 1
    assert "no plugin found" in out.stdout


# -- name conflicts ---------------------------------------------------------------------------------------

ALPHA = '''
from sandbox import tool


@tool
def shared() -> str:
    """Provided by two plugins."""
    return "from alpha"
'''

ZETA = ALPHA.replace("from alpha", "from zeta")


@pytest.fixture
def conflicting(make_plugin: Callable[..., Path]) -> Path:
    # Folder names sort the other way round from plugin names: the plugin name decides.
    make_plugin("zeta", ZETA, folder="1-zeta")
    return make_plugin("alpha", ALPHA, folder="2-alpha")


def test_a_tool_name_claimed_by_two_plugins_goes_to_the_one_that_sorts_first(conflicting: Path) -> None:
    outputs = [toolcell("list", "--plugins", str(conflicting), "--policy", "none") for _ in range(2)]
    for out in outputs:
        assert out.returncode == 0, out.stderr
        rows = [line.split() for line in out.stdout.splitlines()[2:] if line.startswith("shared")]
        assert rows == [["shared", "alpha", "Provided", "by", "two", "plugins."]]
        assert "conflict" in out.stdout  # the loser's status line
        assert "shared" in out.stderr and "alpha" in out.stderr and "zeta" in out.stderr
    assert outputs[0].stdout == outputs[1].stdout  # deterministic


def test_the_conflict_winner_is_the_one_that_answers_calls(conflicting: Path) -> None:
    out = toolcell("call", "shared", "{}", "--plugins", str(conflicting), "--policy", "none")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["content"][0]["text"] == "from alpha"


def test_an_address_in_use_is_reported_with_the_address_before_any_worker_starts(tmp_path: Path) -> None:
    import socket

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        out = toolcell("serve", "--http", f"127.0.0.1:{port}", "--policy", "none", "--no-watch")
    finally:
        taken.close()
    assert out.returncode == 1
    assert f"127.0.0.1:{port}" in out.stderr and "in use" in out.stderr
    assert "Stop it, or serve on another address, e.g. toolcell serve --http 127.0.0.1:" in out.stderr, out.stderr
    assert "plugin_loaded" not in out.stderr  # refused before loading anything


def test_each_daemon_has_its_own_pidfile_and_reload_reaches_only_this_configurations(tmp_path: Path) -> None:
    """Two daemons share a state dir with other plugin sets (a test suite's, another project's):
    ``toolcell reload`` reaches only the daemons of its own configuration (its config file, narrowed by
    the plugin folders it names), names them, counts the others; ``--all`` reaches every one, ``--pid``
    exactly one. (A bare ``toolcell reload`` is never run here: it would mean the daemons of the default
    state dir serving the bundled plugins, which are not this test's.)"""
    import os
    import time

    state = tmp_path / "state"
    config = tmp_path / "toolcell.toml"
    config.write_text(f'state_dir = "{state}"\n')
    folders = [str(REPO / "plugins" / "conformance"), str(REPO / "plugins" / "mathkit")]

    def serve(folder: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--stdio", "--config", str(config),
                                 "--policy", "none", "--no-watch", "--plugins", folder],
                                cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    daemons = [serve(folder) for folder in folders]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(list(state.glob("toolcell-*.pid"))) < 2:
            time.sleep(0.1)
        assert sorted(p.name for p in state.glob("toolcell-*.pid")) == sorted(f"toolcell-{d.pid}.pid" for d in daemons)
        mine = toolcell("reload", "--config", str(config), "--plugins", folders[0])
        assert mine.returncode == 0, mine.stderr
        assert f"daemon {daemons[0].pid}" in mine.stdout and f"daemon {daemons[1].pid}" not in mine.stdout
        assert "left 1 daemon(s) of other configurations alone" in mine.stdout
        unserved = str(REPO / "plugins" / "textkit")
        nobody = toolcell("reload", "--config", str(config), "--plugins", unserved)  # no daemon serves these
        assert nobody.returncode == 1
        assert "no running daemon of this configuration" in nobody.stderr and str(daemons[1].pid) in nobody.stderr
        named = toolcell("reload", "--config", str(config))  # a config file names its daemons, whatever --plugins
        assert named.returncode == 0 and all(f"daemon {d.pid}" in named.stdout for d in daemons), named.stdout
        everyone = toolcell("reload", "--config", str(config), "--all")
        assert everyone.returncode == 0, everyone.stderr
        assert all(f"daemon {d.pid}" in everyone.stdout for d in daemons), everyone.stdout
        import socket

        with socket.socket() as taken:  # an address in use names the daemons of this state dir: these two
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            busy = toolcell("serve", "--http", f"127.0.0.1:{taken.getsockname()[1]}", "--config", str(config),
                            "--policy", "none", "--no-watch")
        assert busy.returncode == 1
        assert f"toolcell daemons of the state dir {state}: " in busy.stderr, busy.stderr
        assert all(f"pid {d.pid} (" in busy.stderr for d in daemons), busy.stderr
        one = toolcell("reload", "--config", str(config), "--pid", str(daemons[1].pid))
        assert f"daemon {daemons[1].pid}" in one.stdout and f"daemon {daemons[0].pid}" not in one.stdout
        first = daemons[0]
        assert first.stdin is not None
        first.stdin.close()
        first.wait(30)
        assert not (state / f"toolcell-{first.pid}.pid").exists()
        assert (state / f"toolcell-{daemons[1].pid}.pid").exists()
    finally:
        for d in daemons:
            if d.poll() is None:
                os.kill(d.pid, 9)
                d.wait(10)
            if d.stdin is not None:
                d.stdin.close()


def test_a_non_editable_install_serves_the_bundled_plugins(tmp_path: Path) -> None:
    """`pip install .` (a wheel) ships the bundled plugins inside the package: run from outside the
    checkout, with only the installed copy importable, `toolcell list` finds their tools."""
    wheels = tmp_path / "wheels"
    target = tmp_path / "site"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                            str(wheels), str(REPO)], capture_output=True, text=True, timeout=300, check=False)
    assert build.returncode == 0, build.stderr[-2000:]
    [wheel] = list(wheels.glob("toolcell-*.whl"))
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                              str(wheel)], capture_output=True, text=True, timeout=300, check=False)
    assert install.returncode == 0, install.stderr[-2000:]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    out = subprocess.run([sys.executable, "-c", "import runtime, sys; from runtime.cli import main; "
                          "assert runtime.__file__.startswith(sys.argv[1]), runtime.__file__; "
                          "sys.argv = ['toolcell', 'list', '--json', '--policy', 'none']; sys.exit(main())",
                          str(target)], cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    listing = json.loads(out.stdout)
    assert {"test_simple_text", "json_schema_2020_12_tool"} <= {t["name"] for t in listing["tools"]}
    assert all(p["path"].startswith(str(target)) for p in listing["plugins"])


def test_scratch_folders_of_daemons_that_are_gone_are_swept_at_start(tmp_path: Path) -> None:
    state = tmp_path / "state"
    dead = state / "999999999~greeter-abc123"   # no such pid
    alive = state / f"{os.getpid()}~greeter-def456"  # a live process: left alone
    for folder in (dead, alive):
        folder.mkdir(parents=True)
        (folder / "leftover").write_text("x")
    config = tmp_path / "toolcell.toml"
    config.write_text(f'state_dir = "{state}"\n')
    out = toolcell("list", "--config", str(config), "--policy", "none", "--plugins", str(REPO / "plugins" / "conformance"))
    assert out.returncode == 0, out.stderr
    assert not dead.exists() and alive.exists()


def test_a_state_dir_someone_else_could_have_planted_is_refused(tmp_path: Path) -> None:
    """The state dir holds approvals, installed environments, pidfiles and the request-state key; the
    default lives under /tmp, where another local user could make it first. One writable by others,
    owned by someone else, or a symlink is refused with the reason, before anything in it is used."""
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "toolcell.toml"
    config.write_text(f'state_dir = "{state}"\n')
    args = ("list", "--config", str(config), "--policy", "none", "--plugins", str(REPO / "plugins" / "conformance"))
    state.chmod(0o777)
    out = toolcell(*args)
    assert out.returncode == 2 and "writable by others" in out.stderr, out.stderr
    state.chmod(0o711)
    os.chown(state, 65534, 65534)
    out = toolcell(*args)
    assert out.returncode == 2 and "belongs to uid 65534" in out.stderr, out.stderr
    state.rmdir()
    (tmp_path / "elsewhere").mkdir()
    state.symlink_to(tmp_path / "elsewhere")
    out = toolcell(*args)
    assert out.returncode == 2 and "not a directory" in out.stderr, out.stderr
    state.unlink()
    assert toolcell(*args).returncode == 0  # made afresh, private


def test_what_a_plugin_prints_reaches_the_log_line_by_line_while_its_worker_lives(tmp_path: Path) -> None:
    import time

    folder = tmp_path / "plugins" / "chatty"
    folder.mkdir(parents=True)
    for p in (tmp_path, tmp_path / "plugins", folder):
        p.chmod(0o755)
    (folder / "plugin.toml").write_text('name = "chatty"\nversion = "1"\nentry = "chatty"\n')
    (folder / "chatty.py").write_text(
        "import time\nfrom sandbox import tool\n\n@tool\ndef talk() -> str:\n"
        "    \"\"\"Print a line without flushing, then keep the worker busy.\"\"\"\n"
        "    print('hello from the plugin')\n    time.sleep(30)\n    return 'done'\n")
    stderr_path = tmp_path / "err.log"
    with open(stderr_path, "w") as stderr:  # the child has its own copy
        proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--stdio", "--policy", "none",
                                 "--no-watch", "--plugins", str(tmp_path / "plugins")], cwd=REPO,
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        assert proc.stdin is not None
        for message in ({"jsonrpc": "2.0", "id": 0, "method": "initialize",
                         "params": {"protocolVersion": "2025-11-25", "capabilities": {}}},
                        {"jsonrpc": "2.0", "method": "notifications/initialized"},
                        {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "talk", "arguments": {}}}):
            proc.stdin.write((json.dumps(message) + "\n").encode())
        proc.stdin.flush()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "hello from the plugin" not in stderr_path.read_text():
            time.sleep(0.1)
        assert "hello from the plugin" in stderr_path.read_text(), "the print stayed in the plugin's buffer"
    finally:
        proc.kill()
        proc.wait(10)
        if proc.stdin is not None:
            proc.stdin.close()


def test_reload_never_signals_a_pid_its_pidfile_cannot_vouch_for(tmp_path: Path) -> None:
    """``toolcell reload`` signals the pids of pidfiles (SIGHUP, whose default action ends a process): a
    pidfile another user could have written, one naming -1 or 0 (every process of the user, the process
    group), or one whose daemon died and whose pid a later process now has, must reach nobody."""
    import os
    import time

    from runtime.reload import running_daemons

    state = tmp_path / "state"
    state.mkdir(mode=0o711)
    # A process that looks like a daemon (``serve`` in its command line), started before its pidfile.
    daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "serve"])
    later: subprocess.Popen[bytes] | None = None
    try:
        time.sleep(0.05)
        pidfile = state / f"toolcell-{daemon.pid}.pid"
        pidfile.write_text(f"{daemon.pid}\nstdio\n")
        pidfile.chmod(0o600)
        assert [d.pid for d in running_daemons(str(state))] == [daemon.pid]
        pidfile.chmod(0o666)  # anyone could have put another pid there
        assert running_daemons(str(state)) == []
        pidfile.unlink()
        for pid in (-1, 0):
            planted = state / f"toolcell-{pid}.pid"
            planted.write_text(f"{pid}\n\n")
            planted.chmod(0o600)
        assert running_daemons(str(state)) == []
        # The daemon that wrote this pidfile an hour ago is gone; a later process has its pid.
        later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "serve"])
        reused = state / f"toolcell-{later.pid}.pid"
        reused.write_text(f"{later.pid}\n\n")
        reused.chmod(0o600)
        os.utime(reused, (time.time() - 3600, time.time() - 3600))
        assert running_daemons(str(state)) == []
        assert later.poll() is None
    finally:
        for proc in (daemon, later):
            if proc is not None:
                proc.kill()
                proc.wait(10)
