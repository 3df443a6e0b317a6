"""Multi-rank workers (torchrun, gloo on CPU): bitwise resume at the same world size and
elastic resume across world sizes at the same global sample position."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.engine_util import make_run
from tests.torchrun_util import (
    RESIZE_LOSS_TOLERANCE,
    TOTAL,
    cursor_at_end,
    finish,
    losses,
    ref_and_killed_on_two_ranks,
    set_ranks,
    torchrun,
)
from training.checkpointing.store import CheckpointStore
from training.events import read_events

pytestmark = pytest.mark.slow


def test_two_ranks_killed_and_resumed_is_bitwise_equal(tmp_path: Path) -> None:
    ref, run, out = ref_and_killed_on_two_ranks(tmp_path, [f"train.total_steps={TOTAL}", "train.ranks=2"])
    assert "resumed from step" in out
    a, b = CheckpointStore(ref).latest_valid(), CheckpointStore(run).latest_valid()
    assert a.step == b.step == TOTAL and a.manifest["world_size"] == 2
    assert {"rank-0.safetensors", "rank-1.safetensors", "state.safetensors"} <= set(b.manifest["files"])
    assert a.digest == b.digest


@pytest.mark.parametrize("before, after, batch", [(2, 1, 8), (1, 2, 8), (2, 3, 12)])
def test_resume_with_another_world_size(tmp_path: Path, before: int, after: int, batch: int) -> None:
    """2→3 needs a global batch both world sizes divide (12); it stays 12 across the change."""
    extra = [f"train.total_steps={TOTAL}", f"train.batch_size={batch}"]
    ref = make_run(tmp_path, "ref", [*extra, f"train.ranks={before}"])
    finish(torchrun(ref, TOTAL, before))
    run = make_run(tmp_path, "resized", [*extra, f"train.ranks={before}"])
    finish(torchrun(run, 30, before))
    set_ranks(tmp_path, "resized", after, batch)
    out = finish(torchrun(run, TOTAL, after))
    assert "resumed from step 30" in out
    changed = read_events(run, "world_size_changed")
    assert changed and changed[0]["old"] == before and changed[0]["new"] == after
    assert cursor_at_end(run) == cursor_at_end(ref)  # same global sample position
    ref_l, run_l = losses(ref), losses(run)
    assert sorted(run_l) == list(range(1, TOTAL + 1))
    diff = max(abs(ref_l[s] - run_l[s]) for s in range(31, TOTAL + 1))
    print(f"world size {before}->{after}: max |loss diff| over steps 31..{TOTAL} = {diff:.4f}")
    assert all(ref_l[s] == run_l[s] for s in range(1, 31))
    assert diff < RESIZE_LOSS_TOLERANCE


def test_sigstop_one_rank_is_a_hang_and_all_ranks_are_reaped(tmp_path: Path) -> None:
    import os
    import signal
    import threading

    import psutil

    from tasks.supervision.attempt import AttemptSpec
    from tasks.supervision.supervisor import ChunkFailed, supervise, worker_command
    from tasks.supervision.worker_liveness import DetectionLimits
    from training.heartbeat import read_heartbeat
    from training.rundir import load_run_config
    from training.tracking.attempts import AttemptId

    run = make_run(
        tmp_path,
        "stop1",
        [
            f"train.total_steps={TOTAL}",
            "train.ranks=2",
            "heartbeat.stall_s=3",
            "heartbeat.timeout_s=6",
            "heartbeat.grace_s=2",
        ],
    )
    stopped: dict = {}

    def stop_rank_1() -> None:
        while True:
            hb = read_heartbeat(run, 1)
            if hb and hb.phase == "train" and hb.step >= 10:
                stopped["pid"], stopped["t"] = int(hb.pid), time.time()
                os.kill(stopped["pid"], signal.SIGSTOP)
                return
            time.sleep(0.01)

    threading.Thread(target=stop_rank_1, daemon=True).start()
    limits = DetectionLimits.from_config(load_run_config(run))
    with pytest.raises(ChunkFailed) as info:
        supervise(
            AttemptSpec(worker_command(run, TOTAL, 2), run, limits, run / "logs" / "t.log", ranks=2, id=AttemptId(1, 1))
        )
    assert info.value.kind == "hang"
    fail = read_events(run, "failure")[-1]
    print(f"one stopped rank detected as hang after {fail['detected_at'] - stopped['t']:.2f} s (stall_s 3)")
    assert not psutil.pid_exists(stopped["pid"]) or psutil.Process(stopped["pid"]).status() == psutil.STATUS_ZOMBIE
    leftovers = [p for p in psutil.process_iter(["cmdline"]) if str(run) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers
