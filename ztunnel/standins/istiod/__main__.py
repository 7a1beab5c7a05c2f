"""``python -m ztunnel.standins.istiod serve``: run the local control plane (delta xDS + Istio CA over TLS) until
SIGINT/SIGTERM.

Example::

    python -m ztunnel.standins.istiod serve --config examples/two-node.yaml --ca-dir ./var/cp \
        --listen 127.0.0.1:15012 --token secret

then start ztunnel with ``XDS_ADDRESS=https://127.0.0.1:15012 CA_ADDRESS=https://127.0.0.1:15012
XDS_ROOT_CA=./var/cp/root-cert.pem CA_ROOT_CA=./var/cp/root-cert.pem AUTH_TOKEN=secret FAKE_CA=false``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from datetime import timedelta

from ztunnel.config import parse_duration
from ztunnel.identity.ca import CaError
from ztunnel.identity.spiffe import DEFAULT_TRUST_DOMAIN, Identity, IdentityError
from ztunnel.localconfig import LocalConfigError
from ztunnel.standins.istiod.ca import node_identity
from ztunnel.standins.istiod.convert import ConvertError
from ztunnel.standins.istiod.server import DEFAULT_LISTEN, XdsServer


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ztunnel.standins.istiod", description="ztunnel's local control plane")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve delta xDS and the Istio CA from local config files")
    s.add_argument(
        "--config", action="extend", nargs="+", default=[], metavar="FILE", help="local config file(s), watched"
    )
    s.add_argument("--ca-dir", required=True, help="CA directory: root-cert.pem (give it to clients) and ca-key.pem")
    s.add_argument("--listen", default=DEFAULT_LISTEN, help=f"host:port to listen on (default {DEFAULT_LISTEN})")
    s.add_argument(
        "--token",
        action="append",
        default=[],
        metavar="TOKEN[=SPIFFE_ID]",
        help="accepted bearer token and the identity it authenticates (default: the trusted node identity); "
        "without any token the server is open to anyone",
    )
    s.add_argument("--trust-domain", default=DEFAULT_TRUST_DOMAIN, help="trust domain of the CA")
    s.add_argument(
        "--trusted-node-identity",
        action="append",
        default=[],
        metavar="SPIFFE_ID",
        help="identity allowed to impersonate workloads (default spiffe://<td>/ns/istio-system/sa/ztunnel)",
    )
    s.add_argument("--hostname", action="append", default=[], help="extra DNS name for the serving certificate")
    s.add_argument("--max-ttl", default="2160h", help="longest certificate lifetime granted (default 90 days)")
    s.add_argument("--log-level", default="info", help="debug, info, warning or error")
    return p


def _tokens(raw: Sequence[str], default: Identity) -> dict[str, Identity]:
    out = {}
    for item in raw:
        token, sep, ident = item.partition("=")
        if not token:
            raise ValueError(f"--token {item!r}: empty token")
        out[token] = Identity.parse(ident) if sep else default
    return out


async def _serve(args: argparse.Namespace) -> int:
    td = args.trust_domain
    trusted = [Identity.parse(x) for x in args.trusted_node_identity] or [node_identity(td)]
    server = XdsServer.from_ca_dir(
        args.ca_dir,
        td,
        config_paths=args.config,
        listen=args.listen,
        tokens=_tokens(args.token, trusted[0]),
        trusted_node_identities=trusted,
        hostnames=args.hostname,
        max_ttl=timedelta(seconds=parse_duration(args.max_ttl)),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    # Printed once the signal handlers are in place: a supervisor that reads this line may stop us right away.
    print(f"serving on {server.url}; clients trust {server.root_cert_path}", flush=True)
    await stop.wait()
    await server.stop(grace=1.0)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (1 with a message on a bad flag or config)."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        import uvloop

        return uvloop.run(_serve(args))
    except (LocalConfigError, ConvertError, CaError, IdentityError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
