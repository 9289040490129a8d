"""Log lines: readable and coloured on a terminal, JSON lines otherwise, ``--log-format`` to choose."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime import logs

REPO = Path(__file__).resolve().parents[2]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _logs_as_they_were() -> Iterator[None]:
    yield
    logs.configure("info", None, "auto")


def test_on_a_terminal_each_event_is_one_readable_coloured_line() -> None:
    screen = Terminal()
    logs.configure("info", screen, "auto")
    logs.log("plugin_loaded", plugin="textkit", tools=6)
    line = screen.getvalue()
    assert line.count("\n") == 1 and not line.startswith("{")
    assert "\x1b[" in line  # coloured
    plain = line.replace("\x1b[0m", "")
    assert "plugin_loaded" in plain and "textkit" in plain and "info" in plain


def test_elsewhere_each_event_is_a_json_line() -> None:
    file = io.StringIO()
    logs.configure("info", file, "auto")
    logs.log("plugin_loaded", plugin="textkit", tools=6)
    record = json.loads(file.getvalue())
    assert record["event"] == "plugin_loaded" and record["plugin"] == "textkit" and record["tools"] == 6


def test_the_format_can_be_forced_either_way() -> None:
    screen = Terminal()
    logs.configure("info", screen, "json")
    logs.log("serving", tools=1)
    assert json.loads(screen.getvalue())["event"] == "serving"
    file = io.StringIO()
    logs.configure("info", file, "text")
    logs.log("serving", tools=1)
    assert "serving" in file.getvalue() and "\x1b[" not in file.getvalue()  # text, uncoloured off a terminal


def test_what_a_plugin_wrote_cannot_put_control_characters_on_the_terminal() -> None:
    screen = Terminal()
    logs.configure("info", screen, "auto")
    logs.log("plugin_output", line="\x1b]0;owned\x07\x1b[2Jgone", nested={"k": "\x1b[31m"})
    out = screen.getvalue()
    for raw in ("\x1b]0", "\x07", "\x1b[2J", "\x1b[31m"):
        assert raw not in out
    assert "\\x1b]0;owned" in out


def test_serve_takes_log_format() -> None:
    done = subprocess.run([sys.executable, "-m", "runtime.cli", "serve", "--stdio", "--no-watch", "--policy", "none",
                           "--plugins", str(REPO / "plugins" / "mathkit"), "--log-format", "text"],
                          cwd=str(REPO), input="", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert any("serving" in line for line in lines), done.stderr
    assert not any(line.startswith("{") for line in lines), done.stderr
