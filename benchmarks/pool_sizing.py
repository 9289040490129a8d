"""Does the default pool size itself as well as the best fixed size? (issue 25, part 2)

One plugin with two tools, ``echo`` (trivial) and ``nap`` (sleeps 100 ms), served by toolcell in
several configurations side by side in one ``toolcell bench`` run per tool:

* ``default``: the plugin as written, no limits set (``max_concurrency`` 4) and the daemon's default
  ``min_workers`` (1): the pool sizes itself;
* ``fixedN`` for N = 1 .. max_concurrency: ``max_concurrency = N`` and ``min_workers = N``: N workers
  started up front and kept.

Prints, per tool and concurrency, every target's calls/s, the best fixed size and the default's ratio
to it; for ``nap`` at the highest concurrency, how many calls ran at once (Little's law: calls/s x
100 ms). The figures go in benchmarks/RESULTS.md.

    python benchmarks/pool_sizing.py [--seconds 5] [--repeat 3] [--concurrency 1,16,128] [--json-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
NAP_S = 0.1

PLUGIN = '''
import time

from sandbox import tool


@tool
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@tool
def nap(text: str) -> str:
    """Sleep 100 ms, then return the text."""
    time.sleep(0.1)
    return text
'''


def _plugin(root: Path, name: str, max_concurrency: int | None, min_workers: int) -> Path:
    folder = root / name / "sizing"
    folder.mkdir(parents=True)
    limits = f"\n[limits]\nmax_concurrency = {max_concurrency}\n" if max_concurrency is not None else ""
    (folder / "plugin.toml").write_text(f'name = "sizing"\nversion = "1.0.0"\nentry = "sizing"\n{limits}')
    (folder / "sizing.py").write_text(PLUGIN)
    for path in (root / name, folder, folder / "plugin.toml", folder / "sizing.py"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    config = root / f"{name}.toml"
    config.write_text(f'plugins = ["{root / name}"]\nwatch = false\nlog_level = "warning"\n'
                      f'state_dir = "{root / "state" / name}"\nmin_workers = {min_workers}\n')
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", default="1,16,128")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved segments per target and step (medians)")
    parser.add_argument("--sizes", default="1,2,3,4", help="fixed pool sizes to compare (default: 1 .. 4)")
    parser.add_argument("--json-dir", default=None, help="keep the bench reports here")
    args = parser.parse_args()
    sizes = [int(n) for n in args.sizes.split(",")]
    root = Path(tempfile.mkdtemp(prefix="pool-sizing-"))
    root.chmod(0o755)
    out = Path(args.json_dir) if args.json_dir else root
    out.mkdir(parents=True, exist_ok=True)
    serve = f"{sys.executable} -m runtime.cli serve --stdio --config"
    targets = [f"default=stdio:{serve} {_plugin(root, 'default', None, 1)}"]
    targets += [f"fixed{n}=stdio:{serve} {_plugin(root, f'fixed{n}', n, n)}" for n in sizes]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cores = len(os.sched_getaffinity(0))
    print(f"# pool sizing: {cores} cores, load {os.getloadavg()[0]:.1f}; targets: default, "
          + ", ".join(f"fixed{n}" for n in sizes))
    for tool in ("echo", "nap"):
        report = out / f"pool-sizing-{tool}.json"
        cmd = [sys.executable, "-m", "runtime.cli", "bench", *targets, "--tool", tool,
               "--args", '{"text": "hi {{seq}}"}', "--expect-text", "hi {{seq}}", "-c", args.concurrency,
               "-d", str(args.seconds), "--repeat", str(args.repeat), "--no-ceiling", "-q", "--json", str(report)]
        subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        _summarise(tool, json.loads(report.read_text()), sizes)
    return 0


def _rates(data: dict[str, Any]) -> dict[tuple[str, int], float]:
    rates: dict[tuple[str, int], float] = {}
    for row in data["summary"]:
        rates[(row["target"], int(row["step"].removeprefix("c=")))] = float(row["calls_per_s"])
    return rates


def _summarise(tool: str, data: dict[str, Any], sizes: list[int]) -> None:
    rates = _rates(data)
    levels = sorted({c for _, c in rates})
    print(f"\n## {tool}\n")
    print("| c | default | " + " | ".join(f"fixed {n}" for n in sizes) + " | best fixed | default / best |")
    print("|---|---|" + "---|" * len(sizes) + "---|---|")
    for c in levels:
        default = rates.get(("default", c), 0.0)
        fixed = {n: rates.get((f"fixed{n}", c), 0.0) for n in sizes}
        best = max(fixed, key=lambda n: fixed[n])
        ratio = default / fixed[best] if fixed[best] else 0.0
        print(f"| {c} | {default:,.0f} | " + " | ".join(f"{fixed[n]:,.0f}" for n in sizes)
              + f" | {best} | {ratio:.1%} |")
    if tool == "nap":
        top = levels[-1]
        print(f"\nnap at c={top}: the default ran {rates.get(('default', top), 0.0) * NAP_S:.1f} calls at once "
              f"(calls/s x {NAP_S * 1000:.0f} ms)")


if __name__ == "__main__":
    raise SystemExit(main())
