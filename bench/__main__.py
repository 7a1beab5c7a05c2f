"""``python -m bench``: measure ztunnel against direct TCP and an Envoy pair on this machine (see bench/README.md).

Examples::

    python -m bench                       # full profile (under 20 minutes)
    python -m bench --quick               # under 3 minutes
    python -m bench --quick --modes hbone,envoy --scenarios throughput,latency
    python -m bench --smoke --out /tmp/b  # seconds; what `make test` runs
    python -m bench --quick --workers 1,2 --modes tcp,hbone --scenarios throughput,latency,connrate
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.processes import parse_workers
from bench.profiles import PROFILES
from bench.runner import Options, main_run, parse_env
from bench.scenarios import SCENARIOS
from bench.topologies import TOPOLOGIES
from bench.topology import MODES


def _csv(allowed: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)}; choose from {', '.join(allowed)}")
        return items

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    prof = p.add_mutually_exclusive_group()
    prof.add_argument("--profile", choices=sorted(PROFILES), default="full", help="sizes and durations (default full)")
    prof.add_argument("--quick", dest="profile", action="store_const", const="quick", help="same as --profile quick")
    prof.add_argument("--full", dest="profile", action="store_const", const="full", help="same as --profile full")
    prof.add_argument("--smoke", dest="profile", action="store_const", const="smoke", help="same as --profile smoke")
    p.add_argument("--modes", type=_csv(MODES, "mode"), default=MODES, help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument(
        "--scenarios",
        type=_csv(SCENARIOS, "scenario"),
        default=SCENARIOS,
        help=f"comma-separated, of {','.join(SCENARIOS)}",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions (default: the profile's; at least 3 for spread)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default bench/results/<timestamp>/)")
    p.add_argument(
        "--ztunnel-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the ztunnel processes (e.g. RUST_LOG=info to measure with access logs)",
    )
    p.add_argument(
        "--topology",
        choices=TOPOLOGIES,
        default="loopback",
        help="loopback: two nodes on 127/8, clients enter ztunnel by SOCKS5 (default); "
        "netns: pods in network namespaces with iptables capture and in-pod ztunnels (root only; no envoy mode)",
    )
    p.add_argument(
        "--workers",
        type=_workers,
        default=(),
        metavar="LIST",
        help="process models to compare, e.g. 1,2 or inline,1,2: each worker count runs the data-path scenarios "
        "with ZTUNNEL_WORKER_THREADS=N, inline as one process (ZTUNNEL_INLINE_DATA_PLANE=true); the inline "
        "process's idle memory is measured in any case (the memory target's baseline)",
    )
    return p


def _workers(text: str) -> tuple[str, ...]:
    try:
        return parse_workers(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.reps is not None and args.reps < 1:
        parser().error("--reps must be at least 1")
    try:
        env = parse_env(args.ztunnel_env)
    except ValueError as e:
        parser().error(str(e))
    opts = Options(
        profile=PROFILES[args.profile],
        modes=args.modes,
        scenarios=args.scenarios,
        reps=args.reps,
        out=args.out,
        ztunnel_env=env,
        topology=args.topology,
        update_latest=args.profile != "smoke" and not args.workers,
        workers=args.workers,
    )
    try:
        main_run(opts)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
