"""What a worker trains with: device, task parts, model, AMP scaler, train state, checkpoint store.

Built in two steps, each once per process, because they have different lifetimes:

* :func:`start_device` picks this rank's device, sets the determinism flags before the first
  CUDA work and joins the process group.  Once: torch allows one process group per process.
* :func:`build_runtime` seeds every RNG, builds the task's parts, wraps the model (DDP), makes the
  AMP scaler and an empty :class:`~training.state.TrainState`.  The result, a frozen
  :class:`Runtime`, is what the restore fills and the loop trains.  A checkpoint that loads but
  cannot be restored may have overwritten part of that state, so the restore falls back with a
  *fresh* runtime (:meth:`Runtime.rebuilt`): nothing of the refused checkpoint leaks into the
  next one.  The checkpoint store is carried over: it remembers what it refused.

A standby worker (``--standby``) builds its runtime while it waits for its order, so the
expensive part of a restart (imports, task build) is done before a failure happens.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from training import distributed, sharding
from training.checkpointing import sharded
from training.checkpointing.memory.memory_tier import MemoryTier
from training.checkpointing.schedule import MemorySchedule, SaveSchedule
from training.checkpointing.state_check import ExpectedState, checkpoint_validator, write_task_shapes
from training.checkpointing.store import CheckpointStore, WriterGroup
from training.compiling import FirstStep
from training.config import ConfigError, RunConfig
from training.datapipe.data import mix_seed
from training.parts import TaskParts
from training.paths import RunPaths
from training.run_memory import open_tier
from training.state import TrainState, configure_determinism, seed_everything
from training.task import build_task


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
    """The autocast dtype, or None when AMP is off.  On CPU autocast runs bfloat16; float16 there
    is refused (a ``device: auto`` run that found no GPU: the config check cannot know)."""
    if not config.train.amp:
        return None
    choice = config.train.amp_dtype
    if device.type == "cpu":
        if choice == "float16":
            raise ConfigError(
                "train.amp_dtype = 'float16' is not honoured on CPU (convoy's CPU autocast runs bfloat16); "
                "use train.amp_dtype: bfloat16 (or auto)"
            )
        return torch.bfloat16
    if choice == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if choice == "bfloat16" else torch.float16


def start_device(config: RunConfig, world_size: int) -> torch.device:
    """This rank's device, made ready: determinism flags (before the first CUDA work), the
    current CUDA device (a bare ``cuda`` and the CUDA RNG calls then mean it), the process group."""
    device = pick_device(config)
    configure_determinism(config.train.deterministic, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    distributed.init(world_size, device)
    return device


T = TypeVar("T")


@dataclass(frozen=True)
class Session:
    """What :meth:`training.worker.Worker.setup` decided for this attempt, beyond the runtime."""

    #: Recorded in each checkpoint's manifest (a clone without ``run.json`` finds the MLflow run).
    mlflow_run_id: str | None
    #: When the loop saves (the adaptive interval, with ``every_steps: auto``, learns as it goes).
    schedule: SaveSchedule
    #: When the loop snapshots into the memory tier (its own interval, ``memory_every_steps``).
    memory: MemorySchedule


def reached(result: T | None, stage: str) -> T:
    """A stage's result, or an error naming the stage that has not run yet."""
    if result is None:
        raise RuntimeError(f"the worker has not reached this yet: {stage}() first")
    return result


