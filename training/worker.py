"""The worker process: restore the newest valid checkpoint, train to ``--until-step``, commit.

``python -m training.worker --run-dir D --until-step N`` (also ``convoy worker``), configured by
the run directory's ``config.json``.  Exit codes (the supervisor contract): ``0`` reached N and
committed it; ``75`` preempted (SIGTERM) after an emergency checkpoint; ``78`` configuration or
data error, or a diverged loss (:mod:`training.loop.nonfinite`); anything else is a crash.

``--standby`` (``orchestration.standby``): start, import and build the task, then wait on stdin for
one JSON line ``{"until_step": N, "pipelined": bool}`` from the chunk supervisor that hands it a
failed worker's place; only then take the run's lease, beat, restore and train as a fresh worker
would.  End of input without an order ends the standby quietly (:mod:`tasks.supervision.standby`).

It trains with :mod:`training.loop.runtime`, one step by :mod:`training.loop.step`, resumes by
:mod:`training.loop.restore`, and holds the lifecycle (:class:`Worker`): lease, heartbeat, preemption, loop, saves.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from training import distributed, faults
from training.checkpointing.schedule import MemorySchedule, SaveSchedule
from training.chunk_boundary import wait_for_previous_boundary
from training.config import ConfigError
from training.datapipe.streams import is_stream
from training.events import (
    EXIT_CONFIG,
    EXIT_PREEMPTED,
    FORKED_BY_ENV,
    Event,
    Phase,
    StandbyOrder,
    WorkerSays,
    append_event,
)
from training.heartbeat import Heartbeat
from training.loop import hermetic
from training.loop.claim import Claim, claim_run
from training.loop.memory_watch import MemoryWatch, give_up_copies
from training.loop.nonfinite import NonFiniteWatch
from training.loop.restore import Restored, restore_newest
from training.loop.runtime import Runtime, Session, amp_dtype, build_runtime, pick_device, reached, start_device
from training.loop.step import micro_batches, throughput, train_step, validation_enabled, validation_losses
from training.memory_budget import StateSize
from training.memory_snapshots import MemorySnapshots
from training.parts import TaskParts
from training.paths import RunPaths
from training.rundir import RunBusy, RunInfo, load_run_config, run_info
from training.state import TrainState
from training.task import unhonoured
from training.tracking.metrics import JsonlBackend, MetricBackend, StepMetricLogger

__all__ = ["Worker", "amp_dtype", "main", "pick_device"]  # re-exported: tests and benchmarks import them here


class Worker:
    """One worker process's life with one run, in stages that are separate methods because they
    happen at different times:

    1. ``__init__``: read the run's config, check ``until``; then :meth:`claim` unless standing by.
    2. :meth:`claim` — take the run (:mod:`training.loop.claim`): the lease first (a second worker on
       this run must change nothing), then beat and catch SIGTERM (from here on a stop is a
       preemption with an emergency save).  A standby claims only when ordered (:meth:`stand_by`).
    3. :meth:`prepare` — build the :class:`~training.loop.runtime.Runtime` (device, task, model,
       scaler, empty train state, checkpoint store).  Touches nothing of the run's state, so a
       standby does it *before* it is called, and a called one skips it.
    4. :meth:`setup` — what needs the claim: stale temp dirs removed, the save schedule
       (:class:`Session`).
    5. :meth:`restore` — the newest checkpoint that verifies and restores
       (:mod:`training.loop.restore`); the runtime may be replaced by a fresh one (a fallback).
    6. :meth:`run` — train to ``until``, saving on the policy's schedule; the final save.
    7. :meth:`finish` (or :meth:`emergency_exit` on SIGTERM) — report, stop beating, leave.

    Each stage's result is held in one object (:class:`Claim`, :class:`Runtime`,
    :class:`Session`, :class:`~training.loop.restore.Restored`), None until the stage ran; reading one
    too early is an error that names the stage."""

    def __init__(
        self,
        run_dir: Path,
        until_step: int | None,
        rank: int = 0,
        world_size: int = 1,
        pipelined: bool = False,
        standby: bool = False,
    ) -> None:
        self.run_dir, self.rank, self.world = run_dir, rank, world_size
        #: Train through chunk boundaries, each after the flow acknowledged the previous one.
        self.pipelined = pipelined
        self.config = load_run_config(run_dir)
        #: The step this worker trains to (a standby learns it from its order).
        self.until = self.check_until(until_step if until_step is not None else self.config.train.total_steps)
        self._claim: Claim | None = None
        self._runtime: Runtime | None = None
        self._session: Session | None = None
        self.snapshots = MemorySnapshots(self.log, self._drop_memory)
        self._restored: Restored | None = None
        self.memory_watch: MemoryWatch  # set by setup (training.loop.memory_watch)
        #: Warns once of a thread of no known purpose beside training (invariant 12).
        self.threads = hermetic.ThreadWatch(run_dir, rank)
        if not standby:
            self.claim()

    # ------------------------------------------------------------------ stage results
    @property
    def claimed(self) -> Claim:
        return reached(self._claim, "claim")

    @property
    def runtime(self) -> Runtime:
        return reached(self._runtime, "prepare")

    @property
    def session(self) -> Session:
        return reached(self._session, "setup")

    @property
    def restored(self) -> Restored:
        return reached(self._restored, "restore")

    @property
    def lease(self) -> FileLock | None:
        """The run's worker lease while this worker holds it (None before the claim, or rank > 0)."""
        return self._claim.lease if self._claim is not None else None

    @property
    def hb(self) -> Heartbeat:
        return self.claimed.heartbeat

    @property
    def parts(self) -> TaskParts:
        return self.runtime.parts

    @property
    def state(self) -> TrainState:
        return self.runtime.state

    # ------------------------------------------------------------------ stages
    def check_until(self, until_step: int) -> int:
        if until_step < 1 or until_step > self.config.train.total_steps:
            raise ConfigError(
                f"--until-step = {until_step}: must be in 1..train.total_steps ({self.config.train.total_steps})"
            )
        return until_step

    def claim(self) -> None:
        """Take the run (:func:`training.loop.claim.claim_run`: lease, last beat, beat, SIGTERM)."""
        self._claim = claim_run(self.run_dir, self.rank, self.config)

    def stand_by(self, order: Callable[[], str]) -> bool:
        """Standby: build everything a restart would (the task), then wait for the ``order`` line;
        False if none came (released).  Until the order a SIGTERM just ends it."""
        self.prepare()
        self.log(f"{WorkerSays.STANDBY_READY} (pid {os.getpid()})")  # a forked one shows the zygote's command line
        line = order().strip()
        if not line:
            return False
        t0 = time.time()
        go = StandbyOrder.from_line(line)
        self.until = self.check_until(go.until_step)
        self.pipelined = go.pipelined
        self.claim()
        self.log(f"standby taking over: training to step {self.until}")
        said = {"rank": self.rank, "pid": os.getpid(), "until_step": self.until, "ordered_at": round(t0, 4)}
        append_event(self.run_dir, Event.STANDBY_TOOK_OVER, **said)
        return True

    def log(self, msg: str) -> None:
        print(f"[worker rank {self.rank}] {msg}", flush=True)

    def prepare(self) -> Runtime:
        """Build the runtime (once: a standby prepared before it took over)."""
        if self._runtime is None:
            device = start_device(self.config, self.world)
            self._runtime = build_runtime(self.config, device, self.rank, self.world, run_dir=self.run_dir)
            amp = self._runtime.autocast
            self.log(f"training on {device}" + (f" with AMP {str(amp).removeprefix('torch.')}" if amp else ""))
            for line in unhonoured(self.config, self._runtime.parts) if self.rank == 0 else ():
                self.log(f"note: {line}")
        return self._runtime

    def setup(self) -> Session:
        """Prepare (unless a standby did), clean up, and decide the session (see :class:`Session`)."""
        runtime = self.prepare()
        cfg = self.config
        if self.rank == 0:
            runtime.store.cleanup_stale_temp()
        mlflow_run_id = (run_info(self.run_dir) or RunInfo()).mlflow_run_id
        distributed.barrier()  # no rank starts saving before rank 0 cleaned up
        schedule = SaveSchedule.for_run(cfg.checkpoint, cfg.train.chunk_steps, self.run_dir, runtime.memory is not None)
        memory = MemorySchedule.for_run(cfg.checkpoint, self.run_dir)
        self._session = Session(mlflow_run_id, schedule, memory)
        tier_root = runtime.memory.root if runtime.memory is not None else None
        self.memory_watch = MemoryWatch(cfg, StateSize.of(runtime.parts), runtime.device.type == "cpu", tier_root)
        return self._session

    def restore(self) -> Restored:
        """Newest checkpoint that verifies, fits the task and restores (:mod:`training.loop.restore`);
        each one passed over is recorded and its reason printed.  None at all: step 0."""
        claimed = self.claimed
        claimed.heartbeat.set(phase=Phase.LOAD)
        restored = restore_newest(self.runtime, self.run_dir, self.log)
        self._runtime, self._restored = restored.runtime, restored
        checkpoint = restored.checkpoint
        said: dict[str, Any] = {
            "rank": self.rank,
            "until_step": self.until,
            "previous_beat_step": claimed.previous_beat_step,
            "intraop_threads": torch.get_num_threads(),  # another count sums in another order
            # A new interpreter, or forked by the run's zygote (pid): which recovery path this was.
            "forked_by": int(os.environ[FORKED_BY_ENV]) if os.environ.get(FORKED_BY_ENV) else None,
        }
        if checkpoint is None:
            self.log(f"{WorkerSays.NO_CHECKPOINT}: starting from step 0")
            append_event(self.run_dir, Event.STARTED, **said)
            return restored
        dt = restored.load_s
        tier = "the memory snapshot" if restored.from_memory else "checkpoint"
        where = f"{tier} {checkpoint.path.name}, verified in {dt:.2f} s"
        self.log(f"{WorkerSays.RESUMED_FROM} step {checkpoint.step} ({where})")
        append_event(
            self.run_dir,
            Event.RESUMED,
            step=checkpoint.step,
            checkpoint=checkpoint.path.name,
            digest=checkpoint.digest,
            load_s=round(dt, 4),
            tier="memory" if restored.from_memory else "disk",
            **said,
        )
        return restored

    def run(self) -> int:
        """Set up, restore, train to ``until`` (saving on the policy's schedule), save, finish."""
        self.setup()
        state = self.restore().runtime.state
        watch = NonFiniteWatch.after(self.config, self.restored)
        if state.step >= self.until:
            self.log(f"{WorkerSays.ALREADY_AT} {state.step} >= {self.until}: nothing to train")
            return self.finish(loss=None)
        metrics = self.open_metrics()
        batches = self.batches()
        evaluating = self.evaluating()
        self.hb.set(phase=Phase.TRAIN, step=state.step)
        # Said at once, not at the next interval: a worker that fails in its first step has still
        # reached the step it resumed at, and the repeated-failure rule compares that step.
        self.hb.beat()
        schedule, memory = self.session.schedule, self.session.memory
        schedule.start(state.step)
        memory.start(state.step)
        loss, preempt = None, self.claimed.preempt
        (stop,) = distributed.agree_any(preempt.requested)
        while state.step < self.until:
            if stop:
                return self.emergency_exit(metrics)
            loss = watch.observe(self.take_step(batches, metrics, evaluating), state)
            more = state.step < self.until and watch.clean  # nonfinite rule 2: no save of a NaN streak
            flags = (more and schedule.due(state.step), more and self.memory_due(), preempt.requested)
            short = self.memory_watch.short(copying=flags[0] or flags[1])  # memory watch rule 5
            due, snap, stop, bad, tight = distributed.agree_any(*flags, watch.tripped(state.step), short is not None)
            if bad:
                watch.act(self.runtime, state.step, self.log, metrics)
            if tight:  # every rank gives its copies up together: saves stay collective
                self._runtime, snap = give_up_copies(self.runtime, self.memory_watch, short, self.log), False
            if due:
                if state.step % self.config.train.chunk_steps == 0:
                    self.await_previous_boundary()
                self.tune_interval(self.checkpoint_now(metrics, blocking=False), metrics)
                schedule.saved(state.step)
            elif snap:  # a disk save of this step makes a snapshot of it redundant (memory tier rule 2)
                self.snapshot_to_memory(metrics)
            if due or snap:  # long enough for a SIGTERM to arrive in: agreed again
                self.memory_watch.copied = True
                (stop,) = distributed.agree_any(preempt.requested)
        self.await_previous_boundary()  # the final save retires older checkpoints too
        self.final_save(metrics)
        return self.finish(loss=loss)

    # ------------------------------------------------------------------ the loop's parts
    def train_step(self, micro_batches: list[Any]) -> dict[str, float]:
        """One optimizer step (:func:`training.loop.step.train_step`)."""
        return train_step(self.runtime, micro_batches)

    def evaluate(self) -> dict[str, float]:
        """In-loop validation (:func:`training.loop.step.validation_losses`), its own phase and limit."""
        self.hb.set(phase=Phase.EVAL)
        try:
            return validation_losses(self.runtime)
        finally:
            self.hb.set(phase=Phase.TRAIN)

    def save(self, blocking: bool) -> float:
        """Snapshot the train state into the store (persisted in the background unless ``blocking``);
        returns the stall: how long the loop was held up."""
        runtime, rank = self.runtime, self.rank
        self.hb.set(phase=Phase.SAVE)
        extra = {"mlflow_run_id": self.session.mlflow_run_id} if rank == 0 else None
        stall = runtime.save_checkpoint(blocking, extra, self.snapshots.failed)
        store = runtime.store
        self.hb.set(phase=Phase.TRAIN)
        if rank == 0:
            append_event(
                self.run_dir,
                Event.CHECKPOINT_SAVED,
                step=runtime.state.step,
                stall_s=round(stall, 5),
                blocking=blocking or not store.policy.async_save,  # as it ran (memory watch rule 5)
                persist_s=round(store.last_persist_s, 5),
            )
        return stall

    def memory_due(self) -> bool:
        return self.runtime.memory is not None and self.session.memory.due(self.runtime.state.step)

    def snapshot_to_memory(self, metrics: StepMetricLogger) -> None:
        """The state into the memory tier, its metrics first as before a disk save."""
        assert self.runtime.memory is not None
        metrics.flush()
        self.snapshots.take(self.runtime.memory, self.runtime.state, self.session.memory)

    def _drop_memory(self) -> None:
        self._runtime = replace(self.runtime, memory=None)

    def checkpoint_now(self, metrics: StepMetricLogger, blocking: bool) -> float:
        """Metrics up to the step made durable, then the save: a committed step's metrics are never
        behind it.  Returns the save's stall."""
        metrics.flush()
        self.threads.check(self.runtime.parts.train_data, self.log)
        return self.save(blocking=blocking)

    def final_save(self, metrics: StepMetricLogger) -> None:
        """The last save of this worker (end of its range, or preemption): blocking, then the
        logger closed (its replay verdict recorded)."""
        self.checkpoint_now(metrics, blocking=True)
        metrics.close()

    def tune_interval(self, stall: float, metrics: StepMetricLogger) -> None:
        """Feed the save schedule; record each new adaptive interval (event + metric)."""
        chosen = self.session.schedule.observe_save(stall)
        if chosen is not None:
            step = self.runtime.state.step
            append_event(self.run_dir, Event.INTERVAL_CHOSEN, step=step, **chosen)
            metrics.log_extra(step, {"ckpt_interval_steps": float(chosen["interval_steps"])})

    def open_metrics(self) -> StepMetricLogger:
        """Step metrics: ``metrics.jsonl`` (rank 0), the run's metric journal.  Nothing here talks
        to MLflow: the chunk task ships the journal (invariant 12: a network client's retries
        would draw from the generators that are training state).

        flush_every=1: every step reaches metrics.jsonl (~70 us) so a replay after a kill has the
        pre-failure values to compare with, and the shipper sends each step within a second."""
        local: list[MetricBackend] = [JsonlBackend(RunPaths(self.run_dir).metrics)] if self.rank == 0 else []
        exact, hold = not self.restored.world_changed, self.config.train.nonfinite_steps  # nonfinite rule 2
        return StepMetricLogger(local, self.run_dir, flush_every=1, exact=exact, hold=hold)

    def resumed_step(self) -> int:
        """The step this worker restored (0 from scratch)."""
        return self.restored.checkpoint.step if self.restored.checkpoint is not None else 0

    def batches(self) -> Iterator[Any]:
        """This rank's micro-batches from the restored cursor on (:func:`training.loop.step.micro_batches`)."""
        return micro_batches(self.runtime, resumed=self.resumed_step() > 0)

    def evaluating(self) -> bool:
        """Whether in-loop validation runs (:func:`training.loop.step.validation_enabled`)."""
        return validation_enabled(self.runtime, self.log)

    def take_step(self, batches: Iterator[Any], metrics: StepMetricLogger, evaluating: bool) -> float:
        """One optimizer step (with its micro-batches), its metrics and beat; returns the loss."""
        cfg, runtime = self.config, self.runtime
        state, parts = runtime.state, runtime.parts
        step_samples = cfg.train.batch_size * cfg.train.grad_accum_steps  # one optimizer step, all ranks
        runtime.store.check()
        t0 = time.perf_counter()
        faults.slow_step(state.step + 1, stopping=lambda: self.claimed.preempt.requested)
        batch = [next(batches) for _ in range(cfg.train.grad_accum_steps)]
        with runtime.compile_phase(self.hb.set):  # a compiled model's first step compiles: not a hang
            out = train_step(runtime, batch, *self.snapshots.hooks(lambda: runtime.memory))
        state.step += 1
        size = None if is_stream(parts.train_data) else len(parts.train_data)  # type: ignore[arg-type]
        state.cursor = state.cursor.advance(step_samples, size)
        state.tokens_seen += step_samples * parts.tokens_per_sample
        dt = time.perf_counter() - t0 - self.snapshots.settled_s  # the wait for a snapshot is its stall
        out.update(step_time_s=dt, **throughput(step_samples, parts.tokens_per_sample, dt))
        out.update(
            {"data/epoch": state.cursor.epoch, "data/samples": state.cursor.samples_consumed(step_samples, size)}
        )
        if stall := self.snapshots.pop_stall():  # after the previous step, whose row was written: on this one
            out["memory_snapshot_s"] = stall
        if evaluating and state.step % cfg.train.eval_every == 0:
            t1 = time.perf_counter()
            out.update(self.evaluate(), eval_time_s=time.perf_counter() - t1)
        metrics.log(state.step, out)
        self.hb.set(step=state.step)
        if state.step == self.resumed_step() + 1 and self.rank == 0:  # recovery ends here (MTTR)
            append_event(self.run_dir, Event.FIRST_STEP, step=state.step, step_s=round(dt, 4))
        self.session.schedule.observe_step(dt, runtime.store.in_flight)
        self.session.memory.observe_step(dt)
        return out["loss"]

    def await_previous_boundary(self) -> None:
        """Pipelined: before committing the next chunk boundary (or the last step), wait until the
        flow acknowledged the previous boundary (rule 1 of :mod:`training.chunk_boundary`)."""
        if not self.pipelined:
            return
        self.hb.set(phase=Phase.SAVE)  # the boundary save starts with the wait (save limits apply)
        preempt, step = self.claimed.preempt, self.runtime.state.step
        chunk = self.config.train.chunk_steps
        wait_for_previous_boundary(self.run_dir, step, chunk, self.resumed_step(), stop=lambda: preempt.requested)

    # ------------------------------------------------------------------ endings
    def emergency_exit(self, metrics: StepMetricLogger) -> int:
        step = self.runtime.state.step
        self.log(f"{WorkerSays.SIGTERM}: saving an emergency checkpoint at step {step}")
        self.final_save(metrics)
        append_event(self.run_dir, Event.PREEMPTED, rank=self.rank, step=step)
        self.leave()
        return EXIT_PREEMPTED

    def finish(self, loss: float | None) -> int:
        store, step = self.runtime.store, self.runtime.state.step
        threads = hermetic.thread_names()  # invariant 12: what ran beside training (before it stops)
        store.wait()
        if self.runtime.memory is not None:  # the run's last step on disk: nothing resumes from it
            self.runtime.memory.release_when_done(step, self.config.train.total_steps)
        committed = (store.last_committed or store.latest_valid(record=False)) if self.rank == 0 else None
        digest = committed.digest if committed else None
        append_event(
            self.run_dir,
            Event.WORKER_DONE,
            rank=self.rank,
            step=step,
            digest=digest,
            loss=loss,
            threads=threads,
            network_clients=hermetic.loaded_network_clients(),
        )
        self.log(f"{WorkerSays.DONE_AT} {step} (digest {digest})")
        self.leave()
        return 0

    def leave(self) -> None:
        """Stop a stream loader's worker processes (they ignore SIGTERM, so the interpreter's
        exit-time join of a live one would wait forever), the last beat, the process group."""
        stream = self.runtime.state.stream
        if stream is not None:
            stream.close()
        self.hb.stop(Phase.DONE)
        distributed.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m training.worker", description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", required=True, type=Path)
    ap.add_argument("--until-step", type=int, help="required unless --standby")
    ap.add_argument(
        "--pipelined",
        action="store_true",
        help="train through chunk boundaries; each waits for the previous boundary's acknowledgement",
    )
    ap.add_argument(
        "--standby",
        action="store_true",
        help="build everything, then wait for a JSON order line on stdin before touching the run",
    )
    args = ap.parse_args(argv)
    if args.until_step is None and not args.standby:
        ap.error("--until-step is required (unless --standby)")
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        if args.standby:
            worker = Worker(args.run_dir, None, rank, world, standby=True)
            if not worker.stand_by(sys.stdin.readline):
                return 0
            return worker.run()
        return Worker(args.run_dir, args.until_step, rank, world, args.pipelined).run()
    except RunBusy as exc:  # the run belongs to another worker: leave its audit alone too
        print(f"{WorkerSays.CONFIG_ERROR}: {exc}", file=sys.stderr, flush=True)
        return EXIT_CONFIG
    except ConfigError as exc:
        print(f"{WorkerSays.CONFIG_ERROR}: {exc}", file=sys.stderr, flush=True)
        append_event(args.run_dir, Event.CONFIG_ERROR, rank=rank, message=str(exc))
        return EXIT_CONFIG


if __name__ == "__main__":  # @record: torchrun's report quotes a failed rank's exception (failure_kinds.py)
    from torch.distributed.elastic.multiprocessing.errors import record

    sys.exit(record(main)())
