"""Typed records at the seams read what is on disk: each round-trips through ``as_dict`` /
``from_dict``, keeps the file's keys, and reads the shapes older versions wrote."""

from __future__ import annotations

import json
from pathlib import Path

from training.events import Phase
from training.heartbeat import HOST, Beat, Heartbeat, heartbeat_path, read_heartbeat


def test_a_written_beat_reads_back_with_the_files_keys(tmp_path: Path) -> None:
    hb = Heartbeat(tmp_path, 1, 60.0)
    hb.set(Phase.TRAIN, 7)
    hb.beat()
    on_disk = json.loads(heartbeat_path(tmp_path, 1).read_text())
    assert sorted(on_disk) == ["host", "phase", "pid", "progress_time", "rank", "step", "time"]
    beat = read_heartbeat(tmp_path, 1)
    assert beat is not None and beat.as_dict() == on_disk
    assert (beat.rank, beat.step, beat.phase, beat.host) == (1, 7, "train", HOST)
    assert beat.is_local and not beat.done and Beat.from_dict(beat.as_dict()) == beat


def test_an_older_beat_without_host_or_progress_time_reads(tmp_path: Path) -> None:
    path = heartbeat_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"pid": 4321, "rank": 0, "step": 12, "phase": "done", "time": 100.5}))
    beat = read_heartbeat(tmp_path, 0)
    assert beat == Beat(pid=4321, rank=0, step=12, phase="done", time=100.5, progress_time=100.5, host=None)
    assert beat.is_local and beat.done  # no host: this machine's, as before


def test_a_beat_of_another_machine_is_not_local_and_garbage_is_no_beat(tmp_path: Path) -> None:
    assert not Beat.from_dict({"pid": 1, "host": HOST + "-elsewhere", "time": 1.0}).is_local
    path = heartbeat_path(tmp_path, 0)
    path.parent.mkdir(parents=True)
    path.write_text('{"pid": 1, "st')  # torn (a beat being replaced on a full disk)
    assert read_heartbeat(tmp_path, 0) is None
    path.write_text('["not", "a", "beat"]')
    assert read_heartbeat(tmp_path, 0) is None
    assert read_heartbeat(tmp_path, 3) is None


def test_a_failure_event_reads_back_as_a_typed_failure(tmp_path: Path) -> None:
    from training.events import Event, append_event, read_events
    from training.tracking.failure_record import FailureDetails, RecordedFailure

    details = FailureDetails(detected_after_s=0.4, trained_to=17, last_committed_step=15, error="E: x", log="l")
    written = RecordedFailure("crash", 2, 3, details)
    append_event(tmp_path, Event.FAILURE, **written.as_event_fields())
    (event,) = read_events(tmp_path, Event.FAILURE)
    assert RecordedFailure.from_event(event) == written
    # an older event (no details beyond the kind) and keys this version does not know still read
    old = RecordedFailure.from_event({"kind": "failure", "failure": "killed", "chunk": 1, "later_key": 5})
    assert (old.kind, old.chunk, old.attempt, old.details) == ("killed", 1, None, FailureDetails())


def test_a_versioned_event_reads_back_as_versioned(tmp_path: Path) -> None:
    from tasks.remote.dvc_version import Versioned
    from training.events import Event, append_event, read_events

    v = Versioned("step-000000030", 30, "ab" * 16, "c0ffee.dir", "x.dvc", "(default)", 4, 0.5, 1.25, True, "i.json")
    append_event(tmp_path, Event.CHECKPOINT_VERSIONED, **v.as_dict())
    (event,) = read_events(tmp_path, Event.CHECKPOINT_VERSIONED)
    assert Versioned.from_dict(event) == v and v.upload_s == 1.75


def test_the_standby_order_is_one_line_both_sides_read() -> None:
    from training.events import StandbyOrder

    order = StandbyOrder(until_step=120, pipelined=True)
    line = order.as_line()
    assert line.endswith("\n") and json.loads(line) == {"until_step": 120, "pipelined": True}
    assert StandbyOrder.from_line(line) == order
    assert StandbyOrder.from_line('{"until_step": 40}') == StandbyOrder(40, False)  # an older order


def test_the_flow_summary_and_its_chunk_rows_round_trip_through_json() -> None:
    """What ``convoy train --json`` prints reads back as the same summary (chunk keys become
    strings in JSON); a local row has no pool-only keys, a pool row keeps them; unknown keys of
    a newer version are kept aside, not lost."""
    from flows.run_summary import RunSummary
    from tasks.records.chunk_record import ChunkRow

    local = ChunkRow(1, 0, 20, "trained", 2, ["killed"], 3.5, "d1", 2.5)
    pool = ChunkRow(2, 20, 40, "trained", 1, [], 2.0, "d2", 2.25, ["fr"], ["node-a"], [{"step": 30}])
    assert set(local.as_dict()) == {
        "chunk", "start_step", "end_step", "status", "attempts", "failure_kinds", "seconds", "digest", "loss"
    }  # fmt: skip
    assert ChunkRow.from_dict(pool.as_dict()) == pool and ChunkRow.from_dict(local.as_dict()) == local
    summary = RunSummary(
        "r", "/runs/r", "f", 40, "d2", 2, 0, {1: 2, 2: 1}, {1: 2.5, 2: 2.25}, [{"chunk": 1, "kinds": ["killed"]}],
        [local, pool], [], None, {"resumes": 1}, [], 1.1, None, {"registered": "m v1"}, 9.0,
    )  # fmt: skip
    data = json.loads(json.dumps(summary.as_dict() | {"later_key": 1}))
    back = RunSummary.from_dict(data)
    assert back == RunSummary(**{**summary.__dict__, "extra": {"later_key": 1}})
    assert (back.final_loss, back.failure_kinds, back.registered_model) == (2.25, ["killed"], "m v1")


def test_a_pool_nodes_outcome_round_trips_and_an_old_artifact_still_reads() -> None:
    """The outcome a chunk flow run on a node publishes for the parent (flows/pool.py): written
    as an artifact's JSON, read back as the same record; an artifact of the dict era reads too."""
    import json

    from flows.pool import NodeOutcome
    from tasks.records.chunk_record import ChunkRecord
    from tasks.supervision.supervisor import ChunkFailed
    from training.tracking.failure_record import FailureDetails

    failed = NodeOutcome("node-a", run_dir="/runs/r")
    failed.failed(ChunkFailed("killed", "chunk 2 killed", FailureDetails(last_committed_step=25, trained_to=31)))
    failed.events = [{"kind": "checkpoint_fetched", "step": 25, "fetch_s": 0.1, "node": "node-a", "time": 1.0}]
    back = NodeOutcome.from_dict(json.loads(json.dumps(failed.as_dict(), default=str)))
    assert back == failed and back.details.last_committed_step == 25
    assert back.fetches() == [
        {"step": 25, "fetch_s": 0.1, "bytes": None, "from_node": None, "node": "node-a", "refused": None}
    ]

    record = {"chunk": 1, "start_step": 0, "end_step": 20, "attempt": 1, "preemptions": 0, "resumed_from": 0}
    record |= {"digest": "d", "loss": 1.5, "seconds": 2.0, "worker_seconds": 1.5, "node": "node-b"}
    old = {"node": "node-b", "ok": True, "run_dir": "/runs/r", "record": record, "events": []}
    done = NodeOutcome.from_dict(old)
    assert done.ok and done.record == ChunkRecord.from_dict(record) and done.kind is None
    assert NodeOutcome.from_dict(json.loads(json.dumps(done.as_dict()))) == done
