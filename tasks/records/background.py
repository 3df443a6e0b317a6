"""Record-keeping off the recovery path: a job that runs on its own thread, one pass at a time.

Why: refreshing the MLflow audit (~1 s) and logging a chunk end's goodput both happen when a
chunk task ends, which is where a worker that dies between two chunk tasks waits to be replaced.
:class:`OneAtATime` runs such a job on a thread: at most one pass runs, and a request while one
runs makes exactly one more pass after it (the running pass may have read the run's files before
the newest chunk's end).  The run's resources hold one per job (:class:`tasks.run_resources.RunResources`)
and the flow joins them before its final records.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class OneAtATime:
    """``job`` on a thread of its own, one pass at a time (see the module docstring)."""

    def __init__(self, job: Callable[[], object], name: str) -> None:
        self.job, self.name = job, name
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._again = False

    def request(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._again = True
                return
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            self.job()
            with self._lock:
                if not self._again:
                    return
                self._again = False

    def join(self, timeout_s: float = 60.0) -> None:
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
