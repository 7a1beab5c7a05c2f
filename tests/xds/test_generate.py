"""The committed generated modules match the .proto sources, and the staleness check notices when they do not."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from xds import generate

ZDS_PROTO = "xds/istio/workload/zds/zds.proto"
ZDS_MODULES = ["xds/istio/workload/zds/zds_pb2.py", "xds/istio/workload/zds/zds_pb2.pyi"]


def test_committed_generated_code_is_current() -> None:
    stale, note = generate.check()
    assert not stale, (
        "generated protobuf modules are stale; run `python -m xds.generate`:\n"
        + "\n".join(f"  {s}" for s in stale)
        + (f"\n{note}" if note else "")
    )


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the repository's xds package (sources and generated modules) under a scratch root."""
    shutil.copytree(generate.REPO_ROOT / "xds", tmp_path / "xds", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_copy_starts_clean(tree: Path) -> None:
    assert generate.stale_files(tree) == []


def test_changed_proto_is_reported(tree: Path) -> None:
    proto = tree / ZDS_PROTO
    proto.write_text(proto.read_text().replace("  Version version = 1;\n", "  Version version = 1;\n  string x = 2;\n"))
    assert generate.stale_files(tree) == [generate.Stale(p, "differs") for p in ZDS_MODULES]


def test_missing_orphan_and_init_are_reported(tree: Path) -> None:
    (tree / "xds/istio/v1/auth/ca_pb2_grpc.py").unlink()
    (tree / "xds/istio/old_pb2.py").write_text("# left over from a deleted proto\n")
    (tree / "xds/envoy/config/core/__init__.py").unlink()
    assert generate.stale_files(tree) == [
        generate.Stale("xds/envoy/config/core/__init__.py", "missing"),
        generate.Stale("xds/istio/old_pb2.py", "orphan"),
        generate.Stale("xds/istio/v1/auth/ca_pb2_grpc.py", "missing"),
    ]


def test_generator_version_change_is_explained(tree: Path) -> None:
    module = tree / ZDS_MODULES[0]
    text = module.read_text()
    assert "# Protobuf Python Version: " in text
    module.write_text(text.replace("# Protobuf Python Version: ", "# Protobuf Python Version: 0.0.0-was-"))
    stale, note = generate.check(tree)
    assert stale == [generate.Stale(ZDS_MODULES[0], "differs")]
    assert note is not None
    assert "0.0.0-was-" in note


def test_write_repairs_and_is_idempotent(tree: Path) -> None:
    (tree / ZDS_MODULES[0]).write_text("stale\n")
    (tree / "xds/istio/old_pb2.pyi").write_text("")
    (tree / "xds/istio/v1/__init__.py").unlink()
    assert generate.write(tree) == [
        "xds/istio/old_pb2.pyi",
        "xds/istio/v1/__init__.py",
        ZDS_MODULES[0],
    ]
    assert not (tree / "xds/istio/old_pb2.pyi").exists()
    assert (tree / "xds/istio/v1/__init__.py").read_text().startswith('"""')
    assert generate.stale_files(tree) == []
    assert generate.write(tree) == []


def test_main_check_exit_codes(tree: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert generate.main(["--check", "--root", str(tree)]) == 0
    (tree / ZDS_MODULES[1]).unlink()
    assert generate.main(["--check", "--root", str(tree)]) == 1
    err = capsys.readouterr().err
    assert f"{ZDS_MODULES[1]}: missing" in err
    assert "python -m xds.generate" in err


def test_broken_proto_fails_loudly(tree: Path) -> None:
    (tree / ZDS_PROTO).write_text('syntax = "proto3";\nmessage {\n')
    with pytest.raises(generate.GenerationError):
        generate.stale_files(tree)
    assert generate.main(["--root", str(tree)]) == 2


def test_generation_is_deterministic(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    generate.run_protoc(first)
    generate.run_protoc(second)
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    assert files, "nothing was generated"
    for rel in files:
        assert (first / rel).read_bytes() == (second / rel).read_bytes(), rel


def test_grpc_modules_only_for_protos_with_services(tmp_path: Path) -> None:
    generate.run_protoc(tmp_path)
    grpc_modules = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*_pb2_grpc.py"))
    assert grpc_modules == [
        "xds/envoy/service/discovery/v3/discovery_pb2_grpc.py",
        "xds/istio/v1/auth/ca_pb2_grpc.py",
    ]
    stubs = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*_pb2.pyi"))
    assert len(stubs) == len(generate.proto_sources()) == 6


def test_include_dirs_resolve_imports() -> None:
    root, well_known, googleapis = generate.include_dirs()
    assert root == generate.REPO_ROOT
    assert (well_known / "google/protobuf/struct.proto").is_file()
    assert (googleapis / "google/rpc/status.proto").is_file()
