"""Goodput and badput by bucket (training/tracking/goodput.py): synthetic event streams whose every
bucket is worked out by hand, the chunk-end points MLflow gets, and one real run through the real
flow with a real SIGKILL of its worker and MLflow on."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.flow_util import CHUNK, TOTAL, config, in_thread, params, wait_for_step
from training.event_records import EventLog
from training.tracking.goodput import BUCKETS, Goodput, StepJournal, StepRow, chunk_points, compute, journal_steps

T0 = 1_800_000_000.0  # any epoch time: the streams below count from it


def ev(t: float, kind: str, **fields: Any) -> dict[str, Any]:
    return {"time": T0 + t, "kind": kind, **fields}


def rows(first: int, last: int, t_first: float, every: float = 0.1, step_s: float = 0.1) -> list[StepRow]:
    """Journal rows of steps first..last, logged ``every`` s apart from ``t_first`` on."""
    return [StepRow(s, T0 + t_first + every * (s - first), step_s, 0.0) for s in range(first, last + 1)]


def assert_adds_up(g: Goodput) -> None:
    assert set(g.badput_s) == set(BUCKETS)
    assert all(v >= 0 for v in g.badput_s.values()), g.badput_s
    assert g.productive_s + sum(g.badput_s.values()) == pytest.approx(g.wall_s, rel=0.01)
    assert g.goodput == pytest.approx(g.productive_s / g.wall_s, abs=1e-4)


def expect(g: Goodput | None, wall: float, productive: float, **buckets: float) -> None:
    """``g`` has this wall-clock, productive time and these buckets (the others 0, ``other`` the rest)."""
    assert g is not None
    assert_adds_up(g)
    assert g.wall_s == pytest.approx(wall, abs=1e-3)
    assert g.productive_s == pytest.approx(productive, abs=1e-3)
    want = {b: buckets.get(b, 0.0) for b in BUCKETS if b != "other"}
    assert {b: g.badput_s[b] for b in want} == pytest.approx(want, abs=1e-3)
    assert g.badput_s["other"] == pytest.approx(wall - productive - sum(want.values()), abs=2e-3)


# ---------------------------------------------------------------------------------- streams
def clean_run() -> tuple[list[dict[str, Any]], list[StepRow]]:
    """One flow, one worker: 10 steps of 0.1 s, an eval of 0.05 s at step 5, two saves."""
    steps = rows(1, 10, 3.1, every=0.12)
    steps[4] = steps[4]._replace(eval_s=0.05)
    events = [
        ev(0, "flow_started", flow_run_id="a"),
        ev(1, "attempt_started", chunk=1, attempt=1),
        ev(3, "started", rank=0, previous_beat_step=None),
        ev(3.7, "checkpoint_saved", step=5, stall_s=0.005),
        ev(4.3, "checkpoint_saved", step=10, stall_s=0.01),
        ev(4.31, "worker_done", rank=0, step=10),
        ev(4.4, "chunk_done", chunk=1, end_step=10),
        ev(5, "flow_done", flow_run_id="a"),
    ]
    return events, steps


def killed_run() -> tuple[list[dict[str, Any]], list[StepRow]]:
    """SIGKILL at step 8 (death 2.85 s, detected 0.2 s later), resumed from step 4 (0.3 s restore);
    steps 5-8 are trained twice, the replay leaves no rows."""
    events = [
        ev(0, "flow_started", flow_run_id="a"),
        ev(1, "attempt_started", chunk=1, attempt=1),
        ev(2, "started", rank=0),
        ev(2.45, "checkpoint_saved", step=4, stall_s=0.02),
        ev(3.2, "failure", failure="killed", chunk=1, attempt=1, detected_at=T0 + 3.05, detected_after_s=0.2)
        | {"trained_to": 8, "last_committed_step": 4, "steps_lost": 4},
        ev(3.5, "attempt_started", chunk=1, attempt=2),
        ev(4.0, "resumed", rank=0, step=4, load_s=0.3),
        ev(4.85, "checkpoint_saved", step=12, stall_s=0.01),
        ev(4.86, "worker_done", rank=0, step=12),
        ev(4.9, "chunk_done", chunk=1, end_step=12),
        ev(5.5, "flow_done", flow_run_id="a"),
    ]
    return events, rows(1, 8, 2.1) + rows(9, 12, 4.5)


def taken_over_run() -> tuple[list[dict[str, Any]], list[StepRow]]:
    """Flow a and its worker die at step 6 (last row at 1.6 s, no event says so); flow b takes the
    run over at 10 s and resumes from the checkpoint at step 5."""
    events = [
        ev(0, "flow_started", flow_run_id="a"),
        ev(0.5, "attempt_started", chunk=1, attempt=1),
        ev(1.0, "started", rank=0),
        ev(1.55, "checkpoint_saved", step=5, stall_s=0.01),
        ev(10.0, "flow_taken_over", flow_run_id="b", previous=["a"]),
        ev(10.1, "flow_started", flow_run_id="b"),
        ev(10.2, "attempt_started", chunk=1, attempt=1),
        ev(10.6, "resumed", rank=0, step=5, load_s=0.1),
        ev(11.15, "worker_done", rank=0, step=10),
        ev(11.2, "chunk_done", chunk=1, end_step=10),
        ev(11.5, "flow_done", flow_run_id="b"),
    ]
    return events, rows(1, 6, 1.1) + rows(7, 10, 10.8)


# ---------------------------------------------------------------------------------- by hand
def test_a_clean_run() -> None:
    events, steps = clean_run()
    # wall 5; productive 10 x 0.1; start-up: attempt (1 s) -> started (3 s); saves 0.015; eval 0.05
    expect(compute(EventLog(events), steps), 5.0, 1.0, program_startup=2.0, checkpoint_save=0.015, evaluation=0.05)
    assert compute(EventLog(events), steps).goodput == 0.2  # type: ignore[union-attr]


def test_a_kill_detection_restore_and_lost_steps() -> None:
    events, steps = killed_run()
    g = compute(EventLog(events), steps)
    expect(
        g,
        5.5,
        1.2,  # steps 1-12 once
        program_startup=1.0 + 0.2,  # 1 -> 2 s, then the retry's attempt 3.5 -> restore begins 3.7
        checkpoint_restore=0.3,
        checkpoint_save=0.03,
        wasted_progress=0.4,  # steps 5-8, trained before the kill, rolled back to 4
        infrastructure_recovery=3.5 - 2.85,  # the death (detected_at - detected_after_s) -> the retry
    )
    assert g is not None and g.step == 12


def test_a_run_in_the_middle_of_its_recovery() -> None:
    """Cut before the retry: the failure names the resume point, so steps 5-8 are already lost,
    and recovery runs to the moment asked about."""
    events, steps = killed_run()
    g = compute(EventLog(events), steps, until=T0 + 3.6)
    expect(g, 3.6, 0.4, program_startup=1.0, checkpoint_save=0.02, wasted_progress=0.4, infrastructure_recovery=0.75)
    assert g is not None and g.step == 4


def test_a_run_taken_over_by_a_second_flow() -> None:
    events, steps = taken_over_run()
    expect(
        compute(EventLog(events), steps),
        11.5,  # the dead flow's gap counts: nobody ended the run
        1.0,
        program_startup=0.5 + 0.3,
        checkpoint_restore=0.1,
        checkpoint_save=0.01,
        wasted_progress=0.1,  # step 6: trained by the dead worker, resumed from 5
        infrastructure_recovery=10.2 - 1.6,  # its last row -> the new flow's attempt
    )


def test_a_flow_that_died_between_two_workers() -> None:
    """No worker ran when flow a died (``pipeline: false``, after chunk 1's clean exit): the gap
    from its last event to flow b's start is recovery all the same."""
    events = [
        ev(0, "flow_started", flow_run_id="a"),
        ev(0.5, "attempt_started", chunk=1, attempt=1),
        ev(1.0, "started", rank=0),
        ev(1.55, "checkpoint_saved", step=5, stall_s=0.01),
        ev(1.56, "worker_done", rank=0, step=5),
        ev(1.6, "chunk_done", chunk=1, end_step=5),
        ev(20.0, "flow_started", flow_run_id="b"),
        ev(20.2, "attempt_started", chunk=2, attempt=1),
        ev(20.5, "resumed", rank=0, step=5, load_s=0.1),
        ev(21.1, "worker_done", rank=0, step=10),
        ev(21.2, "flow_done", flow_run_id="b"),
    ]
    g = compute(EventLog(events), rows(1, 5, 1.1) + rows(6, 10, 20.6))
    expect(
        g,
        21.2,
        1.0,
        program_startup=0.5 + 0.2,
        checkpoint_restore=0.1,
        checkpoint_save=0.01,
        infrastructure_recovery=20.0 - 1.6,
    )


def test_a_flow_that_ended_by_itself_stops_the_clock() -> None:
    """Flow a gave up (flow_failed at 3.3 s); a person ran it again at 100 s: the 96.7 s between
    are not the run's wall-clock, and the failure's recovery ends where flow a ended."""
    events, steps = killed_run()
    head = [e for e in events if e["time"] <= T0 + 3.2] + [ev(3.3, "flow_failed", flow_run_id="a")]
    tail = [
        ev(100.0, "flow_started", flow_run_id="b"),
        ev(100.5, "attempt_started", chunk=1, attempt=1),
        ev(101.0, "resumed", rank=0, step=4, load_s=0.3),
        ev(101.5, "worker_done", rank=0, step=8),
        ev(102.0, "flow_done", flow_run_id="b"),
    ]
    g = compute(EventLog(head + tail), steps[:8])
    expect(
        g,
        3.3 + 2.0,
        0.8,  # steps 1-8: the second flow ended at 8
        program_startup=1.0 + 0.2,
        checkpoint_restore=0.3,
        checkpoint_save=0.02,
        wasted_progress=0.4,
        infrastructure_recovery=(3.3 - 2.85) + (100.5 - 100.0),  # the death to flow a's end; flow b to its attempt
    )


def test_events_after_the_cut_change_nothing() -> None:
    events, steps = killed_run()
    early = compute(EventLog(events), steps, until=T0 + 2.46)
    assert early == compute(EventLog(events[:4]), steps[:4], until=T0 + 2.46)
    expect(early, 2.46, 0.4, program_startup=1.0, checkpoint_save=0.02)


def test_chunk_points_are_cut_at_each_chunk_end() -> None:
    events, steps = killed_run()
    events = [*events[:4], ev(2.5, "chunk_done", chunk=1, end_step=4), *events[4:]]
    first, second = chunk_points(EventLog(events), steps)
    assert (first.step, second.step) == (4, 12)
    assert first.cumulative == compute(EventLog(events), steps, until=T0 + 2.5)
    assert second.cumulative == compute(EventLog(events), steps, until=T0 + 4.9)
    assert first.interval == first.cumulative.goodput
    a, b = first.cumulative, second.cumulative
    assert second.interval == pytest.approx((b.productive_s - a.productive_s) / (b.wall_s - a.wall_s), abs=1e-4)
    assert [p.step for p in chunk_points(EventLog(events), steps, only=[12])] == [12]
    metrics = second.metrics()
    assert metrics["goodput"] == second.cumulative.goodput
    assert {k for k in metrics if k.startswith("badput/")} == {f"badput/{b}" for b in BUCKETS}


def test_goodput_round_trips_and_describes_its_largest_buckets() -> None:
    events, steps = taken_over_run()
    g = compute(EventLog(events), steps)
    assert g is not None and Goodput.from_dict(json.loads(json.dumps(g.as_dict()))) == g
    assert g.describe().startswith(f"{g.goodput:.3f} of 11.5 s; badput: infrastructure_recovery 8.6 s")
    assert compute(EventLog(), []) is None


# ---------------------------------------------------------------------------------- MLflow, once
def write_run(run_dir: Path, events: list[dict[str, Any]], steps: list[StepRow]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    journal = [{"step": r.step, "metrics": {"step_time_s": r.step_s}, "time_ms": int(r.time * 1000)} for r in steps]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(j) + "\n" for j in journal))


