"""``make demo``: ztunnel on the embedded default (local config + local CA), started and stopped cleanly.

Runs node A of ``examples/two-node.yaml`` in dedicated mode with the fake (local) CA and no control plane,
waits until it reports ready, shows what it loaded, then drains it as SIGTERM would and exits 0.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from ztunnel.app import build
from ztunnel.config import from_env
from ztunnel.telemetry import setup_logging

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "two-node.yaml"


async def _main(ca_dir: str) -> int:
    config = from_env(
        {
            "XDS_ADDRESS": "",
            "FAKE_CA": "true",
            "ZTUNNEL_CA_DIR": ca_dir,
            "LOCAL_XDS_PATH": str(EXAMPLE),
            "PROXY_MODE": "dedicated",
            "PROXY_WORKLOAD_INFO": "default/client/client",
            "NODE_NAME": "node-a",
        }
    )
    app = build(config)
    await app.start()
    print(f"ztunnel (node-a) ready={app.readiness.ready}: {len(app.state.workloads)} workloads, ", end="")
    print(f"{len(app.state.services)} services, {len(app.state.policies)} policies from {EXAMPLE.name}")
    for w in app.state.workloads:
        print(
            f"  workload {w.namespace}/{w.name} {', '.join(map(str, w.workload_ips))} {w.protocol.value} {w.identity}"
        )
    app.shutdown()
    await app.wait()
    print("drained and stopped cleanly")
    return 0


def main() -> int:
    setup_logging("warn")
    with tempfile.TemporaryDirectory(prefix="ztunnel-demo-") as ca_dir:
        import uvloop

        return uvloop.run(_main(ca_dir))


if __name__ == "__main__":
    sys.exit(main())
