"""Faults under load through HAProxy (both eras, 64 clients at once): a replica drained with SIGTERM,
a replica SIGKILLed, redis-server restarted. Every call is answered exactly once or fails with a
named reason; the tool records each run of a call, so a call run twice (a retry after it ran) is seen."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx2
import trio
from replica_cluster import Cluster, open_cluster, sigterm
from task_e2e import LEGACY, TOKENS, WAIT_S, Http, sigkill, text_of, until

TERMINAL = {"completed", "failed", "cancelled"}
CLIENTS = 64

#: ``record`` appends its label to a file (one line per run, O_APPEND), works a little, answers.
LEDGER = '''
import time

from sandbox import tool


@tool
def record(label: str, ledger: str, seconds: float = 0.02) -> str:
    """Note this run, work a while, answer.

    Args:
        label: The call's own label.
        ledger: The file every run is noted in.
        seconds: How long to work.
    """
    with open(ledger, "a") as f:
        f.write(label + "\\n")
    time.sleep(seconds)
    return "done " + label
'''


def ledger_plugin(make_plugin: Callable[..., Path]) -> Path:
    return make_plugin("ledger", LEDGER, limits={"timeout_s": 30, "max_concurrency": 8})


@dataclass
class Load:
    """``CLIENTS`` clients (half 2026-07-28, half 2025-11-25 sessions) calling ``record`` through the
    balancer until stopped; each call's one outcome by label: "ok" or why it failed."""

    client: httpx2.AsyncClient
    url: str
    ledger: Path
    outcomes: dict[str, str] = field(default_factory=dict)
    reopened: int = 0
    ok: int = 0
    running: bool = True
    progress: trio.Event = field(default_factory=trio.Event)

    def settle(self, label: str, outcome: str) -> None:
        assert label not in self.outcomes, f"{label} answered twice"
        self.outcomes[label] = outcome
        if outcome == "ok":
            self.ok += 1
            if self.ok % 25 == 0:
                self.progress.set()
                self.progress = trio.Event()

    async def more(self, calls: int) -> None:
        """Wait until ``calls`` more calls were answered ok."""
        target = self.ok + calls
        with trio.fail_after(60):
            while self.ok < target:
                await self.progress.wait()

    def judge(self, label: str, response: httpx2.Response) -> str:
        if response.status_code != 200:
            return f"http {response.status_code}"
        reply = response.json()
        if "error" in reply:
            return f"error {reply['error'].get('code')}: {reply['error'].get('message')}"
        result = reply["result"]
        if result.get("isError"):
            return f"tool error: {text_of(result)}"
        assert text_of(result) == f"done {label}", reply  # its own answer, never another call's
        return "ok"

    def arguments(self, label: str) -> dict[str, Any]:
        return {"name": "record", "arguments": {"label": label, "ledger": str(self.ledger)}}

    async def modern_client(self, i: int) -> None:
        http = Http(self.client, self.url, TOKENS["alice"])
        n = 0
        while self.running:
            n += 1
            label = f"m{i}-{n}"
            headers, body = http.modern_request("tools/call", self.arguments(label), ext=False)
            try:
                response = await self.client.post(self.url, content=body, headers=headers)
            except httpx2.TransportError as exc:
                self.settle(label, f"transport {type(exc).__name__}")
                continue
            self.settle(label, self.judge(label, response))

    async def legacy_client(self, i: int) -> None:
        http = Http(self.client, self.url, TOKENS["alice"])
        session = await http.legacy_session()
        n = 0
        while self.running:
            n += 1
            label = f"l{i}-{n}"
            message = {"jsonrpc": "2.0", "id": n, "method": "tools/call", "params": self.arguments(label)}
            try:
                response = await self.client.post(self.url, json=message, headers=http.legacy_headers(session))
                for _ in range(5):
                    if response.status_code == 503:  # "did not run" (its replica is stopping): retry, as the README says
                        await trio.sleep(0.2)
                    elif response.status_code == 404:  # its replica is gone: a new session, as the spec has it
                        self.reopened += 1
                        session = await http.legacy_session()
                    else:
                        break
                    response = await self.client.post(self.url, json=message, headers=http.legacy_headers(session))
            except httpx2.TransportError as exc:
                self.settle(label, f"transport {type(exc).__name__}")
                continue
            self.settle(label, self.judge(label, response))

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for i in range(CLIENTS // 2):
                nursery.start_soon(self.modern_client, i)
                nursery.start_soon(self.legacy_client, i)
            task_status.started()

    def runs(self) -> Counter[str]:
        return Counter(self.ledger.read_text().split())


async def test_a_drained_replica_refuses_nothing_and_a_killed_one_loses_only_its_calls_in_flight(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    async with open_cluster(tmp_path / "cluster", ledger_plugin(make_plugin)) as cluster, \
            httpx2.AsyncClient(timeout=WAIT_S, limits=httpx2.Limits(max_connections=CLIENTS + 8)) as client:
        http = Http(client, cluster.url, TOKENS["alice"])
        drained, killed = cluster.replica("replica2"), cluster.replica("replica3")
        load = Load(client, cluster.url, tmp_path / "ledger")
        async with trio.open_nursery() as nursery:
            await nursery.start(load.run)
            await load.more(200)

            # SIGTERM: /healthz says draining while the replica still serves; HAProxy sends elsewhere.
            sigterm(drained)
            status, health = await until(lambda: cluster.healthz(client, drained), lambda h: h[0] == 404)
            assert health["status"] == "draining", health
            base = cluster.healthz_url(drained).rsplit("/", 1)[0]
            assert (await client.get(base + "/readyz")).status_code == 503  # readiness: out
            assert (await client.get(base + "/livez")).status_code == 200  # liveness: still alive
            direct = Http(client, drained.url, TOKENS["alice"])
            status, reply = await direct.modern("tools/call", load.arguments("direct-while-draining"), ext=False)
            assert status == 200 and text_of(reply["result"]) == "done direct-while-draining"
            with trio.fail_after(WAIT_S):
                await drained.proc.wait()
            await load.more(200)
            refused = {label: o for label, o in load.outcomes.items() if o != "ok"}
            # Nothing refused that another replica could take: every modern call (round-robin) went
            # elsewhere. A legacy session sticks to the drained replica until it stops (no other replica
            # holds it); a call of such a session that HAProxy had just sent as the listener closed is cut
            # (a transport error), and it never ran, so its client may safely send it again (and then
            # gets 404 and a new session, as the loop above does).
            assert all(label.startswith("l") for label in refused), refused
            ran = load.runs()
            assert all(ran[label] == 0 for label in refused), refused
            assert len(refused) <= CLIENTS // 2, refused
            before_kill = len(load.outcomes)

            # SIGKILL, with a task running on the victim and a finished one in the store.
            finished = (await http.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0}}))[1]
            assert (await http.wait_task(finished["result"]["taskId"], TERMINAL))["status"] == "completed"
            running_there = None
            while running_there is None:
                headers, body = http.modern_request("tools/call", {"name": "slow_compute", "arguments": {"seconds": 60}})
                r = await client.post(cluster.url, content=body, headers=headers)
                if r.headers["x-toolcell-replica"] == "replica3":
                    running_there = r.json()["result"]["taskId"]
            await sigkill(killed)
            await load.more(300)
            load.running = False
        outcomes = load.outcomes
        failures = Counter(o for label, o in list(outcomes.items())[before_kill:] if o != "ok")
        # Calls in flight on the killed replica end with a clear error, and only those: HAProxy's 502,
        # or, for a request it had sent on a kept-alive server connection, the client connection closed
        # with no response (HAProxy's way to leave a non-idempotent retry to the client).
        assert set(failures) <= {"http 502", "transport RemoteProtocolError"}, failures
        assert sum(failures.values()) <= CLIENTS
        runs = load.runs()
        assert max(runs.values()) == 1, [label for label, n in runs.items() if n > 1]  # no call ran twice
        assert all(runs[label] == 1 for label, o in outcomes.items() if o == "ok")  # every answer is of one run
        assert len(outcomes) > 1000 and load.reopened > 0

        # Its running task reads failed with a reason; the finished one is still there.
        failed = await http.wait_task(running_there, TERMINAL)
        assert failed["status"] == "failed" and "stopped before it finished" in failed["error"]["message"], failed
        done = await http.task_get(finished["result"]["taskId"])
        assert done["status"] == "completed" and text_of(done["result"]) == "computed result after 0.0 s"


