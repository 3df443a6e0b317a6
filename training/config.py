"""Validated configuration for a convoy run (``params.yaml`` → :class:`RunConfig`).

Every input goes through pydantic with ``extra='forbid'`` so a typo is an error rather than a
silently ignored setting.  :func:`load_config` is the single entry point: it reads the YAML,
applies ``-S section.key=value`` overrides and returns a validated model or raises
:class:`ConfigError` whose message is one line naming the key, the value and what is allowed.

The *fingerprint* covers only the settings that change the training trajectory (task, data,
model arguments, optimisation hyper-parameters, seed, global batch), each marked
``Annotated[<type>, Trajectory(...)]`` where it is declared (:mod:`training.trajectory`: opt-in, so a
new setting never changes an existing run's fingerprint unless it is marked).  Chunking, checkpoint
cadence, heartbeat limits, retries and tracking are not marked, so they may change between resumes.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from training.config_text import (
    CPU_FLOAT16,
    EMA_FSDP,
    ConfigError,
    apply_overrides,
    format_validation_error,
    yaml_error_line,
)
from training.trajectory import Trajectory, trajectory_of

#: ConfigError and format_validation_error live in training.config_text; tasks import them from here.
__all__ = ["ConfigError", "DataMissing", "RunConfig", "config_from_dict", "format_validation_error", "load_config"]


class DataMissing(ConfigError):
    """The task's data is not on this machine (not prepared yet, or it lives on the GPU nodes).

    Raised by task factories; a check before the run (``check_task``) tolerates it, the worker,
    which needs the data, does not."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


#: Version of the synthetic corpus generator (``training/datapipe/corpus.py``), part of the fingerprint of a
#: synthetic run: a run trained on the old corpus is not resumed on a regenerated, different one.
SYNTHETIC_GENERATOR = 2


class DataConfig(_Strict):
    """Where the corpus comes from and how it is cut into samples."""

    source: Annotated[Literal["synthetic", "file"], Trajectory()] = "synthetic"
    #: With ``source: file``: the local text file to train on (must exist); hashed as written.
    path: Annotated[str | None, Trajectory()] = None
    #: Where ``convoy prepare`` writes the prepared corpus (relative to the working directory).
    prepared_dir: str = "data"
    #: Characters of synthetic text to generate.
    synthetic_chars: Annotated[int, Trajectory()] = Field(400_000, gt=1000)
    #: Fraction of the corpus held out for validation.
    val_fraction: Annotated[float, Trajectory()] = Field(0.05, gt=0, lt=0.5)
    #: Tokens per training sample (the model sees seq_len inputs and predicts seq_len targets).
    seq_len: Annotated[int, Trajectory()] = Field(64, gt=1)
    #: DataLoader worker processes (0 = load in the training process).  Not in the trajectory:
    #: every sample is seeded by its position (invariant 9).
    num_workers: int = Field(0, ge=0, le=32)

    def derived_trajectory(self) -> dict[str, Any]:
        """The synthetic corpus's generator version: another generator is another corpus, and a
        run is never resumed on it."""
        return {"generator": SYNTHETIC_GENERATOR} if self.source == "synthetic" else {}

    @model_validator(mode="after")
    def _file_needs_path(self) -> DataConfig:
        if self.source == "file":
            if not self.path:
                raise ValueError("data.source 'file' needs data.path (a local text file)")
            if not Path(self.path).is_file():
                raise ValueError(f"data.path = {self.path!r}: file not found")
        return self