def test_a_journal_reader_reads_on_and_again_only_for_another_file(tmp_path: Path) -> None:
    """A :class:`StepJournal` (held by whoever reads goodput again: no module keeps one) reads on
    from where it stopped, and reads a replaced or shorter journal again from its start."""
    path = tmp_path / "metrics.jsonl"

    def write(first: int, last: int, mode: str = "a") -> None:
        with open(path, mode) as f:
            f.writelines(
                json.dumps({"step": s, "time_ms": s * 1000, "metrics": {"step_time_s": 0.5}}) + "\n"
                for s in range(first, last + 1)
            )

    reader = StepJournal(tmp_path)
    assert reader.rows() == []  # no journal yet
    write(1, 3)
    assert [r.step for r in reader.rows()] == [1, 2, 3]
    write(4, 5)
    with open(path, "a") as f:
        f.write('{"step": 6')  # a row still being written waits for its newline
    assert [r.step for r in reader.rows()] == [1, 2, 3, 4, 5]
    assert reader.rows()[-1] == StepRow(5, 5.0, 0.5, 0.0)
    replaced = tmp_path / "new.jsonl"
    replaced.write_text(json.dumps({"step": 9, "metrics": {}}) + "\n")
    os.replace(replaced, path)  # another file (a new inode): read from its start
    assert [r.step for r in reader.rows()] == [9]
    write(10, 12)
    assert [r.step for r in reader.rows()] == [9, 10, 11, 12]
    write(1, 1, mode="w")  # the same file, shorter: read again
    assert [r.step for r in reader.rows()] == [1]
    assert journal_steps(tmp_path) == reader.rows()  # no reader: the journal read whole


