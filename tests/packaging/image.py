"""The image's Python payload, computed offline: the files the Dockerfile's builder stage copies from the build
context into its WORKDIR (``.dockerignore`` applied, as Docker does), laid out in a directory, and the wheel that the
builder's ``pip install .`` installs, built from them with the development venv's setuptools (no network, no Docker).

Only the COPY forms the Dockerfile uses are supported (a file to a file or a directory, a directory's contents to a
directory, destinations relative to WORKDIR); anything else raises, so a new form cannot be silently misread.
"""

from __future__ import annotations

import posixpath
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.packaging import dockerfile as df


def builder_stage(instructions: list[df.Instruction]) -> int:
    """The stage named ``builder`` (``FROM ... AS builder``)."""
    for ins in instructions:
        if ins.keyword == "FROM" and ins.args.lower().endswith(" as builder"):
            return ins.stage
    raise ValueError("the Dockerfile has no stage named builder")


def builder_files(instructions: list[df.Instruction], rules: df.IgnoreRules, root: Path) -> dict[str, Path]:
    """``{path under the builder's WORKDIR: file in the context}`` for every file its COPY instructions bring in."""
    stage = builder_stage(instructions)
    workdir = "/"
    files: dict[str, Path] = {}
    for ins in instructions:
        if ins.stage != stage:
            continue
        if ins.keyword == "WORKDIR":
            workdir = posixpath.join(workdir, ins.args)
        if ins.keyword not in ("COPY", "ADD") or "from" in ins.flags:
            continue
        *sources, dest = ins.words()
        target = posixpath.normpath(posixpath.join(workdir, dest))
        if target != workdir and not target.startswith(workdir.rstrip("/") + "/"):
            raise ValueError(f"line {ins.line}: COPY to {dest} outside WORKDIR {workdir}: not supported here")
        into_dir = dest.endswith("/") or len(sources) > 1
        for source in sources:
            path = root / source
            if rules.ignored(source):
                raise ValueError(f"line {ins.line}: {source} is excluded by .dockerignore")
            if path.is_dir():
                for file in sorted(p for p in path.rglob("*") if p.is_file()):
                    rel = file.relative_to(root).as_posix()
                    if not rules.ignored(rel):
                        files[posixpath.relpath(posixpath.join(target, file.relative_to(path).as_posix()), workdir)] = (
                            file
                        )
            elif path.is_file():
                name = posixpath.join(target, path.name) if into_dir else target
                files[posixpath.relpath(name, workdir)] = path
            else:
                raise ValueError(f"line {ins.line}: COPY source {source} does not exist")
    return files


def lay_out(files: dict[str, Path], into: Path) -> Path:
    for rel, source in files.items():
        (into / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, into / rel)
    return into


def build_wheel(project: Path, out: Path) -> Path:
    """The wheel ``pip install .`` builds from ``project`` (setuptools from this venv; no network)."""
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run(
        [*pip, "-w", str(out), str(project)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


def wheel_modules(wheel: Path) -> list[str]:
    """The ``.py`` files of a wheel (its ``*.dist-info`` left out)."""
    with zipfile.ZipFile(wheel) as z:
        return sorted(n for n in z.namelist() if n.endswith(".py"))


def extract(wheel: Path, into: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        z.extractall(into)
    return into
