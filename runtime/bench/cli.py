"""``toolcell bench``: the command line (``toolcell bench --help`` lists every flag).

    toolcell bench toolcell:benchmarks/plugins "sdk=stdio:python3 benchmarks/peers/sdk_server.py" \\
        --tool echo --args '{"text": "hi {{seq}}"}' --concurrency 1,16 --duration 5 --html bench.html
    toolcell bench http://127.0.0.1:8765/mcp --token TOKEN --rate 100,200,400 --list
    toolcell bench compare base.json new.json --threshold 10 --markdown
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

EXTRA_HINT = "toolcell bench needs the bench extra: pip install 'toolcell[bench]'"


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("values must be positive")
    return values


def _ints(text: str) -> list[int]:
    values = _floats(text)
    if any(v != int(v) for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: whole numbers expected")
    return [int(v) for v in values]


#: The examples ``--help`` shows (the README shows the same ones; tests/bench/test_bench_cli.py checks).
EXAMPLES = [
    "toolcell bench toolcell:benchmarks/plugins \"sdk=stdio:python3 benchmarks/peers/sdk_server.py\" "
    "toolcell+http:benchmarks/plugins \"sdk-http=http:python3 benchmarks/peers/sdk_server.py --http --port {port}\" "
    "--tool echo --args '{\"text\": \"hi {{seq}}\"}' --expect-text 'hi {{seq}}' -c 1,16 --duration 5 --html bench.html",
    "toolcell bench \"stdio:npx -y @modelcontextprotocol/server-everything\" --call 'echo {\"message\": \"x\"}' --list",
    "toolcell bench https://example.test/mcp --token \"$TOKEN\" --rate 50,100,200,400",
    "toolcell bench stdio:./server --scenario mix.toml --era modern -n 10000 --repeat 5 --json new.json",
    "toolcell bench trivial --tool echo --fail-if 'p99>50ms' --fail-if 'errors>0' --markdown",
    "toolcell bench compare base.json new.json --threshold 10 --markdown",
]


def _gate(text: str) -> object:
    # lazy: gates imports hdrh (the bench extra) through report and stats; main() checks for it first
    from runtime.bench import gates

    try:
        return gates.parse(text)
    except gates.GateError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parser() -> argparse.ArgumentParser:
    """The ``toolcell bench`` argument parser."""
    p = argparse.ArgumentParser(
        prog="toolcell bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Load-benchmark MCP servers side by side (interleaved), with HDR latency histograms, "
                    "server CPU and memory, the client's own ceiling, and an HTML report.",
        epilog="targets: stdio:COMMAND | http:COMMAND (with {port}) | http(s)://URL | toolcell:PLUGIN_DIR | "
               "toolcell+http:PLUGIN_DIR | trivial | trivial+http; NAME=TARGET labels one.\n"
               "compare: toolcell bench compare BASE.json NEW.json [--threshold PCT] [--alpha P] [--markdown] "
               "[--fail-if ...]\n\n"
               "examples:\n" + "\n".join(f"  {e}" for e in EXAMPLES))
    p.add_argument("targets", nargs="+", metavar="TARGET", help="what to benchmark (see below)")
    s = p.add_argument_group("scenario (default: --tool echo if nothing else is given... see --list)")
    s.add_argument("--scenario", metavar="FILE", help="a TOML scenario ([[call]] entries, [list])")
    s.add_argument("--call", action="append", default=[], metavar="[W*]TOOL [JSON]",
                   help="a tools/call in the mix, e.g. '3*echo {\"text\": \"hi {{seq}}\"}' (repeatable)")
    s.add_argument("--tool", help="one tool to call (with --args)")
    s.add_argument("--args", help="its arguments, a JSON object ({{seq}}, {{rand}}, {{uuid}}, {{now_ms}} filled in)")
    s.add_argument("--list", nargs="?", type=int, const=1, default=None, metavar="WEIGHT",
                   help="full tools/list walks in the mix (with this weight; the default scenario when no call is given)")
    s.add_argument("--expect-text", help="every call's text content must be exactly this (placeholders filled in)")
    s.add_argument("--expect-contains", help="every call's text content must contain this")
    load = p.add_argument_group("load")
    load.add_argument("-c", "--concurrency", type=_ints, help="closed loop: operations in flight; a list steps "
                      "through them (e.g. 1,4,16,64) (default 16)")
    load.add_argument("--rate", type=_floats, help="open loop: operations started per second, on schedule; a list "
                      "steps through them to find the knee")
    load.add_argument("--max-inflight", type=int, default=0,
                      help="open loop: most operations in flight (stdio) or connections (HTTP); default 100000 / 256")
    load.add_argument("-d", "--duration", type=float, default=10.0, help="measured seconds per segment (default 10)")
    load.add_argument("-n", "--count", type=int, default=0, help="measure this many operations instead of a duration")
    load.add_argument("--warmup", type=float, default=1.0, help="seconds of load before measuring (default 1)")
    load.add_argument("--timeout", type=float, default=10.0, help="seconds an operation may take (default 10)")
    load.add_argument("--repeat", type=int, default=1, help="segments per target and step; medians reported (default 1)")
    load.add_argument("--fresh", action="store_true", help="a fresh server process for every segment")
    proto = p.add_argument_group("protocol")
    proto.add_argument("--era", choices=["legacy", "modern"], default="legacy",
                       help="legacy: initialize handshake (and an HTTP session); modern: 2026-07-28 stateless")
    proto.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'", help="HTTP header (repeatable)")
    proto.add_argument("--token", help="bearer token for HTTP targets (default: $TOOLCELL_BENCH_TOKEN)")
    proto.add_argument("--insecure", action="store_true", help="https: do not verify the server's certificate")
    proto.add_argument("--path", default="/mcp", help="endpoint path of http: command targets (default /mcp)")
    out = p.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="the whole report as JSON ('-': to stdout, instead of the table)")
    out.add_argument("--html", metavar="FILE", help="a self-contained HTML report with plots")
    out.add_argument("--markdown", action="store_true", help="print the summary as markdown (a pull-request comment)")
    out.add_argument("--fail-if", action="append", default=[], type=_gate, metavar="'[TARGET:]METRIC OP VALUE'",
                     help="exit 1 if any measured target crosses it at any step, e.g. 'p99>50ms', 'errors>0', "
                          "'error_rate>=1%%', 'calls/s<1000', 'toolcell:rss>200MB' (metrics: p50 p90 p99 p99.9 max "
                          "mean errors error_rate calls/s cpu rss; repeatable)")
    out.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    out.add_argument("--baseline", metavar="NAME", help="the target ratios divide by (default: the first)")
    out.add_argument("--no-ceiling", action="store_true", help="do not measure the client's ceiling (trivial server)")
    out.add_argument("--no-phases", action="store_true", help="toolcell targets: run without the daemon's metrics")
    return p


def compare_parser() -> argparse.ArgumentParser:
    """The ``toolcell bench compare`` argument parser."""
    p = argparse.ArgumentParser(
        prog="toolcell bench compare", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compare two --json reports, repeat by repeat (run both with --repeat 5 or more): per target "
                    "and step, the medians of calls/s, p50 and p99, and a Mann-Whitney U test of whether the "
                    "difference is more than noise. Exit 1 on a regression (for CI), 2 on unusable input.",
        epilog="examples:\n  toolcell bench compare base.json new.json\n"
               "  toolcell bench compare base.json new.json --threshold 5 --alpha 0.01 --markdown > comment.md\n"
               "  toolcell bench compare base.json new.json --fail-if 'p99>50ms'\n"
               "  toolcell bench compare run.json:before run.json:after")
    p.add_argument("base", metavar="BASE.json", help="a --json report, or REPORT.json:TARGET for one of its targets")
    p.add_argument("new", metavar="NEW.json", help="the same (two targets of one run: run.json:before run.json:after)")
    p.add_argument("--threshold", type=float, default=10.0, metavar="PCT",
                   help="a significant change counts as a regression only beyond this percent (default 10)")
    p.add_argument("--alpha", type=float, default=0.05, metavar="P",
                   help="significance level: a difference with p at or above it is 'no significant change' "
                        "(default 0.05)")
    p.add_argument("--markdown", action="store_true", help="print markdown (a pull-request comment)")
    p.add_argument("--fail-if", action="append", default=[], type=_gate, metavar="'[TARGET:]METRIC OP VALUE'",
                   help="also exit 1 if the NEW report crosses it (as for toolcell bench; repeatable)")
    return p


def _compare(argv: Sequence[str]) -> int:
    # lazy: these import hdrh (the bench extra); main() checks for it first and prints EXTRA_HINT
    from runtime.bench import compare, gates, report

    p = compare_parser()
    args = p.parse_args(argv)
    if not 0 < args.alpha < 1 or args.threshold < 0:
        print("toolcell bench compare: --alpha must be between 0 and 1, --threshold not negative", file=sys.stderr)
        return 2
    try:
        (base, base_target), (new, new_target) = report.load_side(args.base), report.load_side(args.new)
    except ValueError as exc:
        print(f"toolcell bench compare: {exc}", file=sys.stderr)
        return 2
    if (base_target is None) != (new_target is None):
        print("toolcell bench compare: name a target on both sides (REPORT.json:TARGET) or on neither",
              file=sys.stderr)
        return 2
    if base_target is not None and new_target is not None and base_target != new_target:
        # Two targets (of one run, or of two): compared as one row, named for both.
        label = f"{new_target} vs {base_target}"
        base = report.only_target(base, base_target, label)
        new = report.only_target(new, new_target, label)
    changes = compare.compare(base, new, args.threshold, args.alpha)
    if not changes:
        print("toolcell bench compare: the reports have no (target, step) in common", file=sys.stderr)
        return 2
    print(compare.render(changes, args.threshold, args.alpha, args.markdown))
    crossed = gates.crossed(new, args.fail_if)
    if crossed:
        print("", *(("- " if args.markdown else "") + line for line in crossed), sep="\n")
    return 1 if crossed or any(c.regressions for c in changes) else 0


class _Stopped(BaseException):
    """SIGTERM or SIGHUP arrived during the run (``timeout``, a CI job's end, a closed terminal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into ``_Stopped`` while the run lasts, so that it ends the way Ctrl-C
    does: through the runner's cleanup, which stops the servers the bench started. Their default
    action ended the bench at once, and its servers (each in a session of its own) ran on."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are delivered to the main thread only
        return

    def stop(signum: int, _frame: Any) -> None:
        raise _Stopped(signum)

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``toolcell bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # lazy: a probe for the bench extra, so that without it the command says what to install
        import hdrh.histogram  # noqa: F401
    except ImportError:
        print(EXTRA_HINT, file=sys.stderr)
        return 2
    if argv[:1] == ["compare"]:
        return _compare(argv[1:])
    args = parser().parse_args(argv)
    if args.html:
        try:
            # lazy: a probe for plotly (the bench extra), which only --html needs
            import plotly  # noqa: F401
        except ImportError:
            print(f"--html: {EXTRA_HINT}", file=sys.stderr)
            return 2
    # lazy: these import hdrh (the bench extra), checked for above
    from runtime.bench import gates, load, report, runner, scenario, targets

    try:
        if args.scenario:
            scen = scenario.load_file(args.scenario)
        else:
            given = args.call or args.tool
            scen = scenario.from_flags(args.call, args.tool, args.args, args.list if given else (args.list or 1),
                                       args.expect_text, args.expect_contains)
        specs = targets.unique_names([targets.parse(t, args.path) for t in args.targets])
    except ValueError as exc:
        print(f"toolcell bench: {exc}", file=sys.stderr)
        return 2
    if args.concurrency and args.rate:
        print("toolcell bench: give --concurrency (closed loop) or --rate (open loop), not both", file=sys.stderr)
        return 2
    if args.rate:
        steps = [load.Shape("open", rate=r, max_inflight=args.max_inflight) for r in args.rate]
    else:
        steps = [load.Shape("closed", concurrency=c) for c in (args.concurrency or [16])]
    if args.duration <= 0 or args.count < 0 or args.warmup < 0 or args.timeout <= 0 or args.repeat < 1:
        print("toolcell bench: --duration, --timeout and --repeat must be positive", file=sys.stderr)
        return 2
    headers = []
    for h in args.header:
        name, sep, value = h.partition(":")
        if not sep or not name.strip():
            print(f"toolcell bench: --header {h!r} is not 'Name: value'", file=sys.stderr)
            return 2
        headers.append((name.strip(), value.strip()))
    token = args.token or os.environ.get("TOOLCELL_BENCH_TOKEN")
    if token:
        headers.append(("Authorization", f"Bearer {token}"))
    if args.baseline and args.baseline not in [s.name for s in specs]:
        print(f"toolcell bench: --baseline {args.baseline!r} is not a target name ({', '.join(s.name for s in specs)})",
              file=sys.stderr)
        return 2
    plan = runner.Plan(targets=specs, scenario=scen, steps=steps,
                       timing=load.Timing(args.warmup, args.duration, args.count, args.timeout), repeat=args.repeat,
                       modern=args.era == "modern", headers=headers, insecure=args.insecure,
                       ceiling=not args.no_ceiling, phases=not args.no_phases, baseline=args.baseline, fresh=args.fresh)
    events: runner.Events | None = None
    if not args.quiet and sys.stderr.isatty():
        # lazy: only at a terminal (progress imports the runner, hence hdrh: the bench extra)
        from runtime.bench.progress import Display

        events = Display()
    try:
        with _stopped_by_signals():
            result = runner.run(plan, events)
    except KeyboardInterrupt:
        print("\ntoolcell bench: interrupted", file=sys.stderr)
        return 130
    except _Stopped as stopped:
        print(f"\ntoolcell bench: stopped by {signal.Signals(stopped.signum).name}", file=sys.stderr)
        return 128 + stopped.signum
    crossed = gates.crossed(result, args.fail_if)
    if args.json == "-":
        sys.stdout.buffer.write(report.to_json(result) + b"\n")
    else:
        print(report.render_text(result, args.markdown))
        if crossed:
            print("", *(("- " if args.markdown else "") + line for line in crossed), sep="\n")
    for line in crossed if args.json == "-" else []:
        print(line, file=sys.stderr)
    if args.json and args.json != "-":
        with open(args.json, "wb") as f:
            f.write(report.to_json(result))
    if args.html:
        # lazy: it imports plotly, which only --html needs (and which was checked for above)
        from runtime.bench import html_report

        html_report.write(result, args.html)
        print(f"HTML report: {args.html}", file=sys.stderr)
    usable = [t for t in result.targets if not t.ceiling]
    return 1 if crossed or any(t.status in ("broken", "down", "died") for t in usable) else 0
