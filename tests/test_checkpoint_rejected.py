"""A bad checkpoint is passed over; a bug while restoring a good one is a crash, never a refusal.

Only :class:`CheckpointRejected` (raised by the store and the train-state validator) means "this
checkpoint is bad".  A ``KeyError``/``TypeError``/``ValueError`` from a bug must crash the worker
with its traceback and leave the checkpoint alone: not recorded as skipped, not quarantined when
the run reaches its step again, still the resume point once the bug is gone.  The fallbacks over
genuinely bad checkpoints are tested in tests/test_checkpoint.py
(``test_corrupt_newest_falls_back_records_event_and_deletes_nothing``) and
tests/test_hostile_inputs.py (``test_checkpoint_that_does_not_fit_is_refused_and_the_resume_falls_back``,
``test_a_refused_checkpoint_reached_again_is_quarantined_as_invalid_and_listed``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tasks.supervision.attempt import AttemptSpec
from tasks.supervision.supervisor import ChunkFailed, supervise, worker_command
from tasks.supervision.worker_liveness import DetectionLimits
from tests.engine_util import make_run, run_worker
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.store import MANIFEST, CheckpointStore
from training.config import RunConfig, load_config
from training.events import Event, FailureKind, read_events
from training.examples import char_gpt
from training.state import TrainState
from training.task import TaskParts
from training.tracking.attempts import AttemptId

BUG_ENV = "CONVOY_TEST_RESTORE_BUG"
NEWEST = "step-000000020"


def build_task_with_restore_bug(config: RunConfig, device: torch.device) -> TaskParts:
    """The char GPT whose ``load_state_dict`` has a bug (a KeyError) when ``BUG_ENV`` is set:
    the checkpoint is fine, the code restoring it is not."""
    parts = char_gpt.build(config, device)
    if os.environ.get(BUG_ENV):
        real = parts.model.load_state_dict

        def load_state_dict(state: Any, *args: Any, **kwargs: Any) -> Any:
            raise KeyError("a bug in the restore, not in the checkpoint")
            return real(state, *args, **kwargs)  # pragma: no cover

        parts.model.load_state_dict = load_state_dict  # type: ignore[method-assign]
    return parts


def small_parts(step: int) -> dict[str, Any]:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 2)
    return {"state": {"model": model.state_dict(), "step": step}, "rank-0": {"rng": torch.get_rng_state()}}


def quarantined(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.*-*"))


def test_a_bug_while_restoring_crashes_the_attempt_and_leaves_the_checkpoint_alone(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path, "bug", ["task=tests.test_checkpoint_rejected:build_task_with_restore_bug"])
    code, out = run_worker(run_dir, 20)
    assert code == 0, out
    limits = DetectionLimits.from_config(
        load_config(None, ["heartbeat.init_timeout_s=120", "heartbeat.timeout_s=30", "heartbeat.grace_s=2"])
    )
    spec = AttemptSpec(
        worker_command(run_dir, 30),
        run_dir,
        limits,
        run_dir / "logs" / "bug.log",
        id=AttemptId(0, 1),
        env={BUG_ENV: "1"},
    )
    with pytest.raises(ChunkFailed) as failed:
        supervise(spec)
    assert failed.value.kind == FailureKind.CRASH, failed.value
    log = (run_dir / "logs" / "bug.log").read_text()
    assert "Traceback (most recent call last)" in log and "KeyError: 'a bug in the restore" in log, log
    assert any("KeyError" in line for line in failed.value.details.tail), failed.value.details
    failure = read_events(run_dir, Event.FAILURE)[-1]  # the audit: the error, the log with the traceback
    assert "KeyError" in failure["error"] and failure["log"] == str(run_dir / "logs" / "bug.log"), failure
    assert failure["last_committed_step"] == 20 and failure["passed_over"] == [], failure
    assert not read_events(run_dir, Event.CHECKPOINT_SKIPPED)  # never recorded as refused
    assert CheckpointStore(run_dir).verify(run_dir / "checkpoints" / NEWEST).step == 20
    code, out = run_worker(run_dir, 30)  # the bug fixed: the same checkpoint is the resume point
    assert code == 0 and f"resumed from step 20 (checkpoint {NEWEST}" in out, out
    assert not quarantined(run_dir) and not read_events(run_dir, Event.CHECKPOINT_INVALID)


def test_a_bug_in_the_train_state_restore_propagates_in_process(tmp_path: Path, monkeypatch) -> None:
    """The issue's case: ``TrainState.restore`` raising KeyError used to make the worker pass
    over a good checkpoint, record it as invalid and later quarantine it."""
    from training.worker import Worker

    run_dir = make_run(tmp_path, "inproc")
    code, out = run_worker(run_dir, 20)
    assert code == 0, out

    def buggy_restore(self: TrainState, loaded: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        raise KeyError("optimizer")

    monkeypatch.setattr(TrainState, "restore", buggy_restore)
    worker = Worker(run_dir, 30)
    try:
        with pytest.raises(KeyError, match="optimizer"):
            worker.run()
    finally:
        worker.hb.stop()
        if worker.lease is not None:
            worker.lease.release()
    assert not read_events(run_dir, Event.CHECKPOINT_SKIPPED) and not worker.runtime.store.refused
    assert CheckpointStore(run_dir).latest_valid(record=False).step == 20


def test_a_bug_in_the_validator_propagates_and_records_nothing(tmp_path: Path) -> None:
    """A ValueError from a bug (ConfigError is one too) is not a rejection."""

    def buggy(manifest: dict[str, Any], parts: dict[str, Any]) -> None:
        int("x")

    CheckpointStore(tmp_path).save(10, small_parts(10), blocking=True)
    store = CheckpointStore(tmp_path, validator=buggy)
    with pytest.raises(ValueError, match="invalid literal") as raised:
        list(store.candidates())
    assert not isinstance(raised.value, CheckpointRejected)
    assert not store.refused and not read_events(tmp_path, Event.CHECKPOINT_SKIPPED)


def test_a_rejection_by_the_validator_is_a_candidate_passed_over_with_its_reason(tmp_path: Path) -> None:
    def rejects_20(manifest: dict[str, Any], parts: dict[str, Any]) -> None:
        if manifest["step"] == 20:
            raise CheckpointRejected("model.w: checkpoint has [3], the task [4]")

    writer = CheckpointStore(tmp_path)
    for step in (10, 20):
        writer.save(step, small_parts(step), blocking=True)
    candidates = list(CheckpointStore(tmp_path, validator=rejects_20).candidates())
    assert [(c.step, c.loaded is None) for c in candidates] == [(20, True), (10, False)]
    assert "checkpoint has [3]" in candidates[0].reason and candidates[1].loaded[0].step == 10
    assert [e["checkpoint"] for e in read_events(tmp_path, Event.CHECKPOINT_SKIPPED)] == [NEWEST]


def test_an_unreadable_file_is_a_rejection_caused_by_the_os_error(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(20, small_parts(20), blocking=True)
    (store.root / NEWEST / "rank-0.safetensors").unlink()
    with pytest.raises(CheckpointRejected, match="unreadable") as rejected:
        store.verify(store.root / NEWEST)
    assert isinstance(rejected.value.__cause__, FileNotFoundError)


def test_a_manifest_of_a_newer_format_is_rejected(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(20, small_parts(20), blocking=True)
    path = store.root / NEWEST / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["format"] = 2
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointRejected, match="format 2"):
        store.verify(store.root / NEWEST)


def test_a_malformed_manifest_file_list_is_a_rejection_not_a_type_error(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(20, small_parts(20), blocking=True)
    path = store.root / NEWEST / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"] = ["state.json"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointRejected, match="'files' is not a mapping"):
        store.verify(store.root / NEWEST)
