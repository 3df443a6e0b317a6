"""Hand a running worker from one chunk task to the next (``orchestration.pipeline``).

Why: restarting the worker at every chunk boundary costs a Python start, ``import torch``, the
model build and a verified restore — measured ~5 s per chunk on the bench model, 9% of a 60 s
chunk.  With pipelining, the worker is started once with ``--until-step`` = the run's end and
commits a checkpoint at every chunk boundary; chunk k's task succeeds as soon as that boundary
is committed and leaves the worker running here; chunk k+1's task adopts it.  Training never
pauses for Prefect's bookkeeping.

Failures are unchanged: the task watching the worker stops its whole group and raises, and the
retry starts a fresh worker from the newest verified checkpoint.  A worker that died between two
tasks is adopted dead and reported as the next chunk's failure (that is where its steps were).
The registry lives in the flow process (tasks are threads there); pool mode never uses it.
The protocol around the boundary (what the worker waits for, what the flow acknowledges, what
retention keeps): :mod:`training.chunk_boundary`.
"""

from __future__ import annotations

import atexit
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from tasks.process_group import stop_group


@dataclass
class LiveWorker:
    proc: subprocess.Popen
    cmd: list[str]
    log_path: Path
    #: Where the parking chunk stopped reading the log; the adopting chunk reads on from there.
    offset: int = 0
    #: The last lines the parking chunk read.  A worker that died right after committing the
    #: boundary said why before the parking chunk stopped reading: the adopting chunk, which
    #: reports that death, must classify it from those lines.
    tail: list[str] = field(default_factory=list)


_LIVE: dict[str, LiveWorker] = {}
_LOCK = threading.Lock()


def _key(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve())


def park(run_dir: str | Path, worker: LiveWorker) -> None:
    """Keep a running worker for the next chunk task of this run."""
    with _LOCK:
        old = _LIVE.pop(_key(run_dir), None)
        _LIVE[_key(run_dir)] = worker
    if old is not None and old.proc is not worker.proc:
        stop_group(old.proc, 5.0)


def adopt(run_dir: str | Path, cmd: list[str]) -> LiveWorker | None:
    """The parked worker of this run if it runs ``cmd`` (else it is stopped and None returned)."""
    with _LOCK:
        worker = _LIVE.pop(_key(run_dir), None)
    if worker is None:
        return None
    if worker.cmd != list(cmd):
        stop_group(worker.proc, 5.0)
        return None
    return worker


def parked_pid(run_dir: str | Path) -> int | None:
    with _LOCK:
        worker = _LIVE.get(_key(run_dir))
    return worker.proc.pid if worker is not None and worker.proc.poll() is None else None


def release(run_dir: str | Path, grace_s: float = 10.0) -> bool:
    """Stop the parked worker of this run, if any (the flow ends or fails).  True if one was."""
    with _LOCK:
        worker = _LIVE.pop(_key(run_dir), None)
    if worker is None:
        return False
    stop_group(worker.proc, grace_s)
    return True


@atexit.register
def _release_all() -> None:
    with _LOCK:
        workers = list(_LIVE.values())
        _LIVE.clear()
    for worker in workers:
        stop_group(worker.proc, 5.0)
