"""A config file that is hostile or simply wrong never hangs the daemon, never crashes it with a
traceback: it exits 2 with one line per problem, each ``file:line:column: problem`` where the
problem has a place (``runtime.config.load_config``, ``read_toml``).

The table runs every case through ``load_config``; a few run through the real ``toolcell serve``
in a subprocess under a timeout (a FIFO named as the config must be refused, not opened)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from runtime.config import MAX_CONFIG_BYTES, Config, ConfigError, load_config

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "benchmarks" / "plugins"

Make = Callable[[Path], None]


def text(source: str) -> Make:
    return lambda path: path.write_text(source, encoding="utf-8")


def raw_bytes(data: bytes) -> Make:
    return lambda path: path.write_bytes(data)


def fifo(path: Path) -> None:
    os.mkfifo(path)


def directory(path: Path) -> None:
    path.mkdir()


def huge_file(path: Path) -> None:
    with path.open("w") as f:  # comments only: valid TOML, just too much of it
        f.truncate(0)
        f.write(("#" * 1023 + "\n") * (MAX_CONFIG_BYTES // 1024 + 1))


def link_to_fifo(path: Path) -> None:
    os.mkfifo(path.with_name("elsewhere"))
    path.symlink_to("elsewhere")


def tokens_file_is_a_fifo(path: Path) -> None:
    os.mkfifo(path.with_name("tokens.toml"))
    path.write_text(f'[http]\ntokens_file = "{path.with_name("tokens.toml")}"\n')


def names_a_fifo(template: str, link: bool = False) -> Make:
    """A config whose ``template`` names ``{fifo}``: a FIFO beside it (the daemon would block reading it);
    ``link``: and ``{fifo}.link``, a symbolic link to it."""
    def make(path: Path) -> None:
        os.mkfifo(path.with_name("named.fifo"))
        if link:
            path.with_name("named.fifo.link").symlink_to("named.fifo")
        path.write_text(template.format(fifo=path.with_name("named.fifo")))
    return make


OAUTH = '[http.oauth]\nissuer = "https://id.example.com"\nresource = "https://x.example.com/mcp"\n'

#: (case, how the file is made, what the message says, its line:column -- None where there is no place)
CASES: list[tuple[str, Make, str, str | None]] = [
    # nesting
    ("inline tables thousands deep", text("x = " + "{a=" * 3000 + "1" + "}" * 3000 + "\n"),
     "not valid TOML: nested too deeply", None),
    ("arrays thousands deep", text("plugins = " + "[" * 3000 + "]" * 3000 + "\n"), "not valid TOML: nested too deeply",
     None),
    ("arrays as deep as TOML allows, where strings go", text("plugins = " + "[" * 200 + "]" * 200 + "\n"),
     r"plugins\[0\] = \[\[\[.*: must be a string, not a list", "1:12"),
    ("inline tables as deep as TOML allows, in a table of tables",
     text("[http]\ntool_rates = { a = { per_s = 1, b = " + "{a=" * 150 + "1" + "}" * 150 + " } }\n"),
     r"http\.tool_rates\.a\.b: unknown key \(known keys: per_s, burst\)", "2:33"),
    # numbers
    ("an integer beyond 64 bits in a field with no upper bound", text("list_ttl_ms = " + "9" * 40 + "\n"),
     "list_ttl_ms = 9999.*: must be at most 9223372036854775807", "1:1"),
    ("an integer of 4,000 digits", text("list_ttl_ms = " + "9" * 4000 + "\n"), r"list_ttl_ms = 9+\.\.\.: must be at most",
     "1:1"),
    ("an integer of 5,000 digits (more than Python converts)", text("list_ttl_ms = " + "9" * 5000 + "\n"),
     "not valid TOML: Exceeds the limit", None),
    ("a negative integer beyond 64 bits", text("[tasks]\nmax_live_per_principal = -" + "9" * 30 + "\n"),
     "tasks.max_live_per_principal = -9+: must be between 1 and 1000000", "2:1"),
    ("an integer too large for a float, where a number goes", text("[http]\nhead_timeout_s = " + "9" * 400 + "\n"),
     "http.head_timeout_s = 9+...: must be a finite number", "2:1"),
    ("inf where a number goes", text("[http]\nhead_timeout_s = inf\n"),
     r"http\.head_timeout_s = inf: must be a finite number \(not inf or nan\)", "2:1"),
    ("-inf where a number goes", text("[http]\nshutdown_grace_s = -inf\n"), "http.shutdown_grace_s = -inf: must be >= 0",
     "2:1"),
    ("nan where a number goes", text("[http]\nidle_timeout_s = nan\n"), "http.idle_timeout_s = nan: must be a finite",
     "2:1"),
    ("nan in a bounded field", text("[tasks]\nheartbeat_s = nan\n"), "tasks.heartbeat_s = nan: must be a finite",
     "2:1"),
    ("nan in an inline table", text(OAUTH + "rate = { per_s = nan }\n"), "http.oauth.rate.per_s = nan: must be a finite",
     "4:10"),
    ("inf where an integer goes", text("page_size = inf\n"), "page_size = inf: must be between 1 and 10000", "1:1"),
    ("a float where an integer goes", text("min_workers = 1.5\n"), "min_workers = 1.5: must be an integer, not a number",
     "1:1"),
    # kinds
    ("a string where a table goes", text('http = "x"\n'), "http: must be a table, not a string", "1:1"),
    ("a list where a table goes", text("tasks = [1, 2]\n"), "tasks: must be a table, not a list", "1:1"),
    ("a string where an inline table goes", text(OAUTH + 'new_tokens_rate = "fast"\n'),
     "http.oauth.new_tokens_rate: must be a table, not a string", "4:1"),
    ("a table where a string goes", text("instructions = { a = 1 }\n"),
     r"instructions = \{'a': 1\}: must be a string, not a table", "1:1"),
    ("a table where a list goes", text("plugins = { a = 1 }\n"), "plugins = .*: must be a list, not a table", "1:1"),
    ("a table where a choice goes", text("policy = { a = 1 }\n"), "policy .*: use compat, none or strict", "1:1"),
    ("true where an integer goes", text("page_size = true\n"), "page_size = True: must be an integer", "1:1"),
    ("a table where a secret source goes", text("[secrets]\nA = 5\n"), "secrets.A: must be a table, not an integer",
     "2:1"),
    # unknown keys, at every level
    ("an unknown key at the top", text("pgae_size = 5\n"), r"pgae_size: unknown key \(did you mean 'page_size'\?\)",
     "1:1"),
    ("an unknown key in [http]", text("[http]\nlisen = 'x'\n"), "http.lisen: unknown key .did you mean 'listen'", "2:1"),
    ("an unknown key in [http.oauth]", text(OAUTH + "isuer = 'x'\n"), "http.oauth.isuer: unknown key .did you mean 'issuer'",
     "4:1"),
    ("an unknown key in an inline table", text(OAUTH + "rate = { per_s = 1, brst = 2 }\n"),
     "http.oauth.rate.brst: unknown key .did you mean 'burst'", "4:21"),
    ("an unknown key in an array of tables", text(f'[[http.tokens]]\nprincipal = "a"\nsha256 = "{"a" * 64}"\nscope = []\n'),
     r"http.tokens\[0\].scope: unknown key .did you mean 'scopes'", "4:1"),
    ("an unknown key in [tasks]", text("[tasks]\nstor = 'x'\n"), "tasks.stor: unknown key .did you mean 'store'", "2:1"),
    ("an unknown key in [approvals]", text("[approvals]\npoll = 1\n"),
     "approvals.poll: unknown key .did you mean 'poll_s'", "2:1"),
    ("an unknown key in a secret's source", text("[secrets.A]\nenvv = 'X'\n"),
     "secrets.A.envv: unknown key .did you mean 'env'", "2:1"),
    ("an unknown table", text("[htpp]\nlisten = 'x'\n"), r"htpp: unknown key \(did you mean 'http'\?\)", "1:1"),
    # not TOML
    ("a key given twice", text("page_size = 1\npage_size = 2\n"), "not valid TOML: Cannot overwrite a value", "2:14"),
    ("a table given twice", text("[http]\nlisten = 'a'\n[http]\npath = '/x'\n"), "not valid TOML: Cannot declare",
     "3:6"),
    ("not TOML at all", text("page_size = = 2\n"), "not valid TOML: Invalid value", "1:13"),
    ("not UTF-8", raw_bytes(b"page_size = 1\ninstructions = '\xff\xfe'\n"),
     r"not UTF-8 text \(byte 0xff\); save the file as UTF-8", "2:17"),
    # not a file one can read
    ("a FIFO", fifo, r"is not a regular file: it is a FIFO \(give a regular TOML file of at most 4 MiB\)", None),
    ("a link to a FIFO", link_to_fifo, r"is not a regular file: it is a FIFO \(.* leads to .*elsewhere\)", None),
    ("a directory", directory, "is not a regular file: it is a directory", None),
    ("a file over the cap", huge_file, f"is larger than {MAX_CONFIG_BYTES} bytes", None),
    # files the config names for the daemon to read
    ("an egress_ca_file that is a FIFO", names_a_fifo('egress_ca_file = "{fifo}"\n'),
     r"egress_ca_file .*named.fifo: not a regular file \(it is a FIFO\); name the file itself", "1:1"),
    ("a state_key_file that is a FIFO", names_a_fifo('state_key_file = "{fifo}"\n'),
     "state_key_file .*: not a regular file .it is a FIFO.", "1:1"),
    ("an approvals.key_file that is a FIFO",
     names_a_fifo('[approvals]\nstore = "redis://127.0.0.1:6379/0"\nkey_file = "{fifo}"\n'),
     "approvals.key_file .*: not a regular file .it is a FIFO.", "3:1"),
    ("an http.oauth.ca_file that is a FIFO", names_a_fifo(OAUTH + 'ca_file = "{fifo}"\n'),
     "http.oauth.ca_file .*: not a regular file .it is a FIFO.", "4:1"),
    ("an introspection secret file that is a FIFO",
     names_a_fifo(OAUTH + 'introspection_client_secret_file = "{fifo}"\n'),
     "http.oauth.introspection_client_secret_file .*: not a regular file .it is a FIFO.", "4:1"),
    ("an egress_ca_file that is a directory", text('egress_ca_file = "/"\n'),
     r"egress_ca_file /: not a regular file \(it is a directory\)", "1:1"),
    ("a tokens_file that is a FIFO", tokens_file_is_a_fifo, "http.tokens_file: .*tokens.toml is not a regular file: it is a FIFO",
     None),
    # the file the daemon writes
    ("an audit_log that is a FIFO", names_a_fifo('[http]\naudit_log = "{fifo}"\n'),
     r"http.audit_log .*named.fifo: a FIFO \(a log pipe whose reader is slow or gone would stop the daemon\)", "2:1"),
    ("an audit_log that is a link to a FIFO", names_a_fifo('[http]\naudit_log = "{fifo}.link"\n', link=True),
     r"http.audit_log .*named.fifo.link: a FIFO", "2:1"),
    ("an audit_log that is a directory", text('[http]\naudit_log = "/"\n'),
     "http.audit_log /: a directory; name the log file itself", "2:1"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("make, says, where", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_hostile_or_mistaken_config_is_one_clear_line_per_problem(tmp_path: Path, make: Make, says: str,
                                                                   where: str | None) -> None:
    path = tmp_path / "toolcell.toml"
    make(path)
    with pytest.raises(ConfigError) as raised:
        load_config(str(path), {})
    message = str(raised.value)
    lines = message.splitlines()
    if len(lines) > 1:
        assert re.fullmatch(r"[0-9]+ problems:", lines[0]), message
        lines = [line.strip() for line in lines[1:]]
    assert len(lines) == 1, message  # one problem each: nothing spurious beside it
    line = lines[0]
    assert re.search(says, line), line
    if where is not None:
        assert line.startswith(f"{path}:{where}: "), line
    else:
        assert str(path) in line or "tokens.toml" in line, line


def test_an_empty_config_file_is_every_default(tmp_path: Path) -> None:
    path = tmp_path / "toolcell.toml"
    path.write_text("")
    assert load_config(str(path), {}) == load_config(None, {}) == Config(state_dir=load_config(None, {}).state_dir)


def test_a_link_to_a_config_file_is_followed(tmp_path: Path) -> None:
    # A Kubernetes ConfigMap is mounted as links (toolcell.toml -> ..data/toolcell.toml).
    (tmp_path / "real.toml").write_text("page_size = 7\n")
    (tmp_path / "toolcell.toml").symlink_to("real.toml")
    assert load_config(str(tmp_path / "toolcell.toml"), {}).page_size == 7


SERVED: list[tuple[str, Make, str]] = [
    ("a FIFO", fifo, "is not a regular file: it is a FIFO"),
    ("a directory", directory, "is not a regular file: it is a directory"),
    ("not UTF-8", raw_bytes(b"\xff = 1\n"), ":1:1: not UTF-8 text"),
    ("nested too deeply", text("x = " + "[" * 5000 + "]" * 5000 + "\n"), "not valid TOML: nested too deeply"),
    ("a wrong value in an inline table", text(OAUTH + "new_tokens_per_address = { per_s = -1 }\n"),
     ":4:28: http.oauth.new_tokens_per_address.per_s = -1: must be > 0"),
    ("an audit_log that is a FIFO", names_a_fifo('[http]\naudit_log = "{fifo}"\n'), ":2:1: http.audit_log"),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make, says", [c[1:] for c in SERVED], ids=[c[0] for c in SERVED])
def test_toolcell_serve_refuses_such_a_config_at_once_without_a_traceback(tmp_path: Path, make: Make,
                                                                         says: str) -> None:
    path = tmp_path / "toolcell.toml"
    make(path)
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--http", "127.0.0.1:0", "--config",
                          str(path), "--plugins", str(PLUGINS)], check=False, cwd=str(REPO), capture_output=True,
                         text=True, timeout=90, stdin=subprocess.DEVNULL)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    problem = [line for line in out.stderr.splitlines() if line.startswith("toolcell: ")]
    assert len(problem) == 1 and says in problem[0] and str(path) in problem[0], out.stderr


@pytest.mark.timeout(120)
def test_toolcell_serve_says_when_the_audit_logs_folder_is_missing(tmp_path: Path) -> None:
    """Checked when the daemon starts (another box, where ``toolcell tasks`` reads the same config,
    may have the folder), before any worker: one line, exit 2, no traceback."""
    path = tmp_path / "toolcell.toml"
    path.write_text(f'[http]\naudit_log = "{tmp_path / "gone" / "audit.log"}"\n')
    load_config(str(path), {})  # not a problem of the config itself
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--http", "127.0.0.1:0", "--config",
                          str(path), "--plugins", str(PLUGINS)], check=False, cwd=str(REPO), capture_output=True,
                         text=True, timeout=90, stdin=subprocess.DEVNULL)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    problem = [line for line in out.stderr.splitlines() if line.startswith("toolcell: ")]
    assert problem == [f"toolcell: http.audit_log {tmp_path / 'gone' / 'audit.log'}: its folder "
                       f"{tmp_path / 'gone'} does not exist"], out.stderr
    assert "worker" not in out.stderr  # refused before the daemon started anything


def test_the_audit_log_opens_a_file_or_a_device_and_never_waits_on_a_fifo(tmp_path: Path) -> None:
    """``open_log_file`` (the daemon's open, after the config's check: a FIFO may appear in between):
    a FIFO is refused whether a reader is there (it would block writes) or not (the open would wait
    for one); a new file is the owner's only; a character device is taken."""
    from runtime.audit import AuditLogError, open_log_file

    fifo_path = tmp_path / "pipe"
    os.mkfifo(fifo_path)
    with pytest.raises(AuditLogError, match="a FIFO; give a regular file"):
        open_log_file(str(fifo_path))  # no reader: never waits for one
    reader = os.open(fifo_path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        with pytest.raises(AuditLogError, match=r"a FIFO \(a log pipe"):
            open_log_file(str(fifo_path))  # a reader: it opens, and is refused for what it is
    finally:
        os.close(reader)
    with pytest.raises(AuditLogError, match="a directory"):
        open_log_file(str(tmp_path))
    new = tmp_path / "audit.log"
    with open_log_file(str(new)) as stream:
        stream.write("one\n")
    assert new.read_text() == "one\n" and (new.stat().st_mode & 0o777) == 0o600
    with open_log_file(str(new)) as stream:  # appended to, never truncated
        stream.write("two\n")
    assert new.read_text() == "one\ntwo\n"
    with open_log_file("/dev/null") as stream:
        stream.write("gone\n")


def test_in_a_folder_anyone_may_write_the_audit_log_is_never_a_planted_link_or_file(tmp_path: Path) -> None:
    """/tmp-like folder (sticky, world-writable), with the kernel's protected_symlinks possibly off:
    a link another user planted at the log's name is not followed (as root it could lead the log into
    any file), and a file of theirs is not appended to (they could read the log). The daemon's own
    file there is used."""
    from runtime.audit import AuditLogError, open_log_file

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = shared / "audit.log"
    link.symlink_to(victim)
    with pytest.raises(AuditLogError, match="links are not followed there"):
        open_log_file(str(link))
    assert victim.read_text() == "precious\n"
    link.unlink()
    planted = shared / "audit.log"
    planted.write_text("")
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(planted, 12345, 12345)
        with pytest.raises(AuditLogError, match="belongs to uid 12345"):
            open_log_file(str(planted))
        planted.unlink()
    with open_log_file(str(shared / "audit.log")) as stream:
        stream.write("ours\n")
    assert (shared / "audit.log").read_text().endswith("ours\n")


def test_an_audit_log_rotated_by_renaming_is_followed_to_the_new_file_and_no_line_is_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """logrotate renames the log (its default, without ``copytruncate``): the daemon kept writing into
    the renamed file for the rest of its life, and the file at the configured name stayed empty."""
    import json

    from runtime import audit

    path = tmp_path / "audit.jsonl"
    log = audit.AuditLog(str(path))
    monkeypatch.setattr(audit, "ROTATION_CHECK_S", 0.0, raising=False)  # look at the name before every line
    try:
        log.write("alice", "t_one", "p", 2, "ok", 0.001)
        path.rename(tmp_path / "audit.jsonl.1")  # nothing at the name until the daemon makes it
        log.write("alice", "t_two", "p", 2, "ok", 0.001)
        path.rename(tmp_path / "audit.jsonl.2")
        path.touch(mode=0o600)  # `create` made the new file first
        log.write("alice", "t_three", "p", 2, "ok", 0.001)
        path.rename(tmp_path / "audit.jsonl.3")
        path.mkdir()  # cannot be opened again: the lines go on to the file still open
        log.write("alice", "t_four", "p", 2, "ok", 0.001)
    finally:
        log.close()

    def tools(name: str) -> list[str]:
        return [json.loads(line)["tool"] for line in (tmp_path / name).read_text().splitlines()]

    assert tools("audit.jsonl.1") == ["t_one"]
    assert tools("audit.jsonl.2") == ["t_two"]
    assert tools("audit.jsonl.3") == ["t_three", "t_four"]
    assert (tmp_path / "audit.jsonl.2").stat().st_mode & 0o777 == 0o600  # made by the daemon: its owner's only
