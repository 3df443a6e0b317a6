"""CUDA: bitwise resume on one GPU (fp32, AMP fp16 with its GradScaler, AMP bf16), per-rank
device RNG, the flow with one kill, a checkpoint moved CPU -> GPU -> CPU, ``device: auto``.

Every test here skips on a machine without CUDA (the reason shows in ``pytest -ra``);
``bench/gpu_check.sh`` runs them on a GPU machine.  They reuse the CPU tests' helpers: what is
proven on CPU in tests/test_resume.py and tests/test_flow.py is proven here on the device.

Tolerance for a run moved between CPU and GPU (not bitwise: other kernels, other reduction
orders): steps before the move are bitwise equal to an all-CPU run; every later loss is within
``MOVED_LOSS_RTOL`` (relative) of it, with dropout off (CPU and CUDA dropout masks come from
different generators, so with dropout the trajectories are different samples, not roundings).
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from tests.engine_util import final_digest, kill_at_random_steps, logged_losses, make_run, reference_digest, run_worker
from tests.flow_run_util import train_killed_in_chunk_3
from training.checkpointing.store import CheckpointStore
from training.events import read_events

NO_CUDA = "needs a CUDA device (none visible)"
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]

TOTAL = 120
GPU = ["train.device=cuda", "train.deterministic=true"]
#: A step of this tiny model takes milliseconds on a GPU: slow it so kills land mid-run.
SLOW = {"CONVOY_FAULTS": "step_delay=0.02"}
PRECISION = {
    "fp32": [],
    "fp16": ["train.amp=true", "train.amp_dtype=float16"],
    "bf16": ["train.amp=true", "train.amp_dtype=bfloat16"],
}
HIDE_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
MOVED_LOSS_RTOL = 1e-2


@pytest.mark.parametrize("precision", list(PRECISION))
def test_sigkill_at_random_steps_resumes_bitwise_on_gpu(tmp_path: Path, precision: str) -> None:
    if precision == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU does not support bfloat16")
    extra = GPU + PRECISION[precision]
    ref = reference_digest(tmp_path, extra)
    run_dir = make_run(tmp_path, "killed", extra)
    rng = random.Random(f"gpu-kill-{precision}")
    targets = sorted(rng.sample(range(3, TOTAL - 5), 3 if precision == "fp32" else 2))
    kills = kill_at_random_steps(run_dir, TOTAL, targets, rng, SLOW)
    code, out = run_worker(run_dir, TOTAL)
    assert code == 0, out
    print(f"{precision}: killed at {kills}")
    assert len(kills) >= 2, kills
    dtype = {"fp16": "float16", "bf16": "bfloat16"}.get(precision)
    assert f"training on cuda:0 with AMP {dtype}" in out if dtype else "training on cuda:0\n" in out
    assert "cuda:0 RNG restored: rank stream (saved on cuda:0)" in out
    assert final_digest(run_dir) == ref
    assert logged_losses(run_dir) == logged_losses(tmp_path / "runs" / "reference")
    assert not read_events(run_dir, "nondeterministic_resume")  # every replayed step matched
    _, parts = CheckpointStore(run_dir).load_latest()
    assert [e["device"] for e in parts["rank-0"]["rng"]["cuda"]] == [0]  # this rank's device only
    scaler = parts["state"]["scaler"]
    if dtype is None:
        assert scaler == {}
    else:  # the GradScaler's dynamic scale is part of the bitwise-equal state
        assert scaler["scale"] > 0 and set(scaler) >= {"growth_factor", "backoff_factor", "_growth_tracker"}


def test_cuda_rng_capture_restore_and_fallback_in_process() -> None:
    from training.state import capture_rng, restore_rng

    dev = torch.device("cuda", 0)
    torch.cuda.manual_seed(7)
    torch.rand(3, device=dev)
    rng = capture_rng(dev)
    want = torch.rand(5, device=dev)
    torch.rand(100, device=dev)
    assert "restored: rank stream" in restore_rng(rng, dev)
    assert torch.equal(torch.rand(5, device=dev), want)
    old = {**rng, "cuda": [e["state"] for e in rng["cuda"]]}  # pre-per-rank format, one device seen
    assert "old all-devices format, entry 0 of 1" in restore_rng(old, dev)
    assert torch.equal(torch.rand(5, device=dev), want)
    cpu_saved = {**rng, "cuda": []}
    assert "freshly seeded" in restore_rng(cpu_saved, dev)
    first = torch.rand(5, device=dev)
    restore_rng(cpu_saved, dev)
    assert torch.equal(torch.rand(5, device=dev), first) and not torch.equal(first, want)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_resume_with_another_number_of_visible_devices(tmp_path: Path) -> None:
    """Saved by a rank training on cuda:1 of 2 visible GPUs; resumed where only that GPU is
    visible (it is cuda:0 there).  Bitwise equal to a run on cuda:0 throughout."""
    ref = reference_digest(tmp_path, GPU)
    run_dir = make_run(tmp_path, "moved", GPU)
    code, out = run_worker(run_dir, 60, {"LOCAL_RANK": "1"})
    assert code == 0 and "training on cuda:1" in out, out
    code, out = run_worker(run_dir, TOTAL, {"CUDA_VISIBLE_DEVICES": "1", "LOCAL_RANK": "0"})
    assert code == 0 and "cuda:0 RNG restored: rank stream (saved on cuda:1)" in out, out
    assert final_digest(run_dir) == ref


def test_old_all_devices_checkpoint_resumes_with_fewer_visible_gpus(tmp_path: Path) -> None:
    """A checkpoint in the format from before per-rank device RNG, written by a rank that saw 2
    GPUs (its ``cuda`` entry lists both devices' states), resumes where 1 GPU is visible (the old
    code refused: 'checkpoint holds RNG for 2 CUDA device(s) but 1 are visible') and ends
    bitwise equal to an uninterrupted run."""
    ref = reference_digest(tmp_path, GPU)
    src = make_run(tmp_path, "src", GPU)
    code, out = run_worker(src, 60)
    assert code == 0, out
    ck, parts = CheckpointStore(src).load_latest()
    rng = parts["rank-0"]["rng"]
    mine = rng["cuda"][0]["state"]
    rng["cuda"] = [mine.clone(), torch.full_like(mine, 7)]  # cuda:0 (this rank's), cuda:1 (another's)
    old = make_run(tmp_path, "old-format", GPU)
    CheckpointStore(old, fingerprint=ck.manifest["fingerprint"]).save(60, parts, blocking=True)
    code, out = run_worker(old, TOTAL)
    assert code == 0, out
    assert "cuda:0 RNG restored: old all-devices format, entry 0 of 2" in out
    assert final_digest(old) == ref


def test_device_auto_cpu_checkpoint_onto_gpu_and_back(tmp_path: Path) -> None:
    """``device: auto`` trains on CPU where no GPU is visible and on the GPU where one is; the
    same run moves CPU (steps 1-40) -> GPU (41-80) -> CPU (81-120) through its checkpoints."""
    extra = ["train.device=auto", "task_args.dropout=0.0"]
    reference_digest(tmp_path, extra, env=HIDE_GPUS)  # all on CPU
    run_dir = make_run(tmp_path, "moved", extra)
    outs = []
    for until, env in ((40, HIDE_GPUS), (80, None), (TOTAL, HIDE_GPUS)):
        code, out = run_worker(run_dir, until, env)
        assert code == 0, out
        outs.append(out)
    assert "training on cpu" in outs[0] and "training on cuda:0" in outs[1] and "training on cpu" in outs[2]
    assert "resumed from step 40" in outs[1] and "resumed from step 80" in outs[2]
    assert "cuda:0 RNG freshly seeded (checkpoint has no CUDA RNG state (saved on CPU))" in outs[1]
    ref = dict(logged_losses(tmp_path / "runs" / "reference"))
    got = dict(logged_losses(run_dir))
    assert sorted(got) == list(range(1, TOTAL + 1))  # the same step trajectory
    assert all(got[s] == ref[s] for s in range(1, 41))  # before the move: bitwise
    worst = max(abs(got[s] - ref[s]) / abs(ref[s]) for s in range(41, TOTAL + 1))
    print(f"moved run: worst relative loss difference to the all-CPU run over steps 41-{TOTAL}: {worst:.2e}")
    assert worst <= MOVED_LOSS_RTOL


@pytest.mark.skipif(importlib.util.find_spec("prefect") is None, reason="needs prefect (not installed)")
def test_convoy_train_flow_on_gpu_one_sigkill(
    prefect_api: str, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The flow + supervisor path on the GPU: SIGKILL inside chunk 3, only chunk 3 retried,
    final state bitwise equal to an uninterrupted GPU worker's."""
    from flows.train import run_training
    from tests.flow_util import CHUNK, TOTAL, assert_no_leftovers, config, params, uninterrupted_digest

    gpu = {"device": "cuda", "deterministic": True}
    ref = uninterrupted_digest(tmp_path, data_dir, "gpu-reference", train=gpu)
    monkeypatch.setenv("CONVOY_FAULTS", f"step_delay=0.03,slow_step={2 * CHUNK + 9}:2")
    cfg = config(params(tmp_path, data_dir, "gpu-kill9", train=gpu))
    run_dir = cfg.run_dir.resolve()
    summary, _ = train_killed_in_chunk_3(run_training, cfg)
    assert summary["final_step"] == TOTAL
    assert summary["digest"] == ref, "resumed GPU run diverged from the uninterrupted one"
    assert summary["attempts"] == {1: 1, 2: 1, 3: 2}
    assert [(e["chunk"], e["failure"]) for e in read_events(run_dir, "failure")] == [(3, "killed")]
    assert_no_leftovers(run_dir)
