"""``ztunnel.tasks.running_loop``: the running loop without asyncio's per-lookup ``getpid``, and never a loop that is
not running in this thread (another thread's, a stopped one, or the parent's in a forked child)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from ztunnel.tasks import running_loop


async def test_the_running_loop_and_the_next_one() -> None:
    loop = asyncio.get_running_loop()
    assert running_loop() is loop
    assert running_loop() is loop

    # A loop started later in this thread (the first stopped) is the one returned.
    def other() -> asyncio.AbstractEventLoop:
        async def inner() -> asyncio.AbstractEventLoop:
            return running_loop()

        return asyncio.run(inner())

    seen: list[asyncio.AbstractEventLoop] = []
    t = threading.Thread(target=lambda: seen.append(other()))
    t.start()
    t.join()
    assert seen and seen[0] is not loop  # another thread: its own loop, not this one
    assert running_loop() is loop


def test_outside_a_loop_it_raises_as_asyncio_does() -> None:
    async def cache() -> None:
        running_loop()

    asyncio.run(cache())  # cached, then stopped and closed
    with pytest.raises(RuntimeError):
        running_loop()


async def test_a_forked_child_does_not_get_the_parents_loop() -> None:
    running_loop()  # cached in this (the forking) thread
    pid = os.fork()
    if pid == 0:  # the child: the parent's loop object is copied and still says it is running
        try:
            running_loop()
        except RuntimeError:
            os._exit(0)  # no running loop here, as asyncio says after a fork
        os._exit(1)
    _, status = await asyncio.to_thread(os.waitpid, pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
