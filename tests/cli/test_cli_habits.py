"""Habits people expect of a command line: an example in every command's ``--help``, shell
completion, progress while packages install, and a README whose first commands work on a fresh
machine (a virtual environment first) and match what CI runs."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from runtime.cli import build_parser
from runtime.progress import progress

REPO = Path(__file__).resolve().parents[2]


def toolcell(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], check=False, cwd=str(REPO), capture_output=True,
                          text=True, timeout=60)


def commands() -> list[str]:
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(sub.choices)  # type: ignore[attr-defined]


@pytest.mark.parametrize("command", commands())
def test_every_command_shows_an_example_of_itself_in_its_help(command: str) -> None:
    out = toolcell(command, "--help")
    assert out.returncode == 0, out.stderr
    assert "examples:" in out.stdout, out.stdout
    examples = out.stdout.split("examples:", 1)[1]
    assert re.search(rf"^\s+toolcell {command}\b", examples, re.M), examples


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed: its completion script cannot be checked")
def test_completion_prints_a_bash_script_that_completes_commands_and_flags() -> None:
    out = toolcell("completion", "bash")
    assert out.returncode == 0, out.stderr
    assert subprocess.run(["bash", "-n"], input=out.stdout, text=True, check=False).returncode == 0
    for word in ("serve", "reload", "tasks", "--log-format", "--plugins", "--all"):
        assert word in out.stdout
    # Sourced in bash, it completes the subcommands of `toolcell `.
    script = out.stdout + '\nCOMP_WORDS=(toolcell re); COMP_CWORD=1; COMP_LINE="toolcell re"; COMP_POINT=11\n' \
        '_shtab_toolcell; printf "%s\\n" "${COMPREPLY[@]}"\n'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=False, timeout=30)
    assert done.stdout.split() == ["reload"], done.stdout + done.stderr
    assert "_files" in toolcell("completion", "zsh").stdout


async def test_progress_off_a_terminal_says_it_is_still_going_every_ten_seconds(
        autojump_clock: trio.testing.MockClock) -> None:
    log = io.StringIO()
    async with progress("installing npm:pkg@1.0.0", log):
        await trio.sleep(25)
    assert log.getvalue().splitlines() == ["installing npm:pkg@1.0.0 ...",
                                           "... still installing npm:pkg@1.0.0 (10 s)",
                                           "... still installing npm:pkg@1.0.0 (20 s)",
                                           "installing npm:pkg@1.0.0: done in 25.0 s"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_progress_on_a_terminal_is_one_line_and_an_error_goes_through_as_it_was(
        autojump_clock: trio.testing.MockClock) -> None:
    screen = Terminal()
    with pytest.raises(KeyError):
        async with progress("installing pypi:x==1", screen):
            await trio.sleep(1)
            raise KeyError("the install failed")
    text = screen.getvalue()
    assert text.count("\n") == 1 and "\r" in text and "(1 s)" in text
    assert text.endswith("installing pypi:x==1: stopped after 1.0 s\x1b[K\n")


def test_the_readme_starts_with_a_virtual_environment_and_ci_runs_its_second_command_verbatim() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("```sh\n", 1)[1].split("```", 1)[0]
    first, second = [line for line in block.splitlines() if line and not line.startswith("#")]
    for command in (first, second):
        assert command.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install -e ")
    assert first.endswith("toolcell serve --http")
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    marker = ci.index("# --- the README's test command, verbatim ---")
    assert ci[marker + 1] == second


def test_the_readme_command_table_names_every_command_and_only_real_ones() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Commands", 1)[1].strip().split("\n\n", 1)[0]
    named = set(re.findall(r"^\| `toolcell ([a-z-]+)", table, re.M))
    assert named == set(commands()), (named ^ set(commands()))


def test_every_flag_of_a_command_is_named_in_its_readme_row_or_the_paragraph_under_the_table() -> None:
    # serve's --log-level, add's --bin and tasks' --limit were in --help and in no README row
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table, after = readme.split("## Commands", 1)[1].strip().split("\n\n", 1)
    paragraph = after.split("\n\n", 1)[0]
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    missing = []
    for name, parser in sub.choices.items():  # type: ignore[attr-defined]
        row = " ".join(line for line in table.splitlines() if re.match(rf"^\| `toolcell {name}[ `]", line))
        flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        missing += [f"{name} {flag}" for flag in sorted(flags)
                    if flag not in row and not (f"`{name}`" in paragraph and flag in paragraph)]
    assert missing == []
