"""A non-finite loss (issue 45, item 4): valid bytes with a bad state are passed over for the
checkpoint before, named in the audit, without a loop; a run that diverges by itself stops in
one line.  ``nan_weights_at=STEP`` (CONVOY_FAULTS) turns every weight NaN after step STEP's update:
the save of that step verifies, and the next step's loss is NaN."""

from __future__ import annotations

from pathlib import Path

from tests.engine_util import final_digest, logged_losses, make_run, run_worker
from training.events import Event, read_events

DISK_ONLY = ["checkpoint.every_steps=10", "checkpoint.memory_every_steps=null"]


def test_nan_weights_under_valid_hashes_are_passed_over_for_the_checkpoint_before(tmp_path: Path) -> None:
    reference = make_run(tmp_path, "reference", DISK_ONLY)
    assert run_worker(reference, 40)[0] == 0
    run_dir = make_run(tmp_path, "poisoned", DISK_ONLY)
    code, out = run_worker(run_dir, 20, {"CONVOY_FAULTS": "nan_weights_at=20"})
    assert code == 0, out  # step 20's loss was finite: its checkpoint, NaN weights, verifies
    code, out = run_worker(run_dir, 40)  # resumes from it: NaN at once
    assert code not in (0, 78), out  # a crash: retried
    assert "valid bytes, bad state" in out and "step-000000020" in out, out
    (invalid,) = read_events(run_dir, Event.CHECKPOINT_INVALID)
    assert invalid["checkpoint"] == "step-000000020" and "non-finite" in invalid["reason"], invalid
    assert (run_dir / "checkpoints" / invalid["moved_to"]).is_dir()  # moved aside, never deleted
    code, out = run_worker(run_dir, 40)  # the retry: from step 10, no loop
    assert code == 0, out
    assert "resumed from step 10" in out, out
    assert final_digest(run_dir) == final_digest(reference)
    assert logged_losses(run_dir) == logged_losses(reference)  # the NaN rows were replaced


def test_a_run_that_diverges_by_itself_stops_in_one_line_and_saves_nothing_of_it(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "diverges", DISK_ONLY)
    code, out = run_worker(run_dir, 40, {"CONVOY_FAULTS": "nan_weights_at=14"})
    assert code == 78, out
    (line,) = [x for x in out.splitlines() if "the run diverged" in x]
    assert "steps 15-17" in line and "train.on_nonfinite: continue" in line, line
    (diverged,) = read_events(run_dir, Event.DIVERGED)
    assert (diverged["first_step"], diverged["step"]) == (15, 17)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == ["step-000000010"]
    assert not read_events(run_dir, Event.CHECKPOINT_INVALID)  # its checkpoints are not blamed
    code, out = run_worker(run_dir, 40)  # run again: it resumes and trains on, a human decided
    assert code == 0, out


def test_on_nonfinite_continue_trains_on(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "trains-on", [*DISK_ONLY, "train.on_nonfinite=continue"])
    code, out = run_worker(run_dir, 20, {"CONVOY_FAULTS": "nan_weights_at=4"})
    assert code == 0, out
    assert not read_events(run_dir, Event.DIVERGED)


def test_a_memory_snapshot_of_nan_weights_is_dropped_for_the_disk_checkpoint(tmp_path: Path) -> None:
    import time

    from tests.engine_util import kill_group, start_worker, wait_for_step

    tiers = {"CONVOY_MEMORY_DIR": str(tmp_path / "tiers")}
    memory = ["checkpoint.every_steps=10", "checkpoint.memory_every_steps=1", "checkpoint.memory_slots=2"]
    reference = make_run(tmp_path, "reference", DISK_ONLY)
    assert run_worker(reference, 30)[0] == 0
    run_dir = make_run(tmp_path, "poisoned", memory)
    p = start_worker(run_dir, 30, {**tiers, "CONVOY_FAULTS": "nan_weights_at=13,slow_step=15:60"})
    assert wait_for_step(run_dir, p, 14) == 14
    time.sleep(0.5)  # step 13's snapshot (NaN weights, valid hashes) is committed inside step 14
    kill_group(p)
    p.wait()
    code, out = run_worker(run_dir, 30, tiers)
    assert code not in (0, 78) and "refusing the memory snapshot step-000000013" in out, out
    code, out = run_worker(run_dir, 30, tiers)  # the retry: the older slot (step 12), or the disk's 10
    assert code == 0 and ("resumed from step 12 (the memory snapshot" in out or "resumed from step 10" in out), out
    assert final_digest(run_dir) == final_digest(reference)
    assert logged_losses(run_dir) == logged_losses(reference)
