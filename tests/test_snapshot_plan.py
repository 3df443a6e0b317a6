"""The memory tier's fast path (training/checkpointing/memory/snapshot_plan.py): same bytes, or no plan.

Two tiers snapshot the same live train state at every step, one through plans, one by the full
walk of model and optimizer every time; their slots must be byte-for-byte equal (rule 1), also
across what breaks a plan: a buffer reassigned out of place, ``p.data = ...``, optimizer state
loaded, a parameter or a module added, a module replaced (rule 2).  Models and optimizers a
plan cannot watch get none (rule 3), and a run whose plans keep breaking stops making them (rule 4).
"""

from __future__ import annotations

import copy
import dataclasses
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from training.checkpointing.memory import slot_format
from training.checkpointing.memory.memory_tier import MemoryTier
from training.checkpointing.memory.snapshot_plan import MAX_REBUILDS
from training.checkpointing.schedule import MemorySchedule
from training.state import TrainState
from training.task import TaskParts


class _Net(nn.Module):
    """Parameters, a BatchNorm's buffers (one int64), and a buffer kept as a running mean."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)
        self.register_buffer("seen", torch.zeros(2))
        self.register_buffer("later", None)  # not in the state dict until it is set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(self.body(x))
        with torch.no_grad():
            self.seen.mul_(0.9).add_(y.mean(0), alpha=0.1)  # in place: the plan holds
        return y


def _state(model: nn.Module | None = None, opt: Callable[..., Any] = torch.optim.AdamW) -> TrainState:
    torch.manual_seed(0)
    model = model or _Net()
    optimizer = opt(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    parts = TaskParts(model, optimizer, scheduler, train_data=[], loss_fn=lambda m, b: m(b).pow(2).mean())
    return TrainState(parts, torch.amp.GradScaler("cpu", enabled=False))


def _forward_backward(state: TrainState, before_backward: Callable[[], object] = lambda: None) -> None:
    p = state.parts
    random.random(), np.random.rand()  # the next batch's fetch draws
    p.optimizer.zero_grad()
    if isinstance(state.stream, _LiveStream):
        state.stream.fetch()
    loss = p.loss_fn(p.model, torch.randn(5, 6))  # the forward updates a buffer in place
    before_backward()
    loss.backward()


class _LiveStream:
    """A stream whose ``state_dict`` is its live position, which the next batch's fetch moves in place."""

    def __init__(self) -> None:
        self.position = {"samples": 0, "shard": [0, 0]}

    def state_dict(self) -> dict[str, Any]:
        return self.position

    def fetch(self) -> None:
        self.position["samples"] += 5
        self.position["shard"][1] += 1


def _step(state: TrainState) -> None:
    p = state.parts
    _forward_backward(state)
    p.optimizer.step()
    p.scheduler.step()
    random.random()  # every RNG moves, as in training
    state.step += 1


class _Pair:
    """The same state into a planning tier and a walking one; their slots compared (rule 1).  A
    third tier copies beside the loop as the worker's does (memory tier rule 7): between its
    snapshot and its commit come the next step's draws, forward (which updates buffers in place)
    and backward, as in the worker."""

    def __init__(self, root: Path) -> None:
        self.fast = MemoryTier(root / "fast", "fp")
        self.slow = MemoryTier(root / "slow", "fp", plans=False)
        self.beside = MemoryTier(root / "beside", "fp", overlap=True)
        self.schedule = MemorySchedule("auto", 0.03)
        self.foreign_draws = 0  # steps not compared (see snapshot)

    def snapshot(self, state: TrainState, forward: bool = True) -> None:
        python_rng = random.getstate()
        for tier in (self.fast, self.slow, self.beside):
            tier.snapshot(state, self.schedule)
        # A thread of the test process drew from python's generator between two tiers' captures
        # (Prefect's client threads do, now and then: pytest runs them beside this module): the
        # tiers did not see one state, so this step's bytes cannot be compared.  A worker runs
        # no such thread (invariant 12).
        one_state = random.getstate() == python_rng
        self.foreign_draws += not one_state
        assert self.foreign_draws <= 3, "a thread of the test process keeps drawing from python's generator"
        broken = self.beside.broken_before_commit
        if forward:  # what the loop does before its optimizer step; the copy beside starts at the backward
            _forward_backward(state, self.beside.backward_begins)
        self.beside.settle()  # ...which it precedes with this
        compared = [self.fast]
        if self.beside.broken_before_commit == broken:
            compared.append(self.beside)
        else:  # its writer found the walked rest changed: that snapshot is not committed (tier rule 7)
            assert slot_format.Header.read(self.beside.root / f"rank-0.slot-{self.beside.next_slot}.head") is None
        theirs = _committed(self.slow)
        for tier in compared if one_state else []:  # the committed header and the bytes it covers
            assert _committed(tier) == theirs, f"{tier.root.name}: the slot differs at step {state.step}"
        assert self.slow._plan is None and self.beside.changed_before_commit == 0

    def planned(self, state: TrainState) -> bool:
        """Whether the next snapshot of ``state`` takes the plan (without taking it)."""
        return self.fast._plan is not None and self.fast._plan.content(state, 0) is not None


