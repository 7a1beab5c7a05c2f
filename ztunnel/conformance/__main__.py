"""``python -m ztunnel.conformance``: run the HBONE conformance checks and print the report (docs/conformance.md).

Exit status: 0 when no check failed (PASS, DIFF, SKIP), 1 when one did (FAIL, ERROR; DIFF too with ``--strict``), 2 on
bad arguments or unreadable files.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import ssl
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from ztunnel.conformance import report
from ztunnel.conformance.checks import FAILING, Check, Result, Verdict, select
from ztunnel.errors import ZtunnelError
from ztunnel.net import format_addr

C = TypeVar("C")


class UsageError(ZtunnelError):
    """A bad argument or file; the message names it."""


def parse_addr(value: str, flag: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{flag} {value!r}: expected HOST:PORT (IPv6 as [ADDR]:PORT)")
    return host.removeprefix("[").removesuffix("]"), int(port)


def readable(path: str | None, flag: str) -> Path | None:
    if path is None:
        return None
    p = Path(path)
    try:
        p.read_bytes()
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot read it: {e.strerror or e}") from e
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ztunnel.conformance",
        description="Check an HBONE peer against upstream ztunnel's behaviour: a terminator (--target, we are the "
        "client) or an originator (--serve, we are the server). See docs/conformance.md.",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--target", metavar="HOST:PORT", help="the HBONE server to check (a ztunnel's 15008)")
    mode.add_argument(
        "--serve", metavar="HOST:PORT", help="listen there as an HBONE server and check the originator that connects"
    )
    mode.add_argument("--list", action="store_true", help="list the checks: id, what each sends, upstream, rule")
    p.add_argument("--ca", metavar="PEM", help="root certificate(s) that verify the peer's certificate")
    p.add_argument("--cert", metavar="PEM", help="our certificate chain (a SPIFFE identity the peer accepts)")
    p.add_argument("--key", metavar="PEM", help="our private key")
    p.add_argument("--expect-identity", metavar="SPIFFE", help="the identity the peer must present")
    p.add_argument(
        "--authority",
        metavar="HOST:PORT",
        help="target mode: CONNECT :authority of a TCP echo service behind the target (default: the target's host, "
        "port 8080)",
    )
    p.add_argument(
        "--ca-key",
        metavar="PEM",
        help="target mode: the key of --ca's root; lets the identity checks sign a wrong-trust-domain and an "
        "expired certificate (skipped without it)",
    )
    p.add_argument(
        "--drive",
        metavar="tcp:HOST:PORT|socks5:HOST:PORT:DEST_HOST:DEST_PORT",
        help="server mode: how to make the originator open tunnels to us: connect to a plain TCP entry it tunnels "
        "(an Envoy listener, a captured address), or through a SOCKS5 proxy (ztunnel's 15080) to DEST",
    )
    p.add_argument("--check", action="append", default=[], metavar="ID", help="run only these checks (id or prefix)")
    p.add_argument("--skip", action="append", default=[], metavar="ID", help="leave these checks out (id or prefix)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds one wait may take (default 10)")
    p.add_argument("--strict", action="store_true", help="a DIFF fails too")
    p.add_argument("--serve-checks", action="store_true", help="with --list: list the server mode's checks")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    return p


def required(args: argparse.Namespace, *names: str) -> None:
    missing = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) is None]
    if missing:
        raise UsageError(f"{' '.join(missing)} required with {'--target' if args.target else '--serve'}")


async def _target(args: argparse.Namespace, progress: bool) -> tuple[list[Result], dict[str, object]]:
    from ztunnel.conformance.target import CHECKS, TargetSpec, run_target

    required(args, "ca", "cert", "key", "expect_identity")
    host, port = parse_addr(args.target, "--target")
    authority = args.authority or format_addr(host, 8080)
    parse_addr(authority, "--authority")
    spec = TargetSpec(
        host=host,
        port=port,
        ca=readable(args.ca, "--ca") or Path(),
        cert=readable(args.cert, "--cert") or Path(),
        key=readable(args.key, "--key") or Path(),
        expect_identity=args.expect_identity,
        authority=authority,
        ca_key=readable(args.ca_key, "--ca-key"),
        timeout=args.timeout,
    )
    checks = selected(CHECKS, args)
    try:
        ssl.create_default_context(cafile=str(spec.ca)).load_cert_chain(str(spec.cert), str(spec.key))
    except (ssl.SSLError, ValueError) as e:
        raise UsageError(f"--ca {spec.ca} / --cert {spec.cert} / --key {spec.key}: not usable for TLS: {e}") from e
    results = await run_target(spec, checks, on_result=_printer(progress))
    return results, {"mode": "target", "target": args.target, "authority": authority}


def selected(checks: Sequence[Check[C]], args: argparse.Namespace) -> list[Check[C]]:
    """``--check`` / ``--skip`` applied to ``checks``."""
    try:
        return select(checks, args.check, args.skip)
    except ValueError as e:
        raise UsageError(str(e)) from e


def _printer(progress: bool) -> Callable[[Result], None]:
    def show(r: Result) -> None:
        if progress:
            print(f"  {r.outcome.verdict:<5} {r.check.id}", file=sys.stderr, flush=True)

    return show


async def _serve(args: argparse.Namespace, progress: bool) -> tuple[list[Result], dict[str, object]]:
    from ztunnel.conformance.originator import CHECKS, Driver, OriginContext, OriginSpec, run_originator

    required(args, "ca", "cert", "key", "expect_identity", "drive")
    host, port = parse_addr(args.serve, "--serve")
    try:
        driver = Driver.parse(args.drive)
    except ValueError as e:
        raise UsageError(str(e)) from e
    spec = OriginSpec(
        ca=readable(args.ca, "--ca") or Path(),
        cert=readable(args.cert, "--cert") or Path(),
        key=readable(args.key, "--key") or Path(),
        expect_identity=args.expect_identity,
        driver=driver,
        timeout=args.timeout,
    )
    checks = selected(CHECKS, args)
    try:
        sock = socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    except OSError as e:
        raise UsageError(f"--serve {args.serve}: cannot listen: {e.strerror or e}") from e
    try:
        OriginContext(spec).tls_context()
    except (ssl.SSLError, OSError, ValueError) as e:
        sock.close()
        raise UsageError(f"--ca {spec.ca} / --cert {spec.cert} / --key {spec.key}: not usable for TLS: {e}") from e
    results = await run_originator(spec, sock, checks, on_result=_printer(progress))
    return results, {"mode": "serve", "serve": args.serve, "drive": str(driver)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        from ztunnel.conformance import originator, target

        checks = originator.CHECKS if args.serve_checks else target.CHECKS
        for c in checks:
            print(f"{c.id}\n    {c.title}\n    sends: {c.sends}\n    upstream: {c.upstream}\n    rule: {c.rule}")
        return 0
    try:
        if args.target:
            results, about = asyncio.run(_target(args, progress=args.output == "table" and sys.stderr.isatty()))
        else:
            results, about = asyncio.run(_serve(args, progress=args.output == "table" and sys.stderr.isatty()))
    except UsageError as e:
        print(f"conformance: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.output == "json":
        print(report.as_json(results, about))
    else:
        where = about.get("target") or about.get("serve")
        print(report.table(results, f"HBONE conformance, {about['mode']} mode: {where}"))
    bad = FAILING | ({Verdict.DIFF} if args.strict else set())
    return 1 if any(r.outcome.verdict in bad for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
