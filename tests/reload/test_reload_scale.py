"""Reload cost does not grow with the number of unchanged plugins (issue 5, item 4).

200 one-tool plugins, each served by a started worker (the daemon in-process, policy ``none``: the
isolation layers are not what this is about). One plugin is changed and the daemon reloads: only that
plugin gets a new pool and a new worker; the 199 others keep the very same pool objects and worker
processes, and not one of their files is read (an unchanged stat signature is enough).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio
from reload_harness import WAIT_S, write_plugin

import runtime.daemon
import runtime.fingerprints
from runtime.config import Config
from runtime.daemon import open_daemon
from runtime.execution.pool import WorkerPool

PLUGINS = 200


async def test_changing_one_plugin_of_200_starts_one_worker_and_leaves_the_others_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plugins = tmp_path / "plugins"
    for i in range(PLUGINS):
        write_plugin(plugins, f"p{i:03d}", {f"t{i:03d}": f"v1 of {i}"})
    # The files were written a moment ago: with the default rule they would be "racily clean" and
    # compared by content. This test is about what happens once they are not.
    monkeypatch.setattr(runtime.fingerprints, "RACY_NS", 0)
    started: list[str] = []
    original_start = WorkerPool.start_worker

    async def counting_start(self: WorkerPool) -> object:
        started.append(self.name)
        return await original_start(self)

    monkeypatch.setattr(WorkerPool, "start_worker", counting_start)
    read: list[str] = []
    original_fingerprint = runtime.fingerprints.fingerprint

    def counting_fingerprint(path: Path) -> str:
        read.append(path.name)
        return original_fingerprint(path)

    monkeypatch.setattr(runtime.daemon, "fingerprint", counting_fingerprint)

    config = Config(plugins=[str(plugins)], policy="none", watch=False, min_workers=1, state_dir=str(tmp_path / "state"))
    with trio.fail_after(PLUGINS * 0.5 + WAIT_S):
        async with open_daemon(config) as daemon:
            assert len(daemon.plugins) == PLUGINS and not daemon.failed
            assert len(started) == PLUGINS
            before = {p.name: (p.pool, {w.pid for w in p.pool.workers}) for p in daemon.plugins.values()
                      if p.pool is not None}
            assert len(before) == PLUGINS and all(len(pids) == 1 for _, pids in before.values())
            started.clear()
            read.clear()

            write_plugin(plugins, "p123", {"t123": "v2 of 123", "t123b": "new"})
            t0 = time.perf_counter()
            assert await daemon.reload() is True
            took_ms = (time.perf_counter() - t0) * 1000

            assert started == ["p123"]  # one new pool, one new worker
            assert read == ["p123"]  # no other folder was read
            after = {p.name: p for p in daemon.plugins.values()}
            assert after["p123"].pool is not before["p123"][0]
            assert before["p123"][0] in daemon._retiring  # it finishes its calls, then closes
            for name, (pool, pids) in before.items():
                if name == "p123":
                    continue
                assert after[name].pool is pool, name
                assert {w.pid for w in pool.workers} == pids, name
                assert not pool.retiring and not pool.closed, name
            assert "t123b" in daemon.catalog.by_name and len(daemon.catalog) == PLUGINS + 1
            print(f"reload of 1 changed plugin out of {PLUGINS}: {took_ms:.0f} ms")

            # A reload with nothing changed reads nothing and starts nothing.
            read.clear()
            assert await daemon.reload() is False
            assert read == [] and started == ["p123"]