def _committed(tier: MemoryTier) -> tuple[bytes, bytes]:
    """The header body and the slot bytes of ``tier``'s last snapshot."""
    slot = 1 - tier.next_slot
    body = slot_format.decode_header((tier.root / f"rank-0.slot-{slot}.head").read_bytes())
    header = slot_format.Header.read(tier.root / f"rank-0.slot-{slot}.head")
    assert body is not None and header is not None
    return body, (tier.root / f"rank-0.slot-{slot}.bin").read_bytes()[: header.size]


def _break_buffer(s: TrainState) -> None:
    s.parts.model.seen = s.parts.model.seen * 0.5  # out of place: a new tensor in _buffers


def _swap_data(s: TrainState) -> None:
    w = s.parts.model.head.weight
    w.data = w.data.clone()


def _load_optimizer(s: TrainState) -> None:
    s.parts.optimizer.load_state_dict(copy.deepcopy(s.parts.optimizer.state_dict()))  # new moments


def _add_parameter(s: TrainState) -> None:
    extra = nn.Parameter(torch.ones(3))
    s.parts.model.extra = extra  # a parameter added to the model...
    s.parts.optimizer.param_groups[0]["params"].append(extra)  # ...and to the optimizer


def _set_none_buffer(s: TrainState) -> None:
    s.parts.model.later = torch.ones(2)  # the key was there (as None): no container grows


def _replace_module(s: TrainState) -> None:
    s.parts.model.body[1] = nn.BatchNorm1d(8, affine=False)  # new buffers under the same name


@pytest.mark.parametrize(
    "breaks",
    [_break_buffer, _swap_data, _load_optimizer, _add_parameter, _set_none_buffer, _replace_module],
    ids=lambda f: f.__name__,
)
def test_plans_write_the_full_walks_bytes_and_notice_what_breaks_them(tmp_path: Path, breaks: Callable) -> None:
    state, pair = _state(), _Pair(tmp_path)
    for _ in range(3):
        _step(state)
        pair.snapshot(state)
    assert pair.planned(state)  # rule 4: the plan agreed and is used
    breaks(state)
    assert not pair.planned(state)  # rule 2
    for _ in range(3):
        _step(state)
        pair.snapshot(state)  # the full walk once, then a new plan: the same bytes throughout
    assert pair.planned(state)


def test_checking_a_plan_changes_nothing_it_checks(tmp_path: Path) -> None:
    """The optimizer's state is a defaultdict: a check that looked a parameter up with ``[]``
    would put back an entry someone removed, and the next checkpoint would differ."""
    state, pair = _state(), _Pair(tmp_path)
    for _ in range(2):
        _step(state)
        pair.snapshot(state)
    param = state.parts.model.head.weight
    del state.parts.optimizer.state[param]
    assert not pair.planned(state)
    assert param not in state.parts.optimizer.state
    pair.snapshot(state)


def _transpose_in_place(s: TrainState) -> None:
    with torch.no_grad():
        s.parts.model.body[3].weight.t_()  # square: the same address and shape, other strides


def _reinterpret(s: TrainState) -> None:
    seen = s.parts.model.seen
    seen.data = seen.data.view(torch.int32)  # the same object, address, shape, strides; another dtype


def _add_hook(s: TrainState) -> None:
    def hook(module: nn.Module, sd: dict, prefix: str, local: Any) -> None:
        sd[prefix + "extra"] = torch.ones(1)

    s.parts.model.head._register_state_dict_hook(hook)


def _other_model(s: TrainState) -> None:
    s.parts = dataclasses.replace(s.parts, model=_Net())


@pytest.mark.parametrize(
    "breaks", [_transpose_in_place, _reinterpret, _add_hook, _other_model], ids=lambda f: f.__name__
)
def test_what_a_plan_cannot_see_through_ends_it(tmp_path: Path, breaks: Callable) -> None:
    """Changes that keep every object in place but change the bytes or the keys (rule 2), and a
    train state that holds another model: the full walk's bytes, no plan made on it (rule 3)."""
    state, pair = _state(), _Pair(tmp_path)
    for _ in range(2):
        _step(state)
        pair.snapshot(state)
    assert pair.planned(state)
    breaks(state)
    assert not pair.planned(state)
    pair.snapshot(state, forward=False)  # an int32 running mean takes no forward


