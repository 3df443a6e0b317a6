"""Thin helpers over torch.distributed for multi-rank workers launched by torchrun.

Every helper is a no-op for a single rank, so the worker has one code path.  Decisions that
must be taken by all ranks at the same step (stop for preemption, save now) go through
:func:`agree_any`; a rank acting alone would leave the others blocked in the next all-reduce.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def init(world_size: int, device: torch.device, timeout_s: float = 600) -> None:
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def agree_any(*flags: bool) -> list[bool]:
    """True for each flag that is true on *any* rank."""
    if not active():
        return list(flags)
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [bool(v) for v in t.tolist()]


def mean(value: float) -> float:
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return float(t.item()) / dist.get_world_size()


def sum_tensor(t: torch.Tensor) -> torch.Tensor:
    """Element-wise sum over ranks of a small CPU tensor (returned on the CPU)."""
    if not active():
        return t
    d = t.to(_device())
    dist.all_reduce(d, op=dist.ReduceOp.SUM)
    return d.cpu()


def check_same_step(step: int) -> None:
    """Every rank must resume from the same step; a mismatch is an error, never silent."""
    if not active():
        return
    t = torch.tensor([step, -step], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    hi, lo = int(t[0]), -int(t[1])
    if hi != lo:
        raise RuntimeError(f"ranks restored different steps (min {lo}, max {hi}); refusing to continue")


def barrier() -> None:
    if active():
        dist.barrier()


def shutdown() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
