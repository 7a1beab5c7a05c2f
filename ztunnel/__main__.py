"""The ``ztunnel`` command: ``proxy`` (default), ``version``, ``help``, ``config`` and ``explain``.

Deliberately tiny, as upstream's ``main.rs``: everything else is configured by environment variables.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

from ztunnel import __version__
from ztunnel.config import DEFAULT_MESH_CONFIG_PATH, Config, ConfigError, from_env

USAGE = """\
usage: ztunnel [proxy [ztunnel] | config | explain ... | version | help]

  proxy    run the proxy (default); configured by environment variables (see docs/configuration.md)
  config   print the effective configuration as JSON and exit
  explain  explain a connection's routing and policy decision (ztunnel explain --help; docs/explain.md)
  version  print the version and exit
  help     print this help
"""


def _raise_nofile_limit() -> None:
    # Upstream raises the soft fd limit to the hard limit at start: a node with 100+ pods needs thousands of fds
    # (istio/ztunnel#1585, "Too many open files").
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _load_config(args: list[str]) -> Config:
    mesh = None
    mesh_path = Path(DEFAULT_MESH_CONFIG_PATH)
    if mesh_path.is_file():
        mesh = mesh_path.read_text(encoding="utf-8")
    return from_env(os.environ, mesh_config=mesh, cpu_count=os.cpu_count() or 1, args=args)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else "proxy"
    if command in ("help", "-h", "--help"):
        sys.stdout.write(USAGE)
        return 0
    if command in ("version", "--version"):
        sys.stdout.write(f"ztunnel {__version__} (python {sys.version.split()[0]})\n")
        return 0
    if command == "explain":
        from ztunnel.explain import main as explain

        return explain(args[1:])
    if command not in ("proxy", "config"):
        sys.stderr.write(f"error: unknown command {command!r}\n{USAGE}")
        return 2

    try:
        config = _load_config(args)
    except ConfigError as e:
        sys.stderr.write(f"error: invalid configuration: {e}\n")
        return 1
    if command == "config":
        from ztunnel.dns.forwarder import ResolvConf

        dump = config.to_json(ResolvConf.load().to_json())
        sys.stdout.write(json.dumps(dump, indent=2, sort_keys=True) + "\n")
        return 0
    return _run_proxy(config)


def _run_proxy(config: Config) -> int:
    from ztunnel.config import LogFormat
    from ztunnel.telemetry import setup_logging

    setup_logging(config.log_level, json_format=config.log_format is LogFormat.JSON)
    _raise_nofile_limit()
    prefork = None
    if not config.inline_data_plane:
        from ztunnel.workers.prefork import Preforked

        # Now, while this process has one thread and has imported nothing of the control plane (the app, admin,
        # xDS, aiohttp, gRPC come below): the workers share its pages and have none of those.
        prefork = Preforked.start(config.worker_threads)
    from ztunnel.app import StartupError, run
    from ztunnel.localconfig import LocalConfigError

    try:
        import uvloop

        return uvloop.run(run(config, prefork))
    except (StartupError, LocalConfigError) as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    except OSError as e:
        # A port already in use, a missing capability: say which and stop (nothing is half-bound).
        sys.stderr.write(f"error: {e}\n")
        return 1
    finally:
        if prefork is not None:
            prefork.close()  # workers the start never took (it failed before): end them


if __name__ == "__main__":
    sys.exit(main())
