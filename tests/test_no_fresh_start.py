"""Never a silent fresh start (issue 45, item 5): a run past its first chunk that finds no
checkpoint that restores fails loudly, recorded with what it looked at; it never trains again from
step 0.  (Inside the first chunk, starting at 0 loses no more than the lost checkpoints held.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.engine_util import logged_losses, make_run, run_worker
from training.events import Event, read_events


def test_a_run_whose_checkpoints_are_all_gone_or_corrupt_is_refused_not_restarted(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "gone", ["checkpoint.memory_every_steps=null", "train.chunk_steps=10"])
    code, out = run_worker(run_dir, 20)
    assert code == 0, out
    steps = [s for s, _ in logged_losses(run_dir)]
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    assert checkpoints, "the first chunk committed checkpoints"
    for ck in checkpoints:  # every one corrupt: each is looked at and passed over
        safetensors = ck / "state.safetensors"
        data = bytearray(safetensors.read_bytes())
        data[-5] ^= 0x20
        safetensors.write_bytes(bytes(data))
    code, out = run_worker(run_dir, 40)
    assert code == 78, out
    (line,) = [x for x in out.splitlines() if "refusing to train it again from step 0" in x]
    assert "committed checkpoints up to step 20" in line and "run_name=<new name>" in line, line
    (refused,) = read_events(run_dir, Event.NO_RESTORABLE_CHECKPOINT)
    assert refused["newest_committed"] == 20
    assert len(refused["looked_at"]) == len(checkpoints), refused
    assert [s for s, _ in logged_losses(run_dir)] == steps, "a step was trained again"
    first_chunk = make_run(tmp_path, "young", ["checkpoint.memory_every_steps=null"])  # chunk_steps 60
    assert run_worker(first_chunk, 20)[0] == 0
    shutil.rmtree(first_chunk / "checkpoints")
    code, out = run_worker(first_chunk, 30)
    assert code == 0 and "starting from step 0" in out, out
    shutil.rmtree(run_dir / "checkpoints")  # gone by hand: the same refusal
    code, out = run_worker(run_dir, 40)
    assert code == 78 and "refusing to train it again from step 0" in out, out
    assert read_events(run_dir, Event.NO_RESTORABLE_CHECKPOINT)[-1]["looked_at"] == [
        "no checkpoint on disk and no memory snapshot"
    ]
