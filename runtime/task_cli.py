"""``toolcell tasks``: list and inspect the tasks in the store, read directly (no daemon needed)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import msgspec
import trio

from runtime.config import Config
from runtime.scope import owners_of, scope_of
from runtime.task_store import TaskRecord, TaskStore, parse_store_url, redact_store_url, wall_clock_ms
from runtime.task_store_open import open_task_store

Table = Callable[[list[list[str]], list[str]], str]
_PAGE = 500


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``toolcell tasks`` and of ``toolcell tasks show ID``."""

    def common(q: argparse.ArgumentParser, default: Any) -> None:
        q.add_argument("--config", default=default, help="TOML config file (for its [tasks] store and state_dir)")
        q.add_argument("--store", default=default, metavar="URL",
                       help="the task store: sqlite:///PATH, redis://HOST:PORT/DB, unix:///PATH (default: the config's)")
        q.add_argument("--principal", default=default, metavar="P", help="only this principal's tasks")
        q.add_argument("--json", action="store_true", default=default, help="print JSON instead of a table")
        q.add_argument("--plugins", action="append", default=default, metavar="DIR",
                       help="the plugin folder(s) of the daemon whose tasks to list (as given to serve; repeatable)")
        q.add_argument("--all", action="store_true", default=default,
                       help="every daemon's tasks in the store, not only those of this configuration's daemons")

    common(p, None)
    p.add_argument("--limit", type=int, default=1000, metavar="N", help="show at most N tasks, newest first")
    sub = p.add_subparsers(dest="tasks_command", metavar="show ID")
    show = sub.add_parser("show", help="one task: status, times, result, error, input requests")
    show.add_argument("task_id", metavar="ID", help="the task's id (one that begins with '-' goes after '--')")
    # Options may come after "show" too; SUPPRESS keeps the ones given before it.
    common(show, argparse.SUPPRESS)


def _iso(ms: int) -> str:
    when = datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC)
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _span(ms: int) -> str:
    """A duration for people: 45s, 12m, 3h, 2d."""
    s = max(0, ms) // 1000
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def _payload(data: bytes | None) -> Any:
    if data is None:
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return {"undecodable_bytes": data[:200].decode("utf-8", "replace")}


def _as_json(rec: TaskRecord, full: bool) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(rec)
    for name in ("result", "error", "input_requests"):
        out.pop(name, None)
        if full:
            out[name] = _payload(getattr(rec, name))
    out["created_at"] = _iso(rec.created_at_ms)
    out["updated_at"] = _iso(rec.updated_at_ms)
    if rec.expires_at_ms is not None:
        out["expires_at"] = _iso(rec.expires_at_ms)
    return out


async def _read(url: str | None, cfg: Config, args: argparse.Namespace) -> tuple[list[TaskRecord], TaskRecord | None]:
    async with open_task_store(url, cfg.state_dir, limits=cfg.tasks.store_limits()) as store:
        if args.tasks_command == "show":
            rec = await (store.get(args.task_id, args.principal) if args.principal is not None
                         else store.inspect(args.task_id))
            return [], rec
        return await _collect(store, args.principal, max(1, args.limit)), None


async def _collect(store: TaskStore, principal: str | None, limit: int) -> list[TaskRecord]:
    found: list[TaskRecord] = []
    cursor: str | None = None
    while len(found) < limit:
        size = min(_PAGE, limit - len(found))
        page, cursor = await (store.list(principal, cursor, size) if principal is not None
                              else store.list_all(cursor, size))
        found += page
        if cursor is None:
            break
    return found


