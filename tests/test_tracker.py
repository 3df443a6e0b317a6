"""The tracking seam (``tasks/records/tracker.py``): :mod:`tasks.records.run_records` hands each of
the run's records to the tracker ``tracking.backend`` names, applies the best-effort policy
itself, and MLflow's tracker is one such backend.

Why a fake backend: it is what a second backend is (a module ``tasks.records.<name>_tracker`` with
a ``tracker(config)``, and the config value), so these tests show that nothing else has to
change.  No Prefect, no MLflow store: the fake records the calls it gets.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from tasks.records import run_records
from tasks.records.mlflow_tracker import MlflowTracker
from tasks.records.tracker import AttemptOutcome, Tracker, tracker_for
from training.config import RunConfig, load_config
from training.tracking.attempts import AttemptId
from training.tracking.failure_record import FailureDetails, RecordedFailure
from training.tracking.goodput import StepJournal


class Follower:
    """A metric follower that follows nothing; ``stopped``: the drain time it was stopped with."""

    say: Callable[[str], None] = print
    stopped: float | None = None

    def mirror(self, run_id: str, first_step: int, last_step: int) -> None:
        pass

    def stop(self, drain_s: float) -> Any:
        self.stopped = drain_s
        return None


class RecordingTracker:
    """A backend that records what it is asked, in order; ``fail``: the operations that raise."""

    name = "Fake"

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.calls: list[tuple[Any, ...]] = []
        self.fail: set[str] = set()
        #: The journal reader each ``log_goodput`` was given (the calls record the run only).
        self.journals: list[StepJournal | None] = []

    def _record(self, op: str, *args: Any) -> None:
        self.calls.append((op, *args))
        if op in self.fail:
            raise RuntimeError(f"{op}: backend down")

    def begin_run(self, run_dir: Path) -> str | None:
        self._record("begin_run", run_dir)
        return "run-1"

    def start_attempt(self, run_dir: Path, attempt: AttemptId) -> str | None:
        self._record("start_attempt", run_dir, attempt)
        return f"attempt-{attempt.chunk}.{attempt.attempt}"

    def end_attempt(
        self, run_dir: Path, attempt_run: str, outcome: AttemptOutcome, attempt: AttemptId | None = None
    ) -> None:
        self._record("end_attempt", run_dir, attempt_run, outcome, attempt)

    def close_orphaned_attempts(self, run_dir: Path, orphans: Sequence[RecordedFailure]) -> list[str]:
        self._record("close_orphaned_attempts", run_dir, list(orphans))
        return ["attempt-0.1"]

    def link_flow_run(self, run_dir: Path, tags: dict[str, str]) -> None:
        self._record("link_flow_run", run_dir, tags)

    def follow_metrics(self, run_dir: Path, say: Callable[[str], None]) -> Follower | None:
        self._record("follow_metrics", run_dir)
        return Follower()

    def log_metrics(self, run_dir: Path, step: int, metrics: dict[str, float]) -> None:
        self._record("log_metrics", run_dir, step, metrics)

    def log_goodput(self, run_dir: Path, journal: StepJournal | None = None) -> list[int]:
        self.journals.append(journal)
        self._record("log_goodput", run_dir)
        return [10]

    def start_system_metrics(self, run_dir: Path) -> Callable[[], None]:
        self._record("start_system_metrics", run_dir)
        return lambda: self.calls.append(("stop_system_metrics",))

    def refresh_audit(self, run_dir: Path) -> dict[str, Any]:
        self._record("refresh_audit", run_dir)
        return {"failures": 0}

    def log_model(self, run_dir: Path) -> dict[str, Any] | None:
        self._record("log_model", run_dir)
        return {"model_id": "m-1"}

    def finish_run(self, run_dir: Path, ok: bool) -> None:
        self._record("finish_run", run_dir, ok)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[RecordingTracker]:
    """``tracking.backend: fake``'s module, as a second backend would add it: one tracker for the
    test, so every call run_records makes lands in one record."""
    backend = RecordingTracker(load_config(None, [], check_task=False))
    module = types.ModuleType("tasks.records.fake_tracker")
    module.tracker = lambda config: backend  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tasks.records.fake_tracker", module)
    yield backend


def fake_config(*overrides: str) -> RunConfig:
    return load_config(None, ["tracking.backend=fake", *overrides], check_task=False)


def test_mlflow_is_the_default_backend_and_a_tracker() -> None:
    tracker = tracker_for(load_config(None, [], check_task=False))
    assert isinstance(tracker, MlflowTracker) and isinstance(tracker, Tracker)
    assert isinstance(RecordingTracker(load_config(None, [], check_task=False)), Tracker)
    assert not isinstance(object(), Tracker)


def test_run_records_hands_a_run_s_records_to_the_configured_backend(tmp_path: Path, fake: RecordingTracker) -> None:
    cfg = fake_config()
    tracker = run_records.tracker_for(cfg)  # what the chunk task keeps for its attempts
    assert tracker is fake
    attempt = AttemptId(1, 1, 0, 10, "flow-1", "task-1")
    orphan = RecordedFailure(kind="orphaned", chunk=0, attempt=1, details=FailureDetails(reason="flow died"))

    assert run_records.begin_run(cfg, tmp_path) == "run-1"
    assert run_records.close_orphaned_attempts(cfg, tmp_path, [orphan]) == ["attempt-0.1"]
    run_records.link_flow_run(cfg, tmp_path, {"convoy.flow_run": "flow-1"})
    assert isinstance(run_records.follow_metrics(cfg, tmp_path, print), Follower)
    with run_records.system_metrics(cfg, tmp_path):
        child = run_records.start_attempt(tracker, tmp_path, attempt)
        done = run_records.attempt_outcome(True, None, 10, 1.5, end_step=10)
        run_records.end_attempt(tracker, tmp_path, child, done, attempt)
        run_records.refresh(cfg, tmp_path)
    assert run_records.log_goodput(cfg, tmp_path) == [10]
    assert run_records.log_model(cfg, tmp_path) == {"model_id": "m-1"}
    assert run_records.finish_run(cfg, tmp_path, True) == {"failures": 0}

    assert fake.calls == [
        ("begin_run", tmp_path),
        ("close_orphaned_attempts", tmp_path, [orphan]),
        ("link_flow_run", tmp_path, {"convoy.flow_run": "flow-1"}),
        ("follow_metrics", tmp_path),
        ("start_system_metrics", tmp_path),
        ("start_attempt", tmp_path, attempt),
        ("end_attempt", tmp_path, "attempt-1.1", AttemptOutcome("FINISHED", None, 10, 1.5, None, 10), attempt),
        ("refresh_audit", tmp_path),
        ("stop_system_metrics",),
        ("log_goodput", tmp_path),
        ("log_model", tmp_path),
        ("refresh_audit", tmp_path),
        ("finish_run", tmp_path, True),
    ]


def test_a_backend_that_fails_is_a_warning_except_when_the_run_opens(
    tmp_path: Path, fake: RecordingTracker, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = fake_config()
    fake.fail = {"begin_run", "start_attempt", "link_flow_run", "refresh_audit", "log_goodput", "start_system_metrics"}
    with pytest.raises(RuntimeError, match="begin_run"):
        run_records.begin_run(cfg, tmp_path)  # reported before any training
    with caplog.at_level(logging.WARNING, logger="convoy.tracking"):
        child = run_records.start_attempt(fake, tmp_path, AttemptId(2, 1, 10, 20))
        run_records.end_attempt(fake, tmp_path, child, run_records.attempt_outcome(False, "killed"))
        run_records.link_flow_run(cfg, tmp_path, {"convoy.flow_run": "flow-1"})
        run_records.refresh(cfg, tmp_path)
        assert run_records.log_goodput(cfg, tmp_path) == []
        with run_records.system_metrics(cfg, tmp_path):
            pass
    assert child is None and "end_attempt" not in {c[0] for c in fake.calls}  # nothing opened, nothing ended
    said = caplog.text
    assert "Fake: could not start the attempt run of chunk 2" in said
    assert "Fake: could not link the Prefect flow run" in said and "audit: could not refresh" in said
    assert "Fake: could not log the goodput" in said and "Fake: could not start the system metrics" in said


def test_tracking_off_asks_no_backend_and_still_writes_the_audit_files(tmp_path: Path, fake: RecordingTracker) -> None:
    cfg = fake_config("tracking.mlflow=false")
    assert run_records.tracker_for(cfg) is None
    assert run_records.begin_run(cfg, tmp_path) is None
    assert run_records.start_attempt(None, tmp_path, AttemptId(1, 1, 0, 10)) is None
    assert run_records.close_orphaned_attempts(cfg, tmp_path, []) == []
    assert run_records.follow_metrics(cfg, tmp_path, print) is None
    assert run_records.log_goodput(cfg, tmp_path) == [] and run_records.log_model(cfg, tmp_path) is None
    summary = run_records.finish_run(cfg, tmp_path, True)
    assert summary is not None and summary["failures"] == 0
    assert (tmp_path / "audit" / "resume_events.json").is_file() and (tmp_path / "audit" / "timeline.png").is_file()
    assert fake.calls == []


def test_the_run_s_resources_hold_its_tracker_and_send_it_metrics_and_goodput(
    tmp_path: Path, fake: RecordingTracker
) -> None:
    """The run's resources send a backend that is not MLflow the worker's step metrics (one
    follower for the run, stopped at its end) and each chunk end's goodput, read through the
    resources' journal reader; every chunk task's attempts go to the one tracker they hold."""
    from tasks.chunk import ChunkRun
    from tasks.execution_plan import ChunkSpan
    from tasks.run_resources import RunResources

    cfg = fake_config("orchestration.zygote=false")
    resources = RunResources(cfg, tmp_path)
    try:
        assert resources.tracker is fake
        assert ChunkRun(cfg, tmp_path, ChunkSpan(0, 0, 10), resources, logging.getLogger("test")).tracker is fake
        follower = resources.follow_metrics(print)
        assert isinstance(follower, Follower) and resources.follow_metrics(print) is follower
        resources.goodput.request()  # at a chunk end, on a thread
        resources.goodput.join()
        assert run_records.log_goodput(cfg, tmp_path, journal=resources.journal) == [10]  # the flow's last call
    finally:
        resources.close()
    assert follower.stopped == cfg.tracking.ship_drain_s
    run_dir = resources.run_dir
    assert fake.calls == [("follow_metrics", run_dir), ("log_goodput", run_dir), ("log_goodput", tmp_path)]
    assert fake.journals == [resources.journal, resources.journal]
