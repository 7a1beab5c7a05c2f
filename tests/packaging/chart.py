"""Rendering charts/ztunnel offline and checking the rendered objects against what our proxy and image expect.

Helm is helm-python-sdk (Helm's Go SDK as a shared library, from PyPI): ``lint`` is ``helm lint`` and
``Chart.render`` is ``helm template`` (values coalesced with the defaults and checked against values.schema.json).
It and kubernetes-validate are imported lazily, so this module loads (and mypy checks it) without them; the tests
skip with a reason when they are missing (fail, with ``ZTUNNEL_PACKAGING_TESTS=require``).

The two checks everything else builds on:

- :func:`contract_violations`: the pod contract of upstream's chart that ztunnel relies on (capabilities, probe,
  token audience, mounts, downward API, ...), as a list of human-readable violations, empty when all hold. Tests
  assert it is empty for every render and non-empty for deliberately broken templates.
- :func:`unread_env_names`: the names the chart puts in the proxy's environment that ``ztunnel.config.from_env``
  never looks at. ``from_env`` is run on the pod's environment through a mapping that records every lookup, and
  every prefix scan (``ISTIO_META_*``, ``XDS_HEADER_*``, ...) through keys that record a matching ``startswith``;
  a name neither looked up nor matched by a scan is one the proxy would silently ignore.
"""

from __future__ import annotations

import importlib
import math
import posixpath
import re
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

import yaml

from ztunnel import config as ztconfig

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ztunnel"
RELEASE = "ztunnel"
NAMESPACE = "istio-system"

CAPABILITIES_ADDED = {"NET_ADMIN", "SYS_ADMIN", "NET_RAW"}
DOWNWARD_API = {
    "POD_NAME": "metadata.name",
    "POD_NAMESPACE": "metadata.namespace",
    "NODE_NAME": "spec.nodeName",
    "INSTANCE_IP": "status.podIP",
    "SERVICE_ACCOUNT": "spec.serviceAccountName",
}
# Where the proxy finds istio-cni's socket, istiod's root certificate and its token (ztunnel/config.py defaults,
# resolved against the image's working directory; see image_paths()).
SOCKET_DIR = "/var/run/ztunnel"

# What upstream's chart renders for the volumes ztunnel reads (istio/istio 86c9f01fd735,
# manifests/charts/ztunnel/templates/daemonset.yaml); contract_violations holds every render to these.
UPSTREAM_TOKEN = {"path": "istio-token", "expirationSeconds": 43200, "audience": "istio-ca"}
# configMap name: trustBundleName | default "istio-ca-root-cert"; with env.ENABLE_CLUSTER_TRUST_BUNDLE_API=true a
# projected clusterTrustBundle "istio.io:istiod-ca:" + (trustBundleName | default "root-cert"), path root-cert.pem.
UPSTREAM_ROOT_CERT_CONFIGMAP = "istio-ca-root-cert"
UPSTREAM_TRUST_BUNDLE_PREFIX = "istio.io:istiod-ca:"
UPSTREAM_TRUST_BUNDLE_DEFAULT = "root-cert"
# hostPath type: "ideally this would be a socket, but istio-cni may not have started yet".
UPSTREAM_SOCKET_HOSTPATH_TYPE = "DirectoryOrCreate"


def helm() -> Any:
    return importlib.import_module("helm_python")


def kubernetes_validate() -> Any:
    return importlib.import_module("kubernetes_validate")


# --- rendering -----------------------------------------------------------------------------------------------------


