"""Prefect task ``run_chunk``: one step range, one supervised worker, retried on its own.

Retry policy comes from ``orchestration.*`` via :func:`retrying_chunk_task` (``with_options``):
``retries`` and a ``retry_condition_fn`` that never retries a ``config`` failure (same input, same
error).  The delays (the first retry at once, then ``retry_delay_seconds * backoff**i`` with
``jitter``) are waited by the failed task run *before* it raises, not by Prefect
(:mod:`tasks.retry_policy`).  One story in both places: convoy logs
"retry 2 in 1.1 s (backoff)", waits, raises, and Prefect's next line "Retry 2/3 will start
immediately" is true; the task page's "Retry Delay 0s" is what Prefect adds, and the task run's tag
``backoff 0s→1s→2s ±10%`` shows convoy's delays next to it.

Attempt numbers count every worker attempt of the chunk in every flow run (Prefect's retries,
preemption re-spawns, a flow that died and the one that took over):
:mod:`training.tracking.attempts`.  Prefect's own ``run_count`` still decides whether a failure
is retried; where the two differ, the task's result message says why (:func:`attempts_explained`).

Preemption (exit 75) is not a fault of the chunk and must be re-submitted at once.  Prefect picks
a retry's delay by attempt index only, not by exception, so a per-kind delay is not expressible
through its retry options.  ``run_chunk`` therefore re-spawns a preempted worker itself, at once,
inside the same task attempt (at most ``retries`` times in a row, each logged and recorded as a
``resubmitted`` event); a preemption beyond that raises and goes through the normal retry path.
The worker resumes from the emergency checkpoint it wrote, so nothing is lost either way.

Pipelining (``orchestration.pipeline``, local mode): the worker is started with the run's last
step as its target and this task ends when the chunk's boundary checkpoint is committed, leaving
the worker training for the next chunk's task to adopt (:mod:`tasks.supervision.handoff`).  The boundary
checkpoint is still verified here and is the chunk's artifact.  The protocol, end to end:
:mod:`training.chunk_boundary`.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import TaskRunContext
from prefect.states import Completed, State

from tasks.execution_plan import ChunkSpan
from tasks.failure_reports import passed_over_clause, report_failure, say_replaced
from tasks.hooks import HookTarget
from tasks.records import run_records
from tasks.records.chunk_record import ChunkRecord
from tasks.records.tracker import MetricFollower
from tasks.remote import remote_checkpoints
from tasks.remote.remote_index import node_name
from tasks.retry_policy import attempts_explained, backoff_tag, retry_wait, should_retry, will_retry
from tasks.run_resources import RunResources
from tasks.supervision.attempt import AttemptSpec, ParkedSince
from tasks.supervision.handoff import Replacement
from tasks.supervision.process_group import reap_stale_worker
from tasks.supervision.repeated import repeated_failure
from tasks.supervision.replacement import REPLACED, replace_parked
from tasks.supervision.supervisor import ChunkFailed, Outcome, supervise, worker_command
from tasks.supervision.worker_handle import WorkerHandle
from tasks.supervision.worker_liveness import DetectionLimits
from training import faults, run_memory
from training.checkpointing.store import CheckpointStore, ResumePoint, checkpoint_name
from training.chunk_boundary import boundary_step
from training.config import RunConfig
from training.event_records import AttemptRecorded, EventLog, Resubmitted, WorkerDone, append_record, read_records
from training.events import Event, FailureKind, StandbyOrder, WorkerSays, append_event
from training.fsutil import file_size
from training.paths import RunPaths
from training.rundir import load_run_config
from training.tracking.attempts import AttemptId, chunk_history, failures_without_progress, next_attempt, record_start
from training.tracking.failure_record import FailureDetails

#: Worker output lines echoed to the Prefect log (everything goes to the chunk's log file).
_ECHO = tuple(m for m in WorkerSays if m != WorkerSays.STANDBY_READY)


def _prefect_ids() -> tuple[int, str | None, str | None]:
    """(Prefect's run count of this task run, its flow run id, its task run id)."""
    ctx = TaskRunContext.get()
    if ctx is None:
        return 1, None, None
    tr = ctx.task_run
    return max(1, tr.run_count), str(tr.flow_run_id) if tr.flow_run_id else None, str(tr.id)


def loss_at(run_dir: Path, step: int) -> float | None:
    for ev in reversed(read_records(run_dir, WorkerDone)):
        if ev.step == step and ev.rank == 0:
            return ev.loss
    from training.tracking.metrics import read_metric_lines  # a pipelined worker passed this boundary without stopping

    rows = [m for s, m in read_metric_lines(RunPaths(run_dir).metrics) if s == step]
    return rows[0].get("loss") if rows else None


def committed_digest(run_dir: Path, step: int, store: CheckpointStore | None = None) -> str | None:
    """Digest of the verified checkpoint at exactly ``step`` (None if missing or invalid);
    ``store``: the run's (its verdicts are reused), else a fresh one."""
    from training.checkpointing.errors import CheckpointRejected

    store = store or CheckpointStore(run_dir)
    try:
        return store.verify(store.root / checkpoint_name(step)).digest
    except CheckpointRejected:
        return None


@task(name="run_chunk", task_run_name="chunk-{chunk}", cache_policy=NO_CACHE)
def run_chunk(run_dir: str, chunk: int, start_step: int, end_step: int, resources: RunResources | None = None) -> State:
    """Train steps ``[start_step, end_step)`` of the run in ``run_dir``; return a Completed state
    holding the chunk's record (:func:`chunk_record` unwraps it) and saying which attempt
    committed it.

    The worker resumes from the newest valid checkpoint, which after a failure may lie inside this
    chunk (or, if a checkpoint turned out corrupt, before it): only the lost steps are redone.
    ``resources``: the run's (:mod:`tasks.run_resources`), which the flow passes to every chunk
    so a parked worker and the standby reach the next one; None: the task makes and closes its own.
    Its failure hook is the submitter's to bind (:func:`audited`).
    """
    rd = Path(run_dir)
    cfg = resources.config if resources is not None else load_run_config(rd)  # passed, not re-read
    own = resources is None
    held = resources or RunResources(cfg, rd)
    try:
        return ChunkRun(cfg, rd, ChunkSpan(chunk, start_step, end_step), held, get_run_logger()).run()
    finally:
        if own:
            held.close()


class ChunkRun:
    """One attempt of one chunk task: supervised worker attempts (a preempted worker is
    re-spawned at once, see the module docstring), then the committed boundary verified and
    recorded."""

    def __init__(self, cfg: RunConfig, run_dir: Path, span: ChunkSpan, resources: RunResources, logger: Any) -> None:
        self.cfg, self.run_dir, self.logger = cfg, run_dir, logger
        self.span = span
        self.chunk, self.start, self.end = span.chunk, span.start, span.end
        self.resources = resources
        self.parking = resources.slots.parking
        #: Prefect's run count in this flow run (what the retry policy counts); ``attempt``: this
        #: chunk's attempt number across every flow run, one per worker attempt.
        self.try_number, flow_run_id, task_run_id = _prefect_ids()
        #: The worker attempt under way (numbered by :meth:`begin_attempt`), with the Prefect runs.
        self.id = AttemptId(self.chunk, 0, self.start, self.end, flow_run_id, task_run_id)
        self.pipelined, self.standby = resources.plan.pipelined, resources.plan.standby
        self.preemptions = 0
        #: Attempts re-spawned inside this task run for a worker killed while parked (at most 1).
        self.replaced = 0
        self.resumed_from = 0
        #: A worker killed while parked before this task began, replaced at once (taken in :meth:`run`).
        self.replacement: Replacement | None = None
        self.shipper: MetricFollower | None = None
        #: The tracker the run's resources hold for all its chunk tasks: the one that opens an
        #: attempt run ends it (it holds where it opened it).
        self.tracker = resources.tracker

    def run(self) -> State:
        if self.try_number == 1:
            faults.handoff_hold(self.chunk)  # a test's slow Prefect (CONVOY_FAULTS)
        # First: a worker killed while parked was replaced at once, and the replacement is ours.
        self.replacement = self.parking.take_replacement()
        if self.parking.parked_pid() is None:  # our own parked worker is not stale
            reap_stale_worker(self.run_dir, self.cfg.train.world_size)
        self.resources.follow_uploads()  # uploads committed checkpoints (tracking.dvc)
        self.shipper = self.resources.follow_metrics(say=self.say)  # the worker never talks to MLflow
        started = time.time()
        outcome = None
        while outcome is None:
            outcome = self.supervised_attempt()
        return self.committed(started, outcome)

    @property
    def attempt(self) -> int:
        return self.id.attempt

    def say(self, line: str) -> None:
        self.logger.info("chunk %d: %s", self.chunk, line)

    def begin_attempt(self, adopting: bool = False) -> str | None:
        """Number this worker attempt, open its MLflow run and record it (``attempt_started``);
        returns the MLflow run id.  ``adopting``: the worker is the one the chunk before left
        training (pipelined): it restores nothing and its steps are the chunk's from its start."""
        rd = self.run_dir
        resumes = None if adopting else self.resumed_from
        self.id = replace(self.id, attempt=next_attempt(EventLog.read(rd), self.chunk), resumes_from=resumes)
        child = run_records.start_attempt(self.tracker, rd, self.id)
        if child and self.shipper is not None:  # the attempt's run charts the steps it trains
            self.shipper.mirror(child, (self.start if adopting else self.resumed_from) + 1, self.end)
        # The event's resumes_from is the step the steps count from, an adopted worker's too.
        started = replace(self.id, resumes_from=self.resumed_from)
        record_start(rd, started, child, file_size(RunPaths(rd).metrics))  # where its steps begin
        return child

    def supervised_attempt(self) -> Outcome | None:
        """One worker attempt under watch: its outcome, or None when it was preempted and is to be
        re-spawned at once; any other failure is reported and raised (Prefect retries the task)."""
        cfg, rd = self.cfg, self.run_dir
        replacement, self.replacement = self.replacement, None
        child = self.account_replacement(replacement) if replacement is not None else self.prepare_attempt()
        t_attempt = time.time()
        try:
            outcome = supervise(self.spec())
        except ChunkFailed as failed:
            exc = self.unless_repeated(failed)
            resume_at = exc.details.last_committed_step or 0
            trained = max(0, resume_at - self.resumed_from)
            run_records.end_attempt(
                self.tracker,
                rd,
                child,
                run_records.attempt_outcome(False, exc.kind, trained, time.time() - t_attempt, exc.details),
                self.id,
            )
            respawned = self.preemptions + self.replaced  # both spend the retries, as a Prefect retry would
            if exc.kind == FailureKind.PREEMPTED and respawned < cfg.orchestration.retries:
                self.respawn_after_preemption(exc, resume_at)
                return None
            retrying = will_retry(cfg, exc, self.try_number)
            wait = retry_wait(cfg, failures_without_progress(EventLog.read(rd), self.chunk) + 1) if retrying else 0.0
            report_failure(
                self.logger,
                cfg,
                exc,
                (self.chunk, self.attempt, self.try_number),
                resume_at,
                self.resources.notes.publish,
                wait,
            )
            time.sleep(wait)  # before raising: Prefect's "will start immediately" is then true
            raise exc from None
        outcome_seconds = time.time() - t_attempt
        done = run_records.attempt_outcome(True, None, self.end - self.resumed_from, outcome_seconds, end_step=self.end)
        run_records.end_attempt(self.tracker, rd, child, done, self.id)
        return outcome

    def account_replacement(self, r: Replacement) -> str | None:
        """The worker the previous chunk parked was killed before this task adopted it, and its
        replacement is training already (:mod:`tasks.supervision.replacement` wrote both
        attempts' events): the MLflow run of the dead attempt, opened and ended failed, the log line
        and failure note a retry would have had, a ``resubmitted`` event, then the replacement's
        MLflow run (``attempt_recorded``).  Returns that run's id."""
        cfg, rd, task_run = self.cfg, self.run_dir, self.id.task_run_id
        self.replaced += 1
        self.id = replace(r.dead_attempt, task_run_id=task_run)
        dead = run_records.start_attempt(self.tracker, rd, self.id)
        if dead and self.shipper is not None:
            self.shipper.mirror(dead, self.start + 1, r.failure.trained_to or self.start)
        resume_at = r.attempt.resumes_from or 0
        kept = max(0, resume_at - self.start)
        run_records.end_attempt(
            self.tracker, rd, dead, run_records.attempt_outcome(False, r.kind, kept, 0.0, r.failure), self.id
        )
        say_replaced(self.logger, cfg, r, self.try_number, self.resources.notes.publish)
        append_record(
            rd, Resubmitted(chunk=self.chunk, attempt=r.dead_attempt.attempt, reason=REPLACED, resume_step=resume_at)
        )
        self.id, self.resumed_from = replace(r.attempt, task_run_id=task_run), resume_at
        child = run_records.start_attempt(self.tracker, rd, self.id)
        if child and self.shipper is not None:
            self.shipper.mirror(child, resume_at + 1, self.end)
        append_record(
            rd, AttemptRecorded(chunk=self.chunk, attempt=self.attempt, task_run_id=task_run, mlflow_run_id=child)
        )
        return child

    def prepare_attempt(self) -> str | None:
        """Before a worker attempt: the newest checkpoint (fetched from the remote where it holds
        a newer one), a bad boundary set aside, the attempt numbered and recorded."""
        cfg, rd = self.cfg, self.run_dir
        adopting = self.parking.holds_worker()
        if self.parking.parked_pid() is None:  # a worker about to restore: the remote may hold a newer checkpoint
            remote_checkpoints.fetch_before_resume(cfg, rd, lambda m: self.logger.info("chunk %d: %s", self.chunk, m))
        point = self.resources.checkpoints.resume_point()
        self.set_aside_bad_boundary(point)
        passed_over = point.passed_over_dicts()
        self.resumed_from = run_memory.resume_step(rd, point.step) or 0  # the memory tier's when newer
        if self.resumed_from < self.start:
            self.logger.warning(
                "chunk %d: newest valid checkpoint is step %d, before the chunk start %d%s",
                self.chunk,
                self.resumed_from,
                self.start,
                passed_over_clause(passed_over),
            )
        return self.begin_attempt(adopting)

    def respawn_after_preemption(self, exc: ChunkFailed, resume_at: int) -> None:
        """A preempted worker is no fault of the chunk: the next attempt starts at once inside
        this Prefect run (Prefect cannot pick a delay by exception), said in the log, a failures
        artifact and a ``resubmitted`` event."""
        cfg, rd = self.cfg, self.run_dir
        self.preemptions += 1
        self.logger.warning(
            "chunk %d attempt %d preempted at step %s; attempt %d starts at once inside this Prefect "
            "run (a preemption is no fault of the chunk: Prefect's run count stays %d), resuming from step %d",
            self.chunk,
            self.attempt,
            exc.details.failed_at_step if exc.details.failed_at_step is not None else "?",
            self.attempt + 1,
            self.try_number,
            resume_at,
        )
        self.resources.notes.publish(
            cfg.run_name,
            f"chunk {self.chunk} attempt {self.attempt}: {exc.kind}",
            [
                exc.details.reason or exc.message,
                f"re-spawned at once inside Prefect run {self.try_number} as attempt {self.attempt + 1}",
                f"resumes from step {resume_at} (steps lost: {exc.details.steps_lost})",
            ],
        )
        append_record(
            rd, Resubmitted(chunk=self.chunk, attempt=self.attempt, reason=FailureKind.PREEMPTED, resume_step=resume_at)
        )

    def set_aside_bad_boundary(self, point: ResumePoint) -> None:
        """This chunk's boundary checkpoint exists but does not verify (corrupted after its
        commit): move it aside before the attempt starts.  The attempt judges the boundary by its
        manifest alone, so left in place it would end every retry at once; a parked worker went on
        from it and is released, and the retry trains to the boundary again."""
        bad = [p for p in point.passed_over if p.step == self.end]
        if not bad:
            return
        self.parking.release(grace_s=5.0)
        store = self.resources.checkpoints
        with contextlib.suppress(FileNotFoundError):  # already gone: nothing to set aside
            store.quarantine(store.root / bad[0].checkpoint, bad[0].reason)
        self.logger.warning(
            "chunk %d: boundary %s does not verify, set aside: %s", self.chunk, bad[0].checkpoint, bad[0].reason
        )

    def unless_repeated(self, exc: ChunkFailed) -> ChunkFailed:
        """``exc``, or the ``repeated`` failure it makes with the attempt before (:mod:`tasks.supervision.repeated`),
        recorded as a ``repeated_failure`` event; that one is never retried."""
        repeat = repeated_failure(self.run_dir, self.chunk)
        if repeat is None:
            return exc
        append_event(self.run_dir, Event.REPEATED_FAILURE, **repeat.event_fields())
        return ChunkFailed(FailureKind.REPEATED, repeat.message, repeat.details(exc.details))

    def spec(self) -> AttemptSpec:
        """The worker attempt under way (:meth:`spec_for`)."""
        return self.spec_for(self.id)

    def spec_for(self, attempt: AttemptId) -> AttemptSpec:
        """A worker attempt of this chunk, or of the next one (a replacement started while this
        task's worker is parked): pipelined workers train to the run's end and hand over at the
        chunk's boundary; otherwise they stop at the chunk's end."""
        cfg, rd = self.cfg, self.run_dir
        until = cfg.train.total_steps if self.pipelined else attempt.end
        log_path = RunPaths(rd).chunk_log(attempt.chunk, attempt.attempt)
        command = worker_command(
            rd.resolve(),
            until,
            cfg.train.ranks,
            pipelined=self.pipelined,
            hosts=cfg.train.hosts if cfg.train.nnodes > 1 else (),
            node_launch=cfg.orchestration.node_launch,
        )
        return AttemptSpec(
            command,
            rd,
            DetectionLimits.from_config(cfg),
            log_path,
            ranks=cfg.train.world_size,
            id=attempt,
            on_line=self.echo if attempt.chunk == self.chunk else None,
            boundary_step=boundary_step(attempt.end, cfg.train.total_steps, self.pipelined),
            standby_order=StandbyOrder(until, self.pipelined) if self.standby else None,
            slots=self.resources.slots,
            checkpoints=self.resources.checkpoints,
            successor=self.replace_parked if self.pipelined and attempt.chunk == self.chunk else None,
        )

    def replace_parked(self, dead: WorkerHandle, since: ParkedSince) -> Replacement | None:
        """This task's worker, parked at its boundary, died before the next chunk's task adopted
        it: report it as that chunk's attempt and start its replacement at once
        (:mod:`tasks.supervision.replacement`; runs on the parking's thread).  Not with
        ``retries: 0``: a replacement is a retry, and a run told not to retry fails on the kill."""
        if self.cfg.orchestration.retries < 1:
            return None
        nxt_span = self.span.following(self.cfg.train.chunk_steps, self.cfg.train.total_steps)
        nxt = AttemptId(nxt_span.chunk, 0, nxt_span.start, nxt_span.end, self.id.flow_run_id, None)
        return replace_parked(dead, since, nxt, self.spec_for)

    def echo(self, line: str) -> None:
        """Worker output worth a line in the Prefect log (everything is in the chunk's log file)."""
        if any(m in line for m in _ECHO):
            self.logger.info("chunk %d: %s", self.chunk, line)

    def committed(self, started: float, outcome: Outcome) -> State:
        """Verify the chunk's end checkpoint and record the chunk (``chunk_done`` event)."""
        rd, chunk = self.run_dir, self.chunk
        digest = committed_digest(rd, self.end, self.resources.checkpoints)
        if digest is None:
            # A pipelined worker went on from this boundary and is parked for the next chunk: the
            # retry must not adopt it (it would report the same boundary again, every retry), but
            # start afresh from the newest checkpoint that verifies.
            self.parking.release(grace_s=5.0)
            raise ChunkFailed(
                FailureKind.CRASH,
                f"chunk {chunk}: worker exited 0 but no valid checkpoint at step {self.end}",
                FailureDetails(
                    last_committed_step=self.resources.checkpoints.resume_point().step, log=str(outcome.log_path)
                ),
            )
        record = ChunkRecord(
            chunk=chunk,
            start_step=self.start,
            end_step=self.end,
            attempt=self.attempt,
            preemptions=self.preemptions,
            resumed_from=self.resumed_from,
            digest=digest,
            loss=loss_at(rd, self.end),
            seconds=round(time.time() - started, 3),
            worker_seconds=round(outcome.seconds, 3),
            node=node_name(),
        )
        append_record(rd, record)  # the chunk_done event: the record's keys, as the flow reads them
        self.logger.info(
            "chunk %d done: steps [%d, %d) digest %s (attempt %d)", chunk, self.start, self.end, digest, self.attempt
        )
        message = _done_message(rd, self.id, self.try_number)
        return Completed(message=message, data=record.as_dict())


def _done_message(run_dir: Path, attempt: AttemptId, run_count: int) -> str:
    """The task run's state message: a retried chunk says so in Prefect's task list, which
    otherwise shows only "Completed".  Failures of earlier flow runs count too (the attempt
    numbers do); where the attempt number is not Prefect's run count, it says why."""
    log = EventLog.read(run_dir)
    kinds = chunk_history(log, attempt.chunk).failure_kinds
    after = f" after {', '.join(kinds)}" if kinds else ""
    why = attempts_explained(log, attempt, run_count)
    return f"steps [{attempt.start}, {attempt.end}) committed on attempt {attempt.attempt}{after}{why}"


def chunk_record(result: Any) -> ChunkRecord:
    """``run_chunk``'s record: the task returns a Completed state (for its message) holding the
    record as a mapping, which a caller receives as such."""
    data = result.result() if isinstance(result, State) else result
    return data if isinstance(data, ChunkRecord) else ChunkRecord.from_dict(data)


def audited(task: Any, resources: RunResources, chunk: int) -> Any:
    """``task`` (``run_chunk`` with its options) for chunk ``chunk`` of the run ``resources`` hold,
    its ``on_failure`` hook bound here to the chunk's :class:`~tasks.hooks.HookTarget`: the hook
    gets only Prefect's task run, and a hook that knows its target needs no lookup by run id, so
    nothing outlives the task object (issue 47 item 4).  About half a millisecond a chunk."""
    target = HookTarget(resources.run_dir, resources.config.run_name, chunk, checkpoints=resources.checkpoints)
    return task.with_options(on_failure=[target.chunk_failed])


def retrying_chunk_task(config: RunConfig) -> Any:
    """``run_chunk`` with this run's retry policy."""
    o = config.orchestration
    return run_chunk.with_options(
        retries=o.retries,
        retry_delay_seconds=0,  # one number, which Prefect's UI can show; the backoff is retry_wait's
        retry_condition_fn=should_retry,
        tags=["convoy", f"run:{config.run_name}", backoff_tag(config)],
    )
