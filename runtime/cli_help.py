"""What ``toolcell COMMAND --help`` shows beyond the options: examples for every command, in one place
(the README's command table shows the same commands), and shell completion (``toolcell completion``)."""

from __future__ import annotations

import argparse
import sys

from runtime.auth import TOKEN_EXAMPLES

EXAMPLES: dict[str, str] = {
    "serve": """examples:
  toolcell serve --http                              http://127.0.0.1:8765/mcp, the bundled plugins
  toolcell serve --stdio --plugins ~/toolcell-plugins   for a client that starts its server itself
  toolcell serve --http 0.0.0.0:8765 --config toolcell.toml   (a non-loopback address needs [[http.tokens]])""",
    "list": """examples:
  toolcell list
  toolcell list --plugins ./plugins --json | jq '.plugins[] | select(.status != "ok")'""",
    "call": """examples:
  toolcell call math_evaluate '{"expression": "2 ** 10"}'
  toolcell call text_stats '{"text": "hello world"}' --plugins ./plugins""",
    "check": """examples:
  toolcell check ./plugins/myplugin        one plugin: every problem, as plugin.toml:LINE:COLUMN
  toolcell check ./plugins                 every plugin of a folder""",
    "add": """examples:
  toolcell add npm:@modelcontextprotocol/server-filesystem --into ~/toolcell-plugins --arg /srv/shared --write filesystem=/srv/shared
  toolcell add pypi:mcp-server-time --into ~/toolcell-plugins --arg=--local-timezone=UTC
  toolcell add ./server.json --into ~/toolcell-plugins     an MCP Registry entry
  toolcell add ./myplugin --into ~/toolcell-plugins""",
    "import": """examples:
  toolcell import ~/.config/Claude/claude_desktop_config.json --into ~/toolcell-plugins
  toolcell import .mcp.json --into ./plugins --only filesystem --write filesystem=/srv/shared --yes""",
    "approve": """examples:
  toolcell approve filesystem --plugins ~/toolcell-plugins""",
    "install": """examples:
  toolcell install claude-desktop --dry-run                 show the change to its config as a diff
  toolcell install claude-code                              ./.mcp.json: toolcell over stdio
  toolcell install vscode --http http://127.0.0.1:8765/mcp --token tc_...   a running daemon over HTTP""",
    "reload": """examples:
  toolcell reload                          the daemon(s) serving the bundled plugins with no config file
  toolcell reload --config toolcell.toml   the daemon(s) started with this config
  toolcell reload --plugins ./plugins      the daemon(s) serving ./plugins
  toolcell reload --pid 4242               exactly this daemon
  toolcell reload --all                    every daemon of the state dir""",
    "tasks": """examples:
  toolcell tasks                           this configuration's daemons' tasks, newest first
  toolcell tasks --all --principal ci-bot --json
  toolcell tasks show 8Zk2...              one task's status, times and result""",
    "token": TOKEN_EXAMPLES,
    "doctor": """examples:
  toolcell doctor
  toolcell doctor --json | jq .layers""",
    "completion": """examples:
  toolcell completion bash > ~/.local/share/bash-completion/completions/toolcell
  toolcell completion zsh > "${fpath[1]}/_toolcell\"""",
}


def add_examples(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Give every subcommand its examples (kept as written: line breaks and alignment)."""
    for name, parser in sub.choices.items():
        if name in EXAMPLES:
            parser.epilog = EXAMPLES[name]
            parser.formatter_class = argparse.RawDescriptionHelpFormatter


def add_completion_command(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    p: argparse.ArgumentParser = sub.add_parser("completion", help="print a shell completion script (bash, zsh, tcsh)")
    p.add_argument("shell", choices=["bash", "zsh", "tcsh"])
    return p


def print_completion(parser: argparse.ArgumentParser, shell: str) -> int:
    """The completion script of the whole command line for ``shell`` (shtab reads the parser)."""
    # Lazy: only `toolcell completion` needs shtab (~15 ms); this module loads with every command.
    import shtab

    sys.stdout.write(shtab.complete(parser, shell=shell))
    return 0