def test_each_chunk_end_is_logged_once_however_often_it_is_asked(tmp_path: Path) -> None:
    """A later flow (a fresh process: nothing remembered but MLflow's history) logs only the chunk
    ends the run lacks, with the values any process computes; ``tracking.mlflow: false`` logs none."""
    from mlflow.tracking import MlflowClient

    from tasks.records import goodput_metrics
    from tasks.records.background import OneAtATime
    from training.rundir import update_run_info

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config(params(tmp_path, tmp_path, "once", tracking={"mlflow": True, "mlflow_uri": uri}))
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("once")).info.run_id
    run_dir = tmp_path / "run"
    events, steps = killed_run()
    events = [*events[:4], ev(2.5, "chunk_done", chunk=1, end_step=4), *events[4:]]
    write_run(run_dir, events[:5], steps[:5])  # chunk 1 is done, chunk 2 not yet
    update_run_info(run_dir, mlflow_run_id=run_id)

    off = cfg.model_copy(update={"tracking": cfg.tracking.model_copy(update={"mlflow": False})})
    assert goodput_metrics.log_points(off, run_dir) == []
    assert client.get_metric_history(run_id, "goodput") == []
    journal = StepJournal(run_dir)  # the run's reader, as the run's resources pass it
    assert goodput_metrics.log_points(cfg, run_dir, journal) == [4]
    write_run(run_dir, events, steps)  # the run went on: chunk 2 ended too
    logger = OneAtATime(lambda: goodput_metrics.log_points(cfg, run_dir, journal), "goodput")  # reads on
    logger.request()  # at the chunk end, on a thread
    logger.join()
    assert goodput_metrics.log_points(cfg, run_dir) == []  # the thread logged step 12
    keys = client.get_run(run_id).data.metrics
    history = {key: [(m.step, m.value) for m in client.get_metric_history(run_id, key)] for key in keys}
    expected = {p.step: p.metrics() for p in chunk_points(EventLog(events), steps)}
    assert set(history) == set(expected[12])
    for key, points in history.items():
        assert points == [(4, pytest.approx(expected[4][key])), (12, pytest.approx(expected[12][key]))], key


