"""Follow a worker's log file: keep its last lines, hand each line to a callback, say where it stopped.

Why a file and not a pipe: the worker writes its output to the file itself, so its output, and
its emergency save, survive the supervisor's death (a print into a widowed pipe would raise); the
supervisor reads the file from a thread.  Where the follower stopped is where the next reader
starts: the chunk that adopts a parked worker reads on from there.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

#: Lines starting with this are the supervisor's own annotations in the log, not the worker's output.
ANNOTATION = "# convoy "
_IDLE_S = 0.05


class LogFollower:
    """Tails ``path`` from byte ``offset`` on a daemon thread until :meth:`stop`."""

    def __init__(
        self,
        path: Path,
        offset: int,
        tail: collections.deque[str],
        on_line: Callable[[str], None] | None,
    ) -> None:
        self.path, self.tail, self.on_line = path, tail, on_line
        self.position = offset
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        """Read what is left, stop; returns the byte offset where the next reader starts."""
        self._stop.set()
        self._thread.join(timeout=5)
        return self.position

    def _keep(self, line: str) -> None:
        self.tail.append(line)
        if self.on_line is not None:
            with contextlib.suppress(Exception):
                self.on_line(line)

    def _follow(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self.position)
            buf = b""
            while True:
                chunk = f.readline()
                if chunk:
                    buf += chunk
                    if not buf.endswith(b"\n"):
                        continue
                    line = buf.decode(errors="replace").rstrip("\n")
                    buf = b""
                    if not line.startswith(ANNOTATION):
                        self._keep(line)
                elif self._stop.is_set():
                    if buf:
                        self.tail.append(buf.decode(errors="replace"))
                    self.position = f.tell()
                    return
                else:
                    time.sleep(_IDLE_S)
