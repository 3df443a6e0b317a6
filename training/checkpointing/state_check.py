"""Is a loaded checkpoint a complete convoy train state, and does it fit the task?  (torch-free)

The store's validator (:func:`checkpoint_validator`) judges the parts a checkpoint loads into:
every key a resume needs, each rank's RNG streams, the step agreeing everywhere and, given an
:class:`ExpectedState`, the model's names, shapes and dtypes and the optimizer's groups.  It reads
tensors only through ``.shape`` and ``.dtype``, so it judges real tensors (the worker's resume)
and the header entries a read-only command loads instead
(:class:`~training.checkpointing.safetensors_io.TensorMeta`) alike: ``convoy verify`` and
``convoy inspect`` check everything a resume would, without importing torch or building the task
(the task's shapes are read from the run's ``task_shapes.json``, written by the worker).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.checkpointing import sharded
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.safetensors_io import TensorMeta
from training.device_rng import select_cuda_rng
from training.fsutil import atomic_write_json

if TYPE_CHECKING:
    from training.parts import TaskParts


def is_tensor(x: Any) -> bool:
    """A torch tensor, or a header entry standing in for one (not a saved numpy array)."""
    if isinstance(x, TensorMeta):
        return not x.array
    torch = sys.modules.get("torch")  # a real tensor exists only where torch was imported
    return torch is not None and isinstance(x, torch.Tensor)


#: Per-parameter optimizer buffers of torch's built-in optimizers that mirror the parameter's
#: shape (Adam/AdamW moments, SGD momentum).  Other per-parameter state (e.g. factored second
#: moments) has shapes of its own and is not compared.
_PARAM_SHAPED_BUFFERS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer")
_STATE_KEYS = ("step", "tokens_seen", "cursor", "scaler", "scheduler")


@dataclass(frozen=True)
class ExpectedState:
    """What a checkpoint must hold to fit the task being trained: model tensor names, shapes and
    dtypes, the optimizer's parameter groups, whether there is an LR scheduler.  Built from the
    live parts (or from parts built on the meta device, where no memory is spent)."""

    model: dict[str, tuple[tuple[int, ...], str]]
    group_shapes: list[list[tuple[int, ...]]]
    has_scheduler: bool
    #: The names of the task's extra state (``TaskParts.extra_state``) a checkpoint must hold.
    extra: tuple[str, ...] = ()

    @classmethod
    def of(cls, parts: TaskParts) -> ExpectedState:
        model = {k: (tuple(v.shape), str(v.dtype)) for k, v in parts.model.state_dict().items()}
        groups = [[tuple(p.shape) for p in g["params"]] for g in parts.optimizer.param_groups]
        return cls(model, groups, parts.scheduler is not None, tuple(sorted(parts.extra_state)))


def checkpoint_validator(expected: ExpectedState | None = None) -> Callable[[dict[str, Any], dict[str, Any]], None]:
    """The store's validator for train-state checkpoints (see ``CheckpointStore.load``): the parts
    make a complete train state of the manifest's step and world size and, when ``expected`` is
    given, fit the task's model and optimizer.  Raises CheckpointRejected with the first mismatch
    (and nothing else for any checkpoint: what :meth:`TrainState.restore` would stumble over is
    checked here, so an error there is a bug, never a reason to pass a checkpoint over)."""

    def validate(manifest: dict[str, Any], parts: dict[str, Any]) -> None:
        step, world = manifest["step"], manifest.get("world_size", 1)
        if not isinstance(world, int) or world < 1:
            raise CheckpointRejected(f"manifest world_size {world!r} is not a positive integer")
        missing = [p for p in ("state", *(f"rank-{r}" for r in range(world))) if p not in parts]
        if missing:
            raise CheckpointRejected(
                f"parts {missing} missing (a {world}-rank checkpoint needs state and rank-0..{world - 1})"
            )
        _check_state(parts["state"], step, sharded_layout=sharded.LAYOUT in parts)
        for r in range(world):
            mine = parts[f"rank-{r}"]
            if not isinstance(mine, dict) or mine.get("step") != step or not isinstance(mine.get("rng"), dict):
                raise CheckpointRejected(f"rank-{r}: not an RNG state of step {step}")
            if not {"python", "numpy", "torch"} <= set(mine["rng"]):
                raise CheckpointRejected(f"rank-{r}: RNG state lacks python/numpy/torch streams")
            _check_cuda_rng(mine["rng"].get("cuda") or [], r)
        if expected is not None:
            _check_fits(parts["state"], expected, sharded_layout=sharded.LAYOUT in parts)

    return validate


def _check_state(s: Any, step: int, sharded_layout: bool) -> None:
    keys = (*_STATE_KEYS, *(() if sharded_layout else ("model", "optimizer")))
    if not isinstance(s, dict) or not set(keys) <= set(s):
        have = sorted(s) if isinstance(s, dict) else type(s).__name__
        raise CheckpointRejected(f"state: not a convoy train state (needs {list(keys)}, has {have})")
    if s["step"] != step:
        raise CheckpointRejected(f"state: step {s['step']!r} != manifest step {step}")
    cursor = s["cursor"]
    if not (isinstance(cursor, dict) and all(isinstance(cursor.get(k), int) for k in ("epoch", "offset"))):
        raise CheckpointRejected(f"state: data cursor {cursor!r} is not {{epoch, offset}}")
    if not isinstance(s.get("extra", {}), dict):
        raise CheckpointRejected("state: the task's extra state is not a mapping of names")
    if not isinstance(s["tokens_seen"], int) or not isinstance(s["scaler"], dict):
        raise CheckpointRejected("state: tokens_seen or scaler state malformed")
    scheduler = s["scheduler"]
    if scheduler is not None and not isinstance(scheduler, dict):
        raise CheckpointRejected("state: LR scheduler state is not a mapping")
    if scheduler is not None and scheduler.get("last_epoch", step) != step:
        raise CheckpointRejected(f"state: LR scheduler position {scheduler['last_epoch']!r} != step {step}")
    if not sharded_layout:
        opt = s["optimizer"]
        if not (
            isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list)
        ):
            raise CheckpointRejected("state: optimizer state is not {state, param_groups}")
        if not isinstance(s["model"], dict) or not all(is_tensor(v) for v in s["model"].values()):
            raise CheckpointRejected("state: model is not a mapping of tensors")


def _check_fits(s: dict[str, Any], want: ExpectedState, sharded_layout: bool) -> None:
    if (s["scheduler"] is not None) != want.has_scheduler:
        raise CheckpointRejected(
            f"state: LR scheduler state {'absent' if want.has_scheduler else 'present'}, "
            f"the task {'has' if want.has_scheduler else 'has no'} scheduler"
        )
    # convoy's EMA may be absent: a fork of a run that kept none starts it from the loaded weights
    missing = [n for n in want.extra if n not in (s.get("extra") or {}) and n != "ema"]
    if missing:
        raise CheckpointRejected(
            f"state: no extra state {missing} (the task keeps {list(want.extra)} in TaskParts.extra_state; "
            f"this checkpoint has {sorted(s.get('extra') or {})})"
        )
    if sharded_layout:
        return  # model/optimizer live in the DCP shards; their keys are matched when they load
    model = s["model"]
    if set(model) != set(want.model):
        missing, extra = sorted(set(want.model) - set(model))[:3], sorted(set(model) - set(want.model))[:3]
        raise CheckpointRejected(f"model does not match the task: missing {missing}, unexpected {extra}")
    for key, (shape, dtype) in want.model.items():
        got = (tuple(model[key].shape), str(model[key].dtype))
        if got != (shape, dtype):
            raise CheckpointRejected(
                f"model.{key}: checkpoint has {list(got[0])} {got[1]}, the task {list(shape)} {dtype}"
            )
    groups = s["optimizer"]["param_groups"]
    sizes = [len(g.get("params", [])) if isinstance(g, dict) else -1 for g in groups]
    if sizes != [len(g) for g in want.group_shapes]:
        raise CheckpointRejected(
            f"optimizer: parameter groups of sizes {sizes}, the task has {[len(g) for g in want.group_shapes]}"
        )
    shapes = [shape for g in want.group_shapes for shape in g]
    position = {pid: j for j, pid in enumerate(pid for g in groups for pid in g["params"])}
    for pid, buffers in s["optimizer"]["state"].items():
        if pid not in position or not isinstance(buffers, dict):
            raise CheckpointRejected(f"optimizer: state for unknown parameter {pid!r}")
        for name in _PARAM_SHAPED_BUFFERS:
            t = buffers.get(name)
            if is_tensor(t) and tuple(t.shape) != shapes[position[pid]]:
                raise CheckpointRejected(
                    f"optimizer: {name} of parameter {pid} has shape {list(t.shape)}, "
                    f"the parameter {list(shapes[position[pid]])}"
                )


def _check_cuda_rng(saved: Any, rank: int) -> None:
    """The device streams are in a format :func:`select_cuda_rng` reads (either format)."""
    if not isinstance(saved, list):
        raise CheckpointRejected(f"rank-{rank}: RNG 'cuda' entry is not a list")
    try:
        select_cuda_rng(saved, 0, is_tensor)
    except ValueError as exc:  # select_cuda_rng names what is malformed
        raise CheckpointRejected(f"rank-{rank}: {exc}") from None


def write_task_shapes(path: Path, expected: ExpectedState) -> None:
    """Record the task's shapes for the read-only commands (rank 0, at each worker start)."""
    atomic_write_json(
        path,
        {
            "model": {k: [list(shape), dtype] for k, (shape, dtype) in expected.model.items()},
            "group_shapes": [[list(s) for s in g] for g in expected.group_shapes],
            "has_scheduler": expected.has_scheduler,
            "extra": list(expected.extra),
        },
    )


def read_task_shapes(path: Path) -> ExpectedState | None:
    """The shapes :func:`write_task_shapes` recorded; None if absent or unreadable (then only
    the structure is checked, which the caller says)."""
    try:
        raw = json.loads(path.read_text())
        return ExpectedState(
            {k: (tuple(shape), str(dtype)) for k, (shape, dtype) in raw["model"].items()},
            [[tuple(s) for s in g] for g in raw["group_shapes"]],
            bool(raw["has_scheduler"]),
            tuple(raw.get("extra", ())),  # absent in shapes recorded before extra state
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