class _WithExtraState(_Net):
    def get_extra_state(self) -> dict[str, int]:
        return {"calls": 1}

    def set_extra_state(self, state: Any) -> None:
        del state


def _hooked() -> nn.Module:
    model = _Net()
    model._register_state_dict_hook(lambda module, sd, prefix, local: None)
    return model


class _CountingSGD(torch.optim.SGD):
    """Per-parameter state that is not a tensor: it can change while every tensor stays."""

    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        for p in self.param_groups[0]["params"]:
            self.state[p]["count"] = self.state[p].get("count", 0) + 1
        return out


@pytest.mark.parametrize(
    ("model", "opt"),
    [(_WithExtraState, torch.optim.AdamW), (_hooked, torch.optim.AdamW), (_Net, _CountingSGD)],
    ids=["extra_state", "state_dict_hook", "non_tensor_optimizer_state"],
)
def test_what_a_plan_cannot_watch_gets_no_plan(tmp_path: Path, model: Callable, opt: Callable) -> None:
    state, pair = _state(model(), opt), _Pair(tmp_path)
    for _ in range(MAX_REBUILDS + 2):
        _step(state)
        pair.snapshot(state)  # rule 3: the full walk, the same bytes
        assert pair.fast._plan is None


def test_plans_that_keep_breaking_are_no_longer_made(tmp_path: Path) -> None:
    state, pair = _state(), _Pair(tmp_path)
    for _ in range(MAX_REBUILDS + 3):
        _step(state)
        _break_buffer(state)  # every step: each plan lives one snapshot
        pair.snapshot(state)
    assert pair.fast._plan is None and pair.fast._plans_failed == MAX_REBUILDS  # rule 4


def test_a_snapshot_whose_parameters_change_before_its_commit_is_not_committed(tmp_path: Path) -> None:
    """Rule 7 of the memory tier: a weight edited in place between a snapshot copied beside the
    loop and its commit (a forward hook that clips weights) leaves that slot without a header;
    the slot before it stays, and the tier copies on the loop's thread from then on."""
    state, tier = _state(), MemoryTier(tmp_path / "beside", "fp", overlap=True)
    schedule = MemorySchedule("auto", 0.03)
    for _ in range(3):
        _step(state)
        tier.snapshot(state, schedule)
        tier.settle()
    assert tier._plan is not None and tier.newest_step() == 3
    _step(state)
    tier.snapshot(state, schedule)
    with torch.no_grad():
        state.parts.model.head.weight.clamp_(-0.01, 0.01)
    tier.settle()
    assert tier.changed_before_commit == 1 and not tier.beside  # copied on the loop's thread from now
    assert tier.complete_steps() == [3]  # step 4's slot has no header; step 3's is intact
    assert tier.candidate(3).loaded is not None
    _step(state)
    tier.snapshot(state, schedule)  # committed at once
    assert tier.complete_steps() == [5, 3]


def test_a_streams_position_is_laid_out_before_the_next_fetch_moves_it(tmp_path: Path) -> None:
    """Memory tier rule 7: the writer thread lays out only what the capture made for it; a stream's
    position may be the stream's live state, which the next fetch moves before the backward (where
    the copy beside the loop starts): it is laid out on the loop's thread, the same bytes."""
    state, pair = _state(), _Pair(tmp_path)
    state.stream = _LiveStream()
    for _ in range(4):
        _step(state)
        pair.snapshot(state)
    assert pair.planned(state) and pair.beside.beside and pair.beside.broken_before_commit == 0


def test_a_copy_beside_the_loop_waits_for_the_backward(tmp_path: Path) -> None:
    """The writer's job starts when the loop says its backward begins (or when the loop settles
    without having said so): its Python never runs beside the loop's fetch and forward."""
    state, tier = _state(), MemoryTier(tmp_path / "beside", "fp", overlap=True)
    schedule = MemorySchedule("auto", 0.03)
    for _ in range(2):  # a plan; the loop has said once that its backward begins
        _step(state)
        tier.snapshot(state, schedule)
        tier.backward_begins()
        tier.settle()
    _step(state)
    tier.snapshot(state, schedule)
    job = tier._beside._job
    assert job is not None and job.done is None  # not handed to the writer thread yet
    time.sleep(0.2)
    older = slot_format.Header.read(tier.root / f"rank-0.slot-{job.slot}.head")
    assert job.done is None and older is not None and older.step == state.step - 2  # its slot untouched
    tier.backward_begins()
    assert job.done is not None and job.done.result(5) is not None
    tier.settle()
    assert tier.newest_step() == state.step
