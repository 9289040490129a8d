"""A burst is met by the whole pool: calls that arrive together start workers up to
``max_concurrency`` instead of queueing on the workers that happen to exist."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from stdio_peer import open_toolcell, text_of

PLUGIN = r'''
import os
import time

from sandbox import tool

WORKER = os.urandom(6).hex()


@tool
def hold(seconds: float = 1.0) -> str:
    """Sleep, reporting which worker ran the call and when (wall clock)."""
    start = time.time()
    time.sleep(seconds)
    return f"{WORKER} {start} {time.time()}"
'''


async def test_a_burst_of_slow_calls_runs_on_every_worker_the_pool_may_have(make_plugin: Callable[..., Path],
                                                                          tmp_path: Path) -> None:
    plugins = make_plugin("burst", PLUGIN, limits={"max_concurrency": 8, "timeout_s": 30})
    async with open_toolcell(plugins, stderr_path=tmp_path / "d.log") as peer:
        await peer.initialize()
        await peer.call("hold", {"seconds": 0.01})  # one worker exists and is idle
        ids = [await peer.start_call("hold", {"seconds": 1.0}) for _ in range(24)]
        spans = []
        for request_id in ids:
            response = await peer.response(request_id, timeout=60)
            worker, start, end = text_of(response).split()
            spans.append((worker, float(start), float(end)))
    workers = {w for w, _, _ in spans}
    assert len(workers) == 8, f"the 24 calls ran on {len(workers)} workers, not the pool's 8"
    # How many calls ran at the same moment, at most: the pool's size.
    overlap = max(sum(1 for _, s, e in spans if s <= t < e) for _, t, _ in spans)
    assert overlap == 8, f"at most {overlap} calls ran at once"
