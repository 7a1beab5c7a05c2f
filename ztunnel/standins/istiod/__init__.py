"""The local control plane: istiod's side of delta xDS and of the Istio CA, served from local config files.

* :mod:`.server`: :class:`~ztunnel.standins.istiod.server.XdsServer`, delta ADS and ``CreateCertificate`` over gRPC
  with TLS, and the sans-IO delta protocol per stream;
* :mod:`.convert`: the state model (local config schema) to xDS protobufs, the inverse of ``ztunnel.xds.types``;
* :mod:`.ca`: who may have which certificate (istiod's CA server rules, simplified);
* ``python -m ztunnel.standins.istiod serve``: the command (:mod:`.__main__`).
"""

from __future__ import annotations
