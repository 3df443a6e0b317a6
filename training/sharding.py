"""Sharded training (``train.parallel: fsdp``): FSDP2 applied by convoy, and what the loop needs
to treat a sharded model like a replicated one.

Why here and not in the task: a user's factory builds a plain ``nn.Module`` and names the units
worth sharding (``TaskParts.shard_units``); convoy owns the process group, the device mesh, the
mixed-precision policy and the order of ``fully_shard`` calls (each unit, then the root, as
torchtitan's ``parallelize`` does), so every factory shards the same way and one config moves a
run from DDP to FSDP.  A factory that shards its model itself (its parameters are DTensors: FSDP2
or tensor parallel) is detected and left as it is; it gets the mesh from :func:`data_parallel_mesh`.

Invariants:

1. **One process group whenever ``parallel`` is ``fsdp``**, at one rank too (a private one-rank
   group, :func:`ensure_process_group`): the model is then sharded over a mesh of one, its state
   is DTensors on every world size, and a checkpoint saved at 2 ranks loads at 1 through the same
   DCP path (re-sharded), never through the replicated one.
2. **Never DDP over DTensors** (:func:`is_sharded`): DDP's start-up broadcast has no sharding
   strategy for them; gradients of a sharded model are reduce-scattered by FSDP itself.
3. **Gradient sync off on every micro-batch but the last** (:func:`gradient_sync`): DDP's
   ``no_sync`` for replicated models, FSDP2's ``set_requires_gradient_sync`` for sharded ones;
   the update is the same, the reductions happen once per optimizer step.
4. **The logged gradient norm is global** (:func:`norm_value`): ``clip_grad_norm_`` over DTensor
   gradients returns a DTensor of partial norms, reduced here over every shard.
5. **The factory's optimizer steps the sharded parameters** (:func:`repoint_optimizer`): the task
   builds model and optimizer together, before convoy shards; the optimizer, still without state,
   is re-pointed parameter by parameter (by name), so no factory has to know about FSDP.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

#: What a task may name as the units to shard: module classes (every submodule of one of them is
#: a unit) or a function returning the units of the model it is given.
ShardUnits = tuple[type[torch.nn.Module], ...] | Callable[[torch.nn.Module], Iterable[torch.nn.Module]]


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether any parameter is a DTensor (FSDP2 or tensor parallel already applied; rule 2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def ensure_process_group(device: torch.device) -> None:
    """Rule 1: a one-rank process group where torchrun started none (a private in-memory store,
    no port, no environment); a no-op where a group exists."""
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


@contextlib.contextmanager
def rehearsal_group() -> Iterator[None]:
    """A one-rank CPU process group for building and sharding a task outside a worker (``convoy
    validate``, a flow's start), torn down after; inside a worker's group, that group."""
    if dist.is_initialized():
        yield
        return
    ensure_process_group(torch.device("cpu"))
    try:
        yield
    finally:
        dist.destroy_process_group()


def rehearse(parts: Any, reshard_after_forward: bool) -> None:
    """Shard a task's model as a worker would, on a mesh of one (``parts`` built on the meta
    device or the CPU, inside :func:`rehearsal_group`): the units named, the optimizer re-pointed,
    every check of :func:`shard_model` made; a model the factory sharded is left as it is."""
    if not is_sharded(parts.model):
        shard_model(parts.model, parts.optimizer, parts.shard_units, torch.device("cpu"), reshard_after_forward, None)


def data_parallel_mesh(device: torch.device | str | None = None) -> Any:
    """The 1-D data-parallel device mesh over every rank (a factory that shards its model itself
    passes it to ``fully_shard``).  Needs the process group convoy starts before the task is built."""
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise RuntimeError(
            "data_parallel_mesh() needs a process group: convoy starts one before building the task when "
            "train.parallel is fsdp (set it), or call it only when torch.distributed.is_initialized()"
        )
    kind = torch.device(device).type if device is not None else ("cuda" if dist.get_backend() == "nccl" else "cpu")
    return init_device_mesh(kind, (dist.get_world_size(),), mesh_dim_names=("dp",))


def units_of(model: torch.nn.Module, spec: ShardUnits | None) -> list[torch.nn.Module]:
    """The submodules ``spec`` names (none: the root alone is one unit), the root left out."""
    if spec is None:
        return []
    if isinstance(spec, tuple):
        found = [m for m in model.modules() if m is not model and isinstance(m, spec)]
    else:
        found = [m for m in spec(model) if m is not model]
    if not found:
        raise ValueError(f"TaskParts.shard_units = {spec!r} names no submodule of {type(model).__name__}")
    return found


def mixed_precision(amp_dtype: torch.dtype | None) -> Any:
    """FSDP2's policy: parameters gathered in the AMP dtype, gradients reduced in fp32 (CPU and AMP
    off: fp32 throughout, FSDP's default)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if amp_dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)


def shard_model(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    units: ShardUnits | None,
    device: torch.device,
    reshard_after_forward: bool,
    amp_dtype: torch.dtype | None,
) -> list[torch.nn.Module]:
    """``fully_shard`` each unit, then the root, over the data-parallel mesh (in place: the
    module keeps its class and its parameter names), and the optimizer re-pointed at the sharded
    parameters (rule 5); returns the units sharded."""
    from torch.distributed.fsdp import fully_shard

    if optimizer.state:
        raise ValueError("the task's optimizer has state before the first step; convoy shards the model before it")
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    mesh = data_parallel_mesh(device)
    policy = mixed_precision(amp_dtype)
    found = units_of(model, units)
    for unit in found:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    repoint_optimizer(optimizer, names, dict(model.named_parameters(remove_duplicate=False)))
    return found


def repoint_optimizer(
    optimizer: torch.optim.Optimizer, names: dict[int, str], sharded: dict[str, torch.nn.Parameter]
) -> None:
    """Rule 5: ``fully_shard`` replaces each parameter by a new DTensor one; the optimizer the
    factory built still holds the old ones, so each is swapped for its sharded self, by name."""
    for group in optimizer.param_groups:
        try:
            group["params"] = [sharded[names[id(p)]] for p in group["params"]]
        except KeyError:
            raise ValueError(
                "the task's optimizer holds a parameter that is not the model's; with train.parallel: fsdp the "
                "optimizer must optimize the model's parameters"
            ) from None


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, on: bool) -> Iterator[None]:
    """Rule 3: gradients reduced over ranks in this block only when ``on``."""
    if on:
        yield
        return
    if hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
        return
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    yield  # one rank, nothing to reduce


def norm_value(norm: torch.Tensor) -> float:
    """Rule 4: the global norm as a float, whether ``clip_grad_norm_`` returned a tensor or a DTensor."""
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return float(full)
