"""A forked worker's tie to the flow process: it stops (SIGTERM, an emergency save) when the flow dies.

A worker spawned by the flow asks the kernel for that (``PR_SET_PDEATHSIG``,
:func:`tasks.supervision.process_group.child_setup`).  A worker forked by the run's zygote cannot:
its parent is the zygote, and the zygote's death must not stop training (a new zygote replaces
it).  So the flow keeps the write end of a pipe that no other process holds and every forked
worker inherits its read end; when the flow process ends, however it ends, the kernel closes
the write end and the read end hangs up.  One thread of the worker (``convoy-lifeline``) waits for
that and nothing else: it draws no random number and touches no training state (invariant 12).
"""

from __future__ import annotations

import os
import select
import signal
import threading

from training.events import LIFELINE_FD_ENV


def watch_lifeline() -> threading.Thread | None:
    """Start the watcher if this process was given a lifeline (``CONVOY_LIFELINE_FD``)."""
    fd = os.environ.get(LIFELINE_FD_ENV)
    if not fd:
        return None
    thread = threading.Thread(target=_wait_for_hangup, args=(int(fd),), name="convoy-lifeline", daemon=True)
    thread.start()
    return thread


def _wait_for_hangup(fd: int) -> None:
    wait_for_hangup(fd)
    os.kill(os.getpid(), signal.SIGTERM)  # the flow is gone: save and leave


def wait_for_hangup(fd: int) -> None:
    """Block until every write end of the pipe ``fd`` reads from is closed (its holders ended)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        for _fd, events in poller.poll():
            if events & (select.POLLHUP | select.POLLERR) or not os.read(fd, 1):
                return
