"""Regenerate the Python protobuf and gRPC modules under ``xds/`` from the ``.proto`` files there.

Usage::

    python -m xds.generate            # (re)write the generated modules
    python -m xds.generate --check    # exit 1, listing them, if committed modules are stale

Every ``xds/**/*.proto`` is compiled with the repository root as the first include directory, so a
proto at ``xds/istio/workload/workload.proto`` is imported by other protos under that path and becomes
the module ``xds.istio.workload.workload_pb2``. The other include directories are grpc_tools' bundled
well-known types (``google/protobuf/*.proto``) and the googleapis-common-protos install
(``google/rpc/status.proto``).

For each proto this writes ``<name>_pb2.py`` and ``<name>_pb2.pyi``, plus ``<name>_pb2_grpc.py`` when the
file declares a service. The ``.pyi`` and ``_pb2_grpc.py`` files get a leading ``# mypy: ignore-errors``
line (see ``MYPY_HEADER``); nothing else is changed.

Output depends only on the sources and the installed grpcio-tools version: protoc runs in-process, inputs
are sorted, and files are written only when their bytes change. Generated modules whose proto no longer
exists are deleted, and missing package ``__init__.py`` files are created.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import descriptor_pb2  # type: ignore[import-untyped,unused-ignore]

__all__ = [
    "GENERATED_SUFFIXES",
    "REPO_ROOT",
    "GenerationError",
    "Stale",
    "check",
    "generator_versions",
    "include_dirs",
    "main",
    "proto_sources",
    "run_protoc",
    "stale_files",
    "write",
]

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "xds"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_INIT_TEMPLATE = (
    '"""Generated protobuf modules for the .proto files in this directory."""\n\nfrom __future__ import annotations\n'
)
# protoc's stubs use bare generics and the gRPC plugin writes untyped functions; mypy (strict) reads both
# whenever typed code imports them, so they are told to keep quiet. Their declared types are still used.
MYPY_HEADER = b"# mypy: ignore-errors\n"
_MYPY_CHECKED_SUFFIXES = ("_pb2.pyi", "_pb2_grpc.py")
# Lines that only record which generator produced a file; used to explain a mismatch, never to hide one.
_VERSION_LINE = re.compile(r"^(# Protobuf Python Version: .*|GRPC_GENERATED_VERSION = .*)$", re.MULTILINE)


class GenerationError(RuntimeError):
    """protoc failed or its inputs could not be located."""


@dataclass(frozen=True, slots=True)
class Stale:
    """One generated file that does not match what the sources produce."""

    path: str  # relative to the repository root, POSIX separators
    reason: str  # "differs", "missing" or "orphan"

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


def proto_sources(root: Path = REPO_ROOT) -> list[str]:
    """The ``.proto`` files under ``<root>/xds``, as sorted root-relative POSIX paths."""
    return sorted(p.relative_to(root).as_posix() for p in (root / PACKAGE).rglob("*.proto"))


def include_dirs(root: Path = REPO_ROOT) -> list[Path]:
    """protoc include directories: the repository root, grpc_tools' well-known types, googleapis-common-protos."""
    grpc_tools_spec = importlib.util.find_spec("grpc_tools")
    if grpc_tools_spec is None or grpc_tools_spec.origin is None:
        raise GenerationError("grpc_tools is not installed (pip install grpcio-tools)")
    well_known = Path(grpc_tools_spec.origin).parent / "_proto"
    status_spec = importlib.util.find_spec("google.rpc.status_pb2")
    if status_spec is None or status_spec.origin is None:
        raise GenerationError("googleapis-common-protos is not installed")
    # .../site-packages/google/rpc/status_pb2.py -> .../site-packages
    googleapis = Path(status_spec.origin).parent.parent.parent
    for directory, needed in ((well_known, "google/protobuf/any.proto"), (googleapis, "google/rpc/status.proto")):
        if not (directory / needed).is_file():
            raise GenerationError(f"{needed} not found in {directory}")
    return [root.resolve(), well_known.resolve(), googleapis.resolve()]


def _protoc(args: list[str]) -> None:
    from grpc_tools import protoc

    rc = protoc.main(["grpc_tools.protoc", *args])
    if rc != 0:
        raise GenerationError(f"protoc exited with status {rc}; its messages are above")


