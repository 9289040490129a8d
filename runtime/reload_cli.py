"""``toolcell reload``: ask the daemon(s) of this configuration to reload their plugin folders.

By default only the daemons whose scope (``runtime.scope``: config file and plugin set) is the
command's own are signalled, never a test suite's or another project's sharing the state dir; the
command names each daemon it reached and counts the ones it left alone. ``--pid N`` reaches exactly
that daemon, ``--all`` every daemon of the state dir.
"""

from __future__ import annotations

import argparse
import sys

from runtime.config import Config
from runtime.reload import RunningDaemon, running_daemons, send_reload
from runtime.scope import Scope, means, scope_of

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file the daemon was started with (its state_dir and plugins)")
    p.add_argument("--plugins", action="append", metavar="DIR",
                   help="plugin folder the daemon serves (as given to serve; repeatable)")
    p.add_argument("--pid", type=int, help="reach only this daemon")
    p.add_argument("--all", action="store_true",
                   help="reach every daemon of the state dir, whatever its configuration")


def _label(d: RunningDaemon) -> str:
    return f"daemon {d.pid} ({d.serving or 'no address recorded'})"


def choose(daemons: list[RunningDaemon], scope: Scope, pid: int | None, everyone: bool,
           plugins_given: bool) -> list[RunningDaemon]:
    """The daemons a reload means: ``--pid``, else ``--all``, else those of ``scope`` (``runtime.scope.means``)."""
    if pid is not None:
        return [d for d in daemons if d.pid == pid]
    if everyone:
        return daemons
    return [d for d in daemons if means(scope, d.scope, plugins_given)]


def run_reload(cfg: Config, args: argparse.Namespace) -> int:
    scope = scope_of(args.config, cfg.plugins)
    daemons = running_daemons(cfg.state_dir)
    chosen = choose(daemons, scope, args.pid, args.all, bool(args.plugins))
    others = [d for d in daemons if d not in chosen]
    if not chosen:
        if args.pid is not None:
            print(f"toolcell reload: no daemon {args.pid} found (pidfiles in {cfg.state_dir})", file=sys.stderr)
        else:
            print(f"toolcell reload: no running daemon of this configuration ({scope.describe()}; pidfiles in "
                  f"{cfg.state_dir})", file=sys.stderr)
            if others:
                print(f"  {len(others)} other daemon(s) run with another configuration; --all reaches them, "
                      "--pid N one of them:", file=sys.stderr)
                for d in others:
                    print(f"    {_label(d)}: {d.scope.describe() if d.scope else 'configuration not recorded'}",
                          file=sys.stderr)
        return 1
    failed = 0
    for d in chosen:
        try:
            send_reload(d.pid)
        except OSError as exc:
            print(f"toolcell reload: could not signal daemon {d.pid}: {exc}", file=sys.stderr)
            failed += 1
            continue
        print(f"toolcell reload: asked {_label(d)} to reload its plugins")
    if others and args.pid is None and not args.all:
        print(f"toolcell reload: left {len(others)} daemon(s) of other configurations alone (--all reaches them)")
    return 1 if failed else 0
