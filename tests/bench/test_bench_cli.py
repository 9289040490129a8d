"""``toolcell bench`` without its extra: a plain install has no ``hdrhistogram`` (imported as ``hdrh``);
the command says which extra to install and exits 2, and the daemon's own commands never need it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _without_hdrh(tmp_path: Path) -> dict[str, str]:
    """An environment in which ``import hdrh`` fails, as on an install without the bench extra."""
    shadow = tmp_path / "shadow" / "hdrh"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('hdrhistogram is not installed')\n")
    return dict(os.environ, PYTHONPATH=str(tmp_path / "shadow"))


def test_bench_without_its_extra_names_the_extra_and_exits_2(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "bench", "http://127.0.0.1:9/mcp"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env=_without_hdrh(tmp_path))
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'toolcell[bench]'" in proc.stderr and "Traceback" not in proc.stderr


def test_the_daemon_does_not_need_the_bench_extra(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "runtime.cli", "check", str(REPO / "benchmarks" / "plugins" / "echo")],
                          cwd=REPO, capture_output=True, text=True, timeout=120, env=_without_hdrh(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
