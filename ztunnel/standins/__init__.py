"""Stand-ins for the components on the other side of ztunnel's protocols, for tests, the demo and the benchmark.

ztunnel is a client of two control components, and each has a stand-in here that speaks the real protocol:

* :mod:`ztunnel.standins.istiod`: istiod's side of delta xDS (workloads, services, policies from local config
  files) and of the Istio CA (``CreateCertificate``), over gRPC with TLS. ``python -m ztunnel.standins.istiod
  serve`` runs it.
* :mod:`ztunnel.standins.cni`: istio-cni's side of in-pod mode: the in-pod iptables rules applied to each pod's
  network namespace, and the ZDS server ztunnel connects to. ``python -m ztunnel.standins.cni`` runs it.

Upstream keeps its counterparts in ``src/test_helpers/`` (``xds.rs``, ``ca.rs``, ``inpod.rs``). They are not part
of the proxy: nothing else in ``ztunnel`` but the test toolkit (:mod:`ztunnel.testing`) and the demo imports them,
and the runtime image leaves them out (tests/test_package_graph.py, tests/test_packaging.py). They are built on the
proxy's own modules (config, identity, state, the ZDS codec in :mod:`ztunnel.inpod.protocol`), which keeps both
sides of each protocol in step.
"""

from __future__ import annotations
