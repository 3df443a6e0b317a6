"""The memory tier (training/checkpointing/memory/memory_tier.py): the newest state in RAM, in front of disk.

Real worker processes, real SIGKILLs: a worker killed between two disk checkpoints resumes from
its memory snapshot (at most one step lost) and ends bitwise where an uninterrupted run ends; a
snapshot older than the newest disk checkpoint, one of another trajectory, and one whose bytes
were flipped are never restored (the disk tier decides); a run that reached its last step frees
the tier; a run directory made again is another run (its own tier).
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_util import kill_group, make_run, run_worker, start_worker, wait_for_step

from training import run_memory
from training.checkpointing.memory import memory_tier, slot_files, slot_format
from training.checkpointing.store import CheckpointStore
from training.events import Event, read_events
from training.heartbeat import read_heartbeat
from training.tracking.resume_audit import trained_high_water

#: Disk checkpoints every 50 steps; the memory tier every step (the demo's ``auto`` choice, pinned
#: here so a loaded machine cannot widen it).
TIERS = ["checkpoint.every_steps=50", "checkpoint.memory_every_steps=1", "checkpoint.memory_slots=2"]


def _kill_at(run_dir: Path, step: int, settle_s: float = 0.0) -> int:
    """Start a worker to 120, SIGKILL it once it reached ``step`` (and ``settle_s`` more: the
    beat comes just before the step's snapshot is written, so a kill at once often lands in
    that write); how far it trained (its last beat may be a step behind its last journal row:
    trained_high_water takes the larger)."""
    p = start_worker(run_dir, 120, {"CONVOY_FAULTS": "step_delay=0.02"})
    assert wait_for_step(run_dir, p, step) is not None
    time.sleep(settle_s)
    kill_group(p, signal.SIGKILL)
    p.wait()
    beat = read_heartbeat(run_dir, 0)
    trained = trained_high_water(run_dir, beat.step if beat else None)
    assert trained is not None
    return trained


def _killed_with_both_slots(where: Path) -> Path:
    """A run killed at step 56 with both of rank 0's slots committed (snapshots copied on the
    loop's thread: one copied beside the loop is committed only before the next update, rule 7).
    A kill that lands while a snapshot is written leaves that slot without a header (rule 4: a
    half-written slot has none), which is right but leaves nothing to corrupt; such a run is made
    again (CI saw it once)."""
    for attempt in range(3):
        run_dir = make_run(where / f"try-{attempt}", extra=[*TIERS, "checkpoint.memory_beside=false"])
        _kill_at(run_dir, 56, settle_s=0.01)
        root = run_memory.tier_root(run_dir)
        heads = [root / f"rank-0.slot-{k}.head" for k in memory_tier.SLOTS] if root is not None else []
        if heads and all(slot_format.Header.read(h) is not None for h in heads):
            return run_dir
    raise AssertionError("three kills in a row landed while a snapshot was being written")


def test_a_header_torn_by_a_kill_is_no_header(tmp_path: Path) -> None:
    """A header is committed by its length and checksum, written last in place: a kill before
    them, or in the middle of the body, leaves a slot with no header, and the other slot decides."""
    tier = memory_tier.MemoryTier(tmp_path / "tier", "fp")
    for step in (5, 6):
        tier.write(step, {"rank-0": {"step": step, "x": torch.full((3,), float(step))}})
    head = tier.root / "rank-0.slot-1.head"  # step 6's
    whole = head.read_bytes()
    assert tier.newest_step() == 6
    n = int.from_bytes(whole[:8], "little")
    for torn in (
        bytes(8) + whole[8:],  # zeroed before the slot was rewritten: not committed yet
        whole[: 16 + n // 2] + bytes(n - n // 2),  # the body half written over zeros
        whole.replace(b'"step":6', b'"step":7'),  # a body that is not the one its checksum is of
    ):
        head.write_bytes(torn)
        assert slot_format.Header.read(head) is None
        assert tier.newest_step() == 5
    head.write_bytes(whole)
    assert tier.newest_step() == 6


def test_a_snapshot_cut_short_leaves_its_slot_without_a_header(tmp_path: Path, monkeypatch: Any) -> None:
    """The header's length is zeroed before the slot is touched: a snapshot that stops in the
    middle of its copy (a kill there) leaves that slot with no header and the older one decides."""
    tier = memory_tier.MemoryTier(tmp_path / "tier", "fp")
    for step in (5, 6):
        tier.write(step, {"rank-0": {"step": step, "x": torch.full((3,), float(step))}})

    def cut(buf: Any, groups: Any, on_cpu: bool = False) -> None:
        raise OSError("killed in the copy")

    monkeypatch.setattr(slot_files, "copy_into", cut)
    with pytest.raises(OSError):
        tier.write(7, {"rank-0": {"step": 7, "x": torch.full((3,), 7.0)}})  # over step 5's slot
    assert slot_format.Header.read(tier.root / "rank-0.slot-0.head") is None
    assert tier.newest_step() == 6


def _resumed(run_dir: Path) -> dict:
    return read_events(run_dir, Event.RESUMED)[-1]


def test_a_killed_worker_resumes_from_its_memory_snapshot_and_ends_bitwise(tmp_path: Path) -> None:
    reference = make_run(tmp_path / "ref", extra=TIERS)
    assert run_worker(reference, 120)[0] == 0
    run_dir = make_run(tmp_path / "run", extra=TIERS)
    killed_at = _kill_at(run_dir, 37)
    snapshot = run_memory.newest_step(run_dir, _fingerprint(run_dir))
    assert snapshot is not None and killed_at - 1 <= snapshot <= killed_at, (snapshot, killed_at)
    code, out = run_worker(run_dir, 120)
    assert code == 0, out
    resumed = _resumed(run_dir)
    assert resumed["tier"] == "memory" and resumed["step"] == snapshot, resumed
    assert killed_at - resumed["step"] <= 1, "more than one step lost"
    assert _digest(run_dir) == _digest(reference)
    # Its snapshots were copied beside the loop (tier rule 7: OMP_NUM_THREADS=1 leaves a CPU free).
    assert "convoy-memory" in read_events(run_dir, Event.WORKER_DONE)[-1]["threads"]
    assert run_memory.tier_root(run_dir) is not None and not run_memory.tier_root(run_dir).exists()  # freed


def _slots(run_dir: Path) -> list[tuple[int, Path, Path]]:
    """(step, header, data) of rank 0's two memory slots, newest first."""
    root = run_memory.tier_root(run_dir)
    assert root is not None
    out = []
    for k in memory_tier.SLOTS:
        header = root / f"rank-0.slot-{k}.head"
        committed = slot_format.Header.read(header)
        assert committed is not None, header
        out.append((committed.step, header, root / f"rank-0.slot-{k}.bin"))
    return sorted(out, reverse=True)


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))


