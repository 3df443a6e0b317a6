"""One truth about failures in every tool: a real flow (real Prefect API, real MLflow on SQLite)
whose worker is SIGKILLed before its first checkpoint and again right after a save.  Steps lost
must be the same in the failure event, `convoy status`, the `convoy chaos` scoring, MLflow's tag
and resume table, the Prefect failure notes and the DVC train metrics; each failed attempt's
MLflow run explains itself (failed-at, resumed-from, steps lost, reason, log tail)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.flow_util import assert_no_leftovers, config, in_thread, params, wait_for_step
from training.events import read_events

pytestmark = pytest.mark.slow

TOTAL, EVERY = 60, 30


def prefect_notes(key: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return [str(a.data) for a in found]


def test_steps_lost_agree_everywhere_and_failed_attempts_explain_themselves(
    prefect_api: str, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.chaos_drill import failure_steps_lost
    from flows.train import run_training
    from tasks.records.mlflow_audit import LOG_TAIL_ARTIFACT
    from tasks.records.mlflow_client import client_for
    from training.evaluate import train_metrics
    from training.event_records import EventLog
    from training.rundir import run_info
    from training.tracking.failure_record import RecordedFailure
    from training.tracking.progress import run_status
    from training.tracking.resume_audit import analyse_events

    monkeypatch.setenv("CONVOY_FAULTS", "step_delay=0.03,slow_step=13:2")  # the first kill lands at 12
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config(
        params(
            tmp_path,
            data_dir,
            "truth",
            train={"total_steps": TOTAL, "chunk_steps": TOTAL},
            # The disk tier only, so that each kill loses steps (with the memory tier: at most one).
            checkpoint={"every_steps": EVERY, "keep_last": 3, "memory_every_steps": None},
            tracking={"mlflow": True, "mlflow_uri": uri},
        )
    )
    run_dir = cfg.run_dir.resolve()
    kills: list[int] = []

    def killer() -> None:
        beat = wait_for_step(run_dir, 12)  # before the first checkpoint (step 30)
        kills.append(beat.step)
        os.kill(beat.pid, signal.SIGKILL)
        manifest = run_dir / "checkpoints" / f"step-{EVERY:09d}" / "manifest.json"
        deadline = time.monotonic() + 240
        while not manifest.exists():  # right after the save commits
            assert time.monotonic() < deadline, "no checkpoint at step 30"
            time.sleep(0.01)
        beat = wait_for_step(run_dir, EVERY)
        kills.append(beat.step)
        os.kill(beat.pid, signal.SIGKILL)

    t = in_thread(killer)
    summary = run_training(cfg)
    t.join(timeout=5)
    assert not t.errors, t.errors  # type: ignore[attr-defined]
    assert summary["final_step"] == TOTAL and len(kills) == 2

    failures = read_events(run_dir, "failure")
    assert [f["failure"] for f in failures] == ["killed", "killed"]
    assert failures[0]["last_committed_step"] is None and failures[0]["steps_lost"] >= kills[0] > 0
    assert failures[1]["last_committed_step"] == EVERY and failures[1]["steps_lost"] >= kills[1] - EVERY
    audit = analyse_events(EventLog.read(run_dir))
    per_failure = [f["steps_lost"] for f in failures]
    assert [r["lost_steps"] for r in audit["rows"]] == per_failure  # the resume rows
    typed_failures = [RecordedFailure.from_event(f) for f in failures]
    assert [failure_steps_lost(f, audit["rows"]) for f in typed_failures] == per_failure  # `convoy chaos`
    total = sum(per_failure)
    print(f"\nkilled at steps {kills}: steps lost {per_failure}")

    status = run_status(cfg, run_dir)
    assert (status["state"], status["steps_lost"], status["failures"]) == ("finished", total, 2)
    assert summary["audit"]["steps_lost"] == total  # the end-of-train summary
    dvc = train_metrics(cfg, run_dir, {"step": TOTAL, "digest": summary["digest"]})
    assert dvc["steps_lost"] == total
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:  # the retried chunk says so in the task list
        (chunk_run,) = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[summary["flow_run_id"]]))
        )
    assert chunk_run.state.message == f"steps [0, {TOTAL}) committed on attempt 3 after killed, killed"
    notes = prefect_notes("convoy-truth-failures")
    for lost in per_failure:
        assert any(f"steps lost: {lost})" in n for n in notes), notes

    client = client_for(uri)
    run_id = run_info(run_dir).mlflow_run_id
    parent = client.get_run(run_id)
    assert parent.data.tags["convoy.steps_lost"] == str(total)
    assert "2 failure(s)" in parent.data.tags["mlflow.note.content"]
    table = client.download_artifacts(run_id, "convoy/resume_events.json", str(tmp_path))
    import json

    payload = json.loads(Path(table).read_text())
    col = payload["columns"].index("lost_steps")
    assert [row[col] for row in payload["data"]] == per_failure

    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    failed = sorted((c for c in children if c.info.status == "FAILED"), key=lambda c: c.info.start_time)
    assert len(failed) == 2
    for child, fail in zip(failed, failures, strict=True):
        tags: dict[str, Any] = child.data.tags
        assert tags["convoy.failure_kind"] == "killed" and "SIGKILL" in tags["convoy.reason"]
        assert tags["convoy.steps_lost"] == str(fail["steps_lost"])
        assert tags["convoy.resumed_from_step"] == str(fail["last_committed_step"] or 0)
        assert int(tags["convoy.failed_at_step"]) == fail["trained_to"]
        # Its charts are the steps it trained (issue 31); the facts of its failure are tags.
        assert "loss" in child.data.metrics and not {"steps_lost", "failed_at_step"} & set(child.data.metrics)
        log = Path(client.download_artifacts(child.info.run_id, LOG_TAIL_ARTIFACT, str(tmp_path / child.info.run_id)))
        assert log.read_text().strip(), "empty log tail"
    assert_no_leftovers(run_dir)
