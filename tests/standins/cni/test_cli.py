"""``python -m ztunnel.standins.cni``: ``rules show`` prints istio-cni's rules; ``serve`` serves ZDS and takes pod
changes on stdin, answering each; a bad pod spec exits 2 naming the expected form."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from tests.standins.cni.helpers import GOLDEN_DNS, Ztunnel


def test_rules_show_command_prints_the_rules() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ztunnel.standins.cni", "rules", "show", "--dns-capture"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == GOLDEN_DNS


async def test_serve_command(tmp_path: Path, netns_files: dict[str, Path], clients: list[Ztunnel]) -> None:
    path = tmp_path / "zds.sock"
    p = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "ztunnel.standins.cni", "serve", "--socket", str(path)],
        *["--pod", f"u1:default/client/sleep:{netns_files['a']}"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert p.stdin is not None and p.stdout is not None

    async def command(line: str) -> None:
        assert p.stdin is not None
        p.stdin.write(line.encode() + b"\n")
        await p.stdin.drain()

    async def answer() -> str:
        assert p.stdout is not None
        return (await asyncio.wait_for(p.stdout.readline(), 10)).decode().strip()

    try:
        assert await answer() == f"listening {path}"
        zt = Ztunnel(path)
        clients.append(zt)
        await zt.hello()
        assert await zt.expect("add", "u1") == [netns_files["a"].stat().st_ino]
        await zt.expect("snapshot_sent")

        await command(f"add u2:other/server/srv:{netns_files['b']}")
        await zt.expect("add", "u2")
        assert await answer() == "ok"
        await command("del u1")
        await zt.expect("del", "u1", error="no such workload")
        assert await answer() == "nack no such workload"
        await command("frobnicate")
        assert (await answer()).startswith("error unknown command")
    finally:
        p.terminate()
        _, err = await asyncio.wait_for(p.communicate(), 10)
    assert p.returncode == 0, err
    assert await zt.eof()


def test_serve_command_rejects_bad_pod_spec(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "ztunnel.standins.cni", "serve", "--socket", str(tmp_path / "s"), "--pod", "x"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert p.returncode == 2 and "UID:NAMESPACE/NAME/SERVICE_ACCOUNT:NETNS" in p.stderr