def test_a_stale_foreign_or_corrupt_snapshot_is_never_restored(tmp_path: Path) -> None:
    run_dir = _killed_with_both_slots(tmp_path / "foreign")  # disk: step 50; memory: ~55 and ~56, one in each slot
    for _step, header, _data in _slots(run_dir):  # another trajectory's snapshots: ignored, not an error
        saved = json.loads(slot_format.decode_header(header.read_bytes()) or b"")
        header.write_bytes(
            b"".join(slot_format.encode_header(json.dumps({**saved, "fingerprint": "0123456789abcdef"}).encode()))
        )
    assert run_memory.newest_step(run_dir, _fingerprint(run_dir)) is None
    code, out = run_worker(run_dir, 60)
    assert code == 0, out
    assert _resumed(run_dir)["tier"] == "disk" and _resumed(run_dir)["step"] == 50

    run_dir = _killed_with_both_slots(tmp_path / "corrupt")  # bytes flipped: the hashes refuse them
    (newest, _h, newest_data), (older, _h2, older_data) = _slots(run_dir)
    _flip(newest_data)
    code, out = run_worker(run_dir, 60)  # the newest refused, the older slot restores
    assert code == 0, out
    assert _resumed(run_dir)["tier"] == "memory" and _resumed(run_dir)["step"] == older == newest - 1
    (refused,) = read_events(run_dir, Event.MEMORY_SNAPSHOT_REFUSED)
    assert refused["checkpoint"] == f"step-{newest:09d}" and "hash" in refused["reason"], refused

    run_dir = _killed_with_both_slots(tmp_path / "both")  # both slots corrupt: the disk tier decides
    for _step, _header, data in _slots(run_dir):
        _flip(data)
    code, out = run_worker(run_dir, 60)
    assert code == 0, out
    assert _resumed(run_dir)["tier"] == "disk" and _resumed(run_dir)["step"] == 50
    assert len(read_events(run_dir, Event.MEMORY_SNAPSHOT_REFUSED)) == 2

    # Older than disk: a worker killed after the disk save at 50 but before its next snapshot
    # (every 16 steps: 48, then 64) leaves 48 in memory; its successor resumes 50 from disk.  Saves
    # synchronous: an asynchronous one is staged in the slot (rule 8), which then holds 50 itself.
    older = ["checkpoint.every_steps=50", "checkpoint.memory_every_steps=16", "checkpoint.async_save=false"]
    run_dir = make_run(tmp_path / "older", extra=older)
    _kill_at(run_dir, 53)
    assert run_memory.newest_step(run_dir, _fingerprint(run_dir)) == 48
    code, out = run_worker(run_dir, 60)
    assert code == 0, out
    assert _resumed(run_dir)["tier"] == "disk" and _resumed(run_dir)["step"] == 50

    # As old as disk: with the save staged in the slot, the slot holds the disk's step; the disk wins.
    run_dir = make_run(tmp_path / "same", extra=older[:2])
    _kill_at(run_dir, 53)
    assert run_memory.newest_step(run_dir, _fingerprint(run_dir)) == 50
    code, out = run_worker(run_dir, 60)
    assert code == 0, out
    assert _resumed(run_dir)["tier"] == "disk" and _resumed(run_dir)["step"] == 50


