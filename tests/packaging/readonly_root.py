"""Run a command the way the chart runs the image: every mount read-only, a tmpfs on /tmp, cwd ``/``.

Used by tests/test_packaging.py as the first process inside ``unshare --mount --net`` (private mount propagation,
so nothing here reaches the host's mounts)::

    unshare --mount --net --propagation private -- python readonly_root.py [--token TEXT] -- ztunnel proxy ztunnel

It remounts every visible mount read-only (``readOnlyRootFilesystem: true``; the kubelet's mounts are stricter here
than in a pod, where /dev and /etc/resolv.conf stay writable), mounts a fresh tmpfs on /tmp (the chart's ``tmp``
emptyDir), brings up loopback in the new network namespace (the pod's ``lo``), optionally writes a service-account
token to ``/tmp/tokens/istio-token`` (the chart's projected token; /tmp is the only place a file can be created),
then ``exec``s the command from ``/`` (the image's WORKDIR) so the command is this process and gets the signals.

Errors are reported on stderr with exit status 125, so a failed setup is not mistaken for the command failing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

TOKEN_PATH = "/tmp/tokens/istio-token"
SETUP_FAILED = 125


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def visible_mounts(mountinfo: str) -> dict[str, tuple[str, set[str]]]:
    """``{mount point: (filesystem type, per-mount options)}`` for the mounts a process can reach.

    A mount point listed twice (a mount stacked on another) is the later entry: the earlier one is hidden below it.
    """
    mounts: dict[str, tuple[str, set[str]]] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        # id parent major:minor root mount-point options [optional...] - fstype source super-options
        sep = fields.index("-")
        mounts[_unescape(fields[4])] = (fields[sep + 1], set(fields[5].split(",")))
    return mounts


def _run(*argv: str, pass_fds: tuple[int, ...] = ()) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False, pass_fds=pass_fds)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or f'exit {result.returncode}'}")


def _under_tmp(path: Path) -> bool:
    return path == Path("/tmp") or Path("/tmp") in path.parents


def setup(token: str | None) -> None:
    for mount_point, (_, options) in visible_mounts(Path("/proc/self/mountinfo").read_text()).items():
        if "ro" not in options:
            # A bind remount changes only this mount's flags (MS_REMOUNT|MS_BIND|MS_RDONLY), never the filesystem's.
            _run("mount", "-o", "remount,bind,ro", mount_point)
    # A checkout under /tmp (a CI runner's clone, say) would vanish under the new tmpfs, and with it the venv's
    # python: hold it by a descriptor, then bind it back at the same path, read-only like everything else.
    checkout = Path(__file__).resolve().parents[2]
    held = os.open(checkout, os.O_PATH | os.O_DIRECTORY) if _under_tmp(checkout) else None
    _run("mount", "-t", "tmpfs", "-o", "mode=1777,nosuid,nodev", "tmpfs", "/tmp")
    if held is not None:
        checkout.mkdir(parents=True)
        # --no-canonicalize: mount(8) would otherwise resolve the fd link to its path, now the empty tmpfs dir.
        _run("mount", "--no-canonicalize", "--bind", f"/proc/self/fd/{held}", str(checkout), pass_fds=(held,))
        _run("mount", "-o", "remount,bind,ro", str(checkout))
        os.close(held)
    _run("ip", "link", "set", "lo", "up")
    if token is not None:
        Path(TOKEN_PATH).parent.mkdir()
        Path(TOKEN_PATH).write_text(token)


def main(argv: list[str]) -> None:
    token = None
    if argv[:1] == ["--token"]:
        token, argv = argv[1], argv[2:]
    if argv[:1] != ["--"] or len(argv) < 2:
        sys.exit(f"usage: {sys.argv[0]} [--token TEXT] -- COMMAND [ARG...]")
    command = argv[1:]
    try:
        setup(token)
        os.chdir("/")
        os.execv(command[0], command)
    except (OSError, RuntimeError) as e:
        print(f"readonly_root: {e}", file=sys.stderr)
        sys.exit(SETUP_FAILED)


if __name__ == "__main__":
    main(sys.argv[1:])
