"""``runtime.launch``: what a hosted server's command and ``#!`` lines resolve to is decided by the plugin
folder and PATH's absolute entries, never by the directory the daemon happens to run in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.launch import LaunchError, resolve


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def daemon_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The daemon's working directory, holding programs a plugin author would like it to run."""
    cwd = tmp_path / "daemon-cwd"
    cwd.mkdir()
    for name in ("interp", "mytool"):
        _script(cwd / name, "#!/bin/sh\n")
    monkeypatch.chdir(cwd)
    return cwd


@pytest.mark.parametrize("line", ["#!./interp", "#!interp", "#!sub/../interp", "#!/usr/bin/env ./interp"])
def test_a_relative_interpreter_is_never_looked_up_in_the_daemons_working_directory(
        tmp_path: Path, daemon_cwd: Path, line: str) -> None:
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    _script(plugin / "run.sh", line + "\n")
    with pytest.raises(LaunchError, match="interpreter") as exc:
        resolve(["./run.sh"], str(plugin))
    assert str(daemon_cwd) not in str(exc.value)


def test_a_relative_interpreter_is_a_file_of_the_plugin_folder_and_stays_inside_it(
        tmp_path: Path, daemon_cwd: Path) -> None:
    plugin = tmp_path / "plugin"
    (plugin / "bin").mkdir(parents=True)
    _script(plugin / "bin" / "interp", "\x7fELF (an interpreter of the author's)\n")
    _script(plugin / "run.sh", "#!./bin/interp -x\n")
    argv, reads = resolve(["./run.sh", "a"], str(plugin))
    assert argv == [str(plugin / "bin" / "interp"), "-x", str(plugin / "run.sh"), "a"]
    assert str(plugin / "bin" / "interp") in reads and not any(str(daemon_cwd) in r for r in reads)
    (plugin / "bin" / "interp").unlink()
    (plugin / "bin" / "interp").symlink_to(daemon_cwd / "interp")
    with pytest.raises(LaunchError, match="symbolic link"):
        resolve(["./run.sh"], str(plugin))
    _script(plugin / "run.sh", "#!../daemon-cwd/interp\n")
    with pytest.raises(LaunchError, match="not a name inside the plugin folder"):
        resolve(["./run.sh"], str(plugin))


def test_a_bare_command_is_found_on_paths_absolute_entries_only(
        tmp_path: Path, daemon_cwd: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    monkeypatch.setenv("PATH", ":.:" + os.environ["PATH"])
    with pytest.raises(LaunchError, match="not on the daemon's PATH"):
        resolve(["mytool"], str(plugin))
    _script(plugin / "run.sh", "#!/usr/bin/env mytool\n")
    with pytest.raises(LaunchError, match="not on the daemon's PATH"):
        resolve(["./run.sh"], str(plugin))
