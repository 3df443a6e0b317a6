"""Per-rank device RNG, AMP dtype and device moves: the selection logic, tested without CUDA.

Which saved CUDA generator state applies to which device is a pure function
(:func:`training.device_rng.select_cuda_rng`); the real CUDA round trip is in ``tests/test_cuda.py``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from training.checkpointing.store import CheckpointStore
from training.config import SYNTHETIC_GENERATOR, ConfigError, load_config
from training.device_rng import select_cuda_rng
from training.state import TrainState, capture_rng, fallback_cuda_seed, restore_rng
from training.task import TaskParts
from training.worker import amp_dtype


def _state(n: int) -> torch.Tensor:
    return torch.full((16,), n, dtype=torch.uint8)


def test_per_rank_entry_is_taken_whatever_device_index_it_was_saved_on() -> None:
    saved = [{"device": 3, "state": _state(3)}]
    for index in (0, 3, 7):  # resumed with the rank on another device index: the stream follows the rank
        chosen, how = select_cuda_rng(saved, index)
        assert torch.equal(chosen, _state(3)) and "cuda:3" in how


def test_old_all_devices_format_takes_this_devices_entry_or_none() -> None:
    saved = [_state(0), _state(1), _state(2), _state(3)]  # saved by a rank that saw 4 GPUs
    chosen, how = select_cuda_rng(saved, 2)
    assert torch.equal(chosen, _state(2)) and "entry 2 of 4" in how
    chosen, how = select_cuda_rng(saved, 5)  # resumed on a node with more GPUs, rank on cuda:5
    assert chosen is None and "none for cuda:5" in how


def test_cpu_saved_checkpoint_has_no_device_state() -> None:
    assert select_cuda_rng([], 0) == (None, "checkpoint has no CUDA RNG state (saved on CPU)")


@pytest.mark.parametrize(
    "bad",
    [
        [{"device": 0, "state": _state(0)}, {"device": 1, "state": _state(1)}],
        [{"device": 0, "state": _state(0)}, _state(1)],
        ["x"],
    ],
)
def test_malformed_entries_are_refused(bad: list) -> None:
    with pytest.raises(ValueError):
        select_cuda_rng(bad, 0)


def test_fallback_seed_is_reproducible_and_distinct_per_rank_and_device() -> None:
    a, b = torch.get_rng_state(), torch.Generator().manual_seed(99).get_state()
    assert fallback_cuda_seed(a, 0) == fallback_cuda_seed(a.clone(), 0)
    assert len({fallback_cuda_seed(a, 0), fallback_cuda_seed(a, 1), fallback_cuda_seed(b, 0)}) == 3
    assert 0 <= fallback_cuda_seed(a, 0) < 2**63


def test_cpu_capture_keeps_the_format_cpu_digests_depend_on() -> None:
    assert capture_rng()["cuda"] == [] and capture_rng(torch.device("cpu"))["cuda"] == []


def test_device_rng_formats_survive_a_checkpoint_round_trip(tmp_path: Path) -> None:
    """Both formats go through safetensors + the JSON skeleton and come back selectable."""
    rng = capture_rng()
    new = {**rng, "cuda": [{"device": 1, "state": _state(7)}]}
    old = {**rng, "cuda": [_state(0), _state(1)]}
    store = CheckpointStore(tmp_path)
    store.save(1, {"rank-0": {"rng": new, "step": 1}, "rank-1": {"rng": old, "step": 1}}, blocking=True)
    _, parts = store.load_latest()
    chosen, _ = select_cuda_rng(parts["rank-0"]["rng"]["cuda"], 0)
    assert torch.equal(chosen, _state(7))
    chosen, _ = select_cuda_rng(parts["rank-1"]["rng"]["cuda"], 1)
    assert torch.equal(chosen, _state(1))


def test_cuda_checkpoint_restores_on_a_cpu_run() -> None:
    """A rank RNG saved on a GPU (any format) restores on CPU: the device stream is ignored.
    (Before per-rank device RNG this raised: 'checkpoint holds RNG for N CUDA device(s) but 0 ...'.)"""
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    rng = capture_rng()
    for cuda in ([{"device": 0, "state": _state(1)}], [_state(0), _state(1)]):
        note = restore_rng({**rng, "cuda": cuda}, torch.device("cpu"))
        assert "not restored" in note and torch.equal(torch.rand(3), want)


def _parts() -> TaskParts:
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 4)
    return TaskParts(
        model=m,
        optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
        scheduler=None,
        train_data=[],
        loss_fn=lambda m, b: b,
    )


def test_amp_off_checkpoint_resumes_with_an_enabled_scaler(tmp_path: Path) -> None:
    """``device: auto`` + ``amp``: saved on CPU (AMP off, empty scaler state), resumed on CUDA
    (AMP on).  GradScaler.load_state_dict refuses an empty dict; the fresh scale is kept."""
    src = TrainState(_parts(), torch.amp.GradScaler("cpu", enabled=False), step=3)
    store = CheckpointStore(tmp_path)
    store.save(3, src.checkpoint_parts(), blocking=True)
    _, loaded = store.load_latest()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=True)
    dst = TrainState(_parts(), scaler)
    dst.restore(loaded)
    assert dst.step == 3 and scaler.get_scale() == 1024.0


def test_scaler_state_round_trips_exactly(tmp_path: Path) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**13, growth_interval=7, enabled=True)
    scaler.load_state_dict({**scaler.state_dict(), "_growth_tracker": 5})
    src = TrainState(_parts(), scaler, step=2)
    store = CheckpointStore(tmp_path)
    store.save(2, src.checkpoint_parts(), blocking=True)
    _, loaded = store.load_latest()
    dst = TrainState(_parts(), torch.amp.GradScaler("cpu", enabled=True))
    dst.restore(loaded)
    assert dst.scaler.state_dict() == scaler.state_dict()


def test_amp_dtype_choice() -> None:
    cuda = torch.device("cuda", 0)  # a device object only: no CUDA call for an explicit choice
    on_cuda = ["train.device=cuda", "train.amp=true"]
    assert amp_dtype(load_config(None, [*on_cuda, "train.amp_dtype=float16"]), cuda) == torch.float16
    assert amp_dtype(load_config(None, [*on_cuda, "train.amp_dtype=bfloat16"]), cuda) == torch.bfloat16
    assert amp_dtype(load_config(None, ["train.amp=false", "train.amp_dtype=float16"]), cuda) is None
    cpu = torch.device("cpu")  # CPU autocast runs bfloat16 (issue 44); float16 there is refused, never ignored
    assert amp_dtype(load_config(None, ["train.amp=true"]), cpu) == torch.bfloat16
    assert amp_dtype(load_config(None, ["train.amp=false"]), cpu) is None
    auto = load_config(None, ["train.device=auto", "train.amp=true", "train.amp_dtype=float16"])
    with pytest.raises(ConfigError, match="not honoured on CPU"):
        amp_dtype(auto, cpu)  # device auto found no GPU: the config check could not know


def _legacy_fingerprint(overrides: list[str]) -> str:
    """The fingerprint as computed before ``train.amp_dtype`` existed."""
    cfg = load_config(None, overrides)
    # settings added since (at their defaults here)
    newer = {"amp_dtype", "eval_samples", "grad_accum_steps", "parallel", "reshard_after_forward"}
    newer |= {"compile", "ema_decay", "ema_registered", "on_nonfinite", "nonfinite_steps"}
    train = cfg.train.model_dump(exclude={"chunk_steps", "eval_every", "ranks", "nnodes", "hosts", *newer})
    data = cfg.data.model_dump(exclude={"num_workers", "prepared_dir"})
    if cfg.data.source == "synthetic":  # a regenerated corpus is another run on purpose (SYNTHETIC_GENERATOR)
        data["generator"] = SYNTHETIC_GENERATOR
    payload = {"task": cfg.task, "task_args": cfg.task_args, "data": data, "train": train}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def test_amp_dtype_is_in_the_fingerprint_only_when_it_changes_the_trajectory() -> None:
    def fp(*o: str) -> str:
        return load_config(None, list(o)).fingerprint()

    for base in ([], ["train.amp=true"], ["train.device=cuda", "train.amp=true"]):
        assert fp(*base) == _legacy_fingerprint(base)  # existing runs keep resuming
    assert fp("train.amp=false", "train.amp_dtype=float16") == fp("train.amp=false")
    fps = {fp("train.device=cuda", "train.amp=true", f"train.amp_dtype={d}") for d in ("auto", "float16", "bfloat16")}
    assert len(fps) == 3


def test_replayed_nan_grad_norm_is_not_a_nondeterministic_resume(tmp_path: Path) -> None:
    """An AMP float16 step that the GradScaler skips logs a NaN (or inf) grad norm; replaying it
    bitwise must not be reported as a non-deterministic resume (NaN != NaN)."""
    from training.events import read_events
    from training.tracking.metrics import JsonlBackend, StepMetricLogger

    rows = [
        (1, {"loss": 2.5, "lr": 1e-3, "grad_norm": float("nan")}),
        (2, {"loss": 2.25, "lr": 1e-3, "grad_norm": float("inf")}),
    ]
    first = StepMetricLogger([JsonlBackend(tmp_path / "metrics.jsonl")], tmp_path, flush_every=1)
    for step, m in rows:
        first.log(step, dict(m))
    first.close()
    replay = StepMetricLogger([JsonlBackend(tmp_path / "metrics.jsonl")], tmp_path, flush_every=1)
    for step, m in rows:
        replay.log(step, dict(m))
    assert replay.replayed == 6 and replay.mismatches == []
    assert not read_events(tmp_path, "nondeterministic_resume")
    replay.log(2, {"loss": 2.0, "lr": 1e-3, "grad_norm": float("inf")})  # a real difference is still caught
    assert [m["metric"] for m in replay.mismatches] == ["loss"]
