"""The plug-in interface: how a user trains *their* model under convoy.

``params.yaml`` names ``task: package.module:factory``.  The factory is called as
``factory(config, device)`` and returns :class:`TaskParts`.  Everything in it must be built
deterministically from ``config`` (convoy seeds every RNG before calling it), because a resumed
worker rebuilds the parts and then overwrites their state from the checkpoint.

:class:`TaskParts` lives in :mod:`training.parts` (a bottom module the checkpoint rooms may name)
and is re-exported here, where users' factories import it from.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from training import sharding
from training.compiling import compile_model, unwrap_compiled
from training.config import ConfigError, DataMissing, RunConfig, resolve_task_factory
from training.datapipe.sample_rng import check_rngs
from training.datapipe.streams import check_stream, is_stream
from training.ema import EMA, WeightEMA
from training.parts import TaskParts

__all__ = ["TaskParts", "build_task", "check_task"]


def build_task(config: RunConfig, device: torch.device) -> TaskParts:
    """Call the configured factory; a bad argument or missing data becomes a ConfigError."""
    try:
        factory = resolve_task_factory(config.task)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    parts = factory(config, device)
    if not isinstance(parts, TaskParts):
        raise ConfigError(f"task = {config.task!r}: factory returned {type(parts).__name__}, not TaskParts")
    if parts.train_step is not None and config.train.grad_accum_steps > 1:
        raise ConfigError(
            f"task = {config.task!r} brings its own train_step, which does the whole update: "
            f"train.grad_accum_steps = {config.train.grad_accum_steps} needs the default step (use 1)"
        )
    parts.model = unwrap_compiled(parts.model)  # a factory's torch.compile: the plain names (rule 1)
    if config.train.compile == "units" and parts.shard_units is None:
        raise ConfigError(
            f"task = {config.task!r}: train.compile = units compiles each of TaskParts.shard_units, which the task "
            "does not name; name them (e.g. its decoder layer class) or use train.compile: model"
        )
    units = sharding.units_of(parts.model, parts.shard_units) if config.train.compile == "units" else []
    compile_model(parts.model, config.train.compile, units)
    attach_extra_state(config, parts)
    try:
        parts.sample_rngs = check_rngs(parts.sample_rngs)
    except ValueError as exc:
        raise ConfigError(f"task = {config.task!r}: TaskParts.{exc}") from None
    check_stream(parts.train_data, "train_data")
    if is_stream(parts.val_data) and config.train.eval_every > 0:
        raise ConfigError(
            f"val_data is a {type(parts.val_data).__name__} (an IterableDataset), but train.eval_every = "
            f"{config.train.eval_every} reads the first train.eval_samples validation samples by index: give a "
            "map-style val_data, or set train.eval_every=0"
        )
    return parts


def attach_extra_state(config: RunConfig, parts: TaskParts) -> None:
    """Check the task's extra state (each object saves and loads a state dict) and add convoy's EMA
    (``train.ema_decay``) to it, as ``"ema"``."""
    for name, obj in parts.extra_state.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(
                f"task = {config.task!r}: TaskParts.extra_state[{name!r}] is a {type(obj).__name__}, which has no "
                "state_dict() and load_state_dict(): give an object with both"
            )
    if config.train.ema_decay is None:
        return
    if EMA in parts.extra_state:
        raise ConfigError(
            f"task = {config.task!r} keeps its own extra_state[{EMA!r}] and train.ema_decay asks convoy for one: "
            "rename the task's, or unset train.ema_decay"
        )
    parts.extra_state[EMA] = WeightEMA(parts.model, config.train.ema_decay)


def unhonoured(config: RunConfig, parts: TaskParts) -> list[str]:
    """One line for each setting this task makes convoy leave unapplied (``convoy validate`` prints
    them, the worker logs them): never silently ignored."""
    lines = []
    if parts.train_step is not None and config.train.grad_clip > 0:
        lines.append(
            f"train.grad_clip = {config.train.grad_clip} is not applied: the task's train_step does the whole "
            "update (clip inside it, or set train.grad_clip: 0 to say so)"
        )
    return lines


def check_task(config: RunConfig, fetch: bool = False, resume_dir: Path | None = None) -> TaskParts | None:
    """Build the task without training it, so ``task_args`` and the factory's own checks fail
    before a run directory exists (``convoy validate``, ``convoy train``, ``open_run``).
    ``fetch``: also fetch and collate the first training batch and one validation batch on the
    CPU (:func:`training.datapipe.preflight.fetch_first_batches`), so a dataset or collate error is a
    one-line config error too; with ``resume_dir`` (the run directory that trains ``config``) a
    stream's saved position there must fit this layout (one line otherwise).

    Built on the meta device: shapes and dtypes without memory for the weights.  A factory that
    cannot build there (e.g. it reads weight values) is built on the CPU instead; anything it
    raises then becomes a one-line ConfigError.  Returns None when the data is not on this
    machine (:class:`DataMissing`, FileNotFoundError): what the factory checked before reading
    it was checked, and the worker, which needs the data, reports it."""
    fsdp = config.train.parallel == "fsdp"
    with sharding.rehearsal_group() if fsdp else contextlib.nullcontext():
        parts = _built_somewhere(config)
        if parts is not None and fsdp:
            try:
                sharding.rehearse(parts, config.train.reshard_after_forward)
            except ValueError as exc:
                raise ConfigError(f"task = {config.task!r}, train.parallel = fsdp: {exc}") from None
    if parts is not None and fetch:  # outside the meta context: samples are read as the worker reads them
        from training.datapipe.preflight import fetch_first_batches

        fetch_first_batches(config, parts, resume_dir)
    return parts


def _built_somewhere(config: RunConfig) -> TaskParts | None:
    """:func:`check_task`'s build: on the meta device, else on the CPU; None without the data.
    With ``train.parallel: fsdp`` it runs inside a one-rank process group
    (:func:`training.sharding.rehearsal_group`), so a factory that shards its model itself takes
    that path here too, on a mesh of one."""
    meta = torch.device("meta")
    for device in (meta, torch.device("cpu")):
        try:
            with device:
                return build_task(config, device)
        except (DataMissing, FileNotFoundError):
            return None
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - not every factory can build on meta; on the CPU it is the factory's
            failure = exc
    raise ConfigError(f"task = {config.task!r}: the factory failed: {type(failure).__name__}: {failure}") from None
