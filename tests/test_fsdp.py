"""``train.parallel: fsdp``: FSDP2 applied by convoy to the example model (each block, then the
root), 2 CPU ranks over gloo.  A run whose ranks are SIGKILLed (all of them, resumed from each
rank's shard in the memory tier; or one alone in the middle of a save) ends bitwise where an
uninterrupted run ends, every step's loss equal; the
checkpoint restored on 1 and on 4 ranks is, gathered whole, bitwise the state that was saved; the
same optimisation as DDP (gradient accumulation, the global gradient norm) within summation order;
the finished model exported whole from the shards loads into the unsharded class."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.dvc_util import dvc_repo
from tests.engine_util import SMALL, final_digest, kill_group, make_run, wait_for_step
from tests.torchrun_util import RESIZE_LOSS_TOLERANCE, TOTAL, finish, losses, torchrun
from training.checkpointing.store import CheckpointStore
from training.events import read_events
from training.heartbeat import read_heartbeat
from training.tracking.resume_audit import trained_high_water

pytestmark = pytest.mark.slow
FSDP = ["train.parallel=fsdp", f"train.total_steps={TOTAL}", "train.ranks=2"]


def reopen(tmp: Path, name: str, extra: list[str]) -> None:
    """The run ``name`` opened again with ``extra`` (another world size: not in the fingerprint)."""
    from training.config import load_config
    from training.rundir import open_run

    where = [f"runs_dir={tmp / 'runs'}", f"data.prepared_dir={tmp / 'data'}", f"run_name={name}"]
    open_run(load_config(None, [*SMALL, *where, *extra]))


def probe(run: Path, ranks: int, out: Path) -> dict:
    """``tests/fsdp_probe.py`` over ``ranks`` ranks: the newest checkpoint restored and compared."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    done = subprocess.run(
        [*cmd, "-m", "tests.fsdp_probe", str(run), str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def kill_rank(run: Path, rank: int, at_step: int, p: subprocess.Popen) -> int:
    """SIGKILL one rank's process (its heartbeat names it) once it trains past ``at_step``."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        hb = read_heartbeat(run, rank)
        if hb and hb.phase in ("train", "save") and hb.step >= at_step:
            os.kill(int(hb.pid), signal.SIGKILL)
            return hb.step
        time.sleep(0.01)
    raise AssertionError(f"rank {rank} never reached step {at_step}")


def test_fsdp_ranks_killed_resume_bitwise_and_restore_whole_on_any_world_size(tmp_path: Path) -> None:
    ref = make_run(tmp_path, "ref", FSDP)
    finish(torchrun(ref, TOTAL, 2))
    tiers = ["checkpoint.memory_every_steps=1", "checkpoint.memory_slots=2"]  # each rank's shard in RAM
    run = make_run(tmp_path, "killed", [*FSDP, "checkpoint.every_steps=5", *tiers])
    p = torchrun(run, TOTAL, 2)
    wait_for_step(run, p, 17)
    kill_group(p)  # every rank at once
    p.wait()
    trained = trained_high_water(run, max(read_heartbeat(run, r).step for r in (0, 1)))
    # Rank 1 alone, while its save persists (slowed): torchrun stops rank 0, nothing half-saved commits.
    os.environ["CONVOY_FAULTS"] = "persist_delay=0.5"
    try:
        p = torchrun(run, TOTAL, 2)
        killed_at = kill_rank(run, 1, 36, p)
    finally:
        del os.environ["CONVOY_FAULTS"]
    p.communicate(timeout=120)
    assert p.returncode != 0
    newest = CheckpointStore(run).latest_valid(record=False)
    assert newest is not None and newest.step <= killed_at
    out = finish(torchrun(run, TOTAL, 2))
    assert "resumed from step" in out
    first = read_events(run, "resumed")[0]  # the ranks killed at once: their shards from RAM (tier rule 9)
    assert first["tier"] == "memory" and trained - first["step"] <= 1, (first, trained)
    assert losses(run) == losses(ref)  # every step, bitwise
    assert final_digest(run) == final_digest(ref)
    ck = CheckpointStore(run).latest_valid(record=False)
    shards = sorted(n for n in ck.manifest["files"] if n.startswith("dcp/"))
    assert any("shard-00001" in n for n in shards) and any("shard-00002" in n for n in shards), shards
    for ranks in (1, 4):  # re-sharded through DCP (2 -> 1, 2 -> 4): gathered whole, the saved state bit for bit
        found = probe(run, ranks, tmp_path / f"probe-{ranks}.json")
        print(f"FSDP checkpoint of step {found['step']} restored on {ranks} rank(s): {found['tensors']} tensors")
        assert found["step"] == TOTAL and found["tensors"] > 20 and found["differ"] == [], found


def test_a_factory_that_shards_its_model_itself_trains_and_resumes_bitwise(tmp_path: Path) -> None:
    """The factory applies ``fully_shard`` itself (its parameters are DTensors when convoy gets
    them): never DDP-wrapped (DDP's start-up broadcast fails on DTensors), it trains, and after a
    SIGKILL of rank 0 in the middle of a step it resumes from the ranks' shards in the memory tier
    and ends bitwise where the uninterrupted run ends."""
    own = [
        *FSDP,
        "task=tests.pipeline_tasks:build_char_gpt_sharding_itself",
        "train.total_steps=30",
        "train.chunk_steps=30",
    ]
    ref = make_run(tmp_path, "ref", own)
    finish(torchrun(ref, 30, 2))
    run = make_run(
        tmp_path,
        "own",
        [*own, "checkpoint.every_steps=5", "checkpoint.memory_every_steps=1", "checkpoint.memory_slots=2"],
    )
    p = torchrun(run, 30, 2)
    killed_at = kill_rank(run, 0, 12, p)
    p.communicate(timeout=120)
    assert p.returncode != 0
    finish(torchrun(run, 30, 2))
    resumed = read_events(run, "resumed")
    first = resumed[0]
    print(f"self-sharded factory: rank 0 killed at step {killed_at}, resumed from {first['step']} ({first['tier']})")
    assert first["tier"] == "memory" and first["step"] > 10, first  # each rank's pieces, from RAM
    assert losses(run) == losses(ref) and final_digest(run) == final_digest(ref)
    ck = CheckpointStore(run).latest_valid(record=False)
    assert ck.manifest["layout"] == "sharded" and sum(n.startswith("dcp/shard-") for n in ck.manifest["files"]) == 2


def test_a_sharded_checkpoint_travels_to_another_machine_and_resumes_bitwise(tmp_path: Path) -> None:
    """Machine A trains FSDP2 over 2 ranks and uploads step 10 (DVC, a local-directory remote);
    machine B, with the repository and the remote only, fetches it (every shard verified against
    the manifest), resumes on 2 ranks and ends at A's step 20 bit for bit."""
    from tasks.remote.dvc_version import version_checkpoint
    from tasks.remote.remote_checkpoints import fetch_newest
    from training.rundir import load_run_config

    remote = str(tmp_path / "remote")
    extra = [*FSDP, "train.total_steps=20", "train.chunk_steps=20", "checkpoint.every_steps=10"]
    extra += ["tracking.dvc=true", f"tracking.dvc_remote={remote}"]
    a = make_run(dvc_repo(tmp_path / "a"), "run", extra)
    finish(torchrun(a, 20, 2))
    version_checkpoint(None, a / "checkpoints" / "step-000000010", remote)
    b = make_run(dvc_repo(tmp_path / "b"), "run", extra)
    got = fetch_newest(load_run_config(b), b)
    assert got is not None and got["step"] == 10 and got["refused"] == [], got
    fetched = CheckpointStore(b).latest_valid(record=False)
    assert fetched.step == 10 and sum(n.startswith("dcp/shard-") for n in fetched.manifest["files"]) == 2
    out = finish(torchrun(b, 20, 2))
    assert "resumed from step 10" in out
    assert final_digest(b) == final_digest(a)
    assert {s: v for s, v in losses(b).items() if s > 10} == {s: v for s, v in losses(a).items() if s > 10}


def test_fsdp_matches_ddp_with_accumulation_and_resumes_on_one_rank_then_two(tmp_path: Path) -> None:
    """FSDP2 and DDP take the same steps (gradient accumulation over 2 micro-batches, clipping on
    the global norm), within the order of the gradient sums; a 2-rank FSDP run continued on one
    rank, then on two again, stays within the documented tolerance; the finished model, exported whole from the
    shards, loads into the plain model class."""
    import torch

    from training.config import load_config
    from training.evaluate import export_final_model, load_model_file
    from training.examples.char_gpt import CharGPT, CharGPTArgs

    accum = ["train.grad_accum_steps=2", "train.grad_clip=0.5"]
    ddp = make_run(tmp_path, "ddp", [f"train.total_steps={TOTAL}", "train.ranks=2", *accum])
    finish(torchrun(ddp, TOTAL, 2))
    run = make_run(tmp_path, "fsdp", [*FSDP, *accum])
    finish(torchrun(run, 20, 2))
    reopen(tmp_path, "fsdp", [*FSDP, *accum, "train.ranks=1"])
    finish(torchrun(run, 40, 1))
    reopen(tmp_path, "fsdp", [*FSDP, *accum])
    finish(torchrun(run, TOTAL, 2))
    assert [(e["old"], e["new"]) for e in read_events(run, "world_size_changed")] == [(2, 1), (1, 2)]
    a, b = losses(ddp), losses(run)
    early = max(abs(a[s] - b[s]) for s in range(1, 21))
    later = max(abs(a[s] - b[s]) for s in range(21, TOTAL + 1))
    norms = [json.loads(line)["metrics"]["grad_norm"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    ddp_norms = [json.loads(line)["metrics"]["grad_norm"] for line in (ddp / "metrics.jsonl").read_text().splitlines()]
    print(f"FSDP vs DDP, accumulation 2: max |loss diff| {early:.2e} (2 ranks), {later:.2e} (after 2->1->2)")
    assert early < 1e-4 and later < RESIZE_LOSS_TOLERANCE
    assert max(abs(x - y) / y for x, y in zip(norms[:20], ddp_norms[:20], strict=True)) < 1e-3  # the global norm
    export = export_final_model(run, tmp_path / "model.safetensors")
    tensors, _ = load_model_file(tmp_path / "model.safetensors")
    cfg = load_config(None, ["task_args.d_model=32", "task_args.n_head=2", "data.seq_len=32"])
    model = CharGPT(CharGPTArgs(**cfg.task_args), cfg.data.seq_len)
    model.load_state_dict(tensors)  # strict: every name, every shape of the unsharded class
    assert export["step"] == TOTAL and torch.equal(model.head.weight, model.tok.weight)


def test_a_failing_rank_is_quoted_not_the_launcher_banner(tmp_path: Path) -> None:
    """Rank 1 of an FSDP run raises in step 3: the failure's reason and error name the rank and
    its exception, never torchrun's ``====`` banner or its hint line; the log is beside it."""
    from tasks.supervision.attempt import AttemptSpec
    from tasks.supervision.supervisor import ChunkFailed, supervise, worker_command
    from tasks.supervision.worker_liveness import DetectionLimits
    from training.rundir import load_run_config
    from training.tracking.attempts import AttemptId

    run = make_run(tmp_path, "bug", [*FSDP, "task=tests.pipeline_tasks:build_char_gpt_raises_on_rank_1"])
    limits = DetectionLimits.from_config(load_run_config(run))
    log = run / "logs" / "t.log"
    with pytest.raises(ChunkFailed) as info:
        supervise(AttemptSpec(worker_command(run, TOTAL, 2), run, limits, log, ranks=2, id=AttemptId(1, 1)))
    fail = read_events(run, "failure")[-1]
    said = "rank 1: ValueError: rank 1 saw a batch of the wrong shape in step 3"
    print(f"\nfailure reason: {fail['reason']}\nerror: {fail['error']}")
    assert info.value.kind == "crash" and said in fail["reason"] and fail["error"] == said, fail
    assert "===" not in fail["reason"] and "To enable traceback" not in fail["reason"]
    assert fail["log"] == str(log)


def test_validate_shards_the_task_on_a_mesh_of_one(tmp_path: Path) -> None:
    """``check_task`` (``convoy validate``, a flow's start) builds the task inside a one-rank
    process group and shards it as a worker would: the example's blocks become DTensors, a unit
    the model lacks is one line, and no process group is left behind."""
    import torch.distributed as dist

    from training.config import ConfigError
    from training.rundir import load_run_config
    from training.sharding import is_sharded
    from training.task import check_task

    parts = check_task(load_run_config(make_run(tmp_path, "fine", ["train.parallel=fsdp"])))
    assert parts is not None and is_sharded(parts.model) and not dist.is_initialized()
    with pytest.raises(ConfigError) as info:
        make_run(tmp_path, "bad", ["train.parallel=fsdp", "task=tests.pipeline_tasks:build_char_gpt_bad_units"])
    assert "shard_units" in str(info.value) and "names no submodule" in str(info.value) and "\n" not in str(info.value)
    assert not dist.is_initialized()
