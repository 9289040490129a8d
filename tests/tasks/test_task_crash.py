"""A daemon killed with SIGKILL mid-task: after the restart its task reads failed, never working,
and the result of a task it had finished is still served (both backends, a real process)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import trio
from store_harness import OpenStore

from runtime.task_store import ORPHAN_ERROR_CODE, local_owner_verdict, new_owner_id, wall_clock_ms

REPO = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("task_owner_child.py")


async def test_a_task_of_a_killed_daemon_reads_failed_after_the_restart_and_a_finished_one_keeps_its_result(
        open_store: OpenStore, store_url: str, tmp_path: Path) -> None:
    restarted = await open_store()
    child = await trio.lowlevel.open_process([sys.executable, str(CHILD), store_url, str(tmp_path),
                                              open_store.namespace],
                                             cwd=str(REPO), stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = b""
        with trio.fail_after(60):
            while not line.endswith(b"\n"):
                chunk = await child.stdout.receive_some(4096)
                assert chunk, "the child exited before creating its tasks"
                line += chunk
        started = json.loads(line)
    finally:
        child.send_signal(signal.SIGKILL)
        with trio.fail_after(30):
            await child.wait()
    assert child.returncode == -signal.SIGKILL

    running = await restarted.get(started["running"], "alice")
    assert running is not None and running.status == "working"  # nobody has looked yet
    # Its heartbeat is fresh, so only the verdict (same host, pid gone) can tell it is dead.
    assert await restarted.recover_orphans(None, wall_clock_ms(), "restart") == 0
    assert await restarted.recover_orphans(local_owner_verdict(new_owner_id()), wall_clock_ms(),
                                           "found at restart") == 1
    failed = await restarted.get(started["running"], "alice")
    assert failed is not None and failed.status == "failed" and failed.error is not None
    assert json.loads(failed.error)["code"] == ORPHAN_ERROR_CODE
    assert "stopped before it finished (found at restart)" in json.loads(failed.error)["message"]
    finished = await restarted.get(started["finished"], "alice")
    assert finished is not None and finished.status == "completed"
    assert finished.result is not None and json.loads(finished.result)["content"][0]["text"] == "done"


def test_the_local_verdict_spares_itself_condemns_a_gone_pid_and_leaves_the_rest_to_heartbeats() -> None:
    me = new_owner_id()
    verdict = local_owner_verdict(me)
    host = me.rsplit(":", 2)[0]
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert verdict(me) is True
    assert verdict(f"{host}:{proc.pid}:00000000") is False
    assert verdict(f"{host}:1:00000000") is None  # alive (pid 1), perhaps someone else's: the heartbeat decides
    # An owner read back from a shared store is untrusted: a pid beyond the range is not ours to judge
    # (it raised OverflowError, which stopped the sweep of orphans and expired tasks for good).
    assert verdict(f"{host}:3000000000:00000000") is None
    assert verdict(f"{host}:{'9' * 40}:00000000") is None
    assert verdict(f"another-host.example:{proc.pid}:00000000") is None
    assert verdict("not an owner id") is None
