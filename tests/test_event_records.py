"""The audit events as typed records (training/event_records.py): every record class survives a trip
through ``events.jsonl``, a line of an older release reads with defaults, a key this version does not
know is kept, and a record writes the keys its kind has always had."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tasks.records.chunk_record import ChunkRecord
from training import event_records as er
from training.events import Event, append_event, read_events
from training.tracking.failure_record import FailureDetails, RecordedFailure

#: One record of every class, every field set to something other than its default.
SAMPLES: list[er.EventRecord] = [
    er.FlowStarted(flow_run_id="f1", flow_run_name="brave-fox", started_at=99.5, committed_step=40, chunks=3),
    er.FlowDone(final_step=120, digest="ab" * 8, trained_chunks=2, flow_run_id="f1"),
    er.FlowFailed(failure="crash", message="boom", chunk=None, resume_step=40, flow_run_id="f1"),
    er.FlowCrashed(failure="crashed", message="gone", chunk=None, resume_step=0, flow_run_id="f2"),
    er.ChunkTaskFailed(failure="repeated", message="same error", chunk=2, resume_step=40, flow_run_id="f1"),
    er.FlowTakenOver(
        flow_run_id="f2",
        previous=["f1"],
        previous_names=["brave-fox"],
        orphaned=[{"chunk": 2, "attempt": 3, "trained_to": 55}],
        mlflow_runs_closed=["m1"],
        crashed_task_runs=["chunk-2 (Running)"],
    ),
    er.AttemptStarted(
        chunk=2,
        attempt=3,
        flow_run_id="f1",
        task_run_id="t1",
        mlflow_run_id="m1",
        resumes_from=40,
        metrics_offset=1234,
        parked=True,
        replaces=2,
    ),
    er.AttemptRecorded(chunk=2, attempt=3, task_run_id="t2", mlflow_run_id="m2"),
    er.Resubmitted(chunk=2, attempt=3, reason="preempted", resume_step=40),
    er.ChunkDone(
        chunk=2,
        start_step=40,
        end_step=80,
        attempt=3,
        preemptions=1,
        resumed_from=40,
        digest="cd" * 8,
        loss=1.25,
        seconds=3.5,
        worker_seconds=3.25,
        node="n1",
    ),
    er.Started(rank=1, until_step=80, previous_beat_step=12, intraop_threads=4, forked_by=321),
    er.Resumed(rank=0, until_step=80, step=40, checkpoint="step-000000040", digest="ef", load_s=0.25, tier="memory"),
    er.Preempted(rank=0, step=55),
    er.WorkerDone(rank=0, step=80, digest="cd", loss=1.25, threads=["MainThread"], network_clients=[]),
    er.WorkerConfigError(rank=0, message="no such corpus"),
    er.FirstStep(step=41, step_s=0.5),
    er.CheckpointSaved(step=50, stall_s=0.01, blocking=False, persist_s=0.2),
    er.CheckpointSkipped(checkpoint="step-000000060", reason="hash mismatch"),
    er.CheckpointPublished(
        step=50, digest="ab", dvc_md5="x.dir", index="i.json", upload_s=1.5, upload_lag_steps=10, upload_lag_s=2.5
    ),
    er.CheckpointFetched(
        step=50,
        digest="ab",
        bytes=1024,
        download_s=0.5,
        verify_s=0.1,
        fetch_s=0.7,
        metric_rows=50,
        from_node="n1",
        node="n2",
        remote="(default)",
        refused=[{"step": 60, "reason": "missing"}],
    ),
    er.ReplayVerified(values_compared=12, mismatches=0),
    er.ReplayMismatch(values_compared=12, mismatches=2),
    er.NondeterministicResume(step=45, metric="loss", logged=1.5, replayed=1.75),
    RecordedFailure(
        "killed",
        2,
        3,
        FailureDetails(detected_after_s=0.4, trained_to=55, last_committed_step=40, steps_lost=15, log="w.log"),
        detected_at=1000.5,
        last_seen=999.0,
    ),
]


def lines(run_dir: Path) -> list[dict[str, Any]]:
    """The run's events.jsonl as the file holds it."""
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


def record_classes(base: type[er.EventRecord] = er.EventRecord) -> set[type[er.EventRecord]]:
    """Every record class of a kind (``KIND`` set), at any depth below ``base``."""
    found: set[type[er.EventRecord]] = set()
    for sub in base.__subclasses__():
        if sub.KIND and sub is not ChunkRecord:  # ChunkRecord: the chunk_done record as the flow holds it
            found.add(sub)
        found |= record_classes(sub)
    return found


