"""What a task hands convoy: :class:`TaskParts` (model, optimizer, scheduler, data, loss...).

Why a module of its own: the parts are the record the whole of training passes around, the
checkpoint rooms included (the memory tier's plan reads the model and the optimizer, the state
check reads their shapes), while :mod:`training.task`, which builds them, reaches for the config,
the streams and the preflight.  Kept at the bottom, with nothing of training above it imported,
the checkpoint rooms can name the parts without importing the run that makes them.  Users import
it as ``training.task.TaskParts`` (re-exported there) or from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from training.datapipe.sample_rng import HOST_RNGS
from training.sharding import ShardUnits


@dataclass
class TaskParts:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    #: Stepped once per optimizer step; its position is the global step.
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    #: A map-style ``Dataset``, or a stream: an ``IterableDataset`` with ``state_dict()`` and
    #: ``load_state_dict()`` (an endless one, sharded by rank and loader worker; see
    #: :mod:`training.datapipe.streams`).  Each sample is fetched with python, numpy and torch's CPU
    #: generator seeded by its place in the run (:mod:`training.datapipe.sample_rng`).
    train_data: Dataset
    #: ``loss_fn(model, batch) -> scalar loss``: ``batch`` is what the DataLoader yields (after
    #: ``collate_fn``) with every tensor moved to the device, whatever its structure: a tensor, a
    #: tuple/list, a dict such as ``{"input_ids", "attention_mask", "labels"}``, or a nesting of
    #: those (:mod:`training.datapipe.batch`).  With gradient accumulation it is called once per
    #: micro-batch and must return the micro-batch's mean loss; convoy scales it.
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    val_data: Dataset | None = None
    #: Tokens per sample, for the tokens-seen counter and tokens/s.
    tokens_per_sample: int = 1
    #: Builds a batch from a list of samples (DataLoader's ``collate_fn``); None = PyTorch's
    #: default, which stacks tensors inside tuples, lists and dicts alike.  Used for the
    #: validation batches too.  Must be deterministic and must not draw from the global RNG.
    collate_fn: Callable[[list[Any]], Any] | None = None
    #: Escape hatch for updates the default step does not cover (two optimizers, custom
    #: clipping): ``train_step(model, batch, optimizer, scaler) -> metrics`` does the whole
    #: update (zero_grad, backward, optimizer step) for one batch on the device and returns at
    #: least ``{"loss": float}``.  convoy still owns the state, cursor, LR scheduler (stepped
    #: after it), checkpoints and metrics.  Not combinable with ``train.grad_accum_steps`` > 1.
    train_step: Callable[[torch.nn.Module, Any, torch.optim.Optimizer, Any], dict[str, float]] | None = None
    #: The host generators a sample's fetch draws from, each seeded per sample: any of
    #: ``"torch"`` (CPU), ``"numpy"``, ``"python"``.  All three by default; a task whose
    #: ``__getitem__`` draws only from torch (torchvision-style transforms) may name just
    #: ``("torch",)`` (the default already seeds numpy and python only for samples that draw
    #: from them, :mod:`training.datapipe.sample_rng`).  A generator left out is
    #: seeded once per loader worker only: drawing from it makes samples depend on the worker.
    sample_rngs: tuple[str, ...] = HOST_RNGS
    #: With ``train.parallel: fsdp``, the units FSDP2 shards before the root: module classes (e.g.
    #: ``(DecoderLayer,)``: every submodule of one of them) or ``fn(model) -> modules``.  None: the
    #: root alone (one all-gather of the whole model per forward: fine for small models, the peak
    #: memory of an unsharded one).  A factory that shards the model itself leaves it None
    #: (:mod:`training.sharding`).
    shard_units: ShardUnits | None = None
    #: State of the task's own that the next update depends on (an EMA, a curriculum, a loss
    #: scale of its own...): name -> object with ``state_dict()`` and ``load_state_dict(sd)``.
    #: Saved in every checkpoint (rank 0's, the ``state`` part under ``extra``), hashed with it and
    #: restored bitwise before training continues; a checkpoint without one of these names does not
    #: restore this task.  The state dicts hold tensors, numbers, strings, lists and dicts (no
    #: DTensors: with ``train.parallel: fsdp`` keep full tensors).  ``train.ema_decay`` adds ``"ema"``.
    extra_state: dict[str, Any] = field(default_factory=dict)
