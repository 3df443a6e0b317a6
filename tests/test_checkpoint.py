"""Checkpoint store: commit protocol, verified restore with fallback, safe loading, retention."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.checkpoint_util import fill, small_parts
from tests.engine_util import make_run, run_worker
from training.checkpointing import safetensors_io as st
from training.checkpointing.errors import CheckpointError
from training.checkpointing.store import MANIFEST, CheckpointStore, state_digest
from training.config import CheckpointConfig
from training.events import read_events


def test_roundtrip_is_exact_and_files_are_standard_safetensors(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    parts = small_parts(3)
    store.save(3, parts)
    store.wait()
    ck, loaded = store.load_latest()
    assert ck.step == 3 and (tmp_path / "checkpoints" / "LATEST").read_text().strip() == ck.path.name
    for k, v in parts["state"]["model"].items():
        assert torch.equal(loaded["state"]["model"][k], v)
    assert loaded["state"]["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.999)
    moments = loaded["state"]["optimizer"]["state"][0]["exp_avg"]
    assert torch.equal(moments, parts["state"]["optimizer"]["state"][0]["exp_avg"])
    with safe_open(str(ck.path / "state.safetensors"), "pt") as f:  # interoperable with the reference reader
        assert "model.weight" in f.keys()
    manifest = json.loads((ck.path / MANIFEST).read_text())
    assert manifest["digest"] == state_digest(manifest["files"]) and manifest["world_size"] == 1


def test_same_state_gives_same_digest(tmp_path: Path) -> None:
    a, b = CheckpointStore(tmp_path / "a"), CheckpointStore(tmp_path / "b")
    a.save(5, small_parts(5), blocking=True)
    b.save(5, small_parts(5), blocking=True)
    assert a.last_committed.digest == b.last_committed.digest


def corrupt_flip(ck: Path) -> None:
    f = ck / "state.safetensors"
    data = bytearray(f.read_bytes())
    data[-7] ^= 0x40
    f.write_bytes(bytes(data))


def corrupt_truncate(ck: Path) -> None:
    f = ck / "state.safetensors"
    os.truncate(f, f.stat().st_size // 2)


def corrupt_no_manifest(ck: Path) -> None:
    (ck / MANIFEST).unlink()


@pytest.mark.parametrize("damage", [corrupt_flip, corrupt_truncate, corrupt_no_manifest])
def test_corrupt_newest_falls_back_records_event_and_deletes_nothing(tmp_path: Path, damage) -> None:
    run_dir = make_run(tmp_path, extra=["checkpoint.memory_every_steps=null"])  # the disk tier's fallback
    code, out = run_worker(run_dir, 40)
    assert code == 0, out
    ckdir = run_dir / "checkpoints"
    assert sorted(p.name for p in ckdir.glob("step-*")) == ["step-000000030", "step-000000040"]
    damage(ckdir / "step-000000040")
    before = sorted(str(p.relative_to(ckdir)) for p in ckdir.rglob("*"))
    store = CheckpointStore(run_dir)
    assert store.latest_valid().step == 30
    code, out = run_worker(run_dir, 35)
    assert code == 0, out
    assert "resumed from step 30" in out
    skipped = read_events(run_dir, "checkpoint_skipped")
    assert skipped and all(e["checkpoint"] == "step-000000040" for e in skipped)
    after = {str(p.relative_to(ckdir)) for p in ckdir.rglob("*")}
    assert set(before) - after <= {"LATEST"} or set(before) <= after  # nothing removed
    assert (ckdir / "step-000000040").exists() and (ckdir / "step-000000030").exists()


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['CONVOY_EXPLOIT_MARKER']}",))


def test_checkpoint_crafted_to_run_code_is_refused(tmp_path: Path, monkeypatch) -> None:
    marker = tmp_path / "pwned"
    monkeypatch.setenv("CONVOY_EXPLOIT_MARKER", str(marker))
    store = CheckpointStore(tmp_path / "run")
    fill(store, [10, 20])
    evil = store.root / "step-000000020"
    target = evil / "state.safetensors"
    target.write_bytes(pickle.dumps({"model": _Exploit()}))
    torch.save({"x": _Exploit()}, evil / "model.pt")
    manifest = json.loads((evil / MANIFEST).read_text())
    for name in ("state.safetensors", "model.pt"):  # an attacker can recompute hashes: they must not save us
        size, digest = st.hash_file(evil / name)
        manifest["files"][name] = {"size": size, "xxh3_128": digest}
    manifest["digest"] = state_digest(manifest["files"])
    (evil / MANIFEST).write_text(json.dumps(manifest))
    ck, _ = store.load_latest()
    assert ck.step == 10
    assert not marker.exists()
    reasons = [e["reason"] for e in read_events(tmp_path / "run", "checkpoint_skipped")]
    assert any("not a safetensors file" in r or "header" in r or "not a file convoy writes" in r for r in reasons)
    with pytest.raises(pickle.UnpicklingError):  # and torch's safe loader refuses it too
        torch.load(evil / "model.pt", weights_only=True)
    assert not marker.exists()


@pytest.mark.parametrize(
    "policy",
    [
        CheckpointConfig(keep_last=1),
        CheckpointConfig(keep_last=2, keep_every=30),
        CheckpointConfig(keep_last=5, max_bytes=1),
        CheckpointConfig(keep_last=3, max_bytes=20_000),
    ],
)
def test_retention_never_removes_newest_verified(tmp_path: Path, policy: CheckpointConfig) -> None:
    store = CheckpointStore(tmp_path, policy)
    steps = list(range(10, 110, 10))
    for s in steps:
        store.save(s, small_parts(s), blocking=True)
        newest = store.latest_valid(record=False)
        assert newest is not None and newest.step == s
    kept = [s for s, _ in store.step_dirs()]
    if policy.keep_every:
        assert {30, 60, 90} <= set(kept)
    if policy.max_bytes == 1:
        assert kept == [100]
    assert kept[0] == 100 and len(kept) <= max(policy.keep_last, 1) + (3 if policy.keep_every else 0)


def test_retention_spares_a_newer_invalid_dir_and_leaves_it_alone(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, CheckpointConfig(keep_last=1))
    fill(store, [10, 20])
    shutil.copytree(store.root / "step-000000020", store.root / "step-000000090")
    (store.root / "step-000000090" / MANIFEST).unlink()
    fill(store, [30])
    assert (store.root / "step-000000090").exists()
    assert [s for s, _ in store.step_dirs()] == [90, 30]


def test_a_checkpoint_a_resume_passed_over_does_not_count_toward_keep_last(tmp_path: Path) -> None:
    """training/checkpointing/retention.py: the chaos test's sequence.  Step 140 corrupt and passed
    over by a resume; the commit of 150 keeps 130 (the newest one that verifies besides 150) and
    leaves 140 for inspection, so that when 150 goes missing the run still resumes from 130."""
    store = CheckpointStore(tmp_path, CheckpointConfig(keep_last=2))
    fill(store, [120, 130, 140])
    corrupt_flip(store.root / "step-000000140")
    os.utime(store.root / "step-000000140" / MANIFEST, (1.0, 1.0))  # written before the resume below
    assert store.latest_valid(record=True).step == 130  # the resume passes 140 over and records it
    assert [e["checkpoint"] for e in read_events(tmp_path, "checkpoint_skipped")] == ["step-000000140"]
    fill(store, [150])
    assert [s for s, _ in store.step_dirs()] == [150, 140, 130]
    shutil.rmtree(store.root / "step-000000150")
    assert store.latest_valid(record=False).step == 130
    fill(store, [160, 170])  # 140 stays, never counted; 130 goes once two newer ones verify
    assert [s for s, _ in store.step_dirs()] == [170, 160, 140]


def test_background_save_error_surfaces_at_next_check(tmp_path: Path, monkeypatch) -> None:
    store = CheckpointStore(tmp_path)
    fill(store, [10])

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(st, "write_file", disk_full)
    store.save(20, small_parts(20))  # async: returns before the failure
    store._thread.join()
    with pytest.raises(CheckpointError, match="No space left"):
        store.check()
    assert store.latest_valid().step == 10
    assert not list(store.root.glob(".tmp-*"))


def test_worker_with_failing_saves_exits_nonzero_keeping_last_good(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    code, out = run_worker(run_dir, 60, env={"CONVOY_FAULTS": "diskfull_from_step=30"})
    assert code not in (0, 75, 78), out
    assert "No space left on device" in out
    assert CheckpointStore(run_dir).latest_valid().step == 20


def test_restored_state_does_not_keep_the_checkpoint_file_mapped(tmp_path: Path) -> None:
    import gc

    from training.state import TrainState
    from training.task import TaskParts

    def parts() -> TaskParts:
        torch.manual_seed(0)
        m = torch.nn.Linear(64, 64)
        opt = torch.optim.AdamW(m.parameters())
        m(torch.randn(2, 64)).sum().backward()
        opt.step()
        return TaskParts(model=m, optimizer=opt, scheduler=None, train_data=[], loss_fn=lambda m, b: b)

    src = TrainState(parts(), torch.amp.GradScaler("cpu", enabled=False), step=7)
    store = CheckpointStore(tmp_path)
    store.save(7, src.checkpoint_parts(), blocking=True)
    dst = TrainState(parts(), torch.amp.GradScaler("cpu", enabled=False))
    _, loaded = store.load_latest()
    dst.restore(loaded)
    del loaded
    gc.collect()
    maps = Path("/proc/self/maps").read_text()
    assert str(tmp_path) not in maps  # retention may delete it; an in-place rewrite must not reach us
    exp_avg = dst.parts.optimizer.state[dst.parts.model.weight]["exp_avg"]
    assert torch.equal(exp_avg, src.parts.optimizer.state[src.parts.model.weight]["exp_avg"])
