"""Three toolcell replicas behind HAProxy (the shipped config, plain round-robin) with one Redis:
2026-07-28 clients are served by any replica for every step of a conversation; 2025-11-25 sessions
stick to the replica that opened them; replicas share only what the operator gives each of them."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import trio
from replica_cluster import Cluster, config_of, open_cluster, sighup
from task_e2e import (REPO, sleeper_plugin, LEGACY, SUB_ID, TOKENS, WAIT_S, Http, SseStream, error_code, read_text,
                      text_of, until)

ELICIT = {"elicitation": {"form": {}}}
TERMINAL = {"completed", "failed", "cancelled"}


async def modern_post(client: httpx2.AsyncClient, cluster: Cluster, method: str, params: dict[str, Any],
                      **kw: Any) -> tuple[str, int, dict[str, Any], bytes]:
    """One 2026-07-28 request through the balancer: (replica that answered, status, reply, raw body)."""
    http = Http(client, cluster.url, TOKENS["alice"])
    headers, body = http.modern_request(method, params, **kw)
    with trio.fail_after(WAIT_S):
        r = await client.post(cluster.url, content=body, headers=headers)
    return r.headers["x-toolcell-replica"], r.status_code, r.json(), r.content


async def test_modern_clients_are_served_by_any_replica_through_plain_round_robin(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    async with open_cluster(tmp_path / "cluster", sleeper_plugin(make_plugin)) as cluster, \
            httpx2.AsyncClient(timeout=WAIT_S) as client:
        # Plain calls: spread over every replica, each answered once, with its own answer.
        served: Counter[str] = Counter()
        for i in range(12):
            replica, status, reply, _ = await modern_post(client, cluster, "tools/call", {
                "name": "slow_compute", "arguments": {"seconds": 0, "label": f"call{i}"}}, ext=False)
            assert status == 200 and text_of(reply["result"]) == f"computed call{i} after 0.0 s", reply
            served[replica] += 1
        assert set(served) == {"replica1", "replica2", "replica3"}, served

        # tools/list is byte-identical on every replica (the same plugins), and so is the fingerprint.
        listings = {}
        for _ in range(3):
            replica, status, _, raw = await modern_post(client, cluster, "tools/list", {}, ext=False)
            listings[replica] = raw.replace(b'"id":' + str(json.loads(raw)["id"]).encode(), b"")
        assert len(listings) == 3 and len(set(listings.values())) == 1
        prints = {(await cluster.healthz(client, d))[1]["catalog"] for d in cluster.replicas}
        assert len(prints) == 1

        # input_required: the retry carrying requestState lands on another replica and resumes there.
        first, status, asked, _ = await modern_post(client, cluster, "tools/call", {
            "name": "test_input_required_result_elicitation", "arguments": {}}, ext=False, caps=ELICIT)
        assert status == 200 and asked["result"]["resultType"] == "input_required", asked
        retry = {"name": "test_input_required_result_elicitation", "arguments": {},
                 "inputResponses": {"user_name": {"action": "accept", "content": {"name": "Ada"}}},
                 "requestState": asked["result"]["requestState"]}
        second, status, done, _ = await modern_post(client, cluster, "tools/call", retry, ext=False, caps=ELICIT)
        assert second != first and status == 200 and text_of(done["result"]) == "Hello, Ada!", done

        # A task created on one replica: listened to, read, answered, its result read, through others.
        creator, _, created, _ = await modern_post(client, cluster, "tools/call", {
            "name": "ask_later", "arguments": {"seconds": 1.0}}, caps=ELICIT)
        task_id = created["result"]["taskId"]
        http = Http(client, cluster.url, TOKENS["alice"])
        listen = SseStream()
        headers, body = http.modern_request("subscriptions/listen", {"notifications": {"taskIds": [task_id]}})
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: listen.run(client, "POST", cluster.url, headers=headers,
                                                               content=body, task_status=task_status))
            waiting = await until(lambda: http.task_get(task_id), lambda t: t["status"] != "working")
            assert waiting["status"] == "input_required", waiting
            heard = await listen.wait_for(lambda m: m.get("method") == "notifications/tasks"
                                          and m["params"]["status"] == "input_required")
            assert heard["params"]["taskId"] == task_id and SUB_ID in heard["params"]["_meta"]
            [key] = waiting["inputRequests"]
            for _ in range(3):  # round-robin: at least one of these lands on another replica than the creator
                answerer, status, ack, _ = await modern_post(client, cluster, "tasks/update", {
                    "taskId": task_id, "inputResponses": {key: {"action": "accept", "content": {"go": True}}}})
                assert status == 200 and ack["result"]["resultType"] == "complete"
                if answerer != creator:
                    break
            assert answerer != creator
            finished = await listen.wait_for(lambda m: m.get("method") == "notifications/tasks"
                                             and m["params"]["status"] == "completed")
            assert text_of(finished["params"]["result"]) == "went on"
            nursery.cancel_scope.cancel()

        # Cancelled through another replica than the one running it; every replica reads it cancelled.
        runner, _, long, _ = await modern_post(client, cluster, "tools/call", {
            "name": "slow_compute", "arguments": {"seconds": 60}})
        long_id = long["result"]["taskId"]
        canceller = runner
        while canceller == runner:
            canceller, status, ack, _ = await modern_post(client, cluster, "tasks/cancel", {"taskId": long_id})
            assert status == 200 and ack["result"]["resultType"] == "complete"
        for _ in range(3):
            _, status, read, _ = await modern_post(client, cluster, "tasks/get", {"taskId": long_id})
            assert read["result"]["status"] == "cancelled", read


async def test_a_listen_on_one_replica_hears_tasks_that_run_on_another(tmp_path: Path) -> None:
    """The listen and the task are on different replicas by construction (two replicas, direct)."""
    async with open_cluster(tmp_path / "cluster", replicas=2) as cluster, \
            httpx2.AsyncClient(timeout=WAIT_S) as client:
        one, two = cluster.replicas
        via_one = Http(client, one.url, TOKENS["alice"])
        via_two = Http(client, two.url, TOKENS["alice"])
        created = (await via_one.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0.5}}))[1]
        task_id = created["result"]["taskId"]
        listen = SseStream()
        headers, body = via_two.modern_request("subscriptions/listen", {"notifications": {"taskIds": [task_id]}})
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: listen.run(client, "POST", two.url, headers=headers,
                                                               content=body, task_status=task_status))
            done = await listen.wait_for(lambda m: m.get("method") == "notifications/tasks")
            assert done["params"]["taskId"] == task_id and done["params"]["status"] == "completed"
            assert text_of(done["params"]["result"]) == "computed result after 0.5 s"
            nursery.cancel_scope.cancel()
        # Bob, listening for Alice's task on the other replica, hears nothing of it.
        bob = Http(client, two.url, TOKENS["bob"])
        other = (await via_one.modern("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0.3}}))[1]
        snoop = SseStream()
        headers, body = bob.modern_request("subscriptions/listen", {"notifications": {"taskIds": [other["result"]["taskId"]]}})
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: snoop.run(client, "POST", two.url, headers=headers,
                                                              content=body, task_status=task_status))
            await via_one.wait_task(other["result"]["taskId"], TERMINAL)
            await trio.sleep(0.5)  # several of the listening replica's store reads
            assert not [m for m in snoop.messages if m.get("method") == "notifications/tasks"]
            nursery.cancel_scope.cancel()


async def legacy_post(client: httpx2.AsyncClient, url: str, session: str | None, message: dict[str, Any]
                      ) -> httpx2.Response:
    headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
               "authorization": f"Bearer {TOKENS['alice']}"}
    if session is not None:
        headers |= {"mcp-session-id": session, "mcp-protocol-version": LEGACY}
    with trio.fail_after(WAIT_S):
        return await client.post(url, json=message, headers=headers)


async def test_legacy_sessions_stick_to_their_replica_and_hear_its_requests_and_catalog_changes(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("extra", "from sandbox import tool\n\n@tool\ndef ping() -> str:\n    return 'pong'\n")
    extra = plugins / "extra"
    moved = plugins.parent / "extra-later"
    extra.rename(moved)  # added later, while the replicas run
    async with open_cluster(tmp_path / "cluster", plugins) as cluster, httpx2.AsyncClient(timeout=WAIT_S) as client:
        sessions: dict[str, str] = {}  # replica -> session opened there
        for attempt in range(9):
            r = await legacy_post(client, cluster.url, None, {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": LEGACY, "capabilities": {"elicitation": {"form": {}}},
                "clientInfo": {"name": "replicas", "version": "1"}}})
            assert r.status_code == 200, r.text
            session = r.headers["mcp-session-id"]
            r = await legacy_post(client, cluster.url, session, {"jsonrpc": "2.0", "method": "notifications/initialized"})
            assert r.status_code == 202, r.text
            sessions.setdefault(r.headers["x-toolcell-replica"], session)
        assert len(sessions) == 3, sessions  # round-robin spread the sessions

        # Every request of a session reaches its replica: never "session not found".
        for replica, session in sessions.items():
            for i in range(6):
                r = await legacy_post(client, cluster.url, session, {"jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
                                                                     "params": {"name": "slow_compute",
                                                                                "arguments": {"seconds": 0, "label": str(i)}}})
                assert r.status_code == 200 and r.headers["x-toolcell-replica"] == replica, (r.status_code, r.text)

        # A server->client request (elicitation) reaches the client on the call's stream; the answer,
        # a POST of its own, goes to the replica waiting for it.
        session = sessions["replica2"]
        headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
                   "authorization": f"Bearer {TOKENS['alice']}", "mcp-session-id": session,
                   "mcp-protocol-version": LEGACY}
        call = {"jsonrpc": "2.0", "id": 50, "method": "tools/call",
                "params": {"name": "test_elicitation", "arguments": {"message": "Your name?"}}}
        result: dict[str, Any] = {}
        async with client.stream("POST", cluster.url, json=call, headers=headers) as response:
            assert response.headers["x-toolcell-replica"] == "replica2"
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                message = json.loads(line[5:])
                if message.get("method") == "elicitation/create":
                    answer = await legacy_post(client, cluster.url, session, {"jsonrpc": "2.0", "id": message["id"], "result": {
                        "action": "accept", "content": {"username": "ada", "email": "ada@example.com"}}})
                    assert answer.status_code == 202, answer.text
                elif message.get("id") == 50:
                    result = message  # the stream ends after it
        assert "result" in result and not result["result"].get("isError"), result

        # Each session's GET stream hears list_changed when its replica reloads a changed folder; the
        # one replica not reloaded says its catalog differs, and the others say so of it.
        streams = {name: SseStream() for name in sessions}
        async with trio.open_nursery() as nursery:
            for name, sid in sessions.items():
                get_headers = {"accept": "text/event-stream", "authorization": f"Bearer {TOKENS['alice']}",
                               "mcp-session-id": sid, "mcp-protocol-version": LEGACY}
                await nursery.start(lambda task_status, h=get_headers, s=streams[name]: s.run(
                    client, "GET", cluster.url, headers=h, task_status=task_status))
            assert all(s.status == 200 for s in streams.values())
            moved.rename(extra)
            for name in ("replica1", "replica2"):
                sighup(cluster.replica(name))
            for name in ("replica1", "replica2"):
                await streams[name].wait_for(lambda m: m.get("method") == "notifications/tools/list_changed")

            stale = cluster.replica("replica3")

            async def differing() -> list[Any]:
                return [(await cluster.healthz(client, d))[1]["catalog_differs"] for d in cluster.replicas]

            # replica3 differs from both others; each of them from replica3 only.
            await until(differing, lambda found: [len(f) for f in found] == [1, 1, 2], within=WAIT_S)
            health = {cluster.name_of(d): (await cluster.healthz(client, d))[1] for d in cluster.replicas}
            assert health["replica1"]["catalog"] == health["replica2"]["catalog"] != health["replica3"]["catalog"]
            assert health["replica1"]["catalog_differs"] == health["replica2"]["catalog_differs"]
            with trio.fail_after(WAIT_S):
                metrics = (await client.get(cluster.metrics_url(stale))).text
            assert f'toolcell_catalog_info{{fingerprint="{health["replica3"]["catalog"]}"}} 1.0' in metrics
            assert "toolcell_catalog_differing_replicas 2.0" in metrics
            sighup(stale)
            await streams["replica3"].wait_for(lambda m: m.get("method") == "notifications/tools/list_changed")
            await until(differing, lambda found: not any(found), within=WAIT_S)
            nursery.cancel_scope.cancel()
        for name in ("replica1", "replica2"):  # exactly one list_changed each
            assert sum(m.get("method") == "notifications/tools/list_changed" for m in streams[name].messages) == 1

        # An unknown session is still refused (404), as the spec has it: the balancer does not mask it.
        r = await legacy_post(client, cluster.url, "no-such-session", {"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        assert r.status_code == 404 and error_code(r.json()) is not None


GATED_V1 = """
from sandbox import tool