class TrainConfig(_Strict):
    """Optimisation settings; those marked ``Trajectory`` are part of the run's fingerprint.

    Not marked: chunking, evaluation and the world size's layout (``ranks``, ``nnodes``, ``hosts``:
    the global batch and the per-sample seeding put the same samples, with the same augmentation,
    in every global batch at any world size; a resume on another world size then differs only by
    the floating-point order of the gradient sum, ~1e-7 in loss, and, with dropout, by the masks
    each rank draws; a stream positioned per shard is refused, see ``training.datapipe.stream_position``)."""

    total_steps: Annotated[int, Trajectory()] = Field(600, gt=0)
    #: Steps per Prefect chunk task; a failure re-runs only the chunk it happened in.
    chunk_steps: int = Field(200, gt=0)
    #: Global batch in samples, split evenly over ranks.
    batch_size: Annotated[int, Trajectory()] = Field(16, gt=0)
    lr: Annotated[float, Trajectory()] = Field(3e-3, gt=0)
    weight_decay: Annotated[float, Trajectory()] = Field(0.01, ge=0)
    warmup_steps: Annotated[int, Trajectory()] = Field(20, ge=0)
    grad_clip: Annotated[float, Trajectory()] = Field(1.0, ge=0)
    seed: Annotated[int, Trajectory()] = Field(1234, ge=0)
    device: Annotated[Literal["cpu", "cuda", "auto"], Trajectory()] = "cpu"
    #: Mixed precision: ``torch.autocast`` on the run's device (CUDA: float16 or bfloat16; CPU:
    #: bfloat16); a GradScaler is part of the saved state.
    amp: Annotated[bool, Trajectory()] = False
    #: Autocast dtype with ``amp``: ``auto`` = bfloat16 on CPU and where the GPU supports it, else
    #: float16 (refused on CPU: its autocast is bfloat16 here).
    #: float16 uses the GradScaler's dynamic loss scale; bfloat16 needs none (the scaler still runs).
    #: Hashed only with AMP on and a dtype chosen: every fingerprint from before it existed stays valid.
    amp_dtype: Annotated[Literal["auto", "float16", "bfloat16"], Trajectory(omit_at="auto", only_with="amp")] = "auto"
    #: torch.use_deterministic_algorithms + cuDNN deterministic (needed for bitwise CUDA resume).
    deterministic: Annotated[bool, Trajectory()] = True
    #: Ranks per node (>1, or ``nnodes`` > 1, launches torchrun).
    ranks: int = Field(1, ge=1, le=64)
    #: Nodes per chunk; the world size is ``ranks * nnodes``.  More than one needs ``hosts``.
    nnodes: int = Field(1, ge=1, le=1024)
    #: One host name per node, node 0 first: node 0 is the machine that runs the chunk task and
    #: hosts the c10d rendezvous; the others are started through ``orchestration.node_launch``
    #: (``localhost``/``127.0.0.1`` entries are started here directly).
    hosts: list[str] = Field(default_factory=list)
    #: Micro-batches per optimizer step (gradient accumulation).  ``batch_size`` is the global
    #: micro-batch (split over ranks), so one optimizer step sees ``batch_size * grad_accum_steps``
    #: samples = micro-batch per rank x accumulation x world size.  Each micro-batch's loss is
    #: scaled by 1/grad_accum_steps; checkpoints fall only on optimizer-step boundaries.
    #: Left out of the fingerprint at 1, so every fingerprint from before it existed stays valid.
    grad_accum_steps: Annotated[int, Trajectory(omit_at=1)] = Field(1, ge=1, le=4096)
    #: How more than one rank trains: ``ddp`` replicates the model (DistributedDataParallel);
    #: ``fsdp`` shards parameters, gradients and optimizer state with FSDP2 (``fully_shard`` on each
    #: of ``TaskParts.shard_units``, then the root; :mod:`training.sharding`), which needs
    #: ``checkpoint.format: sharded`` (chosen for you when the format is not set).  Hashed only at
    #: ``fsdp``: every fingerprint from before it existed stays valid.
    parallel: Annotated[Literal["ddp", "fsdp"], Trajectory(omit_at="ddp")] = "ddp"
    #: With ``fsdp``: free each unit's gathered parameters after its forward (less memory, one more
    #: all-gather in the backward); FSDP2's ``reshard_after_forward``.
    reshard_after_forward: bool = True
    #: An EMA of the weights with this decay (e.g. 0.999), saved and restored bitwise, ``val_loss_ema``
    #: at each eval (:mod:`training.ema`); ``ema_registered: ema`` registers it as the model.
    ema_decay: Annotated[float | None, Trajectory(omit_at=None)] = Field(None, gt=0, lt=1)
    ema_registered: Literal["model", "ema"] = "model"
    #: ``torch.compile``: ``model`` (the whole call) or ``units`` (each of ``TaskParts.shard_units``),
    #: in place: checkpoints keep the plain names (:mod:`training.compiling`).
    compile: Annotated[Literal["off", "model", "units"], Trajectory(omit_at="off")] = "off"
    #: A loss that is not finite (NaN, inf) ``nonfinite_steps`` optimizer steps in a row: ``stop``
    #: ends the run in one line (no checkpoint of those steps is written), or, within that many
    #: steps of a resume, refuses the checkpoint resumed from and retries from the one before it
    #: (:mod:`training.loop.nonfinite`); ``continue`` trains on.
    on_nonfinite: Literal["stop", "continue"] = "stop"
    nonfinite_steps: int = Field(3, ge=1)
    #: Evaluate on the validation split every this many optimizer steps (0 = never); ``val_loss``
    #: is logged at that step.  Does not change the trajectory (own data order, RNG untouched).
    eval_every: int = Field(0, ge=0)
    #: Validation samples per evaluation: the first this many of the validation split, in order
    #: (fewer if the split is smaller), in batches of ``batch_size``.
    eval_samples: int = Field(256, gt=0)

    @model_validator(mode="after")
    def _chunk_fits(self) -> TrainConfig:
        if self.chunk_steps > self.total_steps:
            raise ValueError(
                f"train.chunk_steps = {self.chunk_steps} is larger than train.total_steps = "
                f"{self.total_steps}; use a chunk of at most total_steps"
            )
        if self.batch_size % self.world_size:
            raise ValueError(
                f"train.batch_size = {self.batch_size} is not divisible by the world size "
                f"{self.world_size} (train.ranks = {self.ranks} x train.nnodes = {self.nnodes}); "
                "the global batch is split evenly over ranks"
            )
        if self.amp and self.amp_dtype == "float16" and self.device == "cpu":
            raise ValueError(CPU_FLOAT16)
        if self.ema_decay is not None and self.parallel == "fsdp":
            raise ValueError(EMA_FSDP)
        if self.nnodes > 1 and len(self.hosts) != self.nnodes:
            raise ValueError(
                f"train.hosts = {self.hosts}: train.nnodes = {self.nnodes} needs exactly {self.nnodes} host "
                "names, node 0 (the machine running the chunk task) first"
            )
        return self

    @property
    def world_size(self) -> int:
        return self.ranks * self.nnodes


