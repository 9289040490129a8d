"""``toolcell doctor``: which isolation layers this machine provides, and what to fix for the rest.

Runs the worker-side capability probe (``sandbox.isolation.probe``) as a subprocess -- it forks and
applies layers for real, which must never happen inside the trio daemon -- and prints a plain-text
table: layer, available or missing, detail or likely cause, fix. Then which policy profiles can
run here. Exit status 0 iff the ``strict`` profile can run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path
from typing import Any

REPO_ROOT = str(Path(__file__).resolve().parent.parent)
PROBE_TIMEOUT_S = 60.0
LAYERS = ("hygiene", "rlimits", "identity", "cgroup", "namespaces", "landlock", "seccomp")


def _probe_command() -> list[str]:
    paths = [REPO_ROOT]
    for key in ("purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p and p not in paths:
            paths.append(p)
    code = f"import sys; sys.path[:0]={paths!r}; from sandbox.isolation.probe import main; sys.exit(main(['--all']))"
    return [os.path.realpath(sys.executable), "-I", "-S", "-c", code]


def run_probe(timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """The probe's JSON report. Raises ``RuntimeError`` when the probe itself fails."""
    try:
        proc = subprocess.run(
            _probe_command(), stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout_s, cwd="/",
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, check=False,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the isolation probe did not finish within {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        raise RuntimeError(f"the isolation probe failed (exit {proc.returncode}): {proc.stderr.decode(errors='replace')[-2000:]}")
    try:
        report: dict[str, Any] = json.loads(proc.stdout)
    except ValueError as exc:
        raise RuntimeError(f"the isolation probe printed no valid JSON: {exc}") from None
    return report


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(text, width) or [""]


def format_table(rows: list[tuple[str, str, str, str]], widths: tuple[int, int, int, int] = (11, 9, 54, 54)) -> str:
    header = ("layer", "status", "detail / likely cause", "fix")
    lines = []
    sep = "  "
    lines.append(sep.join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    lines.append(sep.join("-" * w for w in widths))
    for row in rows:
        cells = [_wrap(c, w) for c, w in zip(row, widths, strict=True)]
        for i in range(max(len(c) for c in cells)):
            lines.append(sep.join((c[i] if i < len(c) else "").ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    return "\n".join(lines)


def render(report: dict[str, Any]) -> tuple[str, bool]:
    """The doctor's text and whether ``strict`` can run."""
    layers: dict[str, dict[str, Any]] = report.get("layers", {})
    rows = []
    missing = []
    for name in LAYERS:
        info = layers.get(name, {"available": False, "reason": "not probed", "fix": ""})
        ok = bool(info.get("available"))
        if not ok:
            missing.append(name)
        rows.append((name, "available" if ok else "MISSING", str(info.get("reason", "")), str(info.get("fix", "")) or "-"))
    strict_info = report.get("strict", {})
    strict_ok = not missing and bool(strict_info.get("ok", False))
    out = [format_table(rows), "", "Profiles:"]
    if strict_ok:
        out.append("  strict  can run: every layer is available")
    else:
        why = f"missing {', '.join(missing)}" if missing else f"applying every layer failed: {strict_info.get('detail', '?')}"
        out.append(f"  strict  CANNOT run ({why})")
    have = [n for n in LAYERS if n not in missing]
    out.append(f"  compat  can run with: {', '.join(have)}" + (f" (without {', '.join(missing)})" if missing else ""))
    out.append("  none    can run (hygiene and rlimits only: unsafe, plugins run unsandboxed)")
    out.append("")
    out.append("Host resources a worker could reach by a path:")
    if layers.get("seccomp", {}).get("available"):
        out.append("  unix sockets  closed: seccomp refuses socket(AF_UNIX) in every worker (socketpair only),")
        out.append("                so no host socket (database, container engine, agent) can be connected to")
    else:
        out.append("  unix sockets  REACHABLE under compat/none: without seccomp a worker can connect to any")
        out.append("                world-writable path socket of the host (strict refuses to start it)")
    watch_ok, watch_detail = file_watching()
    out.append(f"File watching (hot reload): {'available' if watch_ok else 'UNAVAILABLE'}: {watch_detail}")
    out.append("")
    out.append(f"interpreter: {report.get('python', '?')}   euid: {report.get('euid', '?')}")
    return "\n".join(out), strict_ok


def file_watching() -> tuple[bool, str]:
    """Whether plugin folders can be watched for changes (``watchfiles``), and what to do if not."""
    try:
        # Imported here, not at the top: this check reports a failing import instead of crashing doctor.
        import watchfiles
    except Exception as exc:  # noqa: BLE001 (any import failure means the same thing here)
        return False, (f"watchfiles cannot be imported ({type(exc).__name__}: {exc}); plugins reload only on SIGHUP "
                       "or `toolcell reload`. Fix: pip install watchfiles")
    return True, f"watchfiles {getattr(watchfiles, '__version__', '?')}"


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        report = run_probe()
    except RuntimeError as exc:
        print(f"toolcell doctor: {exc}", file=sys.stderr)
        return 2
    if "--json" in args:
        print(json.dumps(report, indent=2))
        strict_ok = all(v.get("available") for v in report.get("layers", {}).values()) and report.get("strict", {}).get("ok", False)
        return 0 if strict_ok else 1
    text, strict_ok = render(report)
    print(text)
    return 0 if strict_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
