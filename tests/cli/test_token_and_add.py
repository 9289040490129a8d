"""``toolcell token`` (argument parsing, what it prints) and what ``toolcell add`` says when a
package needs ``--bin``, run as real commands."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], check=False, cwd=str(REPO), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_token_prints_the_toml_entry_of_a_token_it_shows_once() -> None:
    out = run("-m", "runtime.cli", "token", "ci-bot", "--scope", "plugin:mathkit", "--scope", "text_*")
    assert out.returncode == 0, out.stderr
    entry = tomllib.loads(out.stdout)["http"]["tokens"][0]
    token = out.stderr.rsplit(": ", 1)[1].strip()
    assert entry == {"principal": "ci-bot", "sha256": hashlib.sha256(token.encode()).hexdigest(),
                     "scopes": ["plugin:mathkit", "text_*"]}


def test_help_is_help_and_never_mints_a_token_for_a_principal_named_like_an_option() -> None:
    for command in (["-m", "runtime.cli", "token", "--help"], ["-m", "runtime.auth", "--help"]):
        out = run(*command)
        assert out.returncode == 0 and "usage:" in out.stdout and "examples:" in out.stdout
        assert "[[http.tokens]]" not in out.stdout and "tc_" not in out.stderr
    bogus = run("-m", "runtime.cli", "token", "--bogus")
    assert bogus.returncode == 2 and "unrecognized arguments: --bogus" in bogus.stderr and "tc_" not in bogus.stderr
    strange = run("-m", "runtime.cli", "token", "a b")
    assert strange.returncode == 2 and "principal 'a b'" in strange.stderr


def test_add_of_a_package_with_several_executables_names_the_bin_flag(tmp_path: Path) -> None:
    state = tmp_path / "state"
    config = tmp_path / "toolcell.toml"
    config.write_text(f'state_dir = "{state}"\n')
    out = run("-m", "runtime.cli", "add", "pypi:jupyter-core==5.7.2", "--into", str(tmp_path / "plugins"),
              "--config", str(config), "--yes", timeout=300)
    assert out.returncode == 1
    assert "several executables (jupyter, jupyter-migrate, jupyter-troubleshoot)" in out.stderr, out.stderr
    assert "--bin NAME, e.g. toolcell add pypi:jupyter-core==5.7.2 --bin jupyter" in out.stderr
    assert "server.bin" not in out.stderr
    assert not (tmp_path / "plugins" / "jupyter-core").exists()
