"""Host memory budgeted before a run starts (training/memory_budget.py, issue 42 item 2).

The state's size read from the task built on the meta device agrees with what it holds once it
trained; the projection counts each tier's copies and the ranks on the node; a projection over the
budget gives up the memory tier, then the async save's staging, one line each; a ``/dev/shm`` too
small for the tier turns it off in one line; a run projected over all of the memory is refused in
one line before anything starts.  End to end: ``convoy train`` in a private mount namespace whose
``/dev/shm`` cannot hold the tier, with a budget that leaves no room for the staging copy, says
both in one line each, trains, and after a SIGKILL of its worker ends bitwise where an
uninterrupted run ends.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from engine_util import make_run
from flow_util import REPO, TOTAL, assert_no_leftovers, config, params, wait_for_step
from typer.testing import CliRunner

from flows.cli.main import app
from training import memory_budget
from training.checkpointing.store import CheckpointStore
from training.config import ConfigError, load_config
from training.memory_budget import GB, HostMemory, StateSize, fit, project
from training.rundir import load_run_config
from training.task import build_task, check_task

PLENTY = HostMemory(int(100 * GB), int(50 * GB), "test")


def _demo(*overrides: str):
    return load_config(None, ["tracking.mlflow=false", *overrides])


def test_the_state_sized_on_meta_is_what_it_holds_once_trained(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    cfg = load_run_config(run_dir)
    planned = StateSize.of(check_task(cfg))  # meta: shapes and dtypes, no optimizer state yet
    parts = build_task(cfg, torch.device("cpu"))
    for p in parts.model.parameters():
        p.grad = torch.zeros_like(p)
    parts.optimizer.step()  # AdamW: its moments exist now
    trained = StateSize.of(parts)
    assert planned.model == trained.model and planned.trainable == trained.trainable > 0
    scalars = sum(s["step"].numel() * s["step"].element_size() for s in parts.optimizer.state.values())
    assert planned.optimizer == trained.optimizer - scalars == 2 * trained.trainable  # two moments


def test_the_projection_counts_each_tier_and_every_rank() -> None:
    size = StateSize(model=400, optimizer=800, trainable=400)
    one = project(_demo(), size, on_cpu=True)  # one slot, which the async save stages in too
    assert (one.live, one.tier, one.staging, one.standby) == (1600, 1200, 0, 0)
    assert (project(_demo("checkpoint.memory_slots=2"), size, on_cpu=True).tier, one.staging) == (2400, 0)
    no_tier = project(_demo("checkpoint.memory_every_steps=null"), size, on_cpu=True)
    assert (no_tier.tier, no_tier.staging) == (0, 1200)  # the save stages its own copy then
    two = project(_demo("train.ranks=2", "train.batch_size=16"), size, on_cpu=True)
    assert (two.live, two.tier, two.staging) == (3200, 1200, 0)  # replicas live; rank 0's copies
    sharded = project(_demo("train.ranks=2", "train.batch_size=16", "checkpoint.format=sharded"), size, on_cpu=True)
    assert (sharded.live, sharded.tier, sharded.staging) == (3200, 2400, 0)  # DDP: each rank's tier a replica
    fsdp = project(_demo("train.ranks=2", "train.batch_size=16", "train.parallel=fsdp"), size, on_cpu=True)
    assert (fsdp.live, fsdp.tier, fsdp.staging) == (1600, 1200, 0)  # FSDP: each rank's tier its share
    gpu = project(_demo("orchestration.standby=true"), size, on_cpu=False)
    assert (gpu.live, gpu.standby) == (0, 400)


def test_over_the_budget_it_gives_up_a_slot_then_the_last_copy_then_refuses() -> None:
    size = StateSize(model=int(1 * GB), optimizer=int(2 * GB), trainable=int(1 * GB))
    cfg = _demo("checkpoint.memory_slots=2")
    kept = fit(cfg, size, PLENTY, on_cpu=True)
    assert kept.config == cfg and kept.gave_up == []
    assert kept.line.startswith("host memory: state 3.00 GB, 1 rank(s) on this node; projected peak 10.70 GB")

    tight = HostMemory(int(8.2 * GB / 0.85), int(50 * GB), "test")  # room for one slot, not two
    one = fit(cfg, size, tight, on_cpu=True)
    assert one.config.checkpoint.memory_slots == 1 and one.config.checkpoint.memory_every_steps == "auto"
    assert len(one.gave_up) == 1 and "memory tier down to one slot (checkpoint.memory_slots: 1)" in one.gave_up[0]
    assert one.projection.peak == int(7.7 * GB)

    tighter = HostMemory(int(5.7 * GB / 0.85), int(50 * GB), "test")  # room for no copy at all
    none = fit(cfg, size, tighter, on_cpu=True)
    c = none.config.checkpoint
    assert c.memory_every_steps is None and not c.async_save and len(none.gave_up) == 2
    assert "memory tier off (checkpoint.memory_every_steps: null)" in none.gave_up[1]
    assert "checkpoint.every_steps = 50" in none.gave_up[1]
    assert "asynchronous saves off (checkpoint.async_save: false)" in none.gave_up[1]
    assert none.config.fingerprint() == cfg.fingerprint()  # nothing of the trajectory was given up

    with pytest.raises(ConfigError) as refused:
        fit(cfg, size, HostMemory(int(4 * GB), int(50 * GB), "test"), on_cpu=True)
    said = str(refused.value)
    assert "\n" not in said and said.startswith("host memory: projected peak 4.70 GB (live state 4.00 GB) exceeds")
    assert "train.parallel: fsdp" in said


def test_a_dev_shm_too_small_for_the_tier_turns_it_off_in_one_line() -> None:
    size = StateSize(model=int(0.1 * GB), optimizer=int(0.2 * GB), trainable=int(0.1 * GB))
    small = HostMemory(int(100 * GB), int(0.064 * GB), "test")  # Docker's default /dev/shm
    out = fit(_demo(), size, small, on_cpu=True)
    assert out.config.checkpoint.memory_every_steps is None and out.config.checkpoint.async_save
    assert out.gave_up == [
        "host memory: /dev/shm has 64.0 MB free, the memory tier's 1 slot(s) need 300.0 MB: memory "
        "tier off (checkpoint.memory_every_steps: null); a kill now loses up to the steps since the last disk "
        "checkpoint (checkpoint.every_steps = 50) instead of those since the last snapshot"
    ]
    assert out.projection.staging == int(0.3 * GB)  # the save stages its own copy, in private memory


def test_validate_prints_the_projection_and_refuses_a_run_that_cannot_fit(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    cfg = load_run_config(run_dir)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    runner = CliRunner()
    ok = runner.invoke(app, ["validate", str(tmp_path / "params.yaml")])
    assert ok.exit_code == 0 and "host memory: state " in ok.output and "(MemAvailable)" in ok.output, ok.output
    refused = runner.invoke(app, ["validate", str(tmp_path / "params.yaml"), "-S", "checkpoint.host_memory_gb=0.1"])
    assert refused.exit_code == 2 and "even with the memory tier and asynchronous saves off" in refused.output


def _unshare_works() -> bool:
    probe = "mount -t tmpfs -o size=1m tmpfs /dev/shm"
    try:
        return (
            subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", probe], timeout=30).returncode == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
def test_a_run_that_cannot_keep_its_tiers_says_so_trains_and_resumes_bitwise(
    prefect_api: str, data_dir: Path, tmp_path: Path, reference_digest: str
) -> None:
    if not _unshare_works():
        pytest.skip("no private mount namespace here (unshare -m needs root): /dev/shm cannot be made small")
    p = params(tmp_path, data_dir, "budget", heartbeat={"stall_s": 30})
    cfg = config(p)
    size = StateSize.of(check_task(cfg))
    # A budget with room for training and the tier's absence, but not for the save's own staging.
    without_tier = project(memory_budget._tier_off(cfg), size, on_cpu=True)
    p["checkpoint"]["host_memory_gb"] = (without_tier.peak - without_tier.staging / 2) / 0.85 / GB
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(p))
    shm = -(-size.state // 2 // 4096) * 4096  # half a slot of the state
    train = shlex.join([sys.executable, "-m", "flows.cli.main", "train", str(tmp_path / "params.yaml")])
    script = f"mount -t tmpfs -o size={shm} tmpfs /dev/shm && exec {train}"
    env = {k: v for k, v in os.environ.items() if k != "CONVOY_MEMORY_DIR"}  # the tier in /dev/shm
    flow = subprocess.Popen(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        cwd=REPO,
        env={**env, "PREFECT_API_URL": prefect_api, "COLUMNS": "250", "CONVOY_FAULTS": "step_delay=0.03"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    run_dir = cfg.run_dir.resolve()
    try:
        beat = wait_for_step(run_dir, 27)
        os.kill(beat.pid, signal.SIGKILL)  # between two disk checkpoints: the disk tier decides
        out, err = flow.communicate(timeout=600)
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, signal.SIGKILL)
            flow.wait()
    assert flow.returncode == 0, err[-3000:]
    said = out + err
    assert "host memory: /dev/shm has " in said and "the memory tier's 1 slot(s) need" in said, said[-3000:]
    assert "asynchronous saves off (checkpoint.async_save: false)" in said, said[-3000:]
    ran = json.loads((run_dir / "config.json").read_text())["checkpoint"]
    assert ran["memory_every_steps"] is None and ran["async_save"] is False
    final = CheckpointStore(run_dir).latest_valid(record=False)
    assert final is not None and final.step == TOTAL and final.digest == reference_digest
    assert_no_leftovers(run_dir)


def test_a_worker_short_of_memory_before_a_copy_gives_its_copies_up_and_resumes_bitwise(tmp_path: Path) -> None:
    """Rule 5 (training/loop/memory_watch.py): a budget the start-up projection fits (it knows the state,
    not the worker's own interpreter and activations) is found short by the worker before its first
    copy: every copy given up in one line and one event, the tier's slot freed, saves synchronous;
    a kill then resumes from disk, and the run ends bitwise on the uninterrupted one."""
    from engine_util import final_digest, kill_group, reference_digest, run_worker, start_worker, wait_for_step

    from training.run_memory import tier_root

    reference = reference_digest(tmp_path, [], until=60)
    cfg = load_run_config(tmp_path / "runs" / "reference")
    size = StateSize.of(check_task(cfg))
    gb = project(cfg, size, on_cpu=True).peak / cfg.checkpoint.host_memory_share / GB * 1.01
    stand_in = HostMemory(int(gb * GB), PLENTY.shm_free, "test")
    assert fit(cfg, size, stand_in, on_cpu=True).gave_up == []  # the start-up budget lets it run whole
    run_dir = make_run(tmp_path, "short", [f"checkpoint.host_memory_gb={gb}"])
    p = start_worker(run_dir, 60)
    assert wait_for_step(run_dir, p, 25) is not None, p.communicate()[0][-3000:]
    kill_group(p)
    said = p.communicate()[0]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    short = [e for e in events if e["kind"] == "host_memory_short"]
    assert len(short) == 1 and short[0]["step"] <= 10, said[-3000:]
    assert "host memory while training: " in said and "asynchronous saves off" in said, said[-3000:]
    saves = [e for e in events if e["kind"] == "checkpoint_saved"]
    assert saves and all(e["blocking"] for e in saves if e["step"] >= short[0]["step"]), saves
    root = tier_root(run_dir)
    assert root is None or not list(root.glob("rank-0.slot-*")), list(root.iterdir()) if root else None
    code, again = run_worker(run_dir, 60)
    assert code == 0 and "host memory while training: " in again, again[-3000:]
    assert final_digest(run_dir) == reference
