"""Worker liveness: a thread rewrites ``heartbeat/rank-<r>.json`` every ``interval_s``.

The beat is written from a thread, not the training loop, so a slow step still beats while a
*stalled* step shows up as a step counter that stops advancing (hang) and a dead or frozen
process as a beat that stops (dead).  That split mirrors NVIDIA resiliency-ext's rank monitor.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.events import Phase
from training.fsutil import atomic_write_json, read_json
from training.paths import RunPaths

PHASES = ("init", "load", "train", "save", "eval", "done")
#: Written into every beat: a pid only means something on the machine that wrote it.
HOST = socket.gethostname()


@dataclass(frozen=True)
class Beat:
    """One heartbeat, as ``heartbeat/rank-<r>.json`` holds it (the file keeps these keys).

    ``progress_time`` is when ``step`` last changed (a beat that advances no step is a hang);
    ``host`` says where ``pid`` means something (beats of older versions carry none)."""

    pid: int
    rank: int
    step: int
    phase: str
    time: float
    progress_time: float
    host: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Beat:
        t = float(d.get("time", 0.0))
        return cls(
            pid=int(d.get("pid", 0)),
            rank=int(d.get("rank", 0)),
            step=int(d.get("step", 0)),
            phase=str(d.get("phase", Phase.INIT)),
            time=t,
            progress_time=float(d.get("progress_time", t)),
            host=d.get("host"),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def is_local(self) -> bool:
        """Whether the beat's pid can be checked here."""
        return self.host is None or self.host == HOST

    @property
    def done(self) -> bool:
        return self.phase == Phase.DONE


def heartbeat_path(run_dir: str | Path, rank: int) -> Path:
    return RunPaths(run_dir).heartbeat(rank)


def read_heartbeat(run_dir: str | Path, rank: int) -> Beat | None:
    """The rank's newest beat; None when it has none (or it is being replaced and unreadable)."""
    try:
        return Beat.from_dict(read_json(heartbeat_path(run_dir, rank)))
    except (FileNotFoundError, ValueError, TypeError, AttributeError):
        return None


class Heartbeat:
    """Background beat writer; the training loop only sets ``step`` and ``phase``."""

    def __init__(self, run_dir: str | Path, rank: int, interval_s: float) -> None:
        self.path = heartbeat_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.interval_s = interval_s
        self.step = 0
        self.phase = Phase.INIT
        self.progress_time = time.time()
        self._stop = threading.Event()
        # One beat at a time: the main thread beats as it enters training while the thread
        # beats on its interval; serialised, the newer beat is always the one left on disk.
        self._write_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="convoy-heartbeat", daemon=True)

    def set(self, phase: Phase | None = None, step: int | None = None) -> None:
        if phase is not None:
            self.phase = phase
        if step is not None and step != self.step:
            self.step = step
            self.progress_time = time.time()

    def beat(self) -> None:
        with self._write_lock:
            self._write_beat()

    def _write_beat(self) -> None:
        # Not durable (no fsync): a beat only matters while this machine is up.
        beat = Beat(os.getpid(), self.rank, self.step, self.phase, time.time(), self.progress_time, HOST)
        atomic_write_json(self.path, beat.as_dict(), durable=False)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
            except OSError:
                pass  # a full disk must not kill training; the supervisor sees stale beats

    def start(self) -> Heartbeat:
        self.beat()
        self._thread.start()
        return self

    def stop(self, final_phase: Phase = Phase.DONE) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.phase = final_phase
        self.beat()