async def test_a_redis_restart_under_load_keeps_plain_calls_working_and_task_requests_retryable(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    async with open_cluster(tmp_path / "cluster", ledger_plugin(make_plugin), replicas=2,
                            persist_redis=True) as cluster, \
            httpx2.AsyncClient(timeout=WAIT_S, limits=httpx2.Limits(max_connections=CLIENTS + 8)) as client:
        http = Http(client, cluster.url, TOKENS["alice"])
        done = (await http.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0}}))[1]
        task_id = done["result"]["taskId"]
        await http.wait_task(task_id, TERMINAL)
        load = Load(client, cluster.url, tmp_path / "ledger")
        task_answers: Counter[str] = Counter()

        async def task_client() -> None:
            while load.running:
                for method, params in (("tasks/get", {"taskId": task_id}),
                                       ("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0}})):
                    headers, body = http.modern_request(method, params)
                    r = await client.post(cluster.url, content=body, headers=headers)
                    if r.status_code == 503:
                        assert r.headers.get("retry-after") == "1", r.headers
                        assert r.json()["error"]["code"] == -31001, r.text
                        task_answers["503"] += 1
                    else:
                        assert r.status_code == 200, r.text
                        task_answers["ok"] += 1

        async with trio.open_nursery() as nursery:
            await nursery.start(load.run)
            nursery.start_soon(task_client)
            await load.more(150)
            cluster.redis.stop()
            down_at = len(load.outcomes)
            await load.more(150)  # plain calls go on without Redis
            answered_down = task_answers["503"]

            async def refused_so_far() -> int:
                return task_answers["503"]

            await until(refused_so_far, lambda n: n > answered_down)  # task requests: 503, retry soon
            cluster.redis.start()
            # The replicas reconnect by themselves: task requests succeed again (a new task is stored).
            created = await until(lambda: http.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0}}),
                                  lambda answer: answer[0] == 200)
            await http.wait_task(created[1]["result"]["taskId"], TERMINAL)
            await load.more(150)
            load.running = False
        assert len(load.outcomes) > down_at
        assert all(o == "ok" for o in load.outcomes.values()), Counter(load.outcomes.values())
        assert task_answers["503"] > 0 and task_answers["ok"] > 0
        # Redis persists (appendonly): the task finished before the restart is still there.
        assert (await http.task_get(task_id))["status"] == "completed"


