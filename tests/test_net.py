"""``ztunnel.net.format_addr``: the one place an address and port become ``ip:port`` / ``[v6]:port`` text."""

from __future__ import annotations

import ast
import ipaddress
from pathlib import Path

from ztunnel.net import format_addr

ROOT = Path(__file__).resolve().parent.parent


def test_format_addr() -> None:
    assert format_addr(ipaddress.ip_address("10.0.0.1"), 15008) == "10.0.0.1:15008"
    assert format_addr(ipaddress.ip_address("fd00::1"), 15008) == "[fd00::1]:15008"
    assert format_addr("127.0.0.1", 0) == "127.0.0.1:0"
    assert format_addr("::", 15001) == "[::]:15001"
    assert format_addr("localhost", 15000) == "localhost:15000"
    assert format_addr("svc.ns.svc.cluster.local", 80) == "svc.ns.svc.cluster.local:80"


def _brackets_a_host(node: ast.AST) -> bool:
    """``f"...[{x}]:{port}..."``, or ``f"[{x}]" if ... else ...`` (a host bracketed before its port is added)."""
    if isinstance(node, ast.IfExp) and isinstance(node.body, ast.JoinedStr):
        return [_kind(v) for v in node.body.values] == ["[", "value", "]"]
    if not isinstance(node, ast.JoinedStr):
        return False
    kinds = [_kind(v) for v in node.values]
    return any(
        kinds[i - 1].endswith("[") and kinds[i] == "value" and kinds[i + 1].startswith("]:")
        for i in range(1, len(kinds) - 1)
    )


def _kind(part: ast.expr) -> str:
    return str(part.value) if isinstance(part, ast.Constant) else "value"


def test_no_other_code_brackets_an_address() -> None:
    """Every ``[v6]:port`` is made by :func:`format_addr`: eight copies of it had grown under other names."""
    copies = []
    for package in ("ztunnel", "bench", "tests"):
        for path in sorted((ROOT / package).rglob("*.py")):
            if path == ROOT / "ztunnel" / "net.py":
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            copies += [
                f"{path.relative_to(ROOT)}:{node.lineno}"
                for node in ast.walk(tree)
                if isinstance(node, ast.expr) and _brackets_a_host(node)
            ]
    assert copies == []
