"""Hot reload under load: calls at concurrency C while a plugin is modified N times.

Runs ``toolcell serve --stdio`` (default policy: strict) on a temporary plugin folder holding the
``echo`` plugin and a ``mut`` plugin. Keeps C ``tools/call`` requests in flight, alternating between
``echo`` and ``mut_stable`` (a tool of the plugin being modified, present in every version), and
rewrites ``mut`` every ``--interval`` seconds, adding one tool each time. Reports:

* calls answered, failed (JSON-RPC error or ``isError``) and lost (sent but never answered);
* for each modification, the time from the file write to the ``notifications/tools/list_changed``
  line reaching the client (median and max), and how many notifications arrived;
* where that time went (medians, from the daemon's log): ``watch`` (write -> the watcher fires),
  ``scan`` (which folders changed), ``load`` (the new version's first worker spawned, isolated,
  plugin imported, ``Ready`` checked), ``swap`` (catalog swap and notification queued); the rest
  is the transport writing the line and the client reading it;
* the environment: cores, load average, versions.

Usage: ``python benchmarks/reload_bench.py [-c 32] [--changes 10] [--interval 1.0] [--policy strict]
[--json FILE] [--keep-log FILE]``
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import selectors
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_mut(folder: Path, version: int) -> None:
    lines = ["from sandbox import tool", "", "@tool", "def mut_stable(text: str) -> str:",
             '    """Present in every version."""', "    return text", ""]
    for i in range(version):
        lines += ["@tool", f"def mut_v{i}(x: int = 0) -> int:", f'    """Added by change {i}."""', f"    return {i}", ""]
    tmp = folder / ".mut.py.tmp"
    tmp.write_text("\n".join(lines))
    os.replace(tmp, folder / "mut.py")  # atomic, like an editor's save


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def breakdown(stderr_log: Path, writes_wall: list[float]) -> dict[str, float | None]:
    """Where the time went, from the daemon's log (wall-clock ``ts``, ms resolution): write ->
    watcher fires (``reload_requested``), the reload's own phases (``reload_done``: scan, load =
    new worker started and Ready, swap), and reload done -> the client heard it (the remainder)."""
    records = []
    for line in stderr_log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") in ("reload_requested", "reload_done"):
            records.append(rec)
    cols: dict[str, list[float]] = {"watch": [], "scan": [], "load": [], "swap": [], "reload": []}
    for i, w in enumerate(writes_wall):
        limit = writes_wall[i + 1] if i + 1 < len(writes_wall) else float("inf")
        req = next((r for r in records if r["event"] == "reload_requested" and w - 0.001 <= r["ts"] < limit), None)
        if req is None:
            continue
        done = next((r for r in records if r["event"] == "reload_done" and r["ts"] >= req["ts"] and r.get("changed")), None)
        cols["watch"].append((req["ts"] - w) * 1000)
        if done is not None:
            cols["reload"].append((done["ts"] - req["ts"]) * 1000)
            for key in ("scan", "load", "swap"):
                if f"{key}_ms" in done:
                    cols[key].append(done[f"{key}_ms"])
    return {k: round(statistics.median(v), 1) if v else None for k, v in cols.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-c", "--concurrency", type=int, default=32)
    ap.add_argument("--changes", type=int, default=10)
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between modifications")
    ap.add_argument("--policy", default="strict")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--keep-log", help="copy the daemon's log (JSON lines) here")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="toolcell-reload-bench-"))
    os.chmod(work, 0o755)
    plugins = work / "plugins"
    shutil.copytree(REPO / "benchmarks" / "plugins" / "echo", plugins / "echo")
    mut = plugins / "mut"
    mut.mkdir(parents=True)
    (mut / "plugin.toml").write_text('name = "mut"\nversion = "1"\nentry = "mut"\n[limits]\nmax_concurrency = 2\n')
    write_mut(mut, 0)
    for p in (plugins, plugins / "echo", mut):
        os.chmod(p, 0o755)

    cmd = [sys.executable, "-m", "runtime.cli", "serve", "--stdio", "--policy", args.policy, "--plugins", str(plugins)]
    err = open(work / "stderr.log", "wb")
    proc = subprocess.Popen(cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, bufsize=0)
    out_fd = proc.stdout.fileno()  # type: ignore[union-attr]
    os.set_blocking(out_fd, False)
    sel = selectors.DefaultSelector()
    sel.register(out_fd, selectors.EVENT_READ)

    def send(obj: object) -> None:
        proc.stdin.write(json.dumps(obj).encode() + b"\n")  # type: ignore[union-attr]

    buf = b""

    def read_lines(timeout: float) -> list[bytes]:
        nonlocal buf
        if not sel.select(timeout):
            return []
        try:
            chunk = os.read(out_fd, 1 << 20)
        except BlockingIOError:
            return []
        if not chunk:
            raise SystemExit("daemon exited; see " + str(work / "stderr.log"))
        buf += chunk
        *lines, buf = buf.split(b"\n")
        return lines

    send({"jsonrpc": "2.0", "id": 0, "method": "initialize",
          "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "reload-bench", "version": "1"}}})
    started = time.monotonic()
    while not any(b'"id":0' in line for line in read_lines(30)):
        if time.monotonic() - started > 60:
            raise SystemExit("no initialize answer")
    send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    templates = [b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"echo","arguments":{"text":"hi"}}}\n',
                 b'{"jsonrpc":"2.0","id":%d,"method":"tools/call","params":{"name":"mut_stable","arguments":{"text":"hi"}}}\n']
    next_id = 1
    outstanding: set[int] = set()
    answered = failed = 0
    failures: list[str] = []

    def fire(n: int) -> None:
        nonlocal next_id
        data = []
        for _ in range(n):
            data.append(templates[next_id % 2] % next_id)
            outstanding.add(next_id)
            next_id += 1
        proc.stdin.write(b"".join(data))  # type: ignore[union-attr]

    writes: list[float] = []
    writes_wall: list[float] = []
    heard: list[float] = []
    fire(args.concurrency)
    t0 = time.monotonic()
    next_change = t0 + args.interval
    end = t0 + args.interval * (args.changes + 1)
    progress_every = max(1, args.changes // 10)
    while True:
        now = time.monotonic()
        if len(writes) < args.changes and now >= next_change:
            write_mut(mut, len(writes) + 1)
            writes.append(time.monotonic())
            writes_wall.append(time.time())
            next_change += args.interval
            if len(writes) % progress_every == 0:
                print(f"  change {len(writes)}/{args.changes} written; {answered} calls answered", file=sys.stderr)
        if now >= end:
            break
        for line in read_lines(0.01):
            if b"notifications/tools/list_changed" in line:
                heard.append(time.monotonic())
                continue
            msg = json.loads(line)
            if "id" not in msg:
                continue
            outstanding.discard(msg["id"])
            answered += 1
            if "error" in msg or msg.get("result", {}).get("isError"):
                failed += 1
                if len(failures) < 5:
                    failures.append(json.dumps(msg)[:300])
            fire(1)
    # drain: every call sent must be answered
    drain_until = time.monotonic() + 15
    while outstanding and time.monotonic() < drain_until:
        for line in read_lines(0.1):
            if b"notifications/tools/list_changed" in line:
                heard.append(time.monotonic())
                continue
            msg = json.loads(line)
            if "id" in msg and msg["id"] in outstanding:
                outstanding.discard(msg["id"])
                answered += 1
                if "error" in msg or msg.get("result", {}).get("isError"):
                    failed += 1
    elapsed = time.monotonic() - t0
    proc.stdin.close()  # type: ignore[union-attr]
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()

    # Pair each write with the first notification after it (and before the next write).
    latencies = []
    for i, w in enumerate(writes):
        limit = writes[i + 1] if i + 1 < len(writes) else float("inf")
        after = [h for h in heard if w <= h < limit]
        if after:
            latencies.append((after[0] - w) * 1000)
    phases = breakdown(work / "stderr.log", writes_wall)
    result = {
        "concurrency": args.concurrency, "changes": len(writes), "policy": args.policy,
        "calls_answered": answered, "calls_failed": failed, "calls_lost": len(outstanding),
        "calls_per_s": round(answered / elapsed), "list_changed_received": len(heard),
        "write_to_list_changed_ms": {"median": round(statistics.median(latencies), 1) if latencies else None,
                                     "max": round(max(latencies), 1) if latencies else None,
                                     "all": [round(x, 1) for x in latencies]},
        "phases_ms_median": phases,
        "nproc": os.cpu_count(), "loadavg": os.getloadavg(),
        "versions": {"python": platform.python_version(), "trio": _version("trio"), "watchfiles": _version("watchfiles"),
                     "kernel": platform.release()},
    }
    print(json.dumps(result, indent=2))
    if failures:
        print("first failures:", *failures, sep="\n  ", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.keep_log:
        shutil.copyfile(work / "stderr.log", args.keep_log)
    shutil.rmtree(work, ignore_errors=True)
    ok = failed == 0 and not outstanding and len(latencies) == len(writes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