@dataclass(frozen=True)
class FreshSettings:
    """The optimisation settings the config asks for, taken before a restore overwrites them
    with the checkpoint's: a forked child run applies its own (:func:`training.loop.restore.adopt_child_settings`)."""

    #: Each optimizer parameter group's hyper-parameters (everything but ``params``).
    groups: list[dict[str, Any]]
    #: The LR scheduler's base learning rates (empty when it has none).
    base_lrs: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Runtime:
    """Everything one rank trains with, built once (see the module docstring).  Frozen: a stage
    that needs another (the restore's fallback) builds a new one instead of patching this."""

    config: RunConfig
    device: torch.device
    rank: int
    world_size: int
    parts: TaskParts
    #: The module the loop calls: ``parts.model`` (sharded in place with ``train.parallel: fsdp``),
    #: or its DDP wrapper with more than one rank.
    model: torch.nn.Module
    scaler: torch.amp.GradScaler
    #: The autocast dtype; None when AMP is off.
    autocast: torch.dtype | None
    #: Step, cursor, RNG: mutable by design (the loop advances it); the object stays this one.
    state: TrainState
    store: CheckpointStore
    fresh: FreshSettings
    #: The memory tier's store (:mod:`training.checkpointing.memory.memory_tier`); None when off.
    memory: MemoryTier | None = None
    #: A compiled model's first step in this worker (:mod:`training.compiling`); None when eager.
    first_compile: FirstStep | None = None

    def compile_phase(self, set_phase: Callable[..., object]) -> contextlib.AbstractContextManager[None]:
        """Around each step: the first of a compiled model in phase ``compile``, the rest as they are."""
        return self.first_compile.phase(set_phase) if self.first_compile is not None else contextlib.nullcontext()

    @property
    def amp(self) -> bool:
        return self.autocast is not None

    @property
    def autocast_dtype(self) -> torch.dtype:
        """What ``torch.autocast`` is given (unused when AMP is off, but it must be a dtype)."""
        return self.autocast or torch.float16

    def save_checkpoint(
        self, blocking: bool, extra: dict[str, Any] | None, tier_failed: Callable[[OSError], None]
    ) -> float:
        """This rank's state into the store (persisted in the background unless ``blocking``;
        sharded: this rank's pieces of model and optimizer with it); returns the loop's stall.

        Persisted in the background with a memory tier, the state is staged in the tier's slot
        and persisted from there (memory tier rule 8: one copy of the state serves both tiers); a
        tier that fails there (``/dev/shm`` full) is told to ``tier_failed`` and the store stages
        its own copy."""
        t0 = time.perf_counter()
        rank, shard = self.rank, self.config.checkpoint.format == "sharded"
        parts = self.state.checkpoint_parts(rank, include_replicated=rank == 0, sharded=shard)
        walked = sharded.flattened(self.parts.model, self.parts.optimizer) if shard else None
        model, optimizer = self.parts.model, self.parts.optimizer
        pieces = sharded.local_shard(model, optimizer, rank, self.world_size, walked) if walked is not None else None
        staged = None
        if self.memory is not None and not (blocking or not self.store.policy.async_save):
            self.store.wait()  # the previous persist has released the slot it read (rule 8)
            try:
                tier_parts = {**parts, **sharded.snapshot_parts(walked)} if walked is not None else parts
                staged = self.memory.stage(self.state.step, tier_parts)
            except OSError as exc:
                tier_failed(exc)
        if staged is not None and pieces is not None:  # the pieces persisted from the slot too
            staged, pieces = sharded.staged_shard(staged, pieces)
        self.store.save(self.state.step, parts, blocking=blocking, extra_manifest=extra, shard=pieces, staged=staged)
        return time.perf_counter() - t0

    def rebuilt(self) -> Runtime:
        """A fresh runtime on the same device with the same store (the restore's fallback)."""
        return build_runtime(self.config, self.device, self.rank, self.world_size, store=self.store, memory=self.memory)


