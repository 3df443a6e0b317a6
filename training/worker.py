"""The worker process: restore the newest valid checkpoint, train to ``--until-step``, commit.

``python -m training.worker --run-dir D --until-step N`` (also ``convoy worker``).  The
configuration is the run directory's ``config.json``.  Exit codes (the supervisor contract):
``0`` reached N and committed it; ``75`` preempted (SIGTERM) after an emergency checkpoint;
``78`` configuration or data error; anything else is a crash.

``--standby`` (``orchestration.standby``): start, import, build the task and connect tracking,
then wait on stdin for one JSON line ``{"until_step": N, "pipelined": bool}`` from the chunk
supervisor that hands it a failed worker's place; only then take the run's lease, beat, restore
and train, exactly as a freshly started worker would.  End of input without an order (the
supervisor released it, or died) ends the standby quietly.  See :mod:`tasks.standby`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import default_collate

from training import distributed, faults
from training.batch import to_device
from training.checkpointing import sharded
from training.checkpointing.adaptive import AdaptiveInterval, estimate_mtbf_s
from training.checkpointing.store import CheckpointStore, WriterGroup
from training.chunk_boundary import wait_for_previous_boundary
from training.config import EXIT_CONFIG, EXIT_PREEMPTED, ConfigError, RunConfig
from training.data import LoaderSpec, mix_seed, validation_keys
from training.events import Event, WorkerSays, append_event
from training.heartbeat import Heartbeat, read_heartbeat
from training.paths import RunPaths
from training.rundir import (
    RunBusy,
    describe_change,
    load_run_config,
    recorded_trajectories,
    run_info,
    take_worker_lease,
)
from training.sample_rng import SeededSamples
from training.state import (
    ExpectedState,
    TrainState,
    capture_rng,
    checkpoint_validator,
    configure_determinism,
    restore_rng,
    seed_everything,
)
from training.streams import is_stream, train_batches
from training.task import build_task
from training.tracking.metrics import DETERMINISTIC_KEYS, JsonlBackend, MetricBackend, StepMetricLogger


class _Preempt:
    """SIGTERM sets a flag; the loop saves at the next step boundary (never mid-update)."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handler)

    def _handler(self, signum: int, frame: Any) -> None:
        self.requested = True


def pick_device(config: RunConfig) -> torch.device:
    """``cuda``/``auto`` with CUDA: the GPU ``LOCAL_RANK`` of those visible (torchrun's layout)."""
    want = config.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("train.device = 'cuda' but no CUDA device is visible; use cpu or auto")
        index = int(os.environ.get("LOCAL_RANK", "0"))
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"local rank {index} needs CUDA device {index} but {torch.cuda.device_count()} "
                "are visible; use at most that many ranks per node"
            )
        return torch.device("cuda", index)
    return torch.device("cpu")