# ---------------------------------------------------------------------------------- a real run
@pytest.mark.slow
def test_a_real_sigkill_adds_up_and_mlflow_has_one_goodput_point_per_chunk_end(
    prefect_api: str, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    from flows.run_summary import RunSummary
    from flows.train import run_training
    from tasks.records import goodput_metrics
    from training.events import read_events
    from training.rundir import run_info

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("CONVOY_FAULTS", f"step_delay=0.03,slow_step={CHUNK + 9}:2")
    cfg = config(params(tmp_path, data_dir, "goodput", tracking={"mlflow": True}))
    run_dir = cfg.run_dir.resolve()

    def killer() -> None:
        os.kill(wait_for_step(run_dir, CHUNK + 8).pid, signal.SIGKILL)  # in chunk 2

    t = in_thread(killer)
    summary = run_training(cfg)
    t.join(timeout=5)
    assert not t.errors, t.errors  # type: ignore[attr-defined]
    assert [e["failure"] for e in read_events(run_dir, "failure")] == ["killed"]
    assert summary["final_step"] == TOTAL
    badput = summary["badput_s"]
    assert set(badput) == set(BUCKETS) and 0 < summary["goodput"] < 1
    assert summary["productive_s"] + sum(badput.values()) == pytest.approx(summary["wall_s"], rel=0.01)
    assert summary["goodput"] == pytest.approx(summary["productive_s"] / summary["wall_s"], abs=1e-3)
    assert badput["program_startup"] > 0 and badput["infrastructure_recovery"] > 0
    assert summary["wall_s"] == summary["seconds"]  # one wall clock in the summary (issue 44, item 5)
    json.loads(json.dumps(summary, default=str))  # what `convoy train --json` prints
    print(f"\ngoodput {summary['goodput']} of {summary['wall_s']} s, productive {summary['productive_s']} s: {badput}")
    assert RunSummary.from_dict(summary).measured_goodput is not None

    client, run_id = MlflowClient(uri), run_info(run_dir).mlflow_run_id
    steps = sorted(m.step for m in client.get_metric_history(run_id, "goodput"))
    assert steps == [CHUNK, 2 * CHUNK, TOTAL]
    assert sorted(m.step for m in client.get_metric_history(run_id, "badput/wasted_progress")) == steps
    assert goodput_metrics.log_points(cfg, run_dir) == []  # asked again (a later flow): nothing logged twice
    assert sorted(m.step for m in client.get_metric_history(run_id, "goodput_interval")) == steps
    final = {m.step: m.value for m in client.get_metric_history(run_id, "goodput")}[TOTAL]
    assert final == summary["goodput"]  # MLflow's last point is the summary's goodput
