"""The memory tier of a sharded state (memory tier rule 9), in this process.

An FSDP2 model on a mesh of one (the one-rank group ``convoy validate`` uses) snapshotted by the
tier and trained on: the snapshot restores it bit for bit, into the local shards, with no
collective.  With two ranks' slots (written here as two tiers would), a rank reads its own pieces
and only the small parts of the other's slot, which is hashed all the same: a flipped byte there
refuses the snapshot.  A snapshot of another fingerprint or of the other checkpoint format is
never restored, none is taken before the optimizer's first update, and pieces that do not fit the
model are refused (on every rank alike) before anything is written into it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from training.checkpointing import sharded
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.memory import memory_tier, slot_files


@dataclass
class _Parts:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


@dataclass
class _State:
    """A :class:`~training.checkpointing.memory.source.SnapshotSource` of a sharded model."""

    parts: _Parts
    step: int = 0
    seen: list[int] = field(default_factory=list)

    def checkpoint_parts(self, rank: int = 0, include_replicated: bool = True, sharded: bool = False) -> dict[str, Any]:
        assert sharded, "a sharded tier asks for the state without model and optimizer"
        out: dict[str, Any] = {f"rank-{rank}": {"step": self.step, "rng": torch.get_rng_state()}}
        if include_replicated:
            out["state"] = {"step": self.step}
        return out


class _Schedule:
    def saved(self, step: int, cost_s: float) -> None:
        pass


@pytest.fixture
def fsdp_state() -> Any:
    """A two-layer MLP, FSDP2 per layer and at the root, in a one-rank process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from training.sharding import ensure_process_group

    ours = not dist.is_initialized()
    ensure_process_group(torch.device("cpu"))
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        mesh = init_device_mesh("cpu", (1,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        yield _State(_Parts(model, torch.optim.AdamW(model.parameters(), lr=1e-2)))
    finally:
        if ours:
            dist.destroy_process_group()


def _train(state: _State, steps: int) -> None:
    for _ in range(steps):
        loss = state.parts.model(torch.randn(5, 8)).square().mean()
        loss.backward()
        state.parts.optimizer.step()
        state.parts.optimizer.zero_grad()
        state.step += 1


def _local(state: _State) -> dict[str, torch.Tensor]:
    """Every piece this rank holds, copied."""
    return {
        k: t.clone()
        for k, t in sharded.held_pieces(sharded.flattened(state.parts.model, state.parts.optimizer)).items()
    }


def test_a_sharded_snapshot_restores_the_local_shards_bitwise(fsdp_state: _State, tmp_path: Path) -> None:
    tier = memory_tier.MemoryTier(tmp_path / "tier", "fp", sharded=True)
    tier.snapshot(fsdp_state, _Schedule())  # no update yet: none taken (DCP's walk would step the optimizer)
    assert tier.complete_steps() == [] and not fsdp_state.parts.optimizer.state
    _train(fsdp_state, 3)
    tier.snapshot(fsdp_state, _Schedule())
    at_snapshot = _local(fsdp_state)
    assert any(k.startswith("optimizer.state") and "exp_avg" in k for k in at_snapshot), sorted(at_snapshot)
    _train(fsdp_state, 2)
    assert any(not torch.equal(t, at_snapshot[k]) for k, t in _local(fsdp_state).items())
    candidate = tier.candidate(3)
    assert candidate.loaded is not None, candidate.reason
    _, parts = candidate.loaded
    assert set(parts) == {"rank-0", "state", sharded.PIECES, sharded.LAYOUT}
    sharded.load_pieces(
        parts[sharded.PIECES], parts[sharded.LAYOUT], fsdp_state.parts.model, fsdp_state.parts.optimizer
    )
    restored = _local(fsdp_state)
    assert restored.keys() == at_snapshot.keys()
    assert all(torch.equal(restored[k], at_snapshot[k]) for k in at_snapshot)
    assert memory_tier.MemoryTier(tmp_path / "tier", "another-fp", sharded=True).complete_steps() == []  # rule 3
    wrong = {**parts[sharded.PIECES], "model.0.weight": torch.zeros(3, 3)}
    _train(fsdp_state, 1)
    before = _local(fsdp_state)
    said = sharded.snapshot_misfit({**parts, sharded.PIECES: wrong}, fsdp_state.parts.model, fsdp_state.parts.optimizer)
    assert said is not None and "model.0.weight" in said and "another sharding" in said  # asked on every rank
    with pytest.raises(CheckpointRejected, match="model.0.weight"):
        sharded.load_pieces(wrong, parts[sharded.LAYOUT], fsdp_state.parts.model, fsdp_state.parts.optimizer)
    assert all(torch.equal(t, before[k]) for k, t in _local(fsdp_state).items())  # nothing written


def _two_rank_tier(root: Path) -> list[memory_tier.MemoryTier]:
    """Rank 0's and rank 1's tiers of a 2-rank sharded run, each with step 4's slot."""
    tiers = [memory_tier.MemoryTier(root, "fp", rank=r, world_size=2, sharded=True) for r in (0, 1)]
    for r, tier in enumerate(tiers):
        parts: dict[str, Any] = {f"rank-{r}": {"step": 4, "rng": torch.arange(3) + r}}
        if r == 0:
            parts["state"] = {"step": 4}
        parts[sharded.PIECES] = {"model.w": torch.full((1000,), float(r)), "optimizer.n": torch.tensor([r])}
        parts[sharded.LAYOUT] = json.dumps({"model": {"w": {"__t__": "model.w"}}, "rank": r})
        tier.write(4, parts)
    return tiers


def test_a_rank_reads_its_own_pieces_and_verifies_the_other_slot(tmp_path: Path) -> None:
    tiers = _two_rank_tier(tmp_path / "tier")
    for r, tier in enumerate(tiers):
        candidate = tier.candidate(4)
        assert candidate.loaded is not None, candidate.reason
        _, parts = candidate.loaded
        assert set(parts) == {"rank-0", "rank-1", "state", sharded.PIECES, sharded.LAYOUT}
        assert torch.equal(parts[sharded.PIECES]["model.w"], torch.full((1000,), float(r)))  # its own
        assert parts[sharded.LAYOUT]["rank"] == r
        assert torch.equal(parts[f"rank-{1 - r}"]["rng"], torch.arange(3) + 1 - r)  # the other's small part
    other = slot_files.data_path(tiers[0].root, 1, 0)
    data = bytearray(other.read_bytes())
    data[100] ^= 0xFF  # inside rank 1's pieces, which rank 0 never copies out
    other.write_bytes(bytes(data))
    refused = tiers[0].candidate(4)
    assert refused.loaded is None and "rank 1" in refused.reason and "corrupt" in refused.reason, refused.reason


def test_a_slot_of_the_other_checkpoint_format_is_refused(tmp_path: Path) -> None:
    """``checkpoint.format`` is not in the fingerprint (a DDP run may change it): a sharded tier
    refuses a replicated snapshot, and a replicated tier a sharded one, instead of crashing."""
    replicated = memory_tier.MemoryTier(tmp_path / "a", "fp")
    replicated.write(4, {"rank-0": {"step": 4, "rng": torch.arange(3)}, "state": {"step": 4}})
    refused = memory_tier.MemoryTier(tmp_path / "a", "fp", sharded=True).candidate(4)
    assert refused.loaded is None and "checkpoint.format" in refused.reason, refused.reason
    (tier,) = _two_rank_tier(tmp_path / "b")[:1]
    assert tier.candidate(4).loaded is not None
    refused = memory_tier.MemoryTier(tmp_path / "b", "fp", rank=0, world_size=2).candidate(4)
    assert refused.loaded is None and "checkpoint.format" in refused.reason, refused.reason
