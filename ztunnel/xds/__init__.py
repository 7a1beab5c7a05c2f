"""The xDS client side: delta ADS subscriptions, conversion of the resources and the updates they make to state.

Modules mirror upstream ``src/xds``:

* :mod:`ztunnel.xds.types`: pure protobuf -> state-model conversion and the type URLs;
* :mod:`ztunnel.xds.client`: the delta ADS subscription state machine (sans-IO) and its grpc.aio adapter;
* :mod:`ztunnel.xds.updater`: the handlers that turn a response into one :class:`~ztunnel.state.StateUpdate`
  (upstream ``xds.rs`` ``ProxyStateUpdater``).

The protobuf modules themselves live in the top-level ``xds`` package, next to the local control plane.
"""

from __future__ import annotations