def test_a_run_directory_made_again_is_another_run(tmp_path: Path) -> None:
    """Rule 3: the tier is keyed by the run directory and its creation time, so deleting a run
    and training it again never resumes the deleted run's snapshot."""
    run_dir = make_run(tmp_path, extra=TIERS)
    _kill_at(run_dir, 12)
    first = run_memory.tier_root(run_dir)
    assert first is not None and first.exists()
    import shutil

    shutil.rmtree(run_dir)
    again = make_run(tmp_path, extra=TIERS)
    assert again == run_dir and run_memory.tier_root(again) != first
    code, out = run_worker(again, 10)
    assert code == 0, out
    assert read_events(again, Event.STARTED) and not read_events(again, Event.RESUMED)  # from step 0
    run_memory.remove(run_dir)
    shutil.rmtree(first, ignore_errors=True)


def test_a_snapshot_past_a_boundary_that_never_reached_disk_is_passed_over(tmp_path: Path) -> None:
    """Rule 6 (found by bench/conformance.py, disk full at a chunk boundary): the boundary's save
    never commits (here the kill lands while it persists), with snapshots past it in memory.  A
    resume from them would never write the boundary (the chunk's artifact, which every retry
    would then miss); they are passed over, the disk tier decides and the boundary is trained to
    and committed again, bitwise as an uninterrupted run."""
    # Both slots committed at the kill (copied on the loop's thread): both are passed over.
    chunks = [
        "checkpoint.every_steps=25",
        "checkpoint.memory_every_steps=1",
        "checkpoint.memory_slots=2",
        "train.chunk_steps=50",
    ]
    chunks.append("checkpoint.memory_beside=false")
    reference = make_run(tmp_path / "ref", extra=chunks)
    assert run_worker(reference, 120)[0] == 0
    run_dir = make_run(tmp_path / "run", extra=chunks)
    # Each persist takes 1 s: step 25's commits by step ~45 at 0.05 s a step; step 50's is in
    # flight when the kill lands two steps after it.
    p = start_worker(run_dir, 120, {"CONVOY_FAULTS": "step_delay=0.05,persist_delay=1.0"})
    assert wait_for_step(run_dir, p, 52) is not None
    kill_group(p, signal.SIGKILL)
    p.wait()
    disk = [step for step, _ in CheckpointStore(run_dir).step_dirs()]
    snapshot = run_memory.newest_step(run_dir, _fingerprint(run_dir))
    assert 50 not in disk and snapshot is not None and snapshot > 50, (disk, snapshot)
    newest_disk = max(disk, default=0)
    assert run_memory.resume_step(run_dir, newest_disk) == newest_disk  # what the flow reports agrees

    code, out = run_worker(run_dir, 120)
    assert code == 0, out
    assert _resumed(run_dir)["tier"] == "disk" and _resumed(run_dir)["step"] == newest_disk, _resumed(run_dir)
    refused = read_events(run_dir, Event.MEMORY_SNAPSHOT_REFUSED)
    assert len(refused) == 2 and all("step-000000050 is not on disk" in e["reason"] for e in refused), refused
    assert 50 in [e["step"] for e in read_events(run_dir, Event.CHECKPOINT_COMMITTED)]  # the boundary, at last
    assert _digest(run_dir) == _digest(reference)


def _fingerprint(run_dir: Path) -> str:
    from training.rundir import load_run_config

    return load_run_config(run_dir).fingerprint()


def _digest(run_dir: Path) -> str:
    checkpoint = CheckpointStore(run_dir).latest_valid(record=False)
    assert checkpoint is not None
    return checkpoint.digest


def test_a_committed_boundary_removed_later_is_not_missing(tmp_path: Path) -> None:
    """Rule 6 guards a chunk whose artifact was never written; a boundary its chunk committed
    (``chunk_done``) and something removed afterwards is no reason to resume further back
    (``convoy chaos`` once resumed from step 0 for it, its other checkpoint being corrupt)."""
    from training.events import append_event

    append_event(tmp_path, Event.CHUNK_DONE, chunk=3, start_step=100, end_step=150, digest="ab")
    committed = memory_tier.committed_boundaries(tmp_path)
    assert committed == {150}
    assert memory_tier.missing_boundary(161, 50, set()) == 150  # never committed: passed over
    assert memory_tier.missing_boundary(161, 50, committed) is None  # committed, then removed
    assert memory_tier.missing_boundary(201, 50, committed) == 200
