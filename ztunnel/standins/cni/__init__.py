"""istio-cni's part of in-pod mode, for tests, the demo and clusters without istio-cni (the "node agent").

istio-cni does two things for ztunnel on each node, and so does this package:

1. **Redirection** (:mod:`.rules`): it applies the in-pod iptables rule set and policy routing to every captured
   pod's network namespace, so the pod's traffic reaches ztunnel's listeners in that namespace.
2. **ZDS** (:mod:`.server`): it is the *server* of the ZDS protocol (``zds.proto``; the codec is
   :mod:`ztunnel.inpod.protocol`, shared with ztunnel's client): it hands each pod's network namespace to the
   node's ztunnel over a SOCK_SEQPACKET unix socket.

``python -m ztunnel.standins.cni`` runs it as a command (:mod:`.__main__`)::

    python -m ztunnel.standins.cni serve --socket /var/run/ztunnel/ztunnel.sock \\
        --pod 1234:default/client/sleep:/run/netns/client --apply-rules
    python -m ztunnel.standins.cni rules apply --netns client
    python -m ztunnel.standins.cni rules show --dns-capture
"""

from __future__ import annotations