async def test_a_draining_replica_keeps_its_legacy_sessions_until_it_stops_and_takes_no_new_clients(
        tmp_path: Path) -> None:
    """HAProxy's ``disable-on-404``: /healthz answers 404 while draining, which takes the replica out of
    round-robin but keeps sending it the requests that stick to it."""
    async with open_cluster(tmp_path / "cluster", drain_s=8) as cluster, \
            httpx2.AsyncClient(timeout=WAIT_S) as client:
        http = Http(client, cluster.url, TOKENS["alice"])
        drained = cluster.replica("replica2")

        async def new_session() -> tuple[str, str]:
            body = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "drain", "version": "1"}}}
            with trio.fail_after(WAIT_S):
                r = await client.post(cluster.url, json=body, headers=http.legacy_headers(None))
                assert r.status_code == 200, r.text
                session = r.headers["mcp-session-id"]
                done = await client.post(cluster.url, json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                                         headers=http.legacy_headers(session))
                assert done.status_code == 202, done.text
            return r.headers["x-toolcell-replica"], session

        async def call(session: str, label: str) -> httpx2.Response:
            message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": "slow_compute", "arguments": {"seconds": 0, "label": label}}}
            with trio.fail_after(WAIT_S):
                return await client.post(cluster.url, json=message, headers=http.legacy_headers(session))

        held = None
        while held is None:
            replica, session = await new_session()
            if replica == "replica2":
                held = session
        assert (await call(held, "before")).headers["x-toolcell-replica"] == "replica2"

        sigterm(drained)
        status, health = await until(lambda: cluster.healthz(client, drained), lambda h: h[0] == 404)
        assert health["status"] == "draining", health
        # HAProxy stops sending it new clients: six in a row (two rounds of three) land elsewhere...
        streak = 0

        async def landed_elsewhere() -> int:
            nonlocal streak
            replica, _ = await new_session()
            streak = streak + 1 if replica != "replica2" else 0
            return streak

        await until(landed_elsewhere, lambda n: n >= 6, within=6)
        # ... while its session still reaches it, and is served there.
        for i in range(3):
            r = await call(held, f"draining{i}")
            assert r.status_code == 200 and r.headers["x-toolcell-replica"] == "replica2", (r.status_code, r.text)
            assert text_of(r.json()["result"]) == f"computed draining{i} after 0.0 s"
        # Once it stopped, the session is gone (404 from another replica, as the spec has it).
        with trio.fail_after(WAIT_S):
            await drained.proc.wait()
        r = await call(held, "after")
        assert r.status_code == 404 and r.headers["x-toolcell-replica"] != "replica2", (r.status_code, r.text)
