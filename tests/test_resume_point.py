"""The one resume-point walker (``CheckpointStore.resume_point``) and its verdicts: each unchanged
checkpoint is hashed once per store, however many callers ask; a checkpoint that changes on disk
(corrupted, replaced, deleted) is verified afresh.  The counts are the store's own
(``verdicts.counts``: real verifications, memo misses)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.checkpoint_util import fill
from training.checkpointing.store import CheckpointStore, checkpoint_name


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x40
    path.write_bytes(bytes(data))


def test_each_checkpoint_is_verified_once_until_it_changes(tmp_path: Path) -> None:
    fill(CheckpointStore(tmp_path), [10, 20, 30])
    store = CheckpointStore(tmp_path)  # as the flow process holds it: one per run
    newest = store.root / checkpoint_name(30)
    for _ in range(4):  # attempt start, failure report, failure details, hook
        point = store.resume_point()
        assert point.step == 30 and point.passed_over == ()
    assert store.verify(newest).step == 30 and store.latest_valid(record=False).step == 30
    assert dict(store.verdicts.counts) == {newest.name: 1}

    flip_a_byte(newest / "state.safetensors")  # corrupted on disk after it was verified
    for _ in range(3):
        point = store.resume_point()
        assert point.step == 20, point
        assert [p.checkpoint for p in point.passed_over] == [newest.name] and point.passed_over[0].reason
    assert dict(store.verdicts.counts) == {newest.name: 2, checkpoint_name(20): 1}

    shutil.rmtree(newest)  # gone: the walk no longer meets it
    assert store.resume_point().step == 20
    assert dict(store.verdicts.counts) == {newest.name: 2, checkpoint_name(20): 1}
    fill(CheckpointStore(tmp_path), [30])  # a new step-30 under the old name: another inode
    assert store.resume_point().step == 30 and store.verdicts.counts[newest.name] == 3


def test_a_fresh_store_verifies_again(tmp_path: Path) -> None:
    """The memo belongs to one store object (the run's, passed explicitly), never to the process."""
    fill(CheckpointStore(tmp_path), [10])
    first, second = CheckpointStore(tmp_path), CheckpointStore(tmp_path)
    assert first.resume_point().step == second.resume_point().step == 10
    assert first.verdicts.counts == second.verdicts.counts == {checkpoint_name(10): 1}


def test_a_committed_checkpoint_that_is_gone_is_passed_over_as_missing(tmp_path: Path) -> None:
    """Issue 31: a checkpoint deleted by hand (not by retention, not moved aside by convoy) is named
    wherever the resume point's passed-over checkpoints are (failure events, the resume table,
    Prefect's warning, the summary): "missing", not silently skipped."""
    fill(CheckpointStore(tmp_path), [10, 20, 30, 40])  # keep_last 3 by default: step 10 retired
    store = CheckpointStore(tmp_path)
    assert store.resume_point().passed_over == ()  # retired by retention: not missing
    shutil.rmtree(store.root / checkpoint_name(40))
    store.quarantine(store.root / checkpoint_name(30), "bit rot")  # moved aside by convoy: not missing
    point = store.resume_point()
    assert point.step == 20
    assert [(p.step, p.reason.split(":")[0]) for p in point.passed_over] == [(40, "missing")], point
    assert point.passed_over_dicts()[0]["checkpoint"] == checkpoint_name(40)
    shutil.rmtree(store.root / checkpoint_name(20))  # the last one: the run would start over, and says why
    point = store.resume_point()
    assert point.step is None and [p.step for p in point.passed_over] == [40, 20], point