class CheckpointConfig(_Strict):
    """When to save and what to keep.  Never part of the fingerprint."""

    @field_validator("every_steps", "memory_every_steps")
    @classmethod
    def _positive(cls, v: int | str | None, info: Any) -> int | str | None:
        if isinstance(v, int) and v <= 0:
            raise ValueError(f"checkpoint.{info.field_name} = {v}: must be a positive number of steps, auto, or null")
        return v

    #: Save every N steps, or ``auto`` (interval from measured save cost and MTBF), or null.
    every_steps: int | Literal["auto"] | None = Field(50)
    #: For ``auto``: MTBF assumed until failures are observed, and the overhead budget.
    mtbf_hours: float = Field(24.0, gt=0)
    max_overhead: float = Field(0.02, gt=0, lt=1)
    every_seconds: float | None = Field(None, gt=0)
    #: Save asynchronously (snapshot into reused buffers, persist on a background thread).
    async_save: bool = True
    #: ``replicated``: rank 0 writes model + optimizer (DDP).  ``sharded``: every rank writes its
    #: pieces in torch.distributed.checkpoint's layout (FSDP-style state, re-sharded on load),
    #: asynchronously like every save.
    format: Literal["replicated", "sharded"] = "replicated"
    keep_last: int = Field(3, ge=1)
    #: Also keep every checkpoint whose step is a multiple of this (0 = off).
    keep_every: int = Field(0, ge=0)
    #: Byte cap over all checkpoints (0 = no cap); the newest verified one is always kept.
    max_bytes: int = Field(0, ge=0)
    #: The memory tier (``training.checkpointing.memory.memory_tier``): snapshot the state into RAM
    #: (``/dev/shm``) every N steps, restored after a kill when newer than the disk tier; ``auto``:
    #: Young/Daly with the snapshot's measured cost and the run's MTBF, held between
    #: ``memory_min_overhead`` and ``memory_max_overhead`` of the step time; null: off.  Never
    #: durable, never "the last verified checkpoint".
    memory_every_steps: int | Literal["auto"] | None = Field("auto")
    #: For ``memory_every_steps: auto``: the most of the step time the snapshots may cost (when
    #: failures are frequent) ...
    memory_max_overhead: float = Field(0.03, gt=0, lt=1)
    #: ... and the least they cost (when failures are rare: a kill still loses only a few steps).
    memory_min_overhead: float = Field(0.005, gt=0, lt=1)
    #: Copy a snapshot of a state in host memory beside the next step's forward and backward, and
    #: commit it before that step's optimizer step (less stall; the newest snapshot is held by
    #: one slot until then), where the process has a CPU its torch threads leave free; false:
    #: copy and commit on the loop's thread, so both slots hold a committed snapshot between two
    #: snapshots (a corrupt newest one falls back to the older).
    memory_beside: bool = True
    #: A memory tier not resumed for this long (no slot written, no worker's beat) is freed by the
    #: next flow started on the machine (``training.memory_sweep``), as is one whose run directory
    #: is gone; ``convoy snapshots`` lists them.  The run still resumes from its disk checkpoints.
    #: Slots per rank in the memory tier: 1 holds the state once, and the async save persists from
    #: it (one copy of the state beside the live one); 2 keep the older snapshot committed while
    #: the newer is written or persisted (a kill then always finds one), at a second copy.
    memory_slots: int = Field(1, ge=1, le=2)
    memory_keep_hours: float = Field(24.0, gt=0)
    #: The share of the host memory offered (``host_memory_gb``, else the cgroup's room or
    #: MemAvailable) that convoy's projected peak may take; above it convoy gives up, in this order,
    #: the memory tier and the async save's staging copy, one line each (``training.memory_budget``),
    #: and it refuses a run projected over all of it even then.
    host_memory_share: float = Field(0.85, gt=0, le=1)
    #: The host memory to plan against, in GB; null: this machine's.
    host_memory_gb: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _overhead_band(self) -> CheckpointConfig:
        if self.memory_min_overhead > self.memory_max_overhead:
            raise ValueError(
                f"checkpoint.memory_min_overhead = {self.memory_min_overhead} is above memory_max_overhead = "
                f"{self.memory_max_overhead}: the least the snapshots cost cannot exceed the most"
            )
        return self