def run_protoc(out_dir: Path, root: Path = REPO_ROOT) -> None:
    """Compile every proto under ``<root>/xds`` into ``out_dir`` (which then contains ``xds/...``)."""
    sources = proto_sources(root)
    if not sources:
        raise GenerationError(f"no .proto files under {root / PACKAGE}")
    includes = [f"--proto_path={d}" for d in include_dirs(root)]
    inputs = [str((root / s).resolve()) for s in sources]
    descriptor_set = out_dir / "descriptors.binpb"
    _protoc(
        [
            *includes,
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--descriptor_set_out={descriptor_set}",
            *inputs,
        ]
    )
    fds = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes())
    descriptor_set.unlink()
    with_services = sorted(f.name for f in fds.file if f.service)
    if with_services:
        _protoc([*includes, f"--grpc_python_out={out_dir}", *(str((root / s).resolve()) for s in with_services)])
    for path in sorted(out_dir.rglob("*")):
        if path.name.endswith(_MYPY_CHECKED_SUFFIXES):
            data = path.read_bytes()
            if not data.startswith(MYPY_HEADER):
                path.write_bytes(MYPY_HEADER + data)


def _generated_files(base: Path) -> dict[str, bytes]:
    """Generated modules under ``<base>/xds``, keyed by base-relative POSIX path."""
    found: dict[str, bytes] = {}
    for path in sorted((base / PACKAGE).rglob("*")):
        if path.is_file() and path.name.endswith(GENERATED_SUFFIXES):
            found[path.relative_to(base).as_posix()] = path.read_bytes()
    return found


def _generate(root: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """(fresh output, committed files) for the sources under ``root``."""
    with tempfile.TemporaryDirectory(prefix="xds-generate-") as tmp:
        run_protoc(Path(tmp), root)
        fresh = _generated_files(Path(tmp))
    return fresh, _generated_files(root)


def _missing_inits(root: Path, files: Sequence[str]) -> list[str]:
    """``__init__.py`` files that the generated modules' packages lack."""
    missing: set[str] = set()
    for rel in files:
        directory = (root / rel).parent
        while directory != root:
            init = directory / "__init__.py"
            if not init.is_file():
                missing.add(init.relative_to(root).as_posix())
            directory = directory.parent
    return sorted(missing)


def check(root: Path = REPO_ROOT) -> tuple[list[Stale], str | None]:
    """Compare the committed generated modules with a fresh generation.

    Returns the stale files (empty means up to date) and, when a difference comes with different
    generator-version lines, a note saying which grpcio-tools versions produced the two.
    """
    fresh, committed = _generate(root)
    stale = [
        Stale(rel, "missing" if rel not in committed else "differs")
        for rel, data in fresh.items()
        if committed.get(rel) != data
    ]
    stale += [Stale(rel, "orphan") for rel in committed if rel not in fresh]
    stale += [Stale(rel, "missing") for rel in _missing_inits(root, list(fresh))]
    note = None
    for rel, data in fresh.items():
        old = committed.get(rel)
        if old is not None and old != data and generator_versions(old) != generator_versions(data):
            note = (
                f"{rel} was generated by {generator_versions(old)}; the installed grpcio-tools "
                f"produces {generator_versions(data)}"
            )
            break
    return sorted(stale, key=lambda s: s.path), note


def stale_files(root: Path = REPO_ROOT) -> list[Stale]:
    """The generated files that differ from what the sources produce; empty means up to date."""
    return check(root)[0]


def generator_versions(data: bytes) -> list[str]:
    """The generator-version lines protoc and the gRPC plugin embed in a generated module."""
    return _VERSION_LINE.findall(data.decode("utf-8", errors="replace"))


def write(root: Path = REPO_ROOT) -> list[str]:
    """Regenerate in place; return the root-relative paths that were written or deleted."""
    fresh, committed = _generate(root)
    changed: list[str] = []
    for rel, data in fresh.items():
        if committed.get(rel) != data:
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            tmp.write_bytes(data)
            tmp.replace(target)
            changed.append(rel)
    for rel in committed:
        if rel not in fresh:
            (root / rel).unlink()
            changed.append(rel)
    for rel in _missing_inits(root, list(fresh)):
        (root / rel).write_text(_INIT_TEMPLATE, encoding="utf-8")
        changed.append(rel)
    return sorted(changed)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xds.generate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="generate into a temporary directory and exit 1 if the committed modules differ",
    )
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root: Path = args.root.resolve()
    try:
        if args.check:
            stale, note = check(root)
            if not stale:
                return 0
            print("stale generated protobuf files:", file=sys.stderr)
            for item in stale:
                print(f"  {item}", file=sys.stderr)
            if note is not None:
                print(f"note: {note}", file=sys.stderr)
            print("run `python -m xds.generate` (or `make protos`) and commit the result", file=sys.stderr)
            return 1
        for rel in write(root):
            print(rel)
    except GenerationError as exc:
        print(f"xds.generate: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
