"""Replace a worker killed while parked between two chunk tasks, at once (issue 30, item 2).

Why: a pipelined worker is parked at a chunk boundary and trains on while the flow versions the
boundary, refreshes MLflow and Prefect starts the next chunk's task (0.3-2 s, and nobody watches
it but the parking's thread).  Killed there, its replacement used to wait for all of that, then
for the next task to adopt the dead worker, report it and for Prefect's retry: 1-2.4 s of
bookkeeping before the fork (bench/mttr.py, the ``parked`` and ``adopted`` tails).  Now the
parking's watcher (a thread of the flow process, woken by the death on its pidfd) does, within
milliseconds:

1. **Post-mortem.**  The dead worker was the next chunk's attempt N (its steps were that
   chunk's): its ``attempt_started`` and ``failure`` events, judged by the same rules as a worker
   under watch (:class:`tasks.supervision.supervisor.WorkerAttempt` on the dead worker, with the
   metric journal's offset and OOM count taken when it was parked).
2. **The next attempt.**  ``attempt_started`` of attempt N+1, resuming where the failure says.
3. **Its worker**, from the run's sources (the standby, a fork of the zygote, else a spawn): it
   restores and trains while the flow and Prefect catch up.

The events come in the order every reader of them expects (a failure before the resume it
causes).  The next chunk's task then finds the :class:`Replacement` in the parking and adds what
only a task can (:meth:`tasks.chunk.ChunkRun.account_replacement`): the MLflow runs of both
attempts, its log line and failure note, a ``resubmitted`` event, then it watches attempt N+1
like any adopted worker.

Only a worker **killed by a signal** is replaced here.  One that exited by itself (a crash, a
config error, a preemption, a full disk) is the next task's to judge as before: the retry
policy's backoff and its never-retried kinds are about those.  A worker that committed the next
chunk's boundary before it died belongs to the chunk after (the next task judges it, as before).
With ``retries: 0`` nothing is replaced (a replacement is a retry; the run fails on the kill, as
the user asked).  Each parked worker is replaced at most once; a replacement that dies before a task adopts it is
that task's to report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

from tasks.supervision.attempt import AttemptSpec, ParkedSince
from tasks.supervision.handoff import Replacement
from tasks.supervision.supervisor import ChunkFailed, WorkerAttempt
from tasks.supervision.worker_handle import WorkerHandle
from tasks.supervision.worker_source import Acquired, Source, WorkerSource
from training import chunk_boundary
from training.event_records import EventLog
from training.fsutil import file_size
from training.paths import RunPaths
from training.tracking.attempts import AttemptId, next_attempt, record_start

log = logging.getLogger("convoy.handoff")

#: The ``reason`` of the ``resubmitted`` event a replaced attempt gets (a preemption's is ``preempted``).
REPLACED = "replaced"


def replace_parked(
    dead: WorkerHandle, since: ParkedSince, next_chunk: AttemptId, spec_for: Callable[[AttemptId], AttemptSpec]
) -> Replacement | None:
    """Report ``dead`` as ``next_chunk``'s attempt and start the next one (the module docstring);
    None when it is not this module's to replace (then the next task adopts it dead, as before).
    ``next_chunk``: the chunk the parked worker was training (its attempt number is chosen here);
    ``spec_for``: that chunk's attempt as its task would run it."""
    rc = dead.poll()
    if rc is None or rc >= 0:  # alive, or ended by itself: the next task judges it
        log.info("parked worker pid %d: exit status %s, not a kill: the next task judges it", dead.pid, rc)
        return None
    probe = spec_for(next_chunk)
    run_dir, boundary = probe.run_dir, probe.boundary_step
    if boundary is not None and chunk_boundary.boundary_committed(run_dir, boundary):
        log.info("parked worker pid %d died after committing step %d: the chunk after's", dead.pid, boundary)
        return None
    number = next_attempt(EventLog.read(run_dir), next_chunk.chunk)
    dead_id = replace(next_chunk, attempt=number, resumes_from=next_chunk.start)
    record_start(run_dir, dead_id, None, since.metrics_offset, parked=True)  # its MLflow run comes later
    failed = post_mortem(spec_for(dead_id), dead, since)
    resume = failed.details.last_committed_step or 0
    new_id = replace(next_chunk, attempt=number + 1, resumes_from=resume)
    record_start(run_dir, new_id, None, file_size(RunPaths(run_dir).metrics), replaces=number)
    acquired = WorkerSource(spec_for(new_id)).fresh(time.time())
    return Replacement(
        dead, dead_id, failed.kind, failed.message, failed.details, acquired.worker, new_id, str(acquired.source)
    )


def post_mortem(spec: AttemptSpec, dead: WorkerHandle, since: ParkedSince) -> ChunkFailed:
    """The dead worker judged as ``spec``'s attempt: reaped, its ``failure`` event written, the
    report returned (what :class:`WorkerAttempt` raises for a watched one)."""
    attempt = WorkerAttempt(spec)
    attempt.start(Acquired(dead, Source.ADOPTED))
    attempt.metrics_offset, attempt.oom_before = since.metrics_offset, since.oom_kills  # as when parked
    try:
        attempt.watch()
    finally:
        attempt.handed_off = False  # dead before the boundary (checked): nothing to park again
        attempt.stop()
    return attempt.failure_report(dead.proc.returncode, time.time() - attempt.started)