def test_every_record_class_has_a_sample_and_a_kind_of_its_own() -> None:
    assert {type(r) for r in SAMPLES} == record_classes()
    kinds = [r.KIND for r in SAMPLES]
    assert len(set(kinds)) == len(kinds) and all(k in set(Event) for k in kinds)


@pytest.mark.parametrize("record", SAMPLES, ids=lambda r: r.KIND)
def test_a_record_survives_the_trip_through_a_json_line(tmp_path: Path, record: er.EventRecord) -> None:
    written = er.append_record(tmp_path, record)
    assert written == record and written.time > 0
    (line,) = lines(tmp_path)
    assert line["kind"] == record.KIND and line["time"] == written.time
    assert {k: v for k, v in line.items() if k not in ("kind", "time")} == json.loads(json.dumps(record.as_fields()))
    (back,) = er.read_records(tmp_path, type(record))
    assert back == record and back.time == written.time and back.as_json() == written.as_json()
    assert type(record).from_json(json.loads(json.dumps(record.as_json()))) == record


def test_a_line_of_an_older_release_reads_with_defaults() -> None:
    """A line written before a key existed: the field's default, never a KeyError."""
    old = er.AttemptStarted.from_json({"time": 5.0, "kind": "attempt_started", "chunk": 1, "attempt": 2})
    assert (old.chunk, old.attempt, old.metrics_offset, old.resumes_from, old.parked) == (1, 2, None, None, None)
    assert old.time == 5.0 and old.extra == {}
    bare = er.Resumed.from_json({"kind": "resumed"})  # no time, no step (a hand-written line)
    assert (bare.time, bare.rank, bare.on_rank0, bare.resumed_from, bare.restore_s) == (0.0, 0, True, 0, 0.0)
    fetched = er.CheckpointFetched.from_json({"kind": "checkpoint_fetched", "step": 5})
    assert fetched.refused is None and fetched.fetch_s is None
    failure = RecordedFailure.from_json({"kind": "failure", "failure": "killed", "time": 7.0})
    assert (failure.kind, failure.chunk, failure.details, failure.death) == ("killed", None, FailureDetails(), 7.0)


def test_an_unknown_key_is_kept_and_written_again(tmp_path: Path) -> None:
    """A newer writer's key survives a reader of this version: in ``extra``, and in the line it writes."""
    line = {"time": 3.0, "kind": "flow_started", "flow_run_id": "f", "slurm_job_id": "77", "later_key": [1]}
    rec = er.FlowStarted.from_json(line)
    assert rec.flow_run_id == "f" and rec.extra == {"slurm_job_id": "77", "later_key": [1]}
    assert rec == er.FlowStarted(flow_run_id="f")  # extra and time are not what a record says
    assert rec.as_json() == {**line, "flow_run_name": None, "committed_step": None, "chunks": None}
    er.append_record(tmp_path, rec)
    assert lines(tmp_path)[0]["later_key"] == [1]
    failure = RecordedFailure.from_json({"kind": "failure", "failure": "hang", "leftover_pids": [9], "node": "n"})
    assert failure.extra == {"leftover_pids": [9], "node": "n"} and failure.as_fields()["leftover_pids"] == [9]


def test_records_write_the_keys_their_writers_always_wrote(tmp_path: Path) -> None:
    """A key some writers add (``optional``) is left out when unset; ``chunk_done`` keeps the keys and
    order of :class:`ChunkRecord`'s mapping; ``started_at`` only where a flow gave it."""
    assert "parked" not in er.AttemptStarted(chunk=1, attempt=1).as_fields()
    assert "started_at" not in er.FlowStarted(flow_run_id="f").as_fields()
    record = ChunkRecord(chunk=1, start_step=0, end_step=20, attempt=1, preemptions=0, resumed_from=None)
    assert record.as_fields() == record.as_dict() and "flow_runs" not in record.as_dict()
    er.append_record(tmp_path, record)
    (back,) = er.read_records(tmp_path, er.ChunkDone)
    assert back.as_fields() == record.as_dict() and ChunkRecord.from_dict(back.as_fields()) == record


