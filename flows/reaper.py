"""The reaper of :mod:`flows.ephemeral_api`: waits for a pipe to hang up, then stops one process.

    python -m flows.reaper <read-fd> <pid> <create-time> <grace-s>

It imports only the standard library and psutil (it starts beside every ``convoy train``), holds
nothing else open, and exits once the process is gone.  The process is stopped only if its pid
still names the process created at ``create-time`` (invariant 2 of :mod:`flows.ephemeral_api`).
"""

from __future__ import annotations

import os
import select
import sys

import psutil


def wait_for_hangup(fd: int) -> None:
    """Block until every write end of the pipe is closed (its holder ended)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while True:
        for _fd, events in poller.poll():
            if events & (select.POLLHUP | select.POLLERR) or not os.read(fd, 1):
                return


def stop(pid: int, created: float, grace_s: float) -> None:
    """SIGTERM ``pid`` if it is still the process created at ``created``; SIGKILL after ``grace_s``."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - created) > 0.01:
            return  # the pid names another process now
        proc.terminate()
        proc.wait(grace_s)
    except psutil.TimeoutExpired:
        proc.kill()
    except psutil.Error:
        return  # gone already


def main(argv: list[str]) -> None:
    fd, pid, created, grace_s = int(argv[0]), int(argv[1]), float(argv[2]), float(argv[3])
    wait_for_hangup(fd)
    stop(pid, created, grace_s)


if __name__ == "__main__":
    main(sys.argv[1:])
