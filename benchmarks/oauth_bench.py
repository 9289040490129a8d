"""HTTP calls/s with an OAuth JWT access token vs a static bearer token, on one daemon, in one run.

One ``toolcell serve --http`` with both a static token and ``[http.oauth]`` (a real HTTPS issuer:
``tests/http/oauth_issuer.py``, joserfc + trustme); ``toolcell bench`` calls ``echo`` at c=16 with
one token, then the other, alternating (``--repeat`` rounds), so the machine's noise falls on both.
Also the cost of checking a token never seen before (signature + claims, RS256 and ES256), which a
client pays once per token: checked tokens are remembered until they expire.

    python benchmarks/oauth_bench.py [--seconds 5] [--repeat 3] [--concurrency 16] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from runtime.bench.procs import cpu_delta_s, cpu_snapshot  # noqa: E402
sys.path.insert(0, str(REPO / "tests" / "http"))

from http_harness import sha, start_server, stop_server  # noqa: E402
from oauth_issuer import RESOURCE, Issuer  # noqa: E402

STATIC = "tc_bench_static_token_0123456789"


def _config(issuer: Issuer) -> str:
    return f'''
policy = "none"

[http]

[[http.tokens]]
principal = "bench"
sha256 = "{sha(STATIC)}"

[http.oauth]
resource = "{RESOURCE}"
issuer = "{issuer.url}"
ca_file = "{issuer.ca_file}"
scope_prefix = "toolcell:"
'''


def _bench(url: str, pid: int, token: str, seconds: float, concurrency: int) -> dict[str, float]:
    before = cpu_snapshot(pid)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "runtime.cli", "bench", url, "--token", token, "--tool", "a_echo",
                        "--args", '{"text": "hi"}', "-c", str(concurrency), "-d", str(seconds), "--warmup", "1",
                        "--no-ceiling", "-q", "--json", out.name], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL)
        report = json.loads(Path(out.name).read_bytes())
    row = report["summary"][0]
    used = cpu_delta_s(before, cpu_snapshot(pid))
    return {"calls_per_s": row["calls_per_s"], "p50_ms": row["latency"]["p50_ms"], "p99_ms": row["latency"]["p99_ms"],
            "errors": sum(row["errors"].values()), "cpu_us": used / max(1.0, row["calls_per_s"] * (seconds + 1)) * 1e6}


def _verify_cost(issuer: Issuer, alg: str, rounds: int) -> float:
    """Microseconds to check a token never seen before (keys already fetched)."""
    import trio

    from runtime.http_config import OAuthConfig, RateLimit
    from runtime.oauth import OAuthVerifier

    # The check itself is measured, so the budget of new tokens (``new_tokens_rate``) is lifted.
    verifier = OAuthVerifier(OAuthConfig(resource=RESOURCE, issuer=issuer.url, ca_file=str(issuer.ca_file),
                                         scope_prefix="toolcell:", new_tokens_rate=RateLimit(per_s=1e9, burst=1e9)))
    tokens = [f"Bearer {issuer.token(alg=alg, jti=str(i))}".encode() for i in range(rounds)]

    async def run() -> float:
        await verifier.verify(tokens[0])  # fetches the keys
        start = time.perf_counter()
        for token in tokens[1:]:
            await verifier.verify(token)
        return (time.perf_counter() - start) / (len(tokens) - 1) * 1e6

    return trio.run(run)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_text:
        tmp = Path(tmp_text)
        issuer = Issuer(tmp)
        server = start_server(tmp, _config(issuer))
        try:
            jwt_token = issuer.token(scope="toolcell:*", exp=int(time.time()) + 3600)
            runs: dict[str, list[dict[str, float]]] = {"static token": [], "OAuth JWT": []}
            for _ in range(args.repeat):
                runs["static token"].append(_bench(server.url, server.proc.pid, STATIC, args.seconds, args.concurrency))
                runs["OAuth JWT"].append(_bench(server.url, server.proc.pid, jwt_token, args.seconds, args.concurrency))
            costs = {alg: _verify_cost(issuer, alg, 300) for alg in ("RS256", "ES256")}
        finally:
            stop_server(server)
            issuer.close()
    static = statistics.median(r["calls_per_s"] for r in runs["static token"])
    print(f"# oauth_bench: HTTP c={args.concurrency}, {args.repeat} alternating rounds x {args.seconds:g} s; "
          f"Python {platform.python_version()}, {os.cpu_count()} cores")
    sep = "|" if args.markdown else " "
    static_cpu = statistics.median(r["cpu_us"] for r in runs["static token"])
    print(sep.join(["token", "calls/s (median)", "vs static", "server CPU µs/call", "vs static", "p50 ms", "p99 ms",
                    "errors"]))
    if args.markdown:
        print("|".join(["---"] * 8))
    for name, rows in runs.items():
        cps = statistics.median(r["calls_per_s"] for r in rows)
        cpu = statistics.median(r["cpu_us"] for r in rows)
        print(sep.join([name, f"{cps:,.0f}", f"{cps / static:.3f}", f"{cpu:,.0f}", f"{cpu / static_cpu:.3f}",
                        f"{statistics.median(r['p50_ms'] for r in rows):.2f}",
                        f"{statistics.median(r['p99_ms'] for r in rows):.2f}", f"{sum(r['errors'] for r in rows):.0f}"]))
    for alg, us in costs.items():
        print(f"first check of a new {alg} token: {us:.0f} µs (once per token; then remembered until it expires)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