def amp_dtype(config: RunConfig, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None when AMP is off (CPU runs ignore ``train.amp``)."""
    if not config.train.amp or device.type != "cuda":
        return None
    choice = config.train.amp_dtype
    if choice == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if choice == "bfloat16" else torch.float16


def tracking_backends(config: RunConfig, run_dir: Path) -> list[MetricBackend]:
    """The remote metric backends (MLflow), slow to import and connect; ``metrics.jsonl`` is
    always there, built at once (the replay check reads it)."""
    backends: list[MetricBackend] = []
    if config.tracking.mlflow:
        from training.tracking.mlflow_backend import MlflowBackend  # imported lazily: ~3 s

        run_id = (run_info(run_dir) or {}).get("mlflow_run_id")
        if run_id:
            backends.append(MlflowBackend(config, run_id, run_dir=run_dir))
    return backends


class TrackingWarmup:
    """Tracking backends built and their history read on a thread, off the recovery's path.

    Why: importing MLflow and reading back what the run logged so far took 2-3 s after the
    restore, before the first step.  The history is stable once this worker holds the run's
    lease (the previous writer is gone), so it is read while the checkpoint loads and the first
    steps train; the metric logger keeps those steps' rows and hands them over when the backends
    are ready (:meth:`StepMetricLogger.attach`).  A standby passes backends it built while waiting.
    """

    def __init__(self, backends: Callable[[], list[MetricBackend]]) -> None:
        self._result: tuple[list[MetricBackend], list[dict[str, dict[int, float]]]] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(backends,), name="convoy-tracking", daemon=True)
        self._thread.start()

    def _run(self, backends: Callable[[], list[MetricBackend]]) -> None:
        try:
            built = backends()
            self._result = built, [b.history(DETERMINISTIC_KEYS) for b in built]
        except BaseException as exc:  # noqa: BLE001 - re-raised in the training thread by result()
            self._error = exc

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> tuple[list[MetricBackend], list[dict[str, dict[int, float]]]]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class Worker:
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
        self.pipelined = pipelined
        self.config = load_run_config(run_dir)
        self.until = self.check_until(until_step if until_step is not None else self.config.train.total_steps)
        self.lease: Any = None
        self.standby_backends: list[MetricBackend] | None = None
        if not standby:
            self.claim()

    def check_until(self, until_step: int) -> int:
        if until_step < 1 or until_step > self.config.train.total_steps:
            raise ConfigError(
                f"--until-step = {until_step}: must be in 1..train.total_steps ({self.config.train.total_steps})"
            )
        return until_step

    def claim(self) -> None:
        """Take the run: the lease first (a second worker on this run must change nothing), then
        beat and catch SIGTERM (from here on a stop is a preemption with an emergency save)."""
        self.lease = take_worker_lease(self.run_dir) if self.rank == 0 else None
        # How far a predecessor that vanished unreported (no supervisor saw it die) got: its
        # last beat, before ours replaces it (the audit's steps lost; training/tracking/resume_audit.py).
        self.previous_beat_step = (read_heartbeat(self.run_dir, self.rank) or {}).get("step")
        self.hb = Heartbeat(self.run_dir, self.rank, self.config.heartbeat.interval_s).start()
        self.preempt = _Preempt()

    def stand_by(self, order: Callable[[], str]) -> bool:
        """Standby: build everything a restart would (task, tracking clients), then wait for the
        ``order`` line; False if none came (released).  Until the order a SIGTERM just ends it."""
        self.prepare()
        if self.rank == 0:
            self.standby_backends = tracking_backends(self.config, self.run_dir)
        self.log(WorkerSays.STANDBY_READY)
        line = order().strip()
        if not line:
            return False
        t0 = time.time()
        go = json.loads(line)
        self.until = self.check_until(int(go["until_step"]))
        self.pipelined = bool(go.get("pipelined", False))
        self.claim()
        self.log(f"standby taking over: training to step {self.until}")
        append_event(
            self.run_dir,
            Event.STANDBY_TOOK_OVER,
            rank=self.rank,
            pid=os.getpid(),
            until_step=self.until,
            ordered_at=round(t0, 4),
        )
        return True

    def log(self, msg: str) -> None:
        print(f"[worker rank {self.rank}] {msg}", flush=True)

    def prepare(self) -> None:
        """Everything a worker needs before it may touch the run: device, task, checkpoint store."""
        if getattr(self, "parts", None) is not None:
            return  # a standby prepared before it took over
        cfg = self.config
        self.device = pick_device(cfg)
        configure_determinism(cfg.train.deterministic, self.device)  # before the first CUDA work
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a bare "cuda" (and the CUDA RNG calls) mean this device
        distributed.init(self.world, self.device)
        self.build()
        self.log(
            f"training on {self.device}"
            + (f" with AMP {str(self.autocast_dtype).removeprefix('torch.')}" if self.amp else "")
        )
        self.store = CheckpointStore(
            self.run_dir,
            cfg.checkpoint,
            cfg.fingerprint(),
            writers=WriterGroup(self.world, self.rank, gather_timeout_s=cfg.heartbeat.save_timeout_s),
            boundary_every=cfg.train.chunk_steps,
            validator=checkpoint_validator(ExpectedState.of(self.parts)),
        )

    def setup(self) -> None:
        """Prepare (unless a standby did), start tracking off the critical path, clean up."""
        self.prepare()
        cfg = self.config
        self.tracking: TrackingWarmup | None = None
        self.tracking_factory: Callable[[], list[MetricBackend]] | None = None
        if self.rank == 0:
            prebuilt = self.standby_backends
            if prebuilt is not None:  # a standby built them while waiting: ready at once
                self.tracking = TrackingWarmup(lambda: prebuilt)
            else:  # built after the first step (start_tracking): its imports would slow that step
                self.tracking_factory = lambda: tracking_backends(cfg, self.run_dir)
        if self.rank == 0:
            self.store.cleanup_stale_temp()
        self.mlflow_run_id = (run_info(self.run_dir) or {}).get("mlflow_run_id")  # recorded in each manifest
        distributed.barrier()  # no rank starts saving before rank 0 cleaned up
        ck = cfg.checkpoint
        self.adaptive = None
        self.world_changed = False
        if ck.every_steps == "auto":
            mtbf = estimate_mtbf_s(self.run_dir, ck.mtbf_hours * 3600)
            self.adaptive = AdaptiveInterval(mtbf, ck.max_overhead)

    def build(self) -> None:
        """Seeded task parts, DDP wrapper, AMP scaler and an empty train state (also after a
        checkpoint that could not be restored: nothing of it may leak into the fallback)."""
        cfg = self.config
        seed_everything(cfg.train.seed)  # identical model init on every rank
        self.parts = build_task(cfg, self.device)
        # The settings this config asks for, before a restore overwrites them (a forked child, see
        # adopt_child_settings).
        self.fresh_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.parts.optimizer.param_groups]
        self.fresh_base_lrs = list(getattr(self.parts.scheduler, "base_lrs", []))
        if self.rank > 0:  # rank 0 keeps the single-process stream; others get their own (dropout)
            seed_everything(mix_seed(cfg.train.seed, self.rank))
        self.model = self.parts.model
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(
                self.parts.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
        dtype = amp_dtype(cfg, self.device)
        self.amp = dtype is not None
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.amp)
        self.autocast_dtype = dtype or torch.float16  # unused when AMP is off
        if self.amp and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ConfigError("train.amp_dtype = 'bfloat16' but this GPU does not support bfloat16; use float16")
        self.state = TrainState(self.parts, self.scaler, device=self.device)

    def restore(self) -> None:
        """Newest checkpoint that verifies, fits the task and restores; each one passed over is
        recorded and its reason printed.  No checkpoint at all: start from step 0."""
        self.hb.set(phase="load")
        t0 = time.perf_counter()
        for _step, path, reason, loaded in self.store.candidates():
            if loaded is None:
                self.log(f"skipping checkpoint {path.name}: {reason}")
                continue
            ck, parts = loaded
            self.check_fingerprint(ck)
            try:
                self.apply(ck, parts)
            except (ValueError, RuntimeError, KeyError, TypeError) as exc:
                if self.world > 1:
                    raise  # every rank must fall back together; a crash makes the retry do it
                self.store.refuse(ck.path, f"restore failed: {exc}")
                self.log(f"skipping checkpoint {ck.path.name}: restore failed: {exc}")
                self.build()
                continue
            if ck.manifest.get("forked_from"):
                self.adopt_child_settings(ck.manifest["forked_from"])
            dt = time.perf_counter() - t0
            self.log(f"{WorkerSays.RESUMED_FROM} step {ck.step} (checkpoint {ck.path.name}, verified in {dt:.2f} s)")
            append_event(
                self.run_dir,
                Event.RESUMED,
                rank=self.rank,
                step=ck.step,
                checkpoint=ck.path.name,
                digest=ck.digest,
                load_s=round(dt, 4),
                until_step=self.until,
                previous_beat_step=self.previous_beat_step,
                intraop_threads=torch.get_num_threads(),  # another count sums in another order
            )
            return
        parent = (run_info(self.run_dir) or {}).get("parent")
        if parent:  # a child trained from scratch would be another run under the child's name
            raise ConfigError(
                f"run {self.config.run_name} starts from {parent['run']} step {parent['step']}, but no "
                "checkpoint here restores (see the skipped checkpoints above); fork it again"
            )
        self.log(f"{WorkerSays.NO_CHECKPOINT}: starting from step 0")
        append_event(
            self.run_dir,
            Event.STARTED,
            rank=self.rank,
            until_step=self.until,
            previous_beat_step=self.previous_beat_step,
            intraop_threads=torch.get_num_threads(),
        )

    def adopt_child_settings(self, parent: dict[str, Any]) -> None:
        """Restoring the parent checkpoint a child run was forked from (``--from``) brought the
        parent's optimisation settings with its state: take the child's instead (optimizer
        hyper-parameters, and for a LambdaLR the base LR, then the LR at the restored step from
        the child's schedule).  Model, optimizer moments, RNG, data cursor and step stay the
        parent's.  Deterministic, so a resumed child (restoring its own checkpoints, which
        already hold these settings) stays bitwise equal to an uninterrupted one."""
        opt, sched = self.parts.optimizer, self.parts.scheduler
        for group, fresh in zip(opt.param_groups, self.fresh_groups, strict=True):
            group.update(fresh)
        if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
            sched.base_lrs = list(self.fresh_base_lrs)
            lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
            for group, lr in zip(opt.param_groups, lrs, strict=True):
                group["lr"] = lr
            sched._last_lr = lrs  # what get_last_lr() reports
        elif sched is not None:
            self.log(f"scheduler {type(sched).__name__}: the parent's schedule state continues unchanged")
        self.log(f"forked from {parent.get('run')} step {parent.get('step')}: this run's optimizer settings apply")

    def check_fingerprint(self, ck: Any) -> None:
        """Refuse a checkpoint of another trajectory, naming the keys that differ (old → new)
        from what ``run.json`` recorded for the checkpoint's fingerprint."""
        info = run_info(self.run_dir) or {}
        saved = ck.manifest.get("fingerprint")
        if saved in (self.config.fingerprint(), *info.get("accepted_fingerprints", [])):
            return
        old = recorded_trajectories(self.run_dir, info).get(saved)
        raise ConfigError(
            f"checkpoint {ck.path.name} was saved with other trajectory settings: "
            f"{describe_change(old, self.config)}; refusing to resume it under this config; resume with the "
            f"config that saved it, train a new run (`convoy train -S run_name=<new name>`), or accept the "
            f"change (`convoy train --allow-config-change`)"
        )

    def apply(self, ck: Any, parts: dict[str, Any]) -> None:
        """Restore the train state from a loaded checkpoint (every rank, same step)."""
        saved_world = int(ck.manifest.get("world_size", 1))
        has_rng = f"rank-{self.rank}" in parts
        self.state.restore(parts, self.rank, restore_rng_state=has_rng, checkpoint_dir=ck.path)
        if has_rng and self.device.type == "cuda":
            self.log(self.state.rng_note)
        if not has_rng:  # more ranks than when saved: a fresh, deterministic stream for this rank
            seed_everything(mix_seed(self.config.train.seed, self.rank, ck.step))
        distributed.check_same_step(self.state.step)
        self.world_changed = saved_world != self.world
        if self.world_changed and self.rank == 0:
            self.log(f"world size changed {saved_world} -> {self.world}: same global batch and sample position")
            append_event(self.run_dir, Event.WORLD_SIZE_CHANGED, step=ck.step, old=saved_world, new=self.world)

    def train_step(self, micro_batches: list[Any]) -> dict[str, float]:
        """One optimizer step over ``grad_accum_steps`` micro-batches (invariant 4: a kill anywhere
        inside it leaves the last checkpoint, at an optimizer-step boundary, as the resume point).

        Each micro-batch's loss is scaled by 1/accum so the gradient is the mean over the whole
        optimizer batch; DDP skips its all-reduce (``no_sync``) on all but the last micro-batch;
        the AMP scaler unscales, steps and updates once per optimizer step."""
        p, cfg = self.parts, self.config.train
        self.model.train()
        p.optimizer.zero_grad(set_to_none=True)
        if p.train_step is not None:  # the task's own update: convoy keeps state, LR and metrics
            out = self.custom_step(micro_batches[0])
        else:
            out = self.accumulate(micro_batches, cfg.grad_clip)
        out.update(self.learning_rates())
        if p.scheduler is not None:
            p.scheduler.step()
        return out

    def accumulate(self, micro_batches: list[Any], grad_clip: float) -> dict[str, float]:
        p, n = self.parts, len(micro_batches)
        total: torch.Tensor | None = None
        for i, batch in enumerate(micro_batches):
            faults.micro_stall(self.state.step + 1, i + 1)
            batch = to_device(batch, self.device)
            last = i == n - 1
            sync = self.model.no_sync() if self.world > 1 and not last else contextlib.nullcontext()
            with sync:
                with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.amp):
                    loss = p.loss_fn(self.model, batch)
                # n == 1 keeps the unscaled loss: bit for bit the update of runs without accumulation
                self.scaler.scale(loss if n == 1 else loss / n).backward()
            total = loss.detach() if total is None else total + loss.detach()
        assert total is not None
        self.scaler.unscale_(p.optimizer)
        params = [q for q in p.model.parameters() if q.grad is not None]
        max_norm = grad_clip if grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.scaler.step(p.optimizer)
        self.scaler.update()
        mean_loss = float(total) if n == 1 else float(total / n)
        return {"loss": distributed.mean(mean_loss), "grad_norm": float(grad_norm)}

    def custom_step(self, batch: Any) -> dict[str, float]:
        """``TaskParts.train_step``: the task's update for one batch (accumulation is refused)."""
        p = self.parts
        batch = to_device(batch, self.device)
        out = {k: float(v) for k, v in p.train_step(self.model, batch, p.optimizer, self.scaler).items()}
        if "loss" not in out:
            raise ConfigError(f"task = {self.config.task!r}: train_step must return a dict with 'loss'")
        out["loss"] = distributed.mean(out["loss"])
        return out

    def learning_rates(self) -> dict[str, float]:
        """``lr`` (group 0, as always) and, with several parameter groups, ``lr/group-k`` each."""
        groups = self.parts.optimizer.param_groups
        out = {"lr": float(groups[0]["lr"])}
        if len(groups) > 1:
            out.update({f"lr/group-{k}": float(g["lr"]) for k, g in enumerate(groups)})
        return out

    def evaluate(self) -> float:
        """Mean validation loss over the first ``train.eval_samples`` samples, in order.

        Why it leaves the trajectory alone: model.eval() + no_grad (no dropout, no gradients, no
        running-stat updates), its own index order (no sampler, no DataLoader, whose start-up
        draws from the global RNG), every RNG stream saved before and restored after (a loss_fn
        may draw), each sample seeded by its index (augmentation in val_data is the same at every
        eval and on every rank), the training cursor untouched.  Each rank takes every world-th sample of each
        batch; the sums are all-reduced."""
        p, cfg = self.parts, self.config.train
        self.hb.set(phase="eval")
        rng = capture_rng(self.device)
        was_training = p.model.training
        p.model.eval()
        collate = p.collate_fn or default_collate
        total = torch.zeros(2, dtype=torch.float64)
        n = min(cfg.eval_samples, len(p.val_data))  # type: ignore[arg-type]
        try:
            with torch.no_grad():
                for lo in range(0, n, cfg.batch_size):
                    idx = list(range(lo, min(lo + cfg.batch_size, n)))[self.rank :: self.world]
                    if not idx:
                        continue
                    keys = validation_keys(self.config.train.seed, idx)
                    batch = to_device(collate(SeededSamples(p.val_data, p.sample_rngs).__getitems__(keys)), self.device)
                    with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.amp):
                        loss = p.loss_fn(p.model, batch)
                    total += torch.tensor([float(loss) * len(idx), len(idx)], dtype=torch.float64)
        finally:
            p.model.train(was_training)
            restore_rng(rng, self.device)
            self.hb.set(phase="train")
        total = distributed.sum_tensor(total)
        return float(total[0] / total[1])

    def save_due(self, step: int, last_save_step: int, last_save_time: float) -> bool:
        ck = self.config.checkpoint
        if step % self.config.train.chunk_steps == 0:
            return True  # a chunk boundary: a pipelined worker's chunk task waits for this commit
        if self.adaptive is not None:
            if step - last_save_step >= self.adaptive.interval_steps():
                return True
        elif ck.every_steps and step % ck.every_steps == 0:
            return True
        return bool(ck.every_seconds and time.time() - last_save_time >= ck.every_seconds)

    def save(self, blocking: bool) -> float:
        self.hb.set(phase="save")
        shard = self.config.checkpoint.format == "sharded"
        parts = self.state.checkpoint_parts(self.rank, include_replicated=self.rank == 0, sharded=shard)
        extra = {"mlflow_run_id": self.mlflow_run_id} if self.rank == 0 else None
        writer = (
            (lambda tmp: sharded.save_shards(tmp, self.parts.model, self.parts.optimizer, self.rank)) if shard else None
        )
        stall = self.store.save(
            self.state.step, parts, blocking=blocking, extra_manifest=extra, collective_write=writer
        )
        self.hb.set(phase="train")
        if self.rank == 0:
            append_event(
                self.run_dir,
                Event.CHECKPOINT_SAVED,
                step=self.state.step,
                stall_s=round(stall, 5),
                blocking=blocking,
                persist_s=round(self.store.last_persist_s, 5),
            )
        return stall

    def tune_interval(self, stall: float, metrics: StepMetricLogger) -> None:
        """Feed the adaptive interval; record each new choice (event + metric)."""
        if self.adaptive is None:
            return
        old = self.adaptive.interval_steps()
        self.adaptive.observe_save(stall)
        new = self.adaptive.interval_steps()
        if new != old:
            append_event(
                self.run_dir,
                Event.INTERVAL_CHOSEN,
                step=self.state.step,
                interval_steps=new,
                interval_s=self.adaptive.interval_seconds(),
                cost_s=self.adaptive.cost_s,
                step_s=self.adaptive.step_s,
                mtbf_s=self.adaptive.mtbf_s,
            )
            metrics.log_extra(self.state.step, {"ckpt_interval_steps": float(new)})

    def run(self) -> int:
        """Set up, restore, train to ``until`` (saving on the policy's schedule), save, finish."""
        self.setup()
        self.restore()
        st = self.state
        self.resumed_step = st.step
        if st.step >= self.until:
            self.log(f"{WorkerSays.ALREADY_AT} {st.step} >= {self.until}: nothing to train")
            return self.finish(loss=None)
        metrics = self.open_metrics()
        batches = self.batches()
        evaluating = self.evaluating()
        self.hb.set(phase="train", step=st.step)
        last_save, last_save_step = time.time(), st.step
        loss = None
        while st.step < self.until:
            (stop,) = distributed.agree_any(self.preempt.requested)
            if stop:
                return self.emergency_exit(metrics)
            loss = self.take_step(batches, metrics, evaluating)
            (due,) = distributed.agree_any(st.step < self.until and self.save_due(st.step, last_save_step, last_save))
            if due:
                if st.step % self.config.train.chunk_steps == 0:
                    self.await_previous_boundary()
                metrics.flush()  # metrics up to a committed step are durable before the commit
                self.tune_interval(self.save(blocking=False), metrics)
                last_save, last_save_step = time.time(), st.step
        self.await_previous_boundary()  # the final save retires older checkpoints too
        metrics.flush()
        self.save(blocking=True)
        self.attach_tracking(metrics, wait=True)
        metrics.close()
        return self.finish(loss=loss)

    def open_metrics(self) -> StepMetricLogger:
        """Step metrics: ``metrics.jsonl`` at once (rank 0), MLflow once its thread has built it.

        flush_every=1: every step reaches metrics.jsonl (~70 us) so a replay after a kill has the
        pre-failure values to compare with; MLflow batches on its own background thread."""
        local: list[MetricBackend] = [JsonlBackend(RunPaths(self.run_dir).metrics)] if self.rank == 0 else []
        return StepMetricLogger(
            local,
            self.run_dir,
            flush_every=1,
            exact=not self.world_changed,
            deferred=self.tracking is not None or self.tracking_factory is not None,
        )

    def batches(self) -> Iterator[Any]:
        """This rank's micro-batches from the restored cursor on."""
        cfg = self.config
        spec = LoaderSpec(
            cfg.train.batch_size, cfg.train.seed, self.state.cursor, self.rank, self.world, cfg.train.grad_accum_steps
        )
        batches = train_batches(
            self.parts.train_data,
            spec,
            num_workers=cfg.data.num_workers,
            collate_fn=self.parts.collate_fn,
            saved_stream=self.state.stream_saved,
            resumed=self.resumed_step > 0,
            sample_rngs=self.parts.sample_rngs,
        )
        if is_stream(self.parts.train_data):
            self.state.stream = batches  # its position goes into this rank's checkpoint part
        return batches

    def evaluating(self) -> bool:
        """Whether in-loop validation runs (``train.eval_every`` and a task with validation data)."""
        every, val = self.config.train.eval_every, self.parts.val_data
        if every > 0 and (val is None or len(val) == 0):  # type: ignore[arg-type]
            self.log(
                f"train.eval_every = {every} but task {self.config.task!r} has no validation data: "
                "no in-loop validation"
            )
            return False
        return every > 0

    def take_step(self, batches: Iterator[Any], metrics: StepMetricLogger, evaluating: bool) -> float:
        """One optimizer step (with its micro-batches), its metrics and beat; returns the loss."""
        st, cfg = self.state, self.config
        step_samples = cfg.train.batch_size * cfg.train.grad_accum_steps  # one optimizer step, all ranks
        self.store.check()
        t0 = time.perf_counter()
        faults.slow_step(st.step + 1)
        out = self.train_step([next(batches) for _ in range(cfg.train.grad_accum_steps)])
        st.step += 1
        data = self.parts.train_data
        size = None if is_stream(data) else len(data)  # type: ignore[arg-type]
        st.cursor = st.cursor.advance(step_samples, size)
        st.tokens_seen += step_samples * self.parts.tokens_per_sample
        dt = time.perf_counter() - t0
        out.update(step_time_s=dt, tokens_per_s=step_samples * self.parts.tokens_per_sample / dt)
        out.update({"data/epoch": st.cursor.epoch, "data/samples": st.cursor.samples_consumed(step_samples, size)})
        if evaluating and st.step % cfg.train.eval_every == 0:
            t1 = time.perf_counter()
            out.update(val_loss=self.evaluate(), eval_time_s=time.perf_counter() - t1)
        metrics.log(st.step, out)
        self.attach_tracking(metrics, wait=False)
        self.hb.set(step=st.step)
        if st.step == self.resumed_step + 1 and self.rank == 0:  # recovery ends here (MTTR)
            append_event(self.run_dir, Event.FIRST_STEP, step=st.step, step_s=round(dt, 4))
            self.start_tracking()
        if self.adaptive is not None:
            self.adaptive.observe_step(dt, self.store.in_flight)
        return out["loss"]

    def start_tracking(self) -> None:
        """Build the tracking backends on their thread (once).  Called after the first step: the
        MLflow import holds the GIL for ~1.5 s and, started earlier, doubled the restart's first step."""
        if self.tracking_factory is not None:
            self.tracking = TrackingWarmup(self.tracking_factory)
            self.tracking_factory = None

    def attach_tracking(self, metrics: StepMetricLogger, wait: bool) -> None:
        """Hand the tracking backends to the logger once they are ready (``wait``: block for it)."""
        if wait:
            self.start_tracking()  # a run that ends before its first step still logs
        if self.tracking is not None and (wait or self.tracking.done()):
            metrics.attach(*self.tracking.result())
            self.tracking = None

    def await_previous_boundary(self) -> None:
        """Pipelined: before committing the next chunk boundary (or the last step), wait until the
        flow acknowledged the previous boundary (rule 1 of :mod:`training.chunk_boundary`)."""
        if not self.pipelined:
            return
        self.hb.set(phase="save")  # the boundary save starts with the wait (save limits apply)
        wait_for_previous_boundary(
            self.run_dir,
            self.state.step,
            self.config.train.chunk_steps,
            self.resumed_step,
            stop=lambda: self.preempt.requested,
        )

    def emergency_exit(self, metrics: StepMetricLogger) -> int:
        self.log(f"{WorkerSays.SIGTERM}: saving an emergency checkpoint at step {self.state.step}")
        metrics.flush()
        self.save(blocking=True)
        self.attach_tracking(metrics, wait=True)
        metrics.close()
        append_event(self.run_dir, Event.PREEMPTED, rank=self.rank, step=self.state.step)
        self.close_stream()
        self.hb.stop("done")
        distributed.shutdown()
        return EXIT_PREEMPTED

    def close_stream(self) -> None:
        """Stop a stream loader's worker processes before exit (they ignore SIGTERM, so the
        interpreter's exit-time join of a live one would wait forever)."""
        if self.state.stream is not None:
            self.state.stream.close()

    def finish(self, loss: float | None) -> int:
        self.store.wait()
        ck = (self.store.last_committed or self.store.latest_valid(record=False)) if self.rank == 0 else None
        digest = ck.digest if ck else None
        append_event(self.run_dir, Event.WORKER_DONE, rank=self.rank, step=self.state.step, digest=digest, loss=loss)
        self.log(f"{WorkerSays.DONE_AT} {self.state.step} (digest {digest})")
        self.close_stream()
        self.hb.stop("done")
        distributed.shutdown()
        return 0


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


if __name__ == "__main__":
    sys.exit(main())
