"""``toolcell bench``'s command line: without its extra a plain install has no ``hdrhistogram``
(imported as ``hdrh``), the command says which extra to install and exits 2, and the daemon's own
commands never need it; the README's bench commands and flags are the ones ``--help`` shows."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _without_hdrh(tmp_path: Path) -> dict[str, str]:
    """An environment in which ``import hdrh`` fails, as on an install without the bench extra."""
    shadow = tmp_path / "shadow" / "hdrh"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('hdrhistogram is not installed')\n")
    return dict(os.environ, PYTHONPATH=str(tmp_path / "shadow"))


def test_bench_without_its_extra_names_the_extra_and_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", "http://127.0.0.1:9/mcp"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=_without_hdrh(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'toolcell[bench]'" in proc.stderr and "Traceback" not in proc.stderr


def test_the_daemon_does_not_need_the_bench_extra(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "check", str(REPO / "benchmarks" / "plugins" / "echo")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=_without_hdrh(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]


def _readme_bench_commands() -> list[list[str]]:
    """Every ``toolcell bench`` command in the README's Benchmarking code blocks, as argv."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Benchmarking"):]
    section = section[:section.index("\n## ", 1)]
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split(" && "):
                words = shlex.split(part, comments=True)
                if words[:2] == ["toolcell", "bench"]:
                    commands.append(words)
    return commands


def _help(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", *args, "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _examples(help_text: str) -> list[list[str]]:
    return [shlex.split(line) for line in help_text.split("examples:\n", 1)[1].splitlines()
            if line.strip().startswith("toolcell bench")]


def test_the_readme_bench_examples_are_the_help_examples_and_each_parses() -> None:
    pytest.importorskip("hdrh")
    from runtime.bench import cli

    readme = _readme_bench_commands()
    bench_help, compare_help = _help(), _help("compare")
    shown = _examples(bench_help)
    assert len(readme) >= 6
    # every example --help shows is in the README, and every README command is one --help shows
    assert [c for c in shown if c not in readme] == []
    assert [c for c in readme if c not in shown + _examples(compare_help)] == []
    for argv in readme + shown + _examples(compare_help):
        args = argv[2:]
        if args[:1] == ["compare"]:
            cli.compare_parser().parse_args([a for a in args[1:] if a not in (">", "comment.md")])
        else:
            cli.parser().parse_args(args)


def test_every_bench_flag_the_readme_names_is_in_help_and_back_and_the_table_row_names_the_new_ones() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| `toolcell bench TARGET"))
    section = readme[readme.index("## Benchmarking"):]
    section = section[:section.index("\n## ", 1)]
    known = set(re.findall(r"--[a-z][a-z-]+", _help() + _help("compare")))
    named = set(re.findall(r"--[a-z][a-z-]+", row + section))
    assert named - known == set()
    # and the reverse: every flag --help shows is in the README (--fresh, --insecure, --path,
    # --max-inflight, --no-ceiling and --no-phases were not)
    assert known - named - {"--help"} == set()
    for flag in ("--repeat", "--markdown", "--fail-if", "--threshold", "--alpha"):
        assert flag in row, flag