class HeartbeatConfig(_Strict):
    """Liveness contract between worker and supervisor (seconds)."""

    interval_s: float = Field(0.5, gt=0)
    #: No step progress for this long in phase ``train`` = hang.
    stall_s: float = Field(20.0, gt=0)
    #: No heartbeat at all for this long = dead.
    timeout_s: float = Field(10.0, gt=0)
    #: Phase limits for start-up (import, init, restore) and saving.
    init_timeout_s: float = Field(120.0, gt=0)
    save_timeout_s: float = Field(120.0, gt=0)
    #: Limit for one in-loop validation (phase ``eval``, ``train.eval_every``): a long eval is not
    #: a hang, an eval stuck past this is.
    eval_timeout_s: float = Field(300.0, gt=0)
    #: Limit for a compiled model's first step in each worker (phase ``compile``), where it compiles.
    compile_timeout_s: float = Field(900.0, gt=0)
    #: SIGTERM → SIGKILL grace period when the supervisor stops a worker.
    grace_s: float = Field(10.0, gt=0)


class OrchestrationConfig(_Strict):
    """How chunks are run and retried by Prefect."""

    mode: Literal["local", "pool"] = "local"
    retries: int = Field(3, ge=0)
    retry_delay_seconds: float = Field(1.0, ge=0)
    backoff: float = Field(2.0, ge=1)
    jitter: float = Field(0.1, ge=0, le=1)
    #: Wall-clock limit for one chunk attempt (0 = none).
    chunk_deadline_s: float = Field(0, ge=0)
    #: Work pool that chunk flow runs go to in ``mode: pool``.
    pool: str = "gpu"
    #: Tag used for the per-GPU-slot concurrency limit in pool mode.
    concurrency_tag: str = "gpu"
    #: Local mode: one worker trains through the chunk boundaries (each one a committed checkpoint
    #: that ends its chunk task) instead of a new worker per chunk; after a failure the retry
    #: starts a fresh worker from the newest verified checkpoint.  Saves ~5 s of start-up a chunk.
    pipeline: bool = True
    #: Local mode, one rank: keep a warm standby worker (started, torch imported, task built,
    #: tracking connected) that takes over at once when the worker fails.  Costs one more
    #: process with the model and optimizer built (host memory), idle while it waits.
    standby: bool = False
    #: Local mode, one rank: a per-run zygote (``training.zygote``: torch and the task's modules
    #: imported, nothing computed) forks every worker and standby in milliseconds instead of
    #: starting a new interpreter (~2.5 s on the demo) at the first start and at every recovery.
    zygote: bool = True
    #: How a node other than this machine is started (``train.hosts``): a command prefix, ``{host}``
    #: replaced by the host name, followed by one shell command (cd + torchrun).  ``-tt`` makes
    #: sshd hang up the remote torchrun when the supervisor stops the local ssh client.
    node_launch: str = "ssh -tt -o BatchMode=yes {host}"


