"""A warm standby worker per run (``orchestration.standby``): the restart path without a start-up.

Why: after a worker dies, a fresh one pays for a Python start, ``import torch``, the task build
and the tracking clients (measured ~3-5 s on the example) before it restores a few milliseconds of
checkpoint.  A standby has paid all of that while the worker trained: it is
``python -m training.worker --run-dir D --standby``, built and waiting on its stdin.  When the
supervisor needs a worker it takes the standby instead of spawning one, writes the order line
(``{"until_step": N, "pipelined": bool}``) and from then on watches it like any worker it
started; a new standby is started behind it.  The standby takes the run's lease, restores the
newest verified checkpoint and trains exactly as a fresh worker would (same build, same restore),
so resumes stay bitwise exact.

Lifetime: one standby per run in the flow process (chunk tasks are threads there, like
:mod:`tasks.handoff`).  Its stdin is a pipe from this process: if the flow dies the pipe closes
and the standby, still waiting, exits (the parent-death signal covers it too); when the flow ends
:func:`release` closes it.  Single process runs only: a multi-rank worker is a torchrun group
whose rendezvous is part of its start, so a spare group would have to join the live one's
rendezvous; not attempted (``standby`` is ignored for more than one rank, said in the log).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tasks.process_group import stop_group
from training.paths import RunPaths


@dataclass
class Standby:
    proc: subprocess.Popen[bytes]
    log_path: Path
    #: Where its output starts in ``log_path`` (the supervisor tails it from there once it is called).
    offset: int
    started: float


#: Starts ``cmd`` with its output appended to ``log_path`` and stdin a pipe; returns the process
#: and the log offset its output starts at (the supervisor's spawn).
StartFn = Callable[[list[str], Path], tuple[subprocess.Popen[bytes], int]]

_STANDBY: dict[str, Standby] = {}
_LOCK = threading.Lock()


def _key(run_dir: str | Path) -> str:
    return str(Path(run_dir).resolve())


def standby_command(run_dir: str | Path) -> list[str]:
    return [sys.executable, "-m", "training.worker", "--run-dir", str(Path(run_dir).resolve()), "--standby"]


def ensure(run_dir: str | Path, start: StartFn) -> Standby:
    """The run's standby; started with ``start(cmd, log_path)`` if there is none alive."""
    rd = Path(run_dir)
    with _LOCK:
        current = _STANDBY.get(_key(rd))
        if current is not None and current.proc.poll() is None:
            return current
        _STANDBY.pop(_key(rd), None)
    paths = RunPaths(rd)
    n = len(list(paths.logs.glob("standby-*.log"))) + 1
    log_path = paths.standby_log(n)
    proc, offset = start(standby_command(rd), log_path)
    standby = Standby(proc, log_path, offset, time.time())
    with _LOCK:
        old = _STANDBY.pop(_key(rd), None)
        _STANDBY[_key(rd)] = standby
    if old is not None:
        stop_group(old.proc, 2.0)
    return standby


def take(run_dir: str | Path, until_step: int, pipelined: bool) -> Standby | None:
    """Hand the run's standby its order and give it to the caller to watch; None if there is no
    standby alive (it died, or was never started): the caller spawns a worker as usual."""
    with _LOCK:
        standby = _STANDBY.pop(_key(run_dir), None)
    if standby is None:
        return None
    if standby.proc.poll() is not None or standby.proc.stdin is None:
        stop_group(standby.proc, 1.0)
        return None
    order = json.dumps({"until_step": until_step, "pipelined": pipelined}) + "\n"
    try:
        standby.proc.stdin.write(order.encode())
        standby.proc.stdin.flush()
        standby.proc.stdin.close()
    except OSError:  # it died between the poll and the write
        stop_group(standby.proc, 1.0)
        return None
    return standby


def release(run_dir: str | Path, grace_s: float = 2.0) -> bool:
    """Stop the run's standby (the flow ends).  True if there was one."""
    with _LOCK:
        standby = _STANDBY.pop(_key(run_dir), None)
    if standby is None:
        return False
    _stop(standby, grace_s)
    return True


def _stop(standby: Standby, grace_s: float) -> None:
    if standby.proc.stdin is not None:
        with contextlib.suppress(OSError):
            standby.proc.stdin.close()  # end of input: a waiting standby exits by itself
    try:
        standby.proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    stop_group(standby.proc, grace_s)


def pid(run_dir: str | Path) -> int | None:
    with _LOCK:
        standby = _STANDBY.get(_key(run_dir))
    return standby.proc.pid if standby is not None and standby.proc.poll() is None else None


@atexit.register
def _release_all() -> None:
    with _LOCK:
        standbys = list(_STANDBY.values())
        _STANDBY.clear()
    for standby in standbys:
        _stop(standby, 2.0)
