"""A chunk whose boundary checkpoint does not verify after the worker committed it (bit rot,
a bad disk) fails, and the retry cannot adopt the pipelined worker that went on from it: found by
bench/conformance.py (map-aug, 2 ranks, corrupt just after a commit), where each of the four
retries adopted the parked worker, saw the same boundary and failed the run."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from engine_util import make_run, run_worker

from tasks.chunk import ChunkRun
from tasks.execution_plan import ChunkSpan
from tasks.run_resources import RunResources
from tasks.supervision.supervisor import ChunkFailed, Outcome
from tasks.supervision.worker_handle import spawn
from training.checkpointing.store import CheckpointStore
from training.events import Event, read_events
from training.rundir import load_run_config


class _Log:
    def info(self, *a: object) -> None: ...

    warning = info


def test_a_boundary_that_does_not_verify_releases_the_parked_worker(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    code, out = run_worker(run_dir, 20)
    assert code == 0, out
    newest = run_dir / "checkpoints" / "step-000000020" / "state.safetensors"
    data = bytearray(newest.read_bytes())
    data[-7] ^= 0x40
    newest.write_bytes(bytes(data))
    # a real process stands for the worker that went on into the next chunk
    cmd = [sys.executable, "-c", "import time; time.sleep(120)"]
    parked = spawn(cmd, tmp_path / "parked.log", "parked", cwd=None, env={})
    cfg = load_run_config(run_dir)
    resources = RunResources(cfg, run_dir)
    try:
        parking = resources.slots.parking
        parking.park(parked, cmd)
        assert parking.parked_pid() == parked.pid
        run = ChunkRun(cfg, run_dir, ChunkSpan(1, 0, 20), resources, _Log())
        with pytest.raises(ChunkFailed, match="no valid checkpoint at step 20") as failed:
            run.committed(time.time(), Outcome(0, 1.0, 20, tmp_path / "parked.log"))
        assert failed.value.details.last_committed_step == 10
        assert parking.parked_pid() is None and parking.adopt(cmd) is None
        assert parked.wait_exit(10), "the parked worker still runs"
    finally:
        resources.close()  # its worker zygote, which would live as long as this test process
        parked.stop(5.0)


def test_a_retry_sets_a_corrupt_boundary_aside_and_trains_to_it_again(tmp_path: Path) -> None:
    """The boundary checkpoint of the chunk is corrupt when the attempt starts (the previous
    attempt found it so and failed): the attempt moves it aside, its worker resumes from the
    newest checkpoint that verifies and commits the boundary again, with the same digest.  Left in
    place, its manifest made every retry "commit" the boundary at once and fail (bench/conformance.py,
    map-aug, corrupt just after the commit of step 20: all five attempts failed in 0.1 s)."""
    # The disk tier only: the retry resumes from the checkpoint of step 10 (not a snapshot in RAM).
    run_dir = make_run(
        tmp_path, extra=["train.chunk_steps=20", "orchestration.pipeline=true", "checkpoint.memory_every_steps=null"]
    )
    code, out = run_worker(run_dir, 20)
    assert code == 0, out
    boundary = run_dir / "checkpoints" / "step-000000020"
    digest = CheckpointStore(run_dir).verify(boundary).digest
    data = bytearray((boundary / "state.safetensors").read_bytes())
    data[-7] ^= 0x40
    (boundary / "state.safetensors").write_bytes(bytes(data))
    cfg = load_run_config(run_dir)
    resources = RunResources(cfg, run_dir)
    try:
        run = ChunkRun(cfg, run_dir, ChunkSpan(1, 0, 20), resources, _Log())
        assert run.pipelined
        outcome = run.supervised_attempt()
        assert outcome is not None and outcome.seconds > 0.5, outcome  # a worker trained 10 -> 20
        assert run.resumed_from == 10
        assert CheckpointStore(run_dir).verify(boundary).digest == digest
        aside = [p.name for p in boundary.parent.glob("step-000000020.invalid-*")]
        assert len(aside) == 1, aside
        invalid = read_events(run_dir, Event.CHECKPOINT_INVALID)
        assert [e["moved_to"] for e in invalid] == aside and "content hash" in invalid[0]["reason"]
    finally:
        resources.close()