def build_runtime(
    config: RunConfig,
    device: torch.device,
    rank: int,
    world_size: int,
    *,
    run_dir: Path | None = None,
    store: CheckpointStore | None = None,
    memory: MemoryTier | None = None,
) -> Runtime:
    """Seeded task parts, DDP wrapper, AMP scaler, an empty train state and the checkpoint store
    (``store``: the one to keep, else a new one for ``run_dir``, validating against these parts)."""
    if config.train.parallel == "fsdp":  # before the task: a factory that shards itself needs the group
        sharding.ensure_process_group(device)
    seed_everything(config.train.seed)  # identical model init on every rank
    parts = build_task(config, device)
    fresh = FreshSettings(
        groups=[{k: v for k, v in g.items() if k != "params"} for g in parts.optimizer.param_groups],
        base_lrs=list(getattr(parts.scheduler, "base_lrs", [])),
    )
    if rank > 0:  # rank 0 keeps the single-process stream; others get their own (dropout)
        seed_everything(mix_seed(config.train.seed, rank))
    dtype = amp_dtype(config, device)
    if dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train.amp_dtype = 'bfloat16' but this GPU does not support bfloat16; use float16")
    model = parallel_model(config, parts, device, world_size, dtype)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype is not None)
    if store is None:
        assert run_dir is not None, "a new store needs the run directory"
        store = open_store(config, run_dir, parts, rank, world_size)
        memory = open_memory_tier(config, store)
    return Runtime(
        config=config,
        device=device,
        rank=rank,
        world_size=world_size,
        parts=parts,
        model=model,
        scaler=scaler,
        autocast=dtype,
        state=TrainState(parts, scaler, device=device),
        store=store,
        fresh=fresh,
        memory=memory,
        first_compile=FirstStep.for_model(model, store.run_dir, rank),
    )


def parallel_model(
    config: RunConfig, parts: TaskParts, device: torch.device, world_size: int, dtype: torch.dtype | None
) -> torch.nn.Module:
    """The module the loop calls: ``parts.model`` sharded in place (``train.parallel: fsdp``), as
    the factory sharded it, DDP-wrapped (replicated, more than one rank), or as it is."""
    if sharding.is_sharded(parts.model):  # the factory applied FSDP2 / tensor parallel (sharding rule 2)
        if config.checkpoint.format != "sharded":
            raise ConfigError(
                f"task = {config.task!r} returns a sharded model (DTensor parameters): set train.parallel: fsdp "
                "(or checkpoint.format: sharded), since every rank saves its own shards"
            )
        return parts.model
    if config.train.parallel == "fsdp":
        t = config.train
        # CPU: parameters gathered and gradients reduced in fp32 (gloo), autocast computes in bf16.
        gather_dtype = dtype if device.type == "cuda" else None
        try:
            sharding.shard_model(
                parts.model, parts.optimizer, parts.shard_units, device, t.reshard_after_forward, gather_dtype
            )
        except ValueError as exc:
            raise ConfigError(f"task = {config.task!r}, train.parallel = fsdp: {exc}") from None
        return parts.model
    if world_size > 1:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(parts.model, device_ids=[device.index] if device.type == "cuda" else None)
    return parts.model


def open_store(config: RunConfig, run_dir: Path, parts: TaskParts, rank: int, world_size: int) -> CheckpointStore:
    """The run's checkpoint store, as this rank writes and the resume validates (against ``parts``).
    Rank 0 records the shapes it validates against, so ``convoy verify`` checks the same without
    building the task (:mod:`training.checkpointing.state_check`)."""
    expected = ExpectedState.of(parts)
    if rank == 0:
        write_task_shapes(RunPaths(run_dir).task_shapes, expected)
    return CheckpointStore(
        run_dir,
        config.checkpoint,
        config.fingerprint(),
        writers=WriterGroup(world_size, rank, gather_timeout_s=config.heartbeat.save_timeout_s),
        boundary_every=config.train.chunk_steps,
        validator=checkpoint_validator(expected),
    )


def open_memory_tier(config: RunConfig, store: CheckpointStore) -> MemoryTier | None:
    """The memory tier beside ``store`` (this rank, same validation), or None where the run
    keeps none (:func:`training.run_memory.open_tier`)."""
    memory = open_tier(store.run_dir, config, store.rank, store.world_size)
    if memory is not None:
        memory.validator = store.validator
    return memory
