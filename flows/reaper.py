"""The reaper of :mod:`flows.ephemeral_api`: waits for a pipe to hang up, then stops one process.

    python -m flows.reaper <read-fd> <pid> <create-time> <grace-s>

It imports only psutil and :mod:`training.loop.lifeline`'s wait (it starts beside every ``convoy train``), holds
nothing else open, and exits once the process is gone.  The process is stopped only if its pid
still names the process created at ``create-time`` (invariant 2 of :mod:`flows.ephemeral_api`).
"""

from __future__ import annotations

import sys

import psutil

from training.loop.lifeline import wait_for_hangup


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
