"""The complete train state and how it maps onto checkpoint parts.

Complete means everything that influences the next update: model, optimizer, LR scheduler
(its position is the global step, checked on restore), AMP GradScaler, every RNG (python, numpy,
torch CPU, the CUDA device this rank trains on — per rank), the data cursor (and, for a stream,
each rank's stream position: every loader worker's state, or for a global-order stream the global
samples trained, the same on every rank: ``training.datapipe.stream_position``), the global step and tokens seen.
Part ``state`` is replicated (rank 0 writes it); part ``rank-<r>`` holds that rank's RNG and stream.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import xxhash

from training.datapipe.data import Cursor
from training.device_rng import select_cuda_rng
from training.ema import EMA
from training.numpy_rng import legacy_state
from training.parts import TaskParts


def configure_determinism(deterministic: bool, device: torch.device) -> None:
    """Flags needed for bitwise-reproducible steps, on CUDA and on CPU.

    CPU: torch's CPU BLAS is MKL, and MKL starts with dynamic threading on (``MKL_DYNAMIC``): it
    may run a GEMM on fewer threads than asked, which changes how sums are split and so the last
    bits.  Intel's reproducibility conditions ask for a fixed thread count with MKL_DYNAMIC
    off; ``torch.set_num_threads`` does both (torch turns MKL's dynamic mode off only there), so
    the process pins the count it already had.  A resumed worker then computes its steps the
    way the uninterrupted one did, whatever else loads the machine."""
    if not deterministic:
        return
    torch.set_num_threads(torch.get_num_threads())
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS call
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def _cuda_index(device: torch.device) -> int:
    """The device's index; a bare ``cuda`` means the current device (what torch would use)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def capture_rng(device: torch.device | None = None) -> dict[str, Any]:
    """This process's RNG streams.  ``cuda`` holds the generator of ``device`` only (the device
    this rank trains on), tagged with its index: ``[{"device": i, "state": ByteTensor}]``; it is
    ``[]`` on CPU (so CPU checkpoints are byte-identical to those written before per-rank device
    RNG).  Other visible devices are none of this rank's business: with torchrun every rank sees
    every GPU of its node, and saving them all tied a checkpoint to the node's GPU count."""
    py = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = legacy_state()  # np.random.get_state(), fast
    state: dict[str, Any] = {
        "python": {"version": py[0], "state": list(py[1]), "gauss_next": py[2]},
        "numpy": {
            "name": np_name,
            "keys": torch.from_numpy(np_keys.astype(np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_gauss),
        },
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if device is not None and device.type == "cuda":
        index = _cuda_index(device)
        state["cuda"] = [{"device": index, "state": torch.cuda.get_rng_state(index).clone()}]
    return state


def fallback_cuda_seed(cpu_state: torch.Tensor, device_index: int) -> int:
    """Seed for a device stream the checkpoint lacks: derived from this rank's restored CPU
    generator state and the device index, so a resume from the same checkpoint is reproducible
    and ranks (whose CPU streams differ) get distinct device streams.  Pure: no CUDA."""
    h = xxhash.xxh64(cpu_state.contiguous().numpy().tobytes())
    h.update(device_index.to_bytes(4, "little"))
    return h.intdigest() & (2**63 - 1)


def restore_rng(
    state: dict[str, Any], device: torch.device | None = None, withheld: frozenset[str] = frozenset()
) -> str:
    """Restore the streams :func:`capture_rng` saved; the CUDA generator only of ``device``, and
    only when this rank trains on CUDA (a CUDA checkpoint resumed on CPU ignores it).  Returns a
    line saying what happened to the device stream (the worker logs it).  ``withheld``
    (``rng.<name>``): streams left as they are (the negative controls, :meth:`TrainState.restore`)."""
    py = state["python"]
    if "rng.python" not in withheld:
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    n = state["numpy"]
    if "rng.numpy" not in withheld:
        np.random.set_state(
            (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
    if "rng.torch" not in withheld:
        torch.set_rng_state(state["torch"].clone())
    if device is None or device.type != "cuda" or "rng.cuda" in withheld:
        return "no CUDA device: device RNG not restored"
    index = _cuda_index(device)
    chosen, how = select_cuda_rng(state.get("cuda") or [], index)
    if chosen is None:
        torch.cuda.init()  # a no-op once initialised; fills default_generators
        torch.cuda.default_generators[index].manual_seed(fallback_cuda_seed(state["torch"], index))
        return f"cuda:{index} RNG freshly seeded ({how})"
    torch.cuda.set_rng_state(chosen.clone(), index)
    return f"cuda:{index} RNG restored: {how}"


@dataclass
class TrainState:
    parts: TaskParts
    scaler: torch.amp.GradScaler
    step: int = 0
    tokens_seen: int = 0
    cursor: Cursor = field(default_factory=Cursor)
    #: The device this rank trains on: its CUDA generator (only) is saved and restored.
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: What restore did with the device RNG (logged by the worker).
    rng_note: str = ""
    #: A stream's loader (``training.datapipe.streams.StreamBatches``): its position is this rank's to save.
    stream: Any = None
    #: This rank's stream position as restored (None: map-style data, or a fresh start).
    stream_saved: dict[str, Any] | None = None

    def checkpoint_parts(self, rank: int = 0, include_replicated: bool = True, sharded: bool = False) -> dict[str, Any]:
        """What the store writes for this rank.  ``sharded``: model and optimizer are left out
        (the sharded format writes each rank's pieces of them); the rest stays in rank 0's ``state``."""
        out: dict[str, Any] = {f"rank-{rank}": {"rng": capture_rng(self.device), "step": self.step}}
        stream = self.stream.state_dict() if self.stream is not None else self.stream_saved
        if stream is not None:  # absent for map-style data: those checkpoints stay as they were
            out[f"rank-{rank}"]["stream"] = stream
        if include_replicated:
            p = self.parts
            out["state"] = {
                **({} if sharded else {"model": p.model.state_dict(), "optimizer": p.optimizer.state_dict()}),
                "scheduler": p.scheduler.state_dict() if p.scheduler is not None else None,
                "scaler": self.scaler.state_dict(),
                "step": self.step,
                "tokens_seen": self.tokens_seen,
                "cursor": self.cursor.to_dict(),
            }
            if p.extra_state:  # absent without: those checkpoints stay as they were
                out["state"]["extra"] = {name: obj.state_dict() for name, obj in sorted(p.extra_state.items())}
        return out

    def restore(
        self,
        loaded: dict[str, Any],
        rank: int = 0,
        restore_rng_state: bool = True,
        load_weights: Callable[[TaskParts], None] | None = None,
        withheld: frozenset[str] = frozenset(),
    ) -> None:
        """``loaded`` is ``CheckpointStore.load``'s parts.  ``load_weights``: model and optimizer
        are loaded by the caller, not from ``loaded["state"]`` (a sharded checkpoint, read
        collectively from its directory by :mod:`training.loop.restore`: every rank calls this).

        ``withheld``: components (:data:`COMPONENTS`, ``optimizer.<buffer>``, ``extra.<name>``)
        left as the fresh task has them, with the checks about them: the negative controls of
        the suite (``CONVOY_FAULTS=withhold=…``, tests/test_negative_controls.py), never a run's.

        ``loaded`` passed :func:`checkpoint_validator` (the store does not hand out parts that did
        not): the checks below restate its promises, so one failing here is a bug and raises as
        such (a crash of the worker), never a reason to pass the checkpoint over."""
        saved = loaded["state"]
        p = self.parts
        if load_weights is not None:
            load_weights(p)
        else:
            if "weights" not in withheld:
                p.model.load_state_dict(saved["model"])
            p.optimizer.load_state_dict(withhold_buffers(saved["optimizer"], withheld))
        own_optimizer_state(p.optimizer)
        if p.scheduler is not None and "scheduler" not in withheld:
            restore_scheduler(p.scheduler, saved)
        # An empty scaler state was saved with AMP off (``device: auto`` on a CPU machine disables
        # AMP); resumed on CUDA with AMP on, GradScaler would refuse it: keep the fresh scale.
        if "scaler" not in withheld and (saved["scaler"] or not self.scaler.is_enabled()):
            self.scaler.load_state_dict(saved["scaler"])  # a no-op when this scaler is disabled
        extra = saved.get("extra") or {}
        restore_extra(p, {name: v for name, v in extra.items() if f"extra.{name}" not in withheld}, withheld)
        self.step = self.step if "step" in withheld else int(saved["step"])
        self.tokens_seen = self.tokens_seen if "tokens_seen" in withheld else int(saved["tokens_seen"])
        self.cursor = self.cursor if "cursor" in withheld else Cursor.from_dict(saved["cursor"])
        if restore_rng_state:
            self._restore_rank(loaded, rank, withheld)

    def _restore_rank(self, loaded: dict[str, Any], rank: int, withheld: frozenset[str]) -> None:
        """This rank's part: its RNG streams and its stream position."""
        mine = loaded.get(f"rank-{rank}")
        if mine is None:
            raise ValueError(f"checkpoint has no RNG state for rank {rank}")
        if int(mine["step"]) != self.step and "step" not in withheld:
            raise ValueError(f"rank {rank} RNG is from step {mine['step']}, state from step {self.step}")
        self.rng_note = restore_rng(mine["rng"], self.device, withheld)
        self.stream_saved = None if "stream" in withheld else mine.get("stream")


#: The components of the train state a restore sets, each of which a negative control withholds
#: (besides one per optimizer buffer, ``optimizer.<key>``, and per extra state, ``extra.<name>``).
COMPONENTS = (
    "weights",
    "scheduler",
    "scaler",
    "step",
    "tokens_seen",
    "cursor",
    "rng.python",
    "rng.numpy",
    "rng.torch",
    "rng.cuda",
    "stream",
)


def withhold_buffers(saved: dict[str, Any], withheld: frozenset[str]) -> dict[str, Any]:
    """The optimizer's state dict with each withheld buffer (``optimizer.<key>``) as a fresh
    optimizer starts it: zeros (a step count of 0)."""
    keys = {name.partition(".")[2] for name in withheld if name.startswith("optimizer.")}
    if not keys:
        return saved
    state = {
        index: {k: torch.zeros_like(v) if k in keys and isinstance(v, torch.Tensor) else v for k, v in buffers.items()}
        for index, buffers in saved["state"].items()
    }
    return {**saved, "state": state}


def own_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The loaded tensors are views of a private mapping of the checkpoint file; model weights
    were copied by load_state_dict, optimizer state was not.  Own it, so the mapping is released
    now (retention may delete that file; an in-place rewrite must not reach us)."""
    for param_state in optimizer.state.values():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                param_state[key] = value.clone()


def restore_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, saved: dict[str, Any]) -> None:
    if saved["scheduler"] is None:
        raise ValueError("checkpoint has no LR scheduler state but the task has a scheduler")
    scheduler.load_state_dict(saved["scheduler"])
    if scheduler.last_epoch != saved["step"]:
        raise ValueError(f"LR scheduler position {scheduler.last_epoch} != global step {saved['step']}")


def restore_extra(parts: TaskParts, saved: dict[str, Any], withheld: frozenset[str] = frozenset()) -> None:
    """The task's extra state (``TaskParts.extra_state``) from a checkpoint's ``extra``.  The
    validator refused a checkpoint without one of the names, except ``ema``: a run forked from a
    parent that kept none starts its average from the weights it loaded (:mod:`training.ema` rule 2)."""
    for name, obj in parts.extra_state.items():
        if name in saved:
            obj.load_state_dict(saved[name])
        elif f"extra.{name}" in withheld:
            continue
        elif name == EMA:
            obj.reset()
        else:
            raise ValueError(f"checkpoint has no extra state {name!r}")
