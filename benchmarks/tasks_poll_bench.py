"""``tasks/get`` polling through a real toolcell daemon, over a task store holding 100,000 tasks.

For each backend (SQLite in the daemon's state dir; Redis, a private ``redis-server``) this:

1. fills the store with ``--tasks`` finished tasks spread over 2,000 other principals (written with
   the store's own ``create``/``transition``, as the daemon would);
2. starts ``toolcell serve --http`` on that store, serving the benchmark ``echo`` plugin with
   ``[tools.echo] task_support = "optional"``;
3. creates ``--live`` tasks of its own through MCP (2025-11-25: ``tools/call`` with ``params.task``
   in a legacy session; ``--modern``: 2026-07-28 with the tasks extension declared), waits for them
   to complete;
4. polls ``tasks/get`` on them from ``-c`` keep-alive connections for ``-s`` seconds with ``wrk``
   (a C load generator, so the client is not the limit; Debian package ``wrk``), every response
   checked by a Lua hook (HTTP 200 and a ``"status":"completed"`` body; anything else counted).

It prints calls/s, p50/p99 (wrk's latency distribution) and errors per backend, with the versions,
core count and load average.

    python benchmarks/tasks_poll_bench.py                     # both backends, 100,000 tasks, c=64, 10 s, 2025-11-25
    python benchmarks/tasks_poll_bench.py --modern --backends sqlite -s 5
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.task_store import TaskRecord, new_owner_id, new_task_id, wall_clock_ms  # noqa: E402
from runtime.task_store_open import connect_task_store  # noqa: E402

PRINCIPALS = 2_000
EXT = "io.modelcontextprotocol/tasks"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def fill(url: str | None, state_dir: str, n: int) -> None:
    """``n`` finished tasks of other principals (50 each at most, under the default live cap)."""
    store = await connect_task_store(url, state_dir)
    owner = new_owner_id()
    result = json.dumps({"content": [{"type": "text", "text": "x" * 160}]}).encode()
    try:
        sem = trio.Semaphore(64)

        async def one(i: int) -> None:
            async with sem:
                now = wall_clock_ms()
                rec = TaskRecord(task_id=new_task_id(), principal=f"p{i % PRINCIPALS}", tool="echo", era="2025-11-25",
                                 status="working", created_at_ms=now, updated_at_ms=now, ttl_ms=86_400_000,
                                 poll_interval_ms=1000, owner=owner)
                await store.create(rec, 1_000_000)
                await store.transition(rec.task_id, status="completed", now_ms=now, result=result)

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(one, i)
    finally:
        await store.aclose()


class Client:
    """A tiny MCP client over one keep-alive connection (set-up only; the load is wrk's)."""

    def __init__(self, port: int, modern: bool) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.modern = modern
        self.session: str | None = None
        self.next_id = 0

    def post(self, method: str, params: dict[str, Any], name: str | None = None) -> dict[str, Any]:
        self.next_id += 1
        headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        if self.modern:
            params = {**params, "_meta": meta()}
            headers.update({"MCP-Protocol-Version": "2026-07-28", "Mcp-Method": method})
            if name is not None:
                headers["Mcp-Name"] = name
        elif self.session:
            headers["Mcp-Session-Id"] = self.session
        body = json.dumps({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        self.conn.request("POST", "/mcp", body, headers)
        resp = self.conn.getresponse()
        data = resp.read()
        if resp.getheader("mcp-session-id"):
            self.session = resp.getheader("mcp-session-id")
        if not data:
            return {}
        parsed: dict[str, Any] = json.loads(data)
        return parsed

    def open(self) -> None:
        if self.modern:
            return
        self.post("initialize", {"protocolVersion": "2025-11-25", "capabilities": {},
                                 "clientInfo": {"name": "tasks-bench", "version": "1"}})
        self.next_id += 1
        body = json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"})
        self.conn.request("POST", "/mcp", body, {"Content-Type": "application/json",
                                                 "Accept": "application/json, text/event-stream",
                                                 "Mcp-Session-Id": self.session or ""})
        self.conn.getresponse().read()


def meta() -> dict[str, Any]:
    return {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "io.modelcontextprotocol/clientCapabilities": {"extensions": {EXT: {}}},
            "io.modelcontextprotocol/clientInfo": {"name": "tasks-bench", "version": "1"}}


def create_tasks(client: Client, n: int) -> list[str]:
    ids = []
    for i in range(n):
        params: dict[str, Any] = {"name": "echo", "arguments": {"text": f"task {i}"}}
        if not client.modern:
            params["task"] = {"ttl": 3_600_000}
        answer = client.post("tools/call", params, "echo")
        result = answer.get("result") or {}
        task_id = result.get("taskId") if client.modern else (result.get("task") or {}).get("taskId")
        if not isinstance(task_id, str):
            raise SystemExit(f"tools/call did not create a task: {answer}")
        ids.append(task_id)
    deadline = time.monotonic() + 60
    for task_id in ids:
        while True:
            got = client.post("tasks/get", {"taskId": task_id}, task_id).get("result") or {}
            if got.get("status") == "completed":
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"task {task_id} did not complete: {got}")
            time.sleep(0.05)
    return ids


LUA = r"""
local ids = {IDS}
local modern = {MODERN}
local session = "{SESSION}"
local n = 0
local bad = 0
request = function()
  n = n + 1
  local id = ids[(n % #ids) + 1]
  local body
  local headers = {["Content-Type"] = "application/json", ["Accept"] = "application/json, text/event-stream"}
  if modern then
    body = '{"jsonrpc":"2.0","id":' .. n .. ',"method":"tasks/get","params":{"taskId":"' .. id ..
      '","_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28","io.modelcontextprotocol/clientCapabilities":{"extensions":{"io.modelcontextprotocol/tasks":{}}}}}}'
    headers["MCP-Protocol-Version"] = "2026-07-28"
    headers["Mcp-Method"] = "tasks/get"
    headers["Mcp-Name"] = id
  else
    body = '{"jsonrpc":"2.0","id":' .. n .. ',"method":"tasks/get","params":{"taskId":"' .. id .. '"}}'
    headers["Mcp-Session-Id"] = session
  end
  return wrk.format("POST", "/mcp", headers, body)
end
response = function(status, headers, body)
  if status ~= 200 or not string.find(body, '"status":"completed"', 1, true) then
    bad = bad + 1
  end
end
done = function(summary, latency, requests)
  io.write(string.format("BENCH %d %d %.3f %.3f %d\n", summary.requests, summary.duration,
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, bad + summary.errors.status + summary.errors.connect +
    summary.errors.read + summary.errors.write + summary.errors.timeout))
end
"""


def run_wrk(port: int, ids: list[str], session: str | None, modern: bool, concurrency: int, seconds: float,
            workdir: Path) -> dict[str, float]:
    # wrk's Lua state is per thread: the response hook counts each thread's bad answers; 1 thread keeps
    # the count whole (wrk's C event loop drives 64 connections from one thread easily).
    script = workdir / "poll.lua"
    script.write_text(LUA.replace("{IDS}", "{" + ",".join(f'"{i}"' for i in ids) + "}")
                      .replace("{MODERN}", "true" if modern else "false").replace("{SESSION}", session or ""))
    out = subprocess.run(["wrk", "-t1", f"-c{concurrency}", f"-d{max(1, round(seconds))}s", "-s", str(script),
                          f"http://127.0.0.1:{port}/mcp"], capture_output=True, text=True, timeout=seconds + 60)
    m = re.search(r"BENCH (\d+) (\d+) ([\d.]+) ([\d.]+) (\d+)", out.stdout)
    if m is None:
        raise SystemExit(f"wrk failed:\n{out.stdout}\n{out.stderr}")
    requests, duration_us, p50, p99, bad = m.groups()
    return {"calls_per_s": int(requests) / (int(duration_us) / 1e6), "p50_ms": float(p50), "p99_ms": float(p99),
            "errors": int(bad), "calls": int(requests)}


def bench_backend(backend: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    state_dir = workdir / f"state-{backend}"
    state_dir.mkdir(mode=0o700)
    redis = None
    url: str | None = None
    try:
        if backend == "redis":
            redis_port = free_port()
            redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no",
                                      "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            url = f"redis://127.0.0.1:{redis_port}/0"
            for _ in range(100):
                try:
                    socket.create_connection(("127.0.0.1", redis_port), timeout=0.1).close()
                    break
                except OSError:
                    time.sleep(0.05)
        t0 = time.monotonic()
        trio.run(fill, url, str(state_dir), args.tasks)
        fill_s = time.monotonic() - t0
        plugin = workdir / f"plugins-{backend}" / "echo"
        shutil.copytree(REPO / "benchmarks" / "plugins" / "echo", plugin)
        with open(plugin / "plugin.toml", "a") as f:
            f.write('\n[tools.echo]\ntask_support = "optional"\n')
        port = free_port()
        config = workdir / f"{backend}.toml"
        store_line = f'store = "{url}"\n' if url else ""
        config.write_text(f'state_dir = "{state_dir}"\nplugins = ["{plugin.parent}"]\nwatch = false\n'
                          f"[tasks]\n{store_line}max_live_per_principal = 1000\n")
        log = open(workdir / f"daemon-{backend}.log", "wb")  # noqa: SIM115 (closed below)
        daemon = subprocess.Popen([sys.executable, "-m", "runtime.cli", "serve", "--http", f"127.0.0.1:{port}",
                                   "--config", str(config), "--log-level", "warning"], cwd=REPO,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        try:
            for _ in range(200):
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            client = Client(port, args.modern)
            client.open()
            ids = create_tasks(client, args.live)
            figures = run_wrk(port, ids, client.session, args.modern, args.concurrency, args.seconds, workdir)
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
            log.close()
        return {"backend": backend, "tasks_in_store": args.tasks + args.live, "fill_s": round(fill_s, 1), **figures}
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=10)


def environment() -> dict[str, Any]:
    import msgspec as _msgspec
    import redis as _redis

    wrk = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    return {"when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": platform.python_version(),
            "trio": trio.__version__, "msgspec": _msgspec.__version__, "redis-py": _redis.__version__,
            "redis-server": server.split()[2] if server else "?", "wrk": wrk[0] if wrk else "?",
            "sqlite": __import__("sqlite3").sqlite_version, "cpus": os.cpu_count(),
            "load": " ".join(f"{x:.2f}" for x in os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,redis")
    parser.add_argument("--tasks", type=int, default=100_000, help="finished tasks of other principals in the store")
    parser.add_argument("--live", type=int, default=64, help="tasks of our own, polled")
    parser.add_argument("-c", "--concurrency", type=int, default=64)
    parser.add_argument("-s", "--seconds", type=float, default=10.0)
    parser.add_argument("--modern", action="store_true", help="2026-07-28 (the tasks extension); default 2025-11-25")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        print("tasks_poll_bench: needs wrk (apt-get install wrk)", file=sys.stderr)
        return 2
    env = environment()
    rows = []
    with tempfile.TemporaryDirectory(prefix="toolcell-tasks-bench-") as tmp:
        for backend in args.backends.split(","):
            rows.append(bench_backend(backend.strip(), args, Path(tmp)))
    env["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    era = "2026-07-28" if args.modern else "2025-11-25"
    print(f"tasks/get polling through toolcell over HTTP ({era}), c={args.concurrency}, {args.seconds:g} s, wrk client\n")
    print("| backend | tasks in store | calls/s | p50 ms | p99 ms | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['backend']} | {r['tasks_in_store']:,} | {r['calls_per_s']:,.0f} | {r['p50_ms']:.2f} | "
              f"{r['p99_ms']:.2f} | {r['errors']} |")
    print("\n- " + "\n- ".join(f"{k}: {v}" for k, v in env.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
