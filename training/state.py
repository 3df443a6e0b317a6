"""The complete train state and how it maps onto checkpoint parts.

Complete means everything that influences the next update: model, optimizer, LR scheduler
(its position is the global step, checked on restore), AMP GradScaler, every RNG (python, numpy,
torch CPU, each CUDA device — per rank), the data cursor, the global step and tokens seen.
Part ``state`` is replicated (rank 0 writes it); part ``rank-<r>`` holds that rank's RNG.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training import sharded
from training.data import Cursor
from training.task import TaskParts


def configure_determinism(deterministic: bool, device: torch.device) -> None:
    """Flags needed for bitwise-reproducible steps (CUDA needs them; CPU is deterministic)."""
    if not deterministic:
        return
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


def capture_rng() -> dict[str, Any]:
    py = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": py[0], "state": list(py[1]), "gauss_next": py[2]},
        "numpy": {"name": np_name, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "cached_gaussian": float(np_gauss)},
        "torch": torch.get_rng_state(),
        "cuda": [],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.clone() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"].clone())
    cuda_states = state.get("cuda") or []
    if cuda_states:
        if not torch.cuda.is_available() or torch.cuda.device_count() < len(cuda_states):
            raise RuntimeError(
                f"checkpoint holds RNG for {len(cuda_states)} CUDA device(s) but "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} are visible")
        torch.cuda.set_rng_state_all([s.clone() for s in cuda_states])


@dataclass
class TrainState:
    parts: TaskParts
    scaler: torch.amp.GradScaler
    step: int = 0
    tokens_seen: int = 0
    cursor: Cursor = field(default_factory=Cursor)

    def checkpoint_parts(self, rank: int = 0, include_replicated: bool = True, sharded: bool = False) -> dict[str, Any]:
        """What the store writes for this rank.  ``sharded``: model and optimizer are left out
        (``training.sharded`` writes them collectively); the rest stays in rank 0's ``state``."""
        out: dict[str, Any] = {f"rank-{rank}": {"rng": capture_rng(), "step": self.step}}
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
        return out

    def restore(self, loaded: dict[str, Any], rank: int = 0, restore_rng_state: bool = True,
                checkpoint_dir: Path | None = None) -> None:
        """``loaded`` is ``CheckpointStore.load``'s parts.  A sharded checkpoint (its parts carry the
        shard skeleton) is read collectively from ``checkpoint_dir``: every rank must call this."""
        s = loaded["state"]
        p = self.parts
        if sharded.LAYOUT in loaded:
            if checkpoint_dir is None:
                raise ValueError("sharded checkpoint: restore needs the checkpoint directory")
            sharded.load_shards(checkpoint_dir, loaded[sharded.LAYOUT], p.model, p.optimizer)
        else:
            p.model.load_state_dict(s["model"])
            p.optimizer.load_state_dict(s["optimizer"])
        # The loaded tensors are views of a private mapping of the checkpoint file; model weights
        # were copied by load_state_dict, optimizer state was not.  Own it, so the mapping is
        # released now (retention may delete that file; an in-place rewrite must not reach us).
        for param_state in p.optimizer.state.values():
            for key, value in param_state.items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    param_state[key] = value.clone()
        if p.scheduler is not None:
            if s["scheduler"] is None:
                raise ValueError("checkpoint has no LR scheduler state but the task has a scheduler")
            p.scheduler.load_state_dict(s["scheduler"])
            if p.scheduler.last_epoch != s["step"]:
                raise ValueError(f"LR scheduler position {p.scheduler.last_epoch} != global step {s['step']}")
        self.scaler.load_state_dict(s["scaler"])
        self.step = int(s["step"])
        self.tokens_seen = int(s["tokens_seen"])
        self.cursor = Cursor.from_dict(s["cursor"])
        if restore_rng_state:
            mine = loaded.get(f"rank-{rank}")
            if mine is None:
                raise ValueError(f"checkpoint has no RNG state for rank {rank}")
            if int(mine["step"]) != self.step:
                raise ValueError(f"rank {rank} RNG is from step {mine['step']}, state from step {self.step}")
            restore_rng(mine["rng"])
