"""Flow ``train``: a long run as a sequence of chunk tasks that each resume from a checkpoint.

Why chunks: a failure inside chunk k costs at most chunk k's steps since its last checkpoint, and
Prefect retries only that task (docs/architecture.md, invariant 6).  The flow itself keeps no training state:
which chunks are done is read from the checkpoint store (the newest *verified* checkpoint), so a
flow that died, or a re-run of a finished run, repeats nothing (a finished run trains nothing).

One writer per run (invariant 8): the flow holds a non-blocking file lock on
``runs/<name>/.lock`` for its whole life; a second flow on the same run is refused at once.  The
OS drops the lock when the holder dies, however it dies (``training/locks.py``, the one helper
behind this lock and the worker's lease).

Entry points: :func:`run_training` (what ``convoy train`` calls) and ``python -m flows.train``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.context import FlowRunContext

from flows import flow_liveness
from flows.ephemeral_api import ephemeral_settings, start_tied_prefect_api
from flows.report import mlflow_link
from flows.run_summary import RunSummary, goodput_fields
from flows.slurm_job import SlurmJob
from tasks.artifacts import prefect_ui_base, publish_chunk_table
from tasks.chunk import audited, chunk_record, committed_digest, loss_at, retrying_chunk_task
from tasks.hooks import flow_crashed, flow_failed
from tasks.records import run_records
from tasks.records.chunk_record import ChunkRecord, ChunkRow
from tasks.remote import dvc_version as version
from tasks.remote import remote_checkpoints
from tasks.remote.dvc_version import VersioningError
from tasks.run_resources import RunResources
from tasks.supervision.process_group import reap_stale_worker
from tasks.supervision.supervisor import ChunkFailed
from tasks.takeover import mlflow_flow_tags, take_over
from training import chunk_boundary, memory_budget
from training.config import ConfigError, RunConfig, load_config
from training.datapipe.corpus import entropy_floor
from training.event_records import EventLog
from training.events import Event, append_event
from training.locks import holding
from training.memory_sweep import free_orphans, freed_line
from training.paths import RunPaths
from training.run_identity import RunInfo
from training.rundir import keyed_config, link_current, open_run, run_info, update_run_info
from training.tracking import resume_audit
from training.tracking.attempts import chunk_history, recorded_digest
from training.tracking.goodput import chunk_ends


class RunLocked(ConfigError):
    """Another flow holds the run's lock.

    A :class:`ConfigError` subclass so every entry point already prints it as one line and exits
    non-zero; it is never retried.
    """


class _NoTracebackWhenClassified(logging.Filter):
    """Drops the traceback Prefect attaches to "Task run failed …" / "Encountered exception …"
    when convoy already classified the failure (:class:`ChunkFailed`, :class:`ConfigError`):
    its message says what happened in words and the worker's full output is in the attempt's log
    file; the traceback only shows where the supervisor raised (the issue's "traceback wall")."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ChunkFailed | ConfigError):
            record.exc_info, record.exc_text = None, None
        return True


def quiet_classified_tracebacks() -> None:
    """Install :class:`_NoTracebackWhenClassified` on Prefect's run loggers (once)."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTracebackWhenClassified) for f in logger.filters):
            logger.addFilter(_NoTracebackWhenClassified())


def plan_chunks(total_steps: int, chunk_steps: int) -> list[tuple[int, int, int]]:
    """``[(chunk, start, end)]`` with chunks numbered from 1; the last one may be shorter."""
    return [(i + 1, s, min(s + chunk_steps, total_steps)) for i, s in enumerate(range(0, total_steps, chunk_steps))]


def run_lock(run_dir: Path, run_name: str) -> contextlib.AbstractContextManager[Any]:
    """Hold ``run_dir/.lock`` (non-blocking) for a ``with`` block; a second flow is refused at once."""
    lock = RunPaths(run_dir).flow_lock

    def refuse(holder: str) -> RunLocked:
        return RunLocked(
            f"run {run_name!r} is already being trained by another flow (lock {lock} held by {holder}); "
            "wait for it to finish or stop it first"
        )

    return holding(lock, refuse)


def flow_run_name() -> str:
    """``<run name>-<UTC time>`` instead of a random ``shiny-marmot``, so a person finds the flow
    runs of run ``demo`` in the Prefect UI by name."""
    from prefect.runtime import flow_run

    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    try:
        p = flow_run.parameters
        cfg = p.get("config")
        if cfg is not None:
            name = cfg.get("run_name") if isinstance(cfg, dict) else cfg.run_name
        else:
            name = load_config(p.get("params"), p.get("overrides") or []).run_name
    except Exception:  # noqa: BLE001 - a name must never fail the run
        name = "train"
    return f"{name or 'train'}-{stamp}"


class TrainingRun:
    """One flow run over one training run: its chunks, their rows, the versioning in flight.

    :meth:`open` pins and reports the run, :meth:`chunk` handles one chunk (skip what is
    committed, else train it, version and acknowledge its boundary), :meth:`close` releases the
    workers and writes the audit whatever happened, :meth:`summary` is what the flow returns."""

    def __init__(self, cfg: RunConfig, run_dir: Path, flow_run_id: str | None, logger: Any) -> None:
        self.cfg, self.run_dir, self.flow_run_id, self.logger = cfg, run_dir, flow_run_id, logger
        self.t0 = time.time()
        self.taken_over: dict[str, Any] | None = None
        #: Final states Prefect set on this flow run while it lived (``note_marks``), each once.
        self.marks: list[tuple[str, str]] = []
        self.flow_run_name: str | None = None
        self.model: dict[str, Any] | None = None
        self.task = retrying_chunk_task(cfg)
        #: What lives across the chunk tasks (parked worker, standby, uploader, versioning).
        self.resources = RunResources(cfg, run_dir)
        self.rows: list[ChunkRow] = []
        self.versioned: list[version.Versioned | version.NotVersioned] = []
        self.audit: dict[str, Any] | None = None
        self.chunks = plan_chunks(cfg.train.total_steps, cfg.train.chunk_steps)
        self.committed = 0
        self.fetched: dict[str, Any] | None = None
        #: The step a ``--from`` child starts at: its chunks up to there are the parent's.
        parent = (run_info(run_dir) or RunInfo()).parent
        self.parent_step = parent.step if parent is not None else 0

    @classmethod
    def open(
        cls, cfg: RunConfig, flow_run: tuple[str | None, str | None], allow_config_change: bool, logger: Any
    ) -> TrainingRun:
        """Pin the run (fingerprint check), point ``runs/<name>`` at it, start its MLflow run,
        close what a dead flow before this one left open; ``flow_run``: (id, name)."""
        flow_run_id, flow_run_name = flow_run
        cfg = fit_to_host(cfg, logger)
        run_dir = open_run(cfg, allow_config_change=allow_config_change).resolve()
        link_current(cfg)
        update_run_info(run_dir, prefect_ui=prefect_ui_base())  # for the links in MLflow's descriptions
        # The run's resources first: its worker zygote imports torch while MLflow starts (a
        # relaunched flow's first step waits for both; issue 30 item 4).
        run = cls(cfg, run_dir, flow_run_id, logger)
        run_records.begin_run(cfg, run_dir)
        if reap_stale_worker(run_dir, cfg.train.world_size):
            logger.warning("stopped a worker of this run left over from a flow that died")
        run.flow_run_name = flow_run_name
        run.taken_over = take_over(cfg, run_dir, flow_run, logger, run.resources.checkpoints, run.resources.notes)
        run.committed = run.newest_committed()
        append_event(
            run_dir,
            Event.FLOW_STARTED,
            started_at=round(run.t0, 3),  # the flow's clock starts before its MLflow run and takeover
            flow_run_id=flow_run_id,
            flow_run_name=flow_run_name,
            committed_step=run.committed,
            chunks=len(run.chunks),
            **(job.fields() if (job := SlurmJob.from_env()) else {}),
        )
        tags = mlflow_flow_tags(run_dir, flow_run_id, flow_run_name) | (job.tags() if job else {})
        run_records.link_flow_run(cfg, run_dir, tags)
        logger.info(
            "run %s: %d chunk(s) of %d steps (%s mode); newest verified checkpoint: step %d",
            cfg.run_name,
            len(run.chunks),
            cfg.train.chunk_steps,
            cfg.orchestration.mode,
            run.committed,
        )
        return run

    def newest_committed(self) -> int:
        """The step the run is at: the newest verified checkpoint here, after fetching a newer one
        from the remote (``tracking.dvc``: this machine may be new to the run, invariant 10); in
        pool mode the newest uploaded one (the nodes train and upload; nothing is fetched here)."""
        cfg, run_dir = self.cfg, self.run_dir
        if cfg.tracking.dvc and self.resources.plan.local:
            self.fetched = remote_checkpoints.fetch_before_resume(cfg, run_dir, self.logger.info)
        committed = self.resources.checkpoints.resume_point().step or 0
        if cfg.tracking.dvc and self.resources.plan.pool:
            committed = max(committed, self.uploaded_final()[0])
        return committed

    def version(self, end: int, only_if_missing: bool = False) -> version.PendingVersion | None:
        if self.resources.plan.pool:
            return None  # the node that trained the chunk uploaded it before reporting
        return self.resources.versioning.submit(end, only_if_missing=only_if_missing)

    def chunk(self, chunk: int, start: int, end: int) -> None:
        row = ChunkRow(chunk, start, end)
        self.rows.append(row)
        if self.committed >= end:
            # What the chunk went through in the flow runs that trained it, and what it committed
            # (a --from child's chunks up to its start were trained by the parent, not this run).
            if end <= self.parent_step:
                row.status = "parent's (committed)"
            else:
                self.record_history(row)
                row.status = "skipped (committed)"
            # Retention may have removed an older boundary since: its commit recorded the digest.
            row.digest = committed_digest(self.run_dir, end, self.resources.checkpoints) or recorded_digest(
                EventLog.read(self.run_dir), chunk
            )
            row.loss = loss_at(self.run_dir, end)
            # A flow that died after the commit but before versioning left it unversioned
            # (a pipelined worker can commit the last chunk before its flow handles it).
            self.version(end, only_if_missing=True)
            return
        c0 = time.time()
        try:
            rec = self.train_chunk(chunk, start, end)
        except BaseException:
            self.record_history(row)
            row.status, row.seconds = "failed", time.time() - c0
            raise
        self.record_history(row)
        row.status, row.seconds, row.digest, row.loss = "trained", time.time() - c0, rec.digest, rec.loss
        if rec.failure_kinds:  # pool mode: its chunk flows' failures, which no event may name
            row.record_history(max(row.attempts, rec.attempt), rec.failure_kinds)
        row.flow_runs, row.nodes, row.fetched = rec.flow_runs, rec.nodes, rec.fetched  # pool mode: per attempt
        self.hand_over_boundary(end)

    def record_history(self, row: ChunkRow) -> None:
        """The chunk's attempts and failure kinds in every flow run of this training run (a
        restarted flow's table must not say "1 attempt, no failures" of a chunk the dead flow
        tried three times)."""
        history = chunk_history(EventLog.read(self.run_dir), row.chunk)
        row.record_history(history.attempts, list(history.failure_kinds))

    def train_chunk(self, chunk: int, start: int, end: int) -> ChunkRecord:
        if self.resources.plan.pool:
            from flows.pool import dispatch_chunk

            return dispatch_chunk(self.cfg, self.run_dir, chunk, start, end)
        task = audited(self.task, self.resources, chunk)  # its failure hook knows the chunk
        return chunk_record(task(str(self.run_dir), chunk, start, end, self.resources))

    def hand_over_boundary(self, end: int) -> None:
        """Version the boundary checkpoint (overlapping the next chunk), then acknowledge it once
        it is staged (rule 3 of :mod:`training.chunk_boundary`)."""
        pending = self.version(end)
        staged = pending.staged if pending is not None else None
        chunk_boundary.acknowledge(self.run_dir, end, staged, timeout_s=self.cfg.heartbeat.save_timeout_s)
        self.resources.audit.request()  # audit table + timeline picture, on a thread: off the recovery path
        self.resources.goodput.request()  # goodput at this chunk end in MLflow, once; on a thread
        self.committed = end
        self.note_marks()

    def note_marks(self) -> None:
        """Record once that Prefect marked this live flow run final (e.g. Crashed by the liveness
        automation): the orchestrator is wrong, training is not.  The flow trains on; the run's
        lock keeps any second flow (e.g. the restart automation's) from training the same steps."""
        mark = flow_liveness.marked_while_alive(self.flow_run_id)
        if mark is None or mark in self.marks:
            return
        self.marks.append(mark)
        append_event(
            self.run_dir,
            Event.FLOW_MARKED_WHILE_ALIVE,
            flow_run_id=self.flow_run_id,
            state=mark[0],
            message=mark[1],
            committed_step=self.committed,
        )
        self.logger.warning(
            "Prefect marks this live flow run %s (%s); training goes on, and the run's lock keeps any second flow out",
            mark[0],
            mark[1] or "no message",
        )

    def close(self, ok: bool) -> None:
        """Release the run's worker and standby, finish versioning and the audit (also on failure)."""
        self.note_marks()  # a mark set during the last chunk
        stopped, versioned, _final_upload = self.resources.close()
        if stopped:  # only after a failure: the last chunk's worker exits itself
            self.logger.info("stopped the pipelined worker of run %s", self.cfg.run_name)
        self.versioned.extend(versioned)
        publish_chunk_table(self.cfg.run_name, [r.as_dict() for r in self.rows], mlflow_link(self.run_dir)[0])
        if ok:
            self.model = run_records.log_model(self.cfg, self.run_dir)
        self.audit = run_records.finish_run(self.cfg, self.run_dir, ok)

    def uploaded_final(self) -> tuple[int, str | None]:
        """(step, digest) of the newest uploaded checkpoint: in pool mode without shared storage the
        checkpoints are on the nodes and in the remote, not here."""
        if not (self.cfg.tracking.dvc and self.resources.plan.pool):
            return 0, None
        try:
            entry = remote_checkpoints.newest_uploaded(self.cfg, self.run_dir)
        except (VersioningError, ValueError, OSError) as exc:
            self.logger.warning("could not read the remote index: %s", exc)
            return 0, None
        return (entry.step, entry.digest) if entry else (0, None)

    def final_checkpoint(self) -> tuple[int, str | None]:
        """(step, digest) of the run's newest checkpoint, verified once.

        Verifying hashes every file of the checkpoint, so it is not done twice: the last chunk's
        row already holds the digest its chunk task (or the skip) verified at the final step.  Only
        a row without one (a skipped chunk whose checkpoint is not on this machine: pool mode
        without shared storage) asks the store, then the remote index."""
        last = self.rows[-1] if self.rows else None
        if last is not None and last.digest is not None:
            return last.end_step, last.digest
        latest = self.resources.checkpoints.resume_point().checkpoint
        return (latest.step, latest.digest) if latest is not None else self.uploaded_final()

    def clock(self, final_step: int) -> dict[str, Any]:
        """The summary's one wall clock: the run's goodput measured to its last chunk's end when it
        is finished (the cut MLflow's last ``goodput`` point is computed at: the same value), else
        to now; ``seconds`` is that wall clock (this command's own when goodput cannot be measured)."""
        ends = chunk_ends(EventLog.read(self.run_dir))
        done = bool(ends) and ends[-1][0] >= final_step == self.cfg.train.total_steps
        until = ends[-1][1] if done else time.time()
        fields = goodput_fields(self.run_dir, until=until, journal=self.resources.journal)
        return {"seconds": fields.get("wall_s", round(time.time() - self.t0, 3)), **fields}

    def summary(self) -> dict[str, Any]:
        """The flow's result (:class:`flows.run_summary.RunSummary`, as a mapping)."""
        rows, audit = self.rows, self.audit or {}
        final_step, digest = self.final_checkpoint()
        taken = self.taken_over or {}
        summary = RunSummary(
            run_name=self.cfg.run_name,
            run_dir=str(self.run_dir),
            flow_run_id=self.flow_run_id,
            final_step=final_step,
            digest=digest,
            trained_chunks=sum(r.status == "trained" for r in rows),
            skipped_chunks=sum(r.status.startswith("skipped") for r in rows),
            parent_chunks=sum(r.status.startswith("parent") for r in rows),
            attempts={r.chunk: r.attempts for r in rows if not r.status.startswith("parent")},
            losses={r.chunk: r.loss for r in rows if r.loss is not None},
            failures=[{"chunk": r.chunk, "kinds": r.failure_kinds} for r in rows if r.failure_kinds],
            chunks=rows,
            versioned=[v.as_dict() for v in self.versioned],
            fetched=self.fetched,
            audit={k: audit.get(k) for k in ("resumes", "failures", "steps_lost", "nondeterministic")},
            passed_over=[
                {"resumed_from_step": r["resumed_from_step"], "passed_over": r["passed_over"]}
                for r in audit.get("rows", [])
                if r.get("passed_over")
            ],
            entropy_floor=entropy_floor(self.cfg.data, self.cfg.task),
            taken_over=taken.get("previous_names") or taken.get("previous"),
            model=self.model,
            **self.clock(final_step),
        )
        self.resources.goodput.join()
        # every chunk end's goodput point, once; the run's journal reader reads on from the last pass
        run_records.log_goodput(self.cfg, self.run_dir, journal=self.resources.journal)
        append_event(
            self.run_dir,
            Event.FLOW_DONE,
            final_step=summary.final_step,
            digest=summary.digest,
            trained_chunks=summary.trained_chunks,
            flow_run_id=self.flow_run_id,
        )
        tags = mlflow_flow_tags(self.run_dir, self.flow_run_id, self.flow_run_name)  # this flow run: finished
        run_records.link_flow_run(self.cfg, self.run_dir, tags)
        return summary.as_dict()


@flow(name="train", flow_run_name=flow_run_name, on_failure=[flow_failed], on_crashed=[flow_crashed], log_prints=True)
def train(
    params: str | None = "params.yaml",
    overrides: list[str] | None = None,
    config: RunConfig | None = None,
    allow_config_change: bool = False,
) -> dict[str, Any]:
    """Train (or continue) the run described by ``config``, or by ``params`` + ``overrides``."""
    quiet_classified_tracebacks()
    cfg = keyed_config(config if config is not None else load_config(params, overrides or []))
    ctx = FlowRunContext.get()
    fr = ctx.flow_run if ctx is not None else None
    flow_run = (str(fr.id), fr.name) if fr is not None else (None, None)
    with run_lock(cfg.run_dir, cfg.run_name):
        run = TrainingRun.open(cfg, flow_run, allow_config_change, get_run_logger())
        resume_audit.import_plotting_beside()  # the audit's timeline, drawn at the end
        ok = False
        try:
            local = run.resources.plan.local  # in pool mode each chunk's flow samples its machine
            with run_records.system_metrics(cfg, run.run_dir) if local else contextlib.nullcontext():
                for chunk, start, end in run.chunks:
                    run.chunk(chunk, start, end)
            ok = True
        finally:
            run.close(ok)
        return run.summary()


def fit_to_host(cfg: RunConfig, logger: Any) -> RunConfig:
    """``cfg`` as this machine's host memory lets it run (``training.memory_budget``), the memory
    tiers of runs that are gone freed first (``training.memory_sweep``: the budget counts what is
    left); each thing given up is one line of the log.  Raises ConfigError for a run projected to
    run out of memory even with everything given up."""
    if line := freed_line(free_orphans(cfg.checkpoint.memory_keep_hours, current=cfg.run_dir)):
        logger.warning(line)  # no snapshot outlives its run
    fitted = memory_budget.fitted(cfg)
    if fitted is None:
        logger.info("host memory: not projected here (the task's data is not on this machine)")
        return cfg
    logger.info(fitted.line)
    for line in fitted.gave_up:
        logger.warning(line)
    return fitted.config


def run_training(
    config: RunConfig, allow_config_change: bool = False, overrides: list[str] | None = None
) -> dict[str, Any]:
    """Run flow ``train`` for ``config`` in this process and return its summary (``overrides``:
    the ``-S`` values ``config`` was made with, shown as the flow run's parameter).

    Without ``PREFECT_API_URL`` Prefect starts its embedded ephemeral API; its start-up on a fresh
    ``PREFECT_HOME`` runs migrations that outlast the default 20 s, hence the longer default.
    Raises :class:`RunLocked` / :class:`ConfigError` (one-line messages) or :class:`ChunkFailed`
    (``.kind``, one-line ``str()``; the flow run is Failed and the audit is written).
    """
    ephemeral_settings()
    # Refuse a second writer or a trajectory-changing config before a flow run even exists (a clean
    # one-line message, no failed run in the UI); the flow repeats both under its own lock, so a
    # race between two callers is still safe.  open_run is idempotent.
    if allow_config_change and config.on_config_change == "new_run":
        raise ConfigError(
            "--allow-config-change does nothing with on_config_change: new_run (a changed config trains its "
            f"own run, {keyed_config(config).run_dir}); to change the settings of an existing run set "
            "-S on_config_change=refuse as well"
        )
    if allow_config_change and ("@" in config.run_name or config.run_dir.is_symlink()):
        raise ConfigError(
            f"--allow-config-change: {config.run_dir} is a run directory named by its config fingerprint; "
            "changing its settings would break that name; train the new settings as their own run instead"
        )
    config = keyed_config(config)
    with run_lock(config.run_dir, config.run_name):  # a second flow is refused first, at once
        memory_budget.fitted(config)  # a run projected to run out of memory: before a flow run exists
        open_run(config, allow_config_change=allow_config_change)
    from prefect import tags

    start_tied_prefect_api()  # Prefect's temporary API (no PREFECT_API_URL) ends with this process, even killed
    with tags("convoy", f"run:{config.run_name}", f"fingerprint:{config.fingerprint()}"):
        # ``overrides`` only for the record (the flow run's Parameters in the UI): ``config``
        # already holds them, and wins.
        return train(config=config, overrides=overrides or None, allow_config_change=allow_config_change)
