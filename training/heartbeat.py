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
from pathlib import Path
from typing import Any

from training.events import Phase
from training.fsutil import atomic_write_json, read_json
from training.paths import RunPaths

PHASES = ("init", "load", "train", "save", "eval", "done")
#: Written into every beat: a pid only means something on the machine that wrote it.
HOST = socket.gethostname()


def beat_is_local(beat: dict[str, Any]) -> bool:
    """Whether the beat's pid can be checked here (beats of older versions carry no host)."""
    return beat.get("host", HOST) == HOST


def heartbeat_path(run_dir: str | Path, rank: int) -> Path:
    return RunPaths(run_dir).heartbeat(rank)


def read_heartbeat(run_dir: str | Path, rank: int) -> dict[str, Any] | None:
    try:
        return read_json(heartbeat_path(run_dir, rank))
    except (FileNotFoundError, ValueError):
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
        atomic_write_json(
            self.path,
            {
                "pid": os.getpid(),
                "host": HOST,
                "rank": self.rank,
                "step": self.step,
                "phase": self.phase,
                "time": time.time(),
                "progress_time": self.progress_time,
            },
            durable=False,
        )

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