class TrackingConfig(_Strict):
    """MLflow tracking and DVC versioning."""

    #: Record the run in its tracking backend (``backend``); false records nothing there (the
    #: run's own files, ``audit/`` included, are written either way).  Named when MLflow was the
    #: only backend.
    mlflow: bool = True
    #: The tracking backend: the module ``tasks/records/<backend>_tracker.py`` whose tracker records
    #: the run (:class:`tasks.records.tracker.Tracker`); ``mlflow`` is the one there is.
    backend: str = Field("mlflow", pattern=r"^[a-z][a-z0-9_]*$")
    #: Tracking URI; empty = $MLFLOW_TRACKING_URI or sqlite:///mlflow.db in the working directory.
    mlflow_uri: str = ""
    #: Where the MLflow UI of a local store (sqlite:/file) is served, for the links convoy prints;
    #: empty = ``mlflow ui``'s default, http://127.0.0.1:5000.  A server URI is its own UI.
    mlflow_ui_url: str = ""
    experiment: str = "convoy"
    #: MLflow's own system metrics (CPU, memory, disk, network, GPU) every this many seconds
    #: while a chunk trains; 0 = off.
    system_metrics_s: float = Field(5.0, ge=0)
    #: How long the flow waits at the run's end for MLflow to take the metrics not yet sent (the
    #: worker never sends them itself: the run's one shipper in the flow process follows
    #: ``metrics.jsonl`` from the first chunk to the last, so no chunk end waits for it).
    ship_drain_s: float = Field(60.0, ge=0)
    #: Log the final model (safetensors + config, nothing pickled) as an MLflow logged model...
    log_model: bool = True
    #: ...and register it as a version of the registered model named after the run.
    register_model: bool = True
    #: Upload committed checkpoints to the DVC remote in the background (each chunk boundary, and
    #: the newest one whenever the uploader is free) and fetch the remote's newest one before a
    #: resume: a run continues on any machine (invariant 10; ``tasks/remote/remote_checkpoints.py``).
    dvc: bool = False
    dvc_remote: str = ""


class InitFrom(_Strict):
    """The parent checkpoint a run starts from (``convoy train --from runs/<parent>[@step]``)."""

    #: The parent's run directory; only its name is hashed, so moving ``runs_dir`` keeps the child.
    run: Annotated[str, Trajectory(hashed_as=lambda run: Path(run).name)]
    step: Annotated[int, Trajectory()] = Field(ge=0)
    #: The parent checkpoint's whole-state digest: the child's identity names the exact state.
    digest: Annotated[str, Trajectory()]


