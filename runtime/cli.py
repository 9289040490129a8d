"""The ``toolcell`` command line: serve, list, call, check, reload, tasks, doctor."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import socket
import sys
from typing import Any, Sequence

import trio

from runtime import __version__, auth, cli_help, logs
from runtime.config import Config, ConfigError, load_config
from runtime.progress import progress
from runtime.scope import scope_of


#: shtab completes these arguments as folders / files (an attribute argparse ignores).
shtab_dir = {"bash": "_shtab_compgen_dirs", "zsh": "_files -/", "tcsh": "d"}
shtab_file = {"bash": "_shtab_compgen_files", "zsh": "_files", "tcsh": "f"}


def _add_common(p: argparse.ArgumentParser, plugins: bool = True) -> None:
    p.add_argument("--config", help="TOML config file").complete = shtab_file  # type: ignore[attr-defined]
    if plugins:
        p.add_argument("--plugins", action="append", metavar="DIR",
                       help="plugin folder (a plugin, or a folder of plugins); repeatable; default: the bundled plugins"
                       ).complete = shtab_dir  # type: ignore[attr-defined]
    p.add_argument("--policy", choices=["strict", "compat", "none"], help="isolation policy (default strict)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", choices=["auto", "json", "text"],
                   help="log lines on stderr: readable text on a terminal and JSON otherwise (auto, the default), "
                        "or always json / text")


def _config(args: argparse.Namespace, **extra: Any) -> Config:
    overrides = {"plugins": getattr(args, "plugins", None), "policy": getattr(args, "policy", None),
                 "log_level": getattr(args, "log_level", None), "log_format": getattr(args, "log_format", None),
                 **extra}
    cfg = load_config(args.config, overrides)
    logs.configure(cfg.log_level, format=cfg.log_format)
    return cfg


def _missing_folders(cfg: Config) -> list[str]:
    return [p for p in cfg.plugins if not os.path.exists(p)]


def _refuse_missing(command: str, cfg: Config) -> bool:
    """Print an error for plugin folders that do not exist (a typo would otherwise mean no tools)."""
    missing = _missing_folders(cfg)
    for path in missing:
        print(f"toolcell {command}: plugin folder {path} does not exist", file=sys.stderr)
    return bool(missing)


def table(rows: list[list[str]], headers: list[str]) -> str:
    """A plain-text table sized to the terminal (long cells are cut with an ellipsis)."""
    width = shutil.get_terminal_size((120, 20)).columns
    cols = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    budget = max(20, width - 2 * (len(cols) - 1) - sum(cols[:-1]))
    cols[-1] = min(cols[-1], budget)

    def cut(text: str, n: int) -> str:
        text = text.replace("\n", " ")
        return text if len(text) <= n else text[: max(0, n - 1)] + "…"

    lines = ["  ".join(h.ljust(cols[i]) for i, h in enumerate(headers)).rstrip(),
             "  ".join("-" * c for c in cols)]
    for r in rows:
        lines.append("  ".join(cut(c, cols[i]).ljust(cols[i]) for i, c in enumerate(r)).rstrip())
    return "\n".join(lines)


# -- serve ---------------------------------------------------------------------------------------


async def _serve(cfg: Config, args: argparse.Namespace) -> None:
    # Lazy: only `serve` loads the daemon and its transports (~80 ms more than --help loads).
    from runtime.serve import serve

    await serve(cfg, stdio=args.stdio, http=args.http, unix=args.unix, scope=scope_of(args.config, cfg.plugins))


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _config(args, page_size=args.page_size, watch=False if args.no_watch else None)
    logs.configure(cfg.log_level)
    if not (args.stdio or args.http is not None or args.unix):
        print("toolcell serve: choose a transport: --stdio, --http [HOST:PORT] and/or --unix PATH", file=sys.stderr)
        return 2
    missing = _missing_folders(cfg)
    if missing and not cfg.watch:
        _refuse_missing("serve", cfg)
        return 2
    for path in missing:
        print(f"toolcell serve: warning: plugin folder {path} does not exist; serving without it and watching "
              "for it to appear", file=sys.stderr)
    try:
        trio.run(_serve, cfg, args)
    except Exception as exc:  # a listener that cannot bind, an unsafe address: say so plainly
        err: BaseException = exc
        while isinstance(err, BaseExceptionGroup) and len(err.exceptions) == 1:
            err = err.exceptions[0]
        if not isinstance(err, (OSError, ValueError)):
            raise
        print(f"toolcell serve: {err}", file=sys.stderr)
        if isinstance(err, OSError) and err.errno == errno.EADDRINUSE:
            print(_address_in_use_advice(cfg), file=sys.stderr)
        return 1
    return 0


def _address_in_use_advice(cfg: Config) -> str:
    """What to do when the address is taken: which toolcell daemons of this state dir serve what, and a
    free port to serve on instead."""
    # Lazy: kept out of `toolcell bench`, which main() runs before build_parser loads it (reload_cli).
    from runtime.reload import running_daemons

    lines = ["  another program listens there. Stop it, or serve on another address, e.g. "
             f"toolcell serve --http 127.0.0.1:{_free_port()} (or set http.listen in the config)."]
    daemons = running_daemons(cfg.state_dir)
    if daemons:
        lines.append(f"  toolcell daemons of the state dir {cfg.state_dir}: " + "; ".join(f"pid {d.pid} ({d.serving})" for d in daemons)
                     + " (kill -TERM PID stops one gracefully)")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# -- list / check / call ---------------------------------------------------------------------------


async def _describe(cfg: Config) -> Any:
    # Lazy: only list and check load the daemon (~20 ms more than --help loads).
    from runtime.daemon import open_daemon

    async with open_daemon(cfg, describe_only=True) as daemon:
        return daemon


async def _describe_showing(cfg: Config, installing: str) -> Any:
    """``_describe``, showing progress while the plugins' packages may be installing (a first check of a
    plugin with dependencies or a server package installs them, which takes a while)."""
    if not installing:
        return await _describe(cfg)
    async with progress(installing, sys.stderr):
        return await _describe(cfg)


def _installs(cfg: Config) -> list[str]:
    """What loading the configured plugins may install: their dependencies and server packages."""
    # Lazy: kept out of `toolcell bench`, which main() runs before build_parser loads these (imports).
    from runtime.manifest import ManifestError, load_manifest
    from runtime.plugins import discover  # lazy: as the line above

    found: list[str] = []
    for path in discover(cfg.plugins):
        try:
            manifest = load_manifest(path)
        except ManifestError:
            continue
        found += manifest.dependencies
        if manifest.server is not None and manifest.server.package:
            found.append(manifest.server.package)
    return found


def _permissions(plugin: Any) -> str:
    if plugin.manifest is None:
        return "-"
    p = plugin.manifest.permissions
    # A network grant is only ever reachable through the daemon's egress proxy (runtime.egress).
    parts = [f"net(proxied):{','.join(p.network)}" if p.network else "net:none"]
    if p.read:
        parts.append(f"read:{','.join(p.read)}")
    if p.write:
        parts.append(f"write:{','.join(p.write)}")
    return " ".join(parts)


def _mode(plugin: Any) -> str:
    """pooled / per_call, or "server" for a hosted MCP server (``runtime.execution.hosted``)."""
    return "server" if plugin.manifest.kind == "server" else str(plugin.manifest.isolation)


def _limits(plugin: Any) -> str:
    if plugin.manifest is None:
        return "-"
    lim = plugin.manifest.limits
    return (f"timeout {lim.timeout_s:g}s, mem {lim.memory_mb}MB, cpu {lim.cpu_s}s, procs {lim.max_processes}, "
            f"conc {lim.max_concurrency}")


def cmd_list(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if _refuse_missing("list", cfg):
        return 2
    logs.configure("error")
    daemon = trio.run(_describe, cfg)
    if args.json:
        tools = [{"name": e.name, "plugin": e.plugin, "description": e.checked.spec.description}
                 for e in daemon.catalog.entries]
        everyone = sorted(list(daemon.plugins.values()) + daemon.failed, key=lambda p: p.name)
        plugins_out = [{"name": p.name, "path": str(p.path), "status": "ok" if p.ok else "refused",
                        "version": p.manifest.version if p.manifest else None,
                        "mode": _mode(p) if p.manifest else None,
                        "tools": len(p.entries), "limits": _limits(p), "permissions": _permissions(p),
                        "problems": list(p.problems), "conflicts": list(p.conflicts)} for p in everyone]
        print(json.dumps({"tools": tools, "plugins": plugins_out}, indent=2))
        return 0 if not daemon.failed else 1
    rows = [[e.name, e.plugin, e.checked.spec.description.split("\n")[0]] for e in daemon.catalog.entries]
    print(table(rows, ["TOOL", "PLUGIN", "DESCRIPTION"]))
    print()
    plugins = sorted(list(daemon.plugins.values()) + daemon.failed, key=lambda p: p.name)
    prow = []
    for p in plugins:
        status = "ok" if p.ok else "refused"
        if p.conflicts:
            status += f" ({len(p.conflicts)} conflicts)"
        version = p.manifest.version if p.manifest else "?"
        prow.append([p.name, version, status, str(len(p.entries)), _mode(p) if p.manifest else "-",
                     _limits(p), _permissions(p)])
    print(table(prow, ["PLUGIN", "VERSION", "STATUS", "TOOLS", "MODE", "LIMITS", "PERMISSIONS"]))
    for p in plugins:
        for problem in p.problems + p.conflicts:
            print(f"  {p.name}: {problem}", file=sys.stderr)
    return 0 if not daemon.failed else 1


def cmd_check(args: argparse.Namespace) -> int:
    cfg = _config(args, plugins=[args.plugin_dir])
    if _refuse_missing("check", cfg):
        return 2
    logs.configure("error")
    needs = _installs(cfg)
    daemon = trio.run(_describe_showing, cfg, f"installing what it needs ({', '.join(needs)})" if needs else "")
    plugins = list(daemon.plugins.values()) + daemon.failed
    if not plugins:
        print(f"{args.plugin_dir}: no plugin found (expected a plugin.toml)")
        return 1
    bad = 0
    for p in plugins:
        if p.ok:
            print(f"{p.name} {p.manifest.version if p.manifest else ''}: ok, {len(p.entries)} tools "
                  f"(layers: {', '.join(p.layers) or 'none'}; permissions: {_permissions(p)})")
            print(f"  limits: {_limits(p)}")
            for e in p.entries:
                print(f"  {e.name}")
        else:
            bad += 1
            print(f"{p.name}: {len(p.problems)} problem(s)")
            for problem in p.problems:
                print(f"  - {problem}")
    return 1 if bad else 0


def cmd_call(args: argparse.Namespace) -> int:
    # Lazy: only `call` loads the daemon and the connection code (~25 ms more than --help loads).
    from runtime.call_cli import run_call_command

    cfg = _config(args)
    if _refuse_missing("call", cfg):
        return 2
    logs.configure(cfg.log_level if args.log_level else "warning")
    return run_call_command(cfg, args)


def cmd_reload(args: argparse.Namespace) -> int:
    # Lazy: kept out of `toolcell bench`, which main() runs before build_parser loads it.
    from runtime.reload_cli import run_reload

    return run_reload(_config(args), args)


def cmd_tasks(args: argparse.Namespace) -> int:
    # Lazy: kept out of `toolcell bench`, which main() runs before build_parser loads it.
    from runtime.task_cli import run_tasks_command

    return run_tasks_command(load_config(args.config, {"plugins": args.plugins}), args, table)


def cmd_doctor(args: argparse.Namespace) -> int:
    # Lazy: only `doctor` loads it (~3 ms with sysconfig, which --help never loads).
    from runtime import doctor

    return int(doctor.main(["--json"] if args.json else []))


def build_parser() -> argparse.ArgumentParser:
    """The whole ``toolcell`` command line (completion scripts are made from it too)."""
    parser = argparse.ArgumentParser(prog="toolcell", description="MCP tools daemon: every call in an isolated worker")
    parser.add_argument("--version", action="version", version=f"toolcell {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="serve MCP clients")
    _add_common(p)
    p.add_argument("--stdio", action="store_true", help="serve one client on stdin/stdout")
    p.add_argument("--http", nargs="?", const="", metavar="HOST:PORT",
                   help="serve Streamable HTTP at http://HOST:PORT/mcp (default: http.listen from the config, "
                        "else 127.0.0.1:8765); combinable with --stdio")
    p.add_argument("--unix", metavar="PATH", help="serve Streamable HTTP on a unix socket too")
    p.add_argument("--page-size", type=int, help="tools per tools/list page")
    p.add_argument("--no-watch", action="store_true", help="do not watch plugin folders (SIGHUP / toolcell reload still work)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("list", help="list the tools a plugin folder provides")
    _add_common(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("call", help="run one tool through a real worker and print the result")
    _add_common(p)
    p.add_argument("name")
    p.add_argument("arguments", nargs="?", default="{}", help="JSON object of arguments")
    p.set_defaults(func=cmd_call)

    p = sub.add_parser("check", help="validate a plugin and report every problem")
    _add_common(p, plugins=False)
    p.add_argument("plugin_dir").complete = shtab_dir  # type: ignore[attr-defined]
    p.set_defaults(func=cmd_check)

    # Lazy: every command but `toolcell bench` builds this parser, and main() runs bench before it:
    # these modules (~210 ms after this module's imports, mostly runtime.imports) stay out of bench.
    from runtime import client_install, imports, reload_cli, task_cli

    imports.register(sub, _add_common, _config)  # add, import, approve

    p = sub.add_parser("install", help="write an MCP client's configuration to use toolcell "
                                       "(claude-desktop, claude-code, cursor, vscode)")
    client_install.add_arguments(p)
    p.set_defaults(func=client_install.run_install)

    p = sub.add_parser("reload", help="ask the daemon(s) of this configuration to reload their plugin folders (SIGHUP)")
    reload_cli.add_arguments(p)
    p.set_defaults(func=cmd_reload)

    p = sub.add_parser("tasks", help="list the tasks in the task store, or show one (reads the store directly)")
    task_cli.add_arguments(p)
    p.set_defaults(func=cmd_tasks)

    p = sub.add_parser("token", help="mint a bearer token for the HTTP transport and print its [[http.tokens]] entry")
    auth.add_token_arguments(p)
    p.set_defaults(func=auth.run_token)

    p = sub.add_parser("doctor", help="probe which isolation layers this machine supports")
    p.add_argument("--json", action="store_true", help="print the probe's report as JSON")
    p.set_defaults(func=cmd_doctor)

    sub.add_parser("bench", help="load-benchmark MCP servers (toolcell bench --help; needs toolcell[bench])")

    p = cli_help.add_completion_command(sub)
    p.set_defaults(func=lambda a: cli_help.print_completion(parser, a.shell))
    cli_help.add_examples(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["bench"]:
        # Lazy: only `toolcell bench` loads runtime.bench (its own parser; hdrh and plotly, the bench
        # extra); no other command and never the daemon (tests/bench/test_bench_pieces.py checks).
        from runtime.bench.cli import main as bench

        return bench(args_in[1:])  # its --help carries its own examples (the README's, checked by a test)
    args = build_parser().parse_args(args_in)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"toolcell: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
