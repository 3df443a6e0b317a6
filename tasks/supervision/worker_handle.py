"""One worker process as its watchers see it: pid, how to wait for its death, how to stop it, its log.

Why one type: a chunk attempt's worker comes from one of three places (spawned for it, adopted
from the previous chunk, the warm standby; :mod:`tasks.supervision.worker_source`) and must be watched the
same way whichever it is.  Death is waited for on a pidfd (``os.pidfd_open``): it turns readable
the moment the process exits, whoever its parent is and whichever thread waits, so a watcher
wakes at once instead of at its next poll.  Where pidfds are missing (not Linux, kernel < 5.3)
the wait falls back to polling :func:`tasks.supervision.process_group.pid_gone`.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tasks.supervision.process_group import child_setup, pid_gone, stop_group

#: Polling step of the fallback wait (no pidfd).
_FALLBACK_POLL_S = 0.02


class DeathWatch:
    """Waits for one process to end: a pidfd where the kernel has them, else polling."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.fd: int | None = None
        with contextlib.suppress(AttributeError, OSError):  # no os.pidfd_open, or no kernel support
            self.fd = os.pidfd_open(pid)

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until the process has ended; True once it has."""
        if self.fd is not None:
            readable, _, _ = select.select([self.fd], [], [], max(timeout_s, 0.0))
            return bool(readable)
        deadline = time.monotonic() + timeout_s
        while not pid_gone(self.pid):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(_FALLBACK_POLL_S, left))
        return True

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


@dataclass
class WorkerHandle:
    """A worker and its log.  ``offset``: where the next reader of the log starts; ``said``: the
    last lines a previous watcher already read (a worker parked by the previous chunk)."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    offset: int
    said: list[str] = field(default_factory=list)
    #: Wall time a watcher first saw it dead (a parked worker's watcher may see it before the
    #: chunk that adopts it exists).
    died_at: float | None = None
    #: Wall time it was started.
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.death = DeathWatch(self.proc.pid)
        self._lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        """Its exit status, None while it runs."""
        return self.proc.poll()

    def wait_exit(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for it to end (at once when it does); True once it has."""
        if self.proc.poll() is None and not self.death.wait(timeout_s):
            return False
        with self._lock:
            if self.died_at is None:
                self.died_at = time.time()
        return True

    def stop(self, grace_s: float) -> list[int]:
        """Stop and reap its whole process group (:func:`tasks.supervision.process_group.stop_group`)."""
        try:
            return stop_group(self.proc, grace_s)
        finally:
            self.death.close()


def spawn(
    cmd: Sequence[str],
    log_path: Path,
    header: str,
    *,
    cwd: str | Path | None,
    env: dict[str, str],
    stdin: int = subprocess.DEVNULL,
) -> WorkerHandle:
    """Start a worker in its own session, output appended to ``log_path`` after a ``# convoy``
    ``header`` line (the worker writes to the file itself, so its output, and its emergency save,
    survive the supervisor's death).  ``stdin=PIPE`` for a standby (its order comes that way)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"# convoy {header} cmd={' '.join(cmd)}\n".encode())
        log.flush()
        offset = log.tell()
        proc = subprocess.Popen(
            list(cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=stdin,
            cwd=cwd,
            env={**env, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
            preexec_fn=child_setup(os.getpid()),
        )
    return WorkerHandle(proc, log_path, offset)