def run_tasks_command(cfg: Config, args: argparse.Namespace, table: Table) -> int:
    """``toolcell tasks`` (a table or JSON of the tasks, newest first) and ``toolcell tasks show ID``."""
    url = args.store if args.store is not None else cfg.tasks.store
    try:
        where = parse_store_url(url, cfg.state_dir)
    except ValueError as exc:
        print(f"toolcell tasks: {exc}", file=sys.stderr)
        return 2
    showing = args.tasks_command == "show"
    if where.kind == "sqlite" and not os.path.exists(where.target):
        print(f"toolcell tasks: no task store at {where.target} (no daemon has kept a task there yet)",
              file=sys.stderr)
        if showing:
            return 1
        print("[]" if args.json else table([], _HEADERS))
        return 0
    try:
        records, rec = trio.run(_read, url, cfg, args)
    except Exception as exc:  # an unreachable Redis, an unreadable file: say which store and why
        print(f"toolcell tasks: cannot read the task store {redact_store_url(url) if url else where.target}: {exc}",
              file=sys.stderr)
        return 1
    if showing:
        if rec is None:
            print(f"toolcell tasks: no task {args.task_id}" +
                  (f" for principal {args.principal!r}" if args.principal is not None else ""), file=sys.stderr)
            return 1
        print(json.dumps(_as_json(rec, True), indent=2, ensure_ascii=False) if args.json else _details(rec))
        return 0
    if args.store is None and not args.all:
        records = _of_this_scope(records, cfg, args)
    if args.json:
        print(json.dumps([_as_json(r, False) for r in records], indent=2, ensure_ascii=False))
        return 0
    now_ms = wall_clock_ms()
    rows = [[r.task_id, r.principal or "-", r.tool, r.status, _span(now_ms - r.created_at_ms),
             "unlimited" if r.ttl_ms is None else f"{_span(r.ttl_ms)} ({_span(r.created_at_ms + r.ttl_ms - now_ms)} left)"]
            for r in records]
    print(table(rows, _HEADERS))
    return 0


def _of_this_scope(records: list[TaskRecord], cfg: Config, args: argparse.Namespace) -> list[TaskRecord]:
    """The tasks run by daemons of this configuration and plugin set (``runtime.scope``); says on
    stderr how many others the store holds. An explicit ``--store`` or ``--all`` shows them all."""
    scope = scope_of(args.config, cfg.plugins)
    owners = owners_of(cfg.state_dir, scope, bool(args.plugins))
    mine = [r for r in records if r.owner in owners]
    if len(mine) < len(records):
        print(f"toolcell tasks: {len(records) - len(mine)} task(s) of daemons with another configuration not shown "
              f"(this one: {scope.describe()}); --all shows every task in the store", file=sys.stderr)
    return mine


_HEADERS = ["ID", "PRINCIPAL", "TOOL", "STATUS", "AGE", "TTL"]


def _details(rec: TaskRecord) -> str:
    now_ms = wall_clock_ms()
    lines = [
        f"task        {rec.task_id}",
        f"status      {rec.status}" + (f": {rec.status_message}" if rec.status_message else ""),
        f"principal   {rec.principal or '- (anonymous)'}",
        f"tool        {rec.tool}",
        f"era         {rec.era}",
        f"created     {_iso(rec.created_at_ms)} ({_span(now_ms - rec.created_at_ms)} ago)",
        f"updated     {_iso(rec.updated_at_ms)} ({_span(now_ms - rec.updated_at_ms)} ago)",
        "expires     never (unlimited ttl)" if rec.expires_at_ms is None else
        f"expires     {_iso(rec.expires_at_ms)} (ttl {_span(rec.ttl_ms or 0)}, {_span(rec.expires_at_ms - now_ms)} left)",
        f"poll every  {rec.poll_interval_ms} ms" if rec.poll_interval_ms is not None else "poll every  -",
        f"owner       {rec.owner}",
    ]
    for name, title in (("input_requests", "input requests"), ("result", "result"), ("error", "error")):
        data = getattr(rec, name)
        if data is not None:
            lines.append(f"{title}:")
            lines += ["  " + line for line in json.dumps(_payload(data), indent=2, ensure_ascii=False).splitlines()]
    return "\n".join(lines)
