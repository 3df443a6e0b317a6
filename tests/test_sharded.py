"""``checkpoint.format: sharded``: model and optimizer through torch.distributed.checkpoint (HF
safetensors storage, no pickle), every rank writing its shards; resume bitwise at the same world
size, re-sharded at another, and every shard verified against the manifest before it is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.engine_util import final_digest, kill_group, make_run, run_worker, start_worker, wait_for_step
from tests.torchrun_util import TOTAL, cursor_at_end, finish, losses, ref_and_killed_on_two_ranks, set_ranks, torchrun
from training.checkpointing.store import CheckpointStore
from training.events import read_events

pytestmark = pytest.mark.slow
SHARDED = ["checkpoint.format=sharded", f"train.total_steps={TOTAL}"]


def shard_files(run: Path) -> list[str]:
    ck = CheckpointStore(run).latest_valid(record=False)
    assert ck is not None and ck.manifest["layout"] == "sharded"
    return sorted(n for n in ck.manifest["files"] if n.startswith("dcp/"))


def test_one_rank_killed_sharded_resume_matches_replicated_run_bitwise(tmp_path: Path) -> None:
    plain = make_run(tmp_path, "plain", [f"train.total_steps={TOTAL}"])
    code, out = run_worker(plain, TOTAL)
    assert code == 0, out[-2000:]
    run = make_run(tmp_path, "sharded", SHARDED)
    p = start_worker(run, TOTAL)
    wait_for_step(run, p, 35)
    kill_group(p)
    p.wait()
    code, out = run_worker(run, TOTAL)
    assert code == 0 and "resumed from step" in out, out[-2000:]
    assert losses(run) == losses(plain)  # every step's loss, bitwise: the same trajectory
    assert shard_files(run) == ["dcp/shard-00001-model-00001-of-00001.safetensors"]
    ck = CheckpointStore(run).latest_valid(record=False)
    ref = CheckpointStore(plain).load_latest()[1]["state"]
    with safe_open(str(ck.path / shard_files(run)[0]), framework="pt") as f:  # final weights, bitwise
        for name, tensor in ref["model"].items():
            key = f"model.{name}"
            if key in f.keys():
                assert f.get_tensor(key).equal(tensor), name
    skeleton = json.loads((ck.path / "dcp.json").read_text())
    assert skeleton["model"]["head.weight"] == skeleton["model"]["tok.weight"]  # tied weights stored once


def test_two_ranks_sharded_killed_and_resumed_is_bitwise_equal(tmp_path: Path) -> None:
    ref, run, out = ref_and_killed_on_two_ranks(tmp_path, [*SHARDED, "train.ranks=2"])
    assert "resumed from step" in out
    files = shard_files(run)
    assert any("shard-00001" in n for n in files) and any("shard-00002" in n for n in files), files  # both wrote
    assert final_digest(run) == final_digest(ref)


def test_sharded_two_ranks_resumed_on_one_and_corrupt_shard_skipped(tmp_path: Path) -> None:
    ref = make_run(tmp_path, "ref", [*SHARDED, "train.ranks=2"])
    finish(torchrun(ref, TOTAL, 2))
    run = make_run(tmp_path, "resized", [*SHARDED, "train.ranks=2", "checkpoint.keep_last=3"])
    finish(torchrun(run, 30, 2))
    store = CheckpointStore(run)
    newest = store.latest_valid(record=False)
    rank1_shard = next(n for n in newest.manifest["files"] if n.startswith("dcp/shard-00002"))
    with open(newest.path / rank1_shard, "r+b") as fh:  # bit rot in the shard rank 1 wrote
        fh.seek(-8, 2)
        fh.write(b"\x00" * 8)
    set_ranks(tmp_path, "resized", 1)
    out = finish(torchrun(run, TOTAL, 1))
    skipped = read_events(run, "checkpoint_skipped")
    assert skipped and skipped[0]["checkpoint"] == newest.path.name and "dcp/shard-00002" in skipped[0]["reason"]
    resumed = read_events(run, "resumed")[-1]["step"]
    assert resumed < 30 and f"resumed from step {resumed}" in out
    changed = read_events(run, "world_size_changed")[-1]
    assert (changed["old"], changed["new"]) == (2, 1)
    assert cursor_at_end(run) == cursor_at_end(ref)  # same global sample position at the end
    ref_l, run_l = losses(ref), losses(run)
    diff = max(abs(ref_l[s] - run_l[s]) for s in range(resumed + 1, TOTAL + 1))
    print(f"sharded 2->1 after a corrupt shard: resumed at {resumed}, max |loss diff| = {diff:.4f}")
    assert all(ref_l[s] == run_l[s] for s in range(1, resumed + 1))
    assert diff < 0.25
