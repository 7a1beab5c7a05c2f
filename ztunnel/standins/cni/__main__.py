"""``python -m ztunnel.standins.cni``: istio-cni's node agent as a command (``serve`` ZDS, or apply/remove/show the
in-pod ``rules``)::

    python -m ztunnel.standins.cni serve --socket /var/run/ztunnel/ztunnel.sock \\
        --pod 1234:default/client/sleep:/run/netns/client --apply-rules
    python -m ztunnel.standins.cni rules apply --netns client
    python -m ztunnel.standins.cni rules show --dns-capture
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from ztunnel.standins.cni.rules import (
    InpodRulesError,
    apply_inpod_rules,
    build_inpod_rules,
    remove_inpod_rules,
    render_restore,
)
from ztunnel.standins.cni.server import ACK_TIMEOUT, DEFAULT_SOCKET, PodInfo, ZdsError, ZdsServer
from ztunnel.tasks import TaskGroup


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m ztunnel.standins.cni",
        description="A stand-in for istio-cni's node agent: in-pod redirection rules and the ZDS server ztunnel "
        "connects to in in-pod mode.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve ZDS to ztunnel",
        description="Listen for ztunnel on a SOCK_SEQPACKET unix socket and announce pods to it. While running, "
        "lines on stdin change the pod set: `add UID:NAMESPACE/NAME/SA:NETNS` and `del UID`; each is answered "
        "on stdout with `ok`, `nack REASON` or `error REASON`.",
    )
    serve.add_argument("--socket", default=DEFAULT_SOCKET, help=f"socket path (ztunnel's INPOD_UDS; {DEFAULT_SOCKET})")
    serve.add_argument(
        "--pod",
        action="append",
        default=[],
        metavar="UID:NAMESPACE/NAME/SA:NETNS",
        help="a pod in the snapshot (repeatable); NETNS is a name under /run/netns or a path",
    )
    serve.add_argument("--apply-rules", action="store_true", help="apply the in-pod rules to each pod's netns")
    serve.add_argument("--dns-capture", action="store_true", help="with --apply-rules: redirect DNS to 15053")
    serve.add_argument("--no-ipv6", action="store_true", help="with --apply-rules: IPv4 rules only")
    serve.add_argument("--ack-timeout", type=float, default=ACK_TIMEOUT, help="seconds to wait for each ack")

    rules = sub.add_parser("rules", help="apply, remove or print the in-pod iptables rules")
    rules.add_argument("action", choices=["apply", "remove", "show"])
    rules.add_argument("--netns", help="the pod's netns: a name under /run/netns or a path (apply/remove)")
    rules.add_argument("--dns-capture", action="store_true", help="include the DNS capture rules (apply/show)")
    rules.add_argument("--no-ipv6", action="store_true", help="IPv4 only (apply/remove)")
    rules.add_argument("--ipv6", action="store_true", help="show the IPv6 variant (show)")
    return p


def _out(line: str) -> None:
    print(line, flush=True)


async def _serve(args: argparse.Namespace, pods: list[PodInfo]) -> int:
    server = ZdsServer(
        args.socket,
        pods,
        ack_timeout=args.ack_timeout,
        apply_rules=args.apply_rules,
        dns_capture=args.dns_capture,
        ipv6=not args.no_ipv6,
    )
    await server.start()
    _out(f"listening {server.path}")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    commands: asyncio.Queue[str | None] = asyncio.Queue()

    def read_stdin() -> None:  # a daemon thread: a blocked read never holds up exit
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line)
        loop.call_soon_threadsafe(commands.put_nowait, None)

    threading.Thread(target=read_stdin, name="nodeagent-stdin", daemon=True).start()
    tasks = TaskGroup("nodeagent-cli")
    tasks.spawn(_control(server, commands), "stdin")
    try:
        await stop.wait()
    finally:
        await tasks.cancel_all(timeout=1)
        await server.stop()
    return 0


async def _control(server: ZdsServer, commands: asyncio.Queue[str | None]) -> None:
    while (line := await commands.get()) is not None:
        words = line.split()
        if not words:
            continue
        try:
            if words[0] == "add" and len(words) == 2:
                error = await server.add_pod(PodInfo.parse(words[1]))
            elif words[0] == "del" and len(words) == 2:
                error = await server.del_pod(words[1])
            else:
                _out(f"error unknown command {line.strip()!r} (use `add UID:NS/NAME/SA:NETNS` or `del UID`)")
                continue
        except (ZdsError, InpodRulesError, ValueError) as e:
            _out(f"error {e}")
            continue
        _out(f"nack {error}" if error else "ok")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "rules":
        if args.action == "show":
            sys.stdout.write(render_restore(build_inpod_rules(ipv6=args.ipv6, dns_capture=args.dns_capture)))
            return 0
        if not args.netns:
            parser.error(f"rules {args.action} needs --netns")
        try:
            if args.action == "apply":
                apply_inpod_rules(args.netns, dns_capture=args.dns_capture, ipv6=not args.no_ipv6)
            else:
                remove_inpod_rules(args.netns, ipv6=not args.no_ipv6)
        except InpodRulesError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    try:
        pods = [PodInfo.parse(s) for s in args.pod]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import uvloop

    try:
        return uvloop.run(_serve(args, pods))
    except (InpodRulesError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
