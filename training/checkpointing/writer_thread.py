"""One named thread that runs the memory tier's slot writes while the loop goes on.

Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are named ``<prefix>_<n>``, and the
worker audits every thread alive beside training by its exact name (``training.loop.hermetic``:
nothing outside the loop may draw from ``random``).  This one is ``convoy-memory``; it copies
and hashes, and draws nothing.  It is started at its first job, in the worker, never in
the zygote (which must not hold threads when it forks).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

NAME = "convoy-memory"


Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class WriterThread:
    """Runs submitted jobs one at a time, in order, on one daemon thread; the thread ends with
    :meth:`shutdown`, or once this object is collected (a tier dropped without one)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._thread is None:
            # The thread holds the queue, not this object: collecting it stops the thread.
            self._thread = threading.Thread(target=_run, args=(self._jobs,), name=NAME, daemon=True)
            self._thread.start()
            weakref.finalize(self, self._jobs.put, None)
        done: Future[Any] = Future()
        self._jobs.put((done, fn, args))
        return done

    def shutdown(self) -> None:
        """Finish the jobs submitted, then stop the thread."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None


def _run(jobs: queue.SimpleQueue[Job | None]) -> None:
    while (job := jobs.get()) is not None:
        done, fn, args = job
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised by Future.result()
            done.set_exception(exc)
        del job, done, fn, args  # nothing of a finished job kept alive while the thread waits
