"""A stand-in daemon for the crash test: it heartbeats, starts one task it never finishes and
completes another, prints both ids, then waits to be killed.

    python task_owner_child.py STORE_URL STATE_DIR NAMESPACE
"""

from __future__ import annotations

import json
import sys

import trio

from runtime.task_store import TaskRecord, new_owner_id, new_task_id, wall_clock_ms
from runtime.task_store_open import connect_task_store


async def main(url: str, state_dir: str, namespace: str) -> None:
    store = await connect_task_store(url, state_dir, namespace=namespace)
    owner = new_owner_id()
    now_ms = wall_clock_ms()
    await store.heartbeat(owner, now_ms)
    ids = {}
    for name in ("running", "finished"):
        rec = TaskRecord(task_id=new_task_id(), principal="alice", tool="slow_tool", era="2026-07-28",
                         status="working", created_at_ms=now_ms, updated_at_ms=now_ms, ttl_ms=600_000, owner=owner)
        await store.create(rec, 10)
        ids[name] = rec.task_id
    await store.transition(ids["finished"], status="completed", now_ms=wall_clock_ms(),
                           result=b'{"content": [{"type": "text", "text": "done"}], "isError": false}')
    print(json.dumps({"owner": owner, **ids}), flush=True)
    await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:4])