class RunConfig(_Strict):
    """The whole ``params.yaml``."""

    #: Name of the run directory under ``runs_dir``.  ``name@<8 hex>`` is the directory of one
    #: config of run ``name`` under ``on_config_change: new_run`` (see :mod:`training.rundir`).
    run_name: str = Field("demo", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*(@[0-9a-f]{8})?$")
    runs_dir: str = "runs"
    #: What a changed trajectory setting does to run ``run_name``.  ``refuse``: one directory
    #: ``runs/<run_name>``; a config with another fingerprint is refused (naming the keys).
    #: ``new_run``: each config trains in its own ``runs/<run_name>@<fingerprint[:8]>``, and
    #: ``runs/<run_name>`` is a symbolic link to the one trained last; the same params again
    #: resume (or reuse) the run that has them.  ``refuse`` by default: existing runs keep their
    #: directory; the project's ``params.yaml`` (what ``dvc repro`` reads) sets ``new_run``.
    on_config_change: Literal["refuse", "new_run"] = "refuse"
    #: Start from this checkpoint of another run instead of from scratch (set by ``--from``).
    #: Absent from the fingerprint of a run from scratch: every fingerprint from before stays valid.
    init_from: Annotated[InitFrom | None, Trajectory(omit_at=None)] = None
    #: ``package.module:factory`` returning a :class:`training.task.TaskParts`.
    task: Annotated[str, Trajectory()] = Field("training.examples.char_gpt:build", pattern=r"^[\w.]+:\w+$")
    #: Keyword arguments for the task factory (validated by the task itself).
    task_args: Annotated[dict[str, Any], Trajectory()] = Field(default_factory=dict)
    data: Annotated[DataConfig, Trajectory()] = Field(default_factory=DataConfig)
    train: Annotated[TrainConfig, Trajectory()] = Field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    heartbeat: HeartbeatConfig = Field(default_factory=HeartbeatConfig)
    orchestration: OrchestrationConfig = Field(default_factory=OrchestrationConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @model_validator(mode="before")
    @classmethod
    def _sharded_for_fsdp(cls, data: Any) -> Any:
        """``train.parallel: fsdp`` picks ``checkpoint.format: sharded`` where the format is not set."""
        if isinstance(data, dict) and isinstance(data.get("train"), dict) and data["train"].get("parallel") == "fsdp":
            checkpoint = data.get("checkpoint")
            if checkpoint is None or (isinstance(checkpoint, dict) and "format" not in checkpoint):
                data = {**data, "checkpoint": {**(checkpoint or {}), "format": "sharded"}}
        return data

    @model_validator(mode="after")
    def _fsdp_writes_shards(self) -> RunConfig:
        if self.train.parallel == "fsdp" and self.checkpoint.format != "sharded":
            raise ValueError(
                "train.parallel = fsdp with checkpoint.format = replicated: a sharded model is saved by every "
                "rank; set checkpoint.format: sharded (or leave it out)"
            )
        return self

    @model_validator(mode="after")
    def _task_importable(self, info: ValidationInfo) -> RunConfig:
        if (info.context or {}).get("check_task", True):
            resolve_task_factory(self.task)
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.run_name

    def trajectory(self) -> dict[str, Any]:
        """The settings marked ``Trajectory`` (what :meth:`fingerprint` hashes), as plain JSON
        values: kept in ``run.json`` so a refusal can name the keys that changed."""
        return trajectory_of(self)

    def fingerprint(self) -> str:
        """Hash of the settings that change the trajectory; see the module docstring."""
        blob = json.dumps(self.trajectory(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def resolve_task_factory(spec: str) -> Any:
    """Import ``package.module:factory``; a ValueError names what could not be found."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == module_name.split(".")[0]
        hint = f"; is the folder holding {exc.name!r} on PYTHONPATH (e.g. export PYTHONPATH=$PWD)?" if missing else ""
        raise ValueError(f"task = {spec!r}: cannot import module {module_name!r} ({exc}){hint}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"task = {spec!r}: module {module_name!r} has no callable {attr!r}")
    return factory


def config_from_dict(data: dict[str, Any], source: str = "config", check_task: bool = True) -> RunConfig:
    """Validate ``data``; ``check_task=False`` skips importing the task's module (a recorded
    config read by a command that never builds the task: importing it would cost ``import torch``)."""
    try:
        return RunConfig.model_validate(data, context={"check_task": check_task})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def load_config(
    path: str | Path | None = "params.yaml", overrides: list[str] | None = None, check_task: bool = True
) -> RunConfig:
    """Read ``path`` (``None`` or missing default = built-in defaults), apply overrides, validate
    (``check_task=False``: without importing the task's module, for a caller that only needs
    where the run lives, e.g. a failure hook in a Prefect worker that has no torch imported)."""
    data: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if p.exists():
            source = str(p)
            try:
                loaded = yaml.safe_load(p.read_text()) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(yaml_error_line(p, exc)) from None
            if not isinstance(loaded, dict):
                raise ConfigError(f"{p}: expected a mapping of sections, got {type(loaded).__name__}")
            data = loaded
        elif str(path) != "params.yaml":
            raise ConfigError(f"{p}: params file not found")
    data = apply_overrides(data, overrides or [])
    return config_from_dict(data, source, check_task=check_task)