@tool
def ping() -> str:
    return "pong v1"
"""

GATED_V2 = """
from sandbox import tool

@tool
def ping() -> str:
    return "pong v2"

@tool
def shout(text: str) -> str:
    return text.upper()
"""


async def toolcell_approve(cluster: Cluster, replica: str, name: str, plugins: Path) -> str:
    """``toolcell approve NAME --yes`` run once, on one replica's box, with that replica's config."""
    done = await trio.run_process(
        [sys.executable, "-m", "runtime.cli", "approve", name, "--yes", "--config", str(config_of(cluster, replica)),
         "--plugins", str(plugins)], cwd=str(REPO), capture_stdout=True, capture_stderr=True, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


async def test_one_approval_reaches_every_replica_and_a_widening_edit_is_held_on_every_replica_until_then(
        tmp_path: Path, make_plugin: Callable[..., Path]) -> None:
    plugins = make_plugin("gated", GATED_V1, prefix="gated_", limits={"timeout_s": 5})
    folder = plugins / "gated"
    async with open_cluster(tmp_path / "cluster", plugins, shared_approvals=True) as cluster, \
            httpx2.AsyncClient(timeout=WAIT_S) as client:
        direct = {cluster.name_of(d): Http(client, d.url, TOKENS["alice"]) for d in cluster.replicas}

        async def listings() -> dict[str, list[str]]:
            found = {}
            for name, http in direct.items():
                status, reply = await http.modern("tools/list", {}, ext=False)
                assert status == 200, reply
                found[name] = sorted(t["name"] for t in reply["result"]["tools"] if t["name"].startswith("gated_"))
            return found

        async def through_balancer(tool: str, arguments: dict[str, Any]) -> set[tuple[str, str]]:
            answers = set()
            for _ in range(6):  # round-robin: every replica answers twice
                replica, status, reply, _ = await modern_post(client, cluster, "tools/call", {
                    "name": tool, "arguments": arguments}, ext=False)
                assert status == 200 and "result" in reply, reply
                answers.add((replica, text_of(reply["result"])))
            return answers

        # Approved once, on replica1's box: the record is in Redis, signed with the operator's key.
        out = await toolcell_approve(cluster, "replica1", "gated", plugins)
        assert "every daemon reading it picks it up" in out, out
        assert await listings() == {name: ["gated_ping"] for name in direct}

        # A widening edit (a higher limit) that also adds a tool: every replica holds it and keeps
        # serving the approved version.
        (folder / "gated.py").write_text(GATED_V2)
        manifest = (folder / "plugin.toml").read_text()
        (folder / "plugin.toml").write_text(manifest.replace("timeout_s = 5", "timeout_s = 50"))
        streams = {name: SseStream() for name in direct}
        async with trio.open_nursery() as nursery:
            for name, http in direct.items():
                headers, body = http.modern_request("subscriptions/listen", {"notifications": {"toolsListChanged": True}})
                await nursery.start(lambda task_status, h=headers, b=body, s=streams[name], u=http.url: s.run(
                    client, "POST", u, headers=h, content=b, task_status=task_status))
            for daemon in cluster.replicas:
                sighup(daemon)  # what each replica's watcher does in production (the harness runs --no-watch)

            async def held_on_every_replica() -> list[bool]:
                return ["needs approval: asks for more than was approved (limits.timeout_s: 5 -> 50)"
                        in read_text(d.log) for d in cluster.replicas]

            await until(held_on_every_replica, all, within=WAIT_S)
            assert await listings() == {name: ["gated_ping"] for name in direct}
            assert await through_balancer("gated_ping", {}) == {(n, "pong v1") for n in direct}

            # Approved once more, from another box: every replica loads it and says list_changed.
            await toolcell_approve(cluster, "replica3", "gated", plugins)
            for name in direct:
                await streams[name].wait_for(lambda m: m.get("method") == "notifications/tools/list_changed")
            nursery.cancel_scope.cancel()
        for name in direct:  # exactly one each: the first approval changed no catalog
            assert sum(m.get("method") == "notifications/tools/list_changed" for m in streams[name].messages) == 1
        assert await listings() == {name: ["gated_ping", "gated_shout"] for name in direct}
        raw = set()
        for http in direct.values():
            headers, body = http.modern_request("tools/list", {}, ext=False)
            r = await client.post(http.url, content=body, headers=headers)
            raw.add(r.content.replace(b'"id":' + str(json.loads(r.content)["id"]).encode(), b""))
        assert len(raw) == 1  # byte-identical on every replica
        assert await through_balancer("gated_shout", {"text": "hi"}) == {(n, "HI") for n in direct}
        assert await through_balancer("gated_ping", {}) == {(n, "pong v2") for n in direct}
        # Nothing of it was kept in a replica's state dir.
        assert not [d for d in direct if (cluster.folder / d / "state" / "approvals.json").exists()]
