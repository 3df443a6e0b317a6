"""``convoy status`` is live: it reads the heartbeat and metrics, and tells running from dead."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.engine_util import kill_group, make_run, run_worker, start_worker, wait_for_step
from training.heartbeat import read_heartbeat
from training.rundir import load_run_config

INTERVAL = 0.1  # heartbeat.interval_s of engine_util.SMALL


def status_json(run_dir: Path) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "flows.cli.main", "status", str(run_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(out.stdout)


def test_status_of_a_fresh_run_dir_is_never_started(tmp_path: Path) -> None:
    assert status_json(make_run(tmp_path, "fresh"))["state"] == "never started"


def test_status_follows_a_running_worker_then_sees_it_dead(tmp_path: Path) -> None:
    """While the worker trains (before its first checkpoint), status reports the step of its
    heartbeat, at most two beats old; after a SIGKILL with no flow around, ``dead``."""
    # One chunk, one save at its end: a worker also saves at every chunk boundary, and a status
    # call slowed by a loaded machine once let it reach step 60 (a boundary of 60-step chunks)
    # before the kill.
    # No memory tier either: the worker must resume from step 0 (steps lost = its last beat).
    run_dir = make_run(
        tmp_path, "live", ["checkpoint.every_steps=120", "train.chunk_steps=120", "checkpoint.memory_every_steps=null"]
    )
    p = start_worker(run_dir, 120, {"CONVOY_FAULTS": "step_delay=0.05"})
    try:
        assert wait_for_step(run_dir, p, 3) is not None
        before = read_heartbeat(run_dir, 0)
        st = status_json(run_dir)
        after = read_heartbeat(run_dir, 0)
        assert st["state"] == "running" and st["worker_alive"], st
        assert before.step <= st["step"] <= after.step, (before, st, after)
        assert st["heartbeat_age_s"] <= 2 * INTERVAL + 0.5, st  # + the CLI's own time to read
        assert st["pid"] == p.pid and st["checkpoint_step"] is None and st["steps_since_checkpoint"] == st["step"]
        assert st["loss"] is not None and st["eta_s"] is not None
    finally:
        kill_group(p, signal.SIGKILL)
        p.wait()
    st = status_json(run_dir)
    assert st["state"] == "dead", st
    assert not st["worker_alive"] and st["step"] >= after.step
    code, out = run_worker(run_dir, 120)  # resumes from step 0 and finishes the run
    assert code == 0, out
    st = status_json(run_dir)
    assert st["state"] == "finished" and st["step"] == st["checkpoint_step"] == 120, st
    assert st["failures"] == st["resumes"] == 1, st
    assert after.step <= st["steps_lost"] <= after.step + 10, st  # the killed worker's last beat
    train = load_run_config(run_dir).train
    assert st["data_samples"] == 120 * train.batch_size * train.grad_accum_steps, st  # the cursor, as samples


def test_one_definition_of_steps_lost(tmp_path: Path) -> None:
    """Steps lost = steps trained beyond the checkpoint resumed from; before the first checkpoint
    that is every step trained; a kill right after a save loses nothing."""
    from training.event_records import EventLog
    from training.events import append_event
    from training.tracking.resume_audit import analyse_events, steps_lost, trained_high_water

    assert steps_lost(36, None) == 36 and steps_lost(40, 40) == 0 and steps_lost(None, 10) is None
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "metrics": {}}) + "\n" for s in (1, 2, 3)))
    assert trained_high_water(tmp_path, 2) == 3 and trained_high_water(tmp_path, 5) == 5
    assert trained_high_water(tmp_path, None, metrics_offset=10**6) is None
    append_event(tmp_path, "started", rank=0, until_step=100)
    append_event(
        tmp_path,
        "failure",
        failure="killed",
        last_beat_step=35,
        trained_to=36,
        last_committed_step=None,
        steps_lost=steps_lost(36, None),
        chunk=1,
        attempt=1,
    )
    append_event(tmp_path, "started", rank=0, until_step=100)  # no checkpoint: from step 0
    append_event(
        tmp_path,
        "failure",
        failure="killed",
        last_beat_step=40,
        trained_to=40,
        last_committed_step=40,
        steps_lost=steps_lost(40, 40),
        chunk=1,
        attempt=2,
    )
    append_event(tmp_path, "resumed", rank=0, step=40, until_step=100)
    audit = analyse_events(EventLog.read(tmp_path))
    assert [r["lost_steps"] for r in audit["rows"]] == [36, 0] and audit["steps_lost"] == 36


def test_state_rules() -> None:
    """running beats everything; finished; failed only when the flow gave up after the last start."""
    from training.event_records import EventLog as Log
    from training.tracking.progress import _state

    gave_up = [{"kind": "flow_started"}, {"kind": "started"}, {"kind": "failure"}, {"kind": "chunk_failed"}]
    assert _state(True, False, Log(gave_up), True) == "running"
    assert _state(False, True, Log(gave_up), True) == "finished"
    assert _state(False, False, Log(gave_up), True) == "failed"
    assert _state(False, False, Log([*gave_up, {"kind": "flow_started"}]), True) == "dead"  # a new flow died since
    assert _state(False, False, Log([{"kind": "started"}, {"kind": "failure"}]), True) == "dead"
    assert _state(False, False, Log(), False) == "never started"
    assert _state(False, False, Log([{"kind": "resumed"}]), True, clean_end=True) == "stopped"  # e.g. a pulled clone


def test_flow_summary_verifies_the_newest_checkpoint_once(tmp_path: Path, monkeypatch: Any) -> None:
    """The summary's final step and digest come from the last chunk's row, which already verified
    that checkpoint (verifying hashes every file); when the row has none the run's store is asked,
    and it remembers its verdict: still one verification."""
    import logging

    from flows.train import TrainingRun
    from training.checkpointing.store import CheckpointStore

    run_dir = make_run(tmp_path, "done", ["train.total_steps=20", "train.chunk_steps=20"])
    assert run_worker(run_dir, 20)[0] == 0
    newest = CheckpointStore(run_dir).latest_valid(record=False)
    assert newest is not None and newest.step == 20
    from training.checkpointing import store as store_module

    loaded: list[Path] = []
    load = store_module.load_checkpoint

    def counting_load(path: Path, *args: Any, **kwargs: Any) -> Any:
        loaded.append(Path(path))
        return load(path, *args, **kwargs)

    monkeypatch.setattr(store_module, "load_checkpoint", counting_load)  # the real reading, counted
    run = TrainingRun(load_run_config(run_dir), run_dir, None, logging.getLogger(__name__))
    try:
        run.committed = 20
        run.chunk(1, 0, 20)  # committed already: skipped, its checkpoint verified for the row
        assert run.final_checkpoint() == (20, newest.digest)
        assert loaded == [run_dir / "checkpoints" / "step-000000020"]
        run.rows[-1].digest = None  # a row without a digest: the run's store is asked
        assert run.final_checkpoint() == (20, newest.digest) and len(loaded) == 1
    finally:
        run.resources.close()  # its worker zygote, which would live as long as this test process
