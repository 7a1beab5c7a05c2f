"""The multi-process data plane: one control process and ``ZTUNNEL_WORKER_THREADS`` worker processes.

- :mod:`~ztunnel.workers.protocol`: the channel between them, sans-IO (frames, messages, request ids);
- :mod:`~ztunnel.workers.channel`: that codec on an asyncio loop, over a unix socketpair with fds beside the bytes;
- :mod:`~ztunnel.workers.worker`: a worker process's data plane, which imports no gRPC, no aiohttp and no
  control-plane code; :mod:`~ztunnel.workers.prefork` forks the first workers at start (sharing memory),
  ``python -m ztunnel.workers`` starts a replacement; :mod:`~ztunnel.workers.process` holds the ``prctl`` calls;
- :mod:`~ztunnel.workers.supervisor`: the control process's side: spawning, restarting, state and certificates
  to the workers, their pods, and gathering their connections and metrics.

docs/architecture.md ("Processes") describes the model.
"""

from __future__ import annotations