def load_values(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    values = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(values, dict):
        raise ValueError(f"{path}: a values file must be a mapping")
    return values


def effective_values(values: dict[str, Any] | None, chart: Path = CHART) -> dict[str, Any]:
    """The chart's values.yaml with ``values`` over it (top-level keys replaced, enough for the keys read here)."""
    defaults = load_values(chart / "values.yaml") or {}
    return {**defaults, **(values or {})}


def _render_templates(values: dict[str, Any] | None, chart: Path) -> dict[str, str]:
    with helm().Chart.load(chart) as loaded:
        manifests: dict[str, str] = loaded.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return manifests


def render(values: dict[str, Any] | None, chart: Path = CHART) -> list[dict[str, Any]]:
    """``helm template ztunnel <chart> -n istio-system [-f values]``: the rendered objects, in template order."""
    manifests = _render_templates(values, chart)
    docs: list[dict[str, Any]] = []
    for template in sorted(manifests):
        if not template.endswith((".yaml", ".yml")):
            continue  # NOTES.txt: render_notes()
        docs.extend(d for d in yaml.safe_load_all(manifests[template]) if d)
    return docs


def render_notes(values: dict[str, Any] | None, chart: Path = CHART) -> str:
    """The rendered NOTES.txt, what ``helm install`` prints."""
    manifests = _render_templates(values, chart)
    (notes,) = [text for name, text in manifests.items() if name.endswith("/NOTES.txt")]
    return notes


def lint(values: dict[str, Any] | None, chart: Path = CHART, kube_version: str | None = None) -> list[str]:
    """``helm lint --strict``: the findings that fail it (warnings and errors), as text."""
    report = helm().lint(chart, values, strict=True, kube_version=kube_version)
    problems = [f"[{m['path']}] {m['error'].strip()}" for m in report.get("messages", []) if m["severity"] >= 2]
    problems += [e.strip() for e in report.get("errors", []) if e.strip() not in " ".join(problems)]
    return problems


def validate(docs: list[dict[str, Any]], kube_version: str) -> list[str]:
    """kubernetes-validate --strict against one Kubernetes version: one message per invalid object."""
    kv = kubernetes_validate()
    errors = []
    for doc in docs:
        try:
            kv.validate(doc, kube_version, strict=True)
        except kv.ValidationError as e:
            where = ".".join(str(p) for p in e.path)
            errors.append(f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}: {where}: {e.message}")
    return errors


def objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


def daemonset(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = objects(docs, "DaemonSet")
    return ds


def proxy_container(ds: dict[str, Any]) -> dict[str, Any]:
    containers: list[dict[str, Any]] = ds["spec"]["template"]["spec"]["containers"]
    (proxy,) = [c for c in containers if c["name"] == "istio-proxy"]
    return proxy


# --- the pod's environment -----------------------------------------------------------------------------------------


def pod_env(ds: dict[str, Any], node_cpus: int = 4) -> dict[str, str]:
    """The proxy's environment as the kubelet would build it, downward-API values filled with plausible ones."""
    pod = ds["spec"]["template"]["spec"]
    container = proxy_container(ds)
    fields = {
        "metadata.name": f"{ds['metadata']['name']}-x7k2p",
        "metadata.namespace": ds["metadata"].get("namespace", NAMESPACE),
        "spec.nodeName": "node-1",
        "status.podIP": "10.244.1.7",
        "spec.serviceAccountName": pod.get("serviceAccountName", "default"),
    }
    env: dict[str, str] = {}
    for var in container.get("env", []):
        name = var["name"]
        if "value" in var:
            env[name] = str(var["value"])
        elif "fieldRef" in var.get("valueFrom", {}):
            env[name] = fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "resourceFieldRef" in var.get("valueFrom", {}):
            ref = var["valueFrom"]["resourceFieldRef"]
            limit = container.get("resources", {}).get("limits", {}).get(ref["resource"].split(".", 1)[1])
            env[name] = str(_ceil_cpu(limit) if limit is not None else node_cpus)
        else:
            raise ValueError(f"env {name}: unsupported source {var!r}")
    return env


def _ceil_cpu(quantity: str | int | float) -> int:
    text = str(quantity)
    return math.ceil(float(text[:-1]) / 1000 if text.endswith("m") else float(text))


class _ScannedKey(str):
    """A key handed out by a scan of the environment; a matching ``startswith`` counts as reading it."""

    _reads: set[str]

    def __new__(cls, value: str, reads: set[str]) -> _ScannedKey:
        key = super().__new__(cls, value)
        key._reads = reads
        return key

    def startswith(self, prefix: str | tuple[str, ...], *args: Any) -> bool:
        hit = str.startswith(self, prefix, *args)
        if hit:
            self._reads.add(str(self))
        return hit


class ReadTracker(Mapping[str, str]):
    """An environment mapping that records which names were looked up or matched by a prefix scan."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = dict(env)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return self._env[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return key in self._env

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return self._env.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter([_ScannedKey(k, self.read) for k in self._env])

    def __len__(self) -> int:
        return len(self._env)

    def items(self) -> Any:
        return [(_ScannedKey(k, self.read), v) for k, v in self._env.items()]


def names_read_by_from_env(env: Mapping[str, str]) -> set[str]:
    """Run ``from_env`` on ``env`` (it must accept it) and return the names of ``env`` it read."""
    tracker = ReadTracker(env)
    ztconfig.from_env(tracker, cpu_count=4)
    return tracker.read & set(env)


# What the kubelet adds to every pod's environment.
_KUBELET_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def unread_env_names(chart_env: Mapping[str, str], image_env: Mapping[str, str] | None = None) -> set[str]:
    """Names in ``chart_env`` that the proxy never reads.

    ``from_env`` must accept the whole pod environment (image env, kubelet env, chart env). Some reads are
    conditional: ``ZTUNNEL_CPU_LIMIT`` is not consulted when ``ZTUNNEL_RESOURCE_CPU_LIMIT`` is set, nor the CPU
    request when ``ZTUNNEL_WORKER_THREADS`` is; so a name unread in the whole environment is tried again on its own,
    and only a name ``from_env`` ignores even then is reported.
    """
    env = {**_KUBELET_ENV, **(image_env or {}), **chart_env}
    unread = set(chart_env) - names_read_by_from_env(env)
    return {name for name in unread if name not in names_read_by_from_env({**_KUBELET_ENV, name: chart_env[name]})}


# --- the contract ----------------------------------------------------------------------------------------------------


def _mounts(container: dict[str, Any]) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def _volumes(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in pod.get("volumes", [])}


def image_paths(workdir: str) -> dict[str, str]:
    """The files ztunnel opens by default, as absolute paths inside the image (its defaults are relative to cwd)."""

    def absolute(p: str) -> str:
        return str(PurePosixPath(workdir) / p)  # pathlib drops the "./"

    return {
        "root_cert": absolute(ztconfig.DEFAULT_ROOT_CERT_PROVIDER),
        "token": absolute(ztconfig.DEFAULT_TOKEN_PROVIDER),
        "socket": absolute(ztconfig.DEFAULT_INPOD_UDS),
    }


def contract_violations(
    docs: list[dict[str, Any]], workdir: str = "/", values: dict[str, Any] | None = None
) -> list[str]:
    """Everything the rendered DaemonSet must do for ztunnel, as upstream's chart does; [] when all hold.

    ``values`` are the values the render was given (the chart's defaults fill the rest): they decide which root
    certificate source upstream's chart would render.
    """
    problems: list[str] = []
    vals = effective_values(values)

    def check(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    ds = daemonset(docs)
    pod = ds["spec"]["template"]["spec"]
    meta = ds["spec"]["template"]["metadata"]
    container = proxy_container(ds)
    sc = container.get("securityContext", {})
    caps = sc.get("capabilities", {})
    env = {e["name"]: e for e in container.get("env", [])}
    mounts = _mounts(container)
    volumes = _volumes(pod)

    check(pod.get("priorityClassName") == "system-node-critical", "priorityClassName is not system-node-critical")
    check(caps.get("drop") == ["ALL"], f"capabilities.drop is {caps.get('drop')!r}, not [ALL]")
    check(
        set(caps.get("add", [])) == CAPABILITIES_ADDED,
        f"capabilities.add is {caps.get('add')!r}, not {sorted(CAPABILITIES_ADDED)}",
    )
    check(sc.get("privileged") is False, "the container must not be privileged")
    check(sc.get("runAsUser") == 0, f"runAsUser is {sc.get('runAsUser')!r}, not 0")
    check(sc.get("runAsGroup") == 1337, f"runAsGroup is {sc.get('runAsGroup')!r}, not 1337")
    check(sc.get("readOnlyRootFilesystem") is True, "readOnlyRootFilesystem is not true")
    probe = container.get("readinessProbe", {}).get("httpGet", {})
    check(
        probe.get("port") == ztconfig.DEFAULT_READINESS_PORT and probe.get("path") == "/healthz/ready",
        f"readiness probe is {probe!r}, not GET :15021/healthz/ready",
    )
    check(container.get("args") == ["proxy", "ztunnel"], f"args are {container.get('args')!r}, not [proxy, ztunnel]")
    ports = {p["containerPort"]: p for p in container.get("ports", [])}
    check(ztconfig.DEFAULT_STATS_PORT in ports, "container port 15020 (metrics) is not declared")
    annotations = meta.get("annotations", {})
    check(
        annotations.get("prometheus.io/scrape") == "true" and annotations.get("prometheus.io/port") == "15020",
        "pod lacks the prometheus.io/scrape=true, prometheus.io/port=15020 annotations",
    )

    # The files ztunnel reads by default must be where the chart mounts them.
    paths = image_paths(workdir)
    cert_dir, cert_file = posixpath.split(paths["root_cert"])
    cert_volume = volumes.get(mounts.get(cert_dir, ""), {})
    bundle = str(vals.get("trustBundleName") or "")
    if str((vals.get("env") or {}).get("ENABLE_CLUSTER_TRUST_BUNDLE_API")).lower() == "true":
        want = {
            "name": UPSTREAM_TRUST_BUNDLE_PREFIX + (bundle or UPSTREAM_TRUST_BUNDLE_DEFAULT),
            "path": cert_file,
        }
        got = cert_volume.get("projected", {}).get("sources")
        check(
            got == [{"clusterTrustBundle": want}],
            f"{cert_dir} (holding {cert_file}, ztunnel's default root certificate) is {got!r}, not the projected "
            f"clusterTrustBundle {want!r} (ENABLE_CLUSTER_TRUST_BUNDLE_API=true)",
        )
    else:
        name = bundle or UPSTREAM_ROOT_CERT_CONFIGMAP
        check(
            cert_volume.get("configMap", {}).get("name") == name,
            f"{cert_dir} (holding {cert_file}, ztunnel's default root certificate) is not mounted from the "
            f"ConfigMap {name}",
        )
    token_dir, token_file = posixpath.split(paths["token"])
    want_token = {**UPSTREAM_TOKEN, "path": token_file}
    token_sources = volumes.get(mounts.get(token_dir, ""), {}).get("projected", {}).get("sources")
    check(
        token_sources == [{"serviceAccountToken": want_token}],
        f"{token_dir}/{token_file} is {token_sources!r}, not the projected service-account token {want_token!r} "
        "(audience istio-ca)",
    )
    socket_dir, _ = posixpath.split(paths["socket"])
    host = volumes.get(mounts.get(socket_dir, ""), {}).get("hostPath", {})
    check(
        host.get("path") == SOCKET_DIR and socket_dir == SOCKET_DIR,
        f"{socket_dir} (INPOD_UDS) is not the node's {SOCKET_DIR} hostPath shared with istio-cni",
    )
    check(
        host.get("type") == UPSTREAM_SOCKET_HOSTPATH_TYPE,
        f"hostPath {SOCKET_DIR} has type {host.get('type')!r}, not {UPSTREAM_SOCKET_HOSTPATH_TYPE} "
        "(istio-cni may not have created it yet)",
    )
    check("emptyDir" in volumes.get(mounts.get("/tmp", ""), {}), "/tmp is not an emptyDir")

    for name, field in DOWNWARD_API.items():
        source = env.get(name, {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        check(source == field, f"env {name} is not the downward API's {field}")
    grace = env.get("TERMINATION_GRACE_PERIOD_SECONDS", {}).get("value")
    check(
        grace == str(pod.get("terminationGracePeriodSeconds")),
        f"env TERMINATION_GRACE_PERIOD_SECONDS={grace!r} differs from terminationGracePeriodSeconds="
        f"{pod.get('terminationGracePeriodSeconds')!r}",
    )
    names = [e["name"] for e in container.get("env", [])]
    check(len(names) == len(set(names)), f"duplicate env names: {sorted(n for n in set(names) if names.count(n) > 1)}")
    return problems


def env_value(ds: dict[str, Any], name: str) -> str | None:
    for var in proxy_container(ds).get("env", []):
        if var["name"] == name and "value" in var:
            return str(var["value"])
    return None


IMAGE_REF = re.compile(r"^[a-z0-9.-]+(?::\d+)?(/[a-z0-9._-]+)+(:[\w][\w.-]{0,127})?(@sha256:[0-9a-f]{64})?$")