def test_read_records_reads_a_log_written_by_append_event(tmp_path: Path) -> None:
    """The log as the writers that still call append_event leave it (the worker, the supervisor)."""
    append_event(tmp_path, Event.FLOW_STARTED, started_at=1.0, flow_run_id="f", flow_run_name="n", committed_step=0)
    append_event(tmp_path, Event.RESUMED, rank=0, step=40, checkpoint="step-000000040", digest="d", load_s=0.5)
    append_event(tmp_path, Event.FAILURE, failure="killed", chunk=1, attempt=1, detected_at=9.5, detected_after_s=0.5)
    append_event(tmp_path, Event.RESUMED, rank=1, step=40)
    append_event(tmp_path, "a_kind_nobody_reads", x=1)
    with (tmp_path / "events.jsonl").open("a") as fh:
        fh.write('{"torn')  # a crash in the middle of a line
    resumed = er.read_records(tmp_path, er.Resumed)
    assert [(r.rank, r.resumed_from, r.restore_s, r.on_rank0) for r in resumed] == [
        (0, 40, 0.5, True),
        (1, 40, 0.0, False),
    ]
    (failure,) = er.read_records(tmp_path, RecordedFailure)
    assert (failure.kind, failure.chunk, failure.death) == ("killed", 1, 9.0)
    (flow,) = er.read_records(tmp_path, er.FlowStarted)
    assert (flow.flow_run_id, flow.clock_start, flow.committed_step) == ("f", 1.0, 0)


def test_one_read_typed_several_ways_keeps_the_logs_order(tmp_path: Path) -> None:
    for kind, fields in [
        (Event.ATTEMPT_STARTED, {"chunk": 1, "attempt": 1}),
        (Event.CHECKPOINT_SAVED, {"step": 5}),
        (Event.FAILURE, {"failure": "killed", "chunk": 1, "attempt": 1}),
        (Event.CHUNK_DONE, {"chunk": 1, "attempt": 2}),
    ]:
        append_event(tmp_path, kind, **fields)
    events = read_events(tmp_path)
    mixed = er.typed(events, RecordedFailure, er.AttemptStarted, er.ChunkDone)
    assert [type(r) for r in mixed] == [er.AttemptStarted, RecordedFailure, er.ChunkDone]
    log = er.EventLog(events)
    assert log.of(er.ChunkDone) == er.typed(events, er.ChunkDone) == [er.ChunkDone(chunk=1, attempt=2)]
    every = log.all(er.CheckpointSaved)
    assert [e.event_kind for e in every] == ["attempt_started", "checkpoint_saved", "failure", "chunk_done"]
    assert isinstance(every[0], er.OtherEvent) and every[0].extra == {"chunk": 1, "attempt": 1}
    assert every[0].as_json() == events[0] and er.EventLog.view(log) is log and len(er.EventLog.read(tmp_path)) == 4


def test_run_json_reads_as_a_run_info_old_files_included(tmp_path: Path) -> None:
    """``run.json`` of every landed release fixture reads as a :class:`RunInfo` with the same values;
    a written one (every key, a lineage, a key this release does not know) round-trips, and an
    update keeps every other key as it was on disk."""
    from training.fsutil import read_json
    from training.paths import RunPaths
    from training.run_identity import Lineage, RunInfo
    from training.rundir import run_info, update_run_info

    releases = sorted((Path(__file__).parent / "releases").glob("*/run"))
    assert len(releases) >= 4
    for run in releases:
        raw, info = read_json(RunPaths(run).run_file), run_info(run)
        assert info is not None and (info.name, info.fingerprint, info.created) == (
            raw["name"],
            raw["fingerprint"],
            raw["created"],
        )
        assert dict(info.trajectories) == raw.get("trajectories", {}) and info.mlflow_run_id is None
    parent = Lineage("runs/p", "p", 20, "d" * 16, "f" * 16, "abc", None)
    full = RunInfo("r", "fp", ("old",), {"fp": {"train.lr": 0.1}}, 12.5, parent, "id", "uri", "1", "ui", "pui")
    full = RunInfo(**{**full.__dict__, "other": {"future_key": [1, 2]}})
    assert RunInfo.from_json(full.to_json()) == full
    assert full.to_json()["parent"]["step"] == 20 and full.to_json()["future_key"] == [1, 2]
    (tmp_path / "run.json").write_text(json.dumps({"name": "r", "fingerprint": "fp", "future_key": 1}))
    assert update_run_info(tmp_path, mlflow_run_id="x").mlflow_run_id == "x"
    on_disk = read_json(RunPaths(tmp_path).run_file)
    assert on_disk == {"name": "r", "fingerprint": "fp", "future_key": 1, "mlflow_run_id": "x"}
