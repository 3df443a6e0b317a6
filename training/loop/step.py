"""The math of one optimizer step and of in-loop validation, on a :class:`~training.loop.runtime.Runtime`,
and the micro-batches the steps take.

No heartbeat, no checkpoint, no metrics logger here: the worker (:mod:`training.worker`) owns
those and calls these functions.  Kept apart so the update itself can be read (and measured,
``bench/loop_overhead.py``) without the loop around it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import default_collate

from training import distributed, faults, sharding
from training.config import ConfigError
from training.datapipe.batch import to_device
from training.datapipe.data import LoaderSpec, validation_keys
from training.datapipe.sample_rng import SeededSamples
from training.datapipe.streams import is_stream, train_batches
from training.ema import EMA, WeightEMA
from training.loop.runtime import Runtime
from training.state import capture_rng, restore_rng


def _nothing() -> None:
    return None


def train_step(
    runtime: Runtime,
    micro_batches: list[Any],
    before_update: Callable[[], object] = _nothing,
    before_backward: Callable[[], object] = _nothing,
) -> dict[str, float]:
    """One optimizer step over ``grad_accum_steps`` micro-batches (invariant 4: a kill anywhere
    inside it leaves the last checkpoint, at an optimizer-step boundary, as the resume point).

    Each micro-batch's loss is scaled by 1/accum so the gradient is the mean over the whole
    optimizer batch; DDP (``no_sync``) and FSDP2 (``set_requires_gradient_sync``) skip their
    gradient reduction on all but the last micro-batch (:func:`training.sharding.gradient_sync`);
    the AMP scaler unscales, steps and updates once per optimizer step.  ``before_update`` runs
    just before the first change to parameters, optimizer state, scaler or LR schedule (before
    a task's own update, which makes them itself): the memory tier commits a snapshot there.
    ``before_backward`` runs just before the first backward (not with a task's own update): a
    snapshot copied beside the loop starts there, where the loop holds no interpreter lock."""
    parts = runtime.parts
    runtime.model.train()
    parts.optimizer.zero_grad(set_to_none=True)
    if parts.train_step is not None:  # the task's own update: convoy keeps state, LR and metrics
        before_update()
        out = custom_step(runtime, micro_batches[0])
    else:
        out = accumulate(runtime, micro_batches, runtime.config.train.grad_clip, before_update, before_backward)
    ema = parts.extra_state.get(EMA)
    if isinstance(ema, WeightEMA):  # after the optimizer step (training.ema rule 1)
        ema.update()
    out.update(learning_rates(runtime))
    if parts.scheduler is not None:
        parts.scheduler.step()
    faults.poison_weights(runtime.state.step + 1, runtime.model)
    return out


def accumulate(
    runtime: Runtime,
    micro_batches: list[Any],
    grad_clip: float,
    before_update: Callable[[], object] = _nothing,
    before_backward: Callable[[], object] = _nothing,
) -> dict[str, float]:
    """Backward over each micro-batch, then one clipped, scaled optimizer step."""
    parts, scaler, n = runtime.parts, runtime.scaler, len(micro_batches)
    total: torch.Tensor | None = None
    for i, batch in enumerate(micro_batches):
        faults.micro_stall(runtime.state.step + 1, i + 1)
        batch = to_device(batch, runtime.device)
        last = i == n - 1
        with sharding.gradient_sync(runtime.model, on=last or runtime.world_size == 1):
            with torch.autocast(runtime.device.type, dtype=runtime.autocast_dtype, enabled=runtime.amp):
                loss = parts.loss_fn(runtime.model, batch)
            if i == 0:
                before_backward()
            # n == 1 keeps the unscaled loss: bit for bit the update of runs without accumulation
            scaler.scale(loss if n == 1 else loss / n).backward()
        total = loss.detach() if total is None else total + loss.detach()
    assert total is not None
    scaler.unscale_(parts.optimizer)
    params = [q for q in parts.model.parameters() if q.grad is not None]
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    before_update()  # gradients only, so far
    scaler.step(parts.optimizer)
    scaler.update()
    mean_loss = float(total) if n == 1 else float(total / n)
    return {"loss": distributed.mean(mean_loss), "grad_norm": sharding.norm_value(grad_norm)}


def custom_step(runtime: Runtime, batch: Any) -> dict[str, float]:
    """``TaskParts.train_step``: the task's update for one batch (accumulation is refused)."""
    parts = runtime.parts
    assert parts.train_step is not None
    batch = to_device(batch, runtime.device)
    out = {k: float(v) for k, v in parts.train_step(runtime.model, batch, parts.optimizer, runtime.scaler).items()}
    if "loss" not in out:
        raise ConfigError(f"task = {runtime.config.task!r}: train_step must return a dict with 'loss'")
    out["loss"] = distributed.mean(out["loss"])
    return out


def throughput(samples: int, tokens_per_sample: int, seconds: float) -> dict[str, float]:
    """``samples_per_s``, and ``tokens_per_s`` for a task that counts tokens (``tokens_per_sample``
    above 1): a task without tokens is not shown a tokens rate that is its samples rate."""
    out = {"samples_per_s": samples / seconds}
    if tokens_per_sample > 1:
        out["tokens_per_s"] = samples * tokens_per_sample / seconds
    return out


def learning_rates(runtime: Runtime) -> dict[str, float]:
    """``lr`` (group 0, as always) and, with several parameter groups, ``lr/group-k`` each."""
    groups = runtime.parts.optimizer.param_groups
    out = {"lr": float(groups[0]["lr"])}
    if len(groups) > 1:
        out.update({f"lr/group-{k}": float(g["lr"]) for k, g in enumerate(groups)})
    return out


def validation_losses(runtime: Runtime) -> dict[str, float]:
    """``val_loss`` of the trained weights and, with convoy's EMA (``train.ema_decay``),
    ``val_loss_ema`` of the averaged ones (on a copy of the model: the live one is untouched)."""
    out = {"val_loss": validation_loss(runtime)}
    ema = runtime.parts.extra_state.get(EMA)
    if isinstance(ema, WeightEMA):
        out["val_loss_ema"] = validation_loss(runtime, ema.module())
    return out


def validation_loss(runtime: Runtime, model: torch.nn.Module | None = None) -> float:
    """Mean validation loss over the first ``train.eval_samples`` samples, in order.

    Why it leaves the trajectory alone: model.eval() + no_grad (no dropout, no gradients, no
    running-stat updates), its own index order (no sampler, no DataLoader, whose start-up
    draws from the global RNG), every RNG stream saved before and restored after (a loss_fn
    may draw), each sample seeded by its index (augmentation in val_data is the same at every
    eval and on every rank), the training cursor untouched.  Each rank takes every world-th
    sample of each batch; the sums are all-reduced.  ``model``: another module to evaluate (the
    EMA's copy), the task's by default."""
    parts, cfg, device = runtime.parts, runtime.config.train, runtime.device
    model = parts.model if model is None else model
    rng = capture_rng(device)
    was_training = model.training
    model.eval()
    collate = parts.collate_fn or default_collate
    total = torch.zeros(2, dtype=torch.float64)
    n = min(cfg.eval_samples, len(parts.val_data))  # type: ignore[arg-type]
    try:
        with torch.no_grad():
            for lo in range(0, n, cfg.batch_size):
                idx = list(range(lo, min(lo + cfg.batch_size, n)))[runtime.rank :: runtime.world_size]
                if not idx:
                    continue
                keys = validation_keys(cfg.seed, idx)
                samples = SeededSamples(parts.val_data, parts.sample_rngs).__getitems__(keys)
                batch = to_device(collate(samples), device)
                with torch.autocast(device.type, dtype=runtime.autocast_dtype, enabled=runtime.amp):
                    loss = parts.loss_fn(model, batch)
                total += torch.tensor([float(loss) * len(idx), len(idx)], dtype=torch.float64)
    finally:
        model.train(was_training)
        restore_rng(rng, device)
    total = distributed.sum_tensor(total)
    return float(total[0] / total[1])


def micro_batches(runtime: Runtime, resumed: bool) -> Iterator[Any]:
    """This rank's micro-batches from the restored cursor on (``resumed``: a stream continues
    from its saved position).  A stream's loader is kept in the train state: its position goes
    into this rank's checkpoint part."""
    cfg, state, parts = runtime.config.train, runtime.state, runtime.parts
    spec = LoaderSpec(cfg.batch_size, cfg.seed, state.cursor, runtime.rank, runtime.world_size, cfg.grad_accum_steps)
    batches = train_batches(
        parts.train_data,
        spec,
        num_workers=runtime.config.data.num_workers,
        collate_fn=parts.collate_fn,
        saved_stream=state.stream_saved,
        resumed=resumed,
        sample_rngs=parts.sample_rngs,
    )
    if is_stream(parts.train_data):
        state.stream = batches
    return batches


def validation_enabled(runtime: Runtime, log: Callable[[str], None]) -> bool:
    """Whether in-loop validation runs: ``train.eval_every`` and a task with validation data (a
    task without says so once, and trains without)."""
    config = runtime.config
    every, val = config.train.eval_every, runtime.parts.val_data
    if every > 0 and (val is None or len(val) == 0):  # type: ignore[arg-type]
        log(f"train.eval_every = {every} but task {config.task!r} has no validation data: no in-loop validation")
        return False
    return every > 0
