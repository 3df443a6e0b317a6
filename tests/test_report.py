"""What a person reads: the end-of-train summary (with the MLflow URL), ``--json`` that still
parses, failures in words, and the live progress line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.report import PLAIN_EVERY_S, failure_lines, plain_due, progress_line, travel_rows
from flows.run_summary import RunSummary
from tasks.supervision.supervisor import ChunkFailed
from tests.flow_util import REPO, params
from training.tracking.progress import RunStatus


def test_progress_line_and_plain_cadence() -> None:
    st = {
        "total_steps": 400,
        "step": 150,
        "loss": 2.345678,
        "tokens_per_s": 12345.6,
        "steps_per_s": 3.21,
        "eta_s": 300.0,
        "checkpoint_step": 100,
        "failures": 1,
        "failure_chunks": [2],
    }
    line = progress_line(RunStatus.from_dict(st), chunk_steps=100)
    assert line == (
        "step 150/400 (38%) · chunk 2/4 attempt 2 · loss 2.3457 · 12,346 tok/s · 3.21 steps/s · "
        "ETA 5.0 min · checkpoint 100 · failures 1"
    )
    assert not plain_due(10.0, 0.0, 20, 0, 400)
    assert plain_due(PLAIN_EVERY_S, 0.0, 20, 0, 400) and plain_due(1.0, 0.0, 40, 0, 400)


def test_travel_rows_name_the_fetch_and_the_node_change() -> None:
    fetch = {"attempt": 2, "step": 30, "node": "node-b", "fetch_s": 0.4}
    summary = {
        "fetched": {"step": 25, "fetch_s": 0.3},
        "chunks": [{"chunk": 1, "nodes": ["node-a"]}, {"chunk": 2, "nodes": ["node-a", "node-b"], "fetched": [fetch]}],
    }
    for key in ("chunks",):
        summary[key] = [{"start_step": 0, "end_step": 10, **c} for c in summary[key]]
    assert travel_rows(RunSummary.from_dict(summary)) == [
        ("fetched from the remote", "step 25 in 0.30 s"),
        ("chunk 2 nodes", "node-a → node-b (fetched step 30 on node-b in 0.40 s)"),
    ]
    quiet = {"fetched": None, "chunks": [{"chunk": 1, "start_step": 0, "end_step": 10}]}
    assert travel_rows(RunSummary.from_dict(quiet)) == []


def test_classified_failures_log_no_traceback() -> None:
    """Prefect logs a classified failure as its message, without the supervisor's traceback."""
    import logging

    from flows.train import _NoTracebackWhenClassified

    def record(exc: BaseException) -> logging.LogRecord:
        try:
            raise exc
        except (ChunkFailed, RuntimeError):
            return logging.LogRecord("prefect.task_runs", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())

    quiet, loud = record(ChunkFailed("diskfull", "chunk 1 diskfull: disk full")), record(RuntimeError("bug"))
    assert _NoTracebackWhenClassified().filter(quiet) and quiet.exc_info is None
    assert _NoTracebackWhenClassified().filter(loud) and loud.exc_info is not None  # a bug keeps its traceback


def test_failure_lines_name_the_log_and_its_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "chunk-1-attempt-1.log"
    log.write_text("".join(f"line {i}\n" for i in range(30)))
    exc = ChunkFailed(
        "killed",
        "chunk 3 killed: signal SIGKILL",
        {
            "reason": "signal SIGKILL",
            "trained_to": 47,
            "detected_after_s": 0.21,
            "last_committed_step": 40,
            "steps_lost": 7,
            "passed_over": [{"checkpoint": "step-000000045", "step": 45, "reason": "manifest.json missing"}],
            "log": str(log),
            "tail": [],
        },
    )
    lines = failure_lines(exc)
    assert lines[0] == "killed: signal SIGKILL"
    assert lines[1] == "at step 47, detected after 0.2 s, a retry resumes from step 40, 7 step(s) lost"
    assert lines[2] == "passed over (do not verify): step 45 (manifest.json missing)"
    assert lines[3] == f"log: {log}" and lines[-1] == "  | line 29"
    assert "ChunkFailed" not in repr(exc) and "resumes from step 40" in repr(exc)


@pytest.mark.slow
def test_train_prints_a_summary_with_the_mlflow_url_and_json_parses(
    prefect_api: str, data_dir: Path, tmp_path: Path
) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    p = params(
        tmp_path,
        data_dir,
        "summary",
        train={"total_steps": 10, "chunk_steps": 10},
        tracking={"mlflow": True, "mlflow_uri": uri},
    )
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(p))
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "COLUMNS": "200"}

    def convoy(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "flows.cli.main", "train", str(path), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    human = convoy("-S", "train.warmup_steps=5")  # the params' own value: the same run
    assert human.returncode == 0, human.stderr[-3000:]
    out = human.stdout
    print(out)
    assert "convoy train: summary" in out and "final loss" in out and "steps lost" in out
    assert "?workflowType=machine_learning" in out and f"mlflow ui --backend-store-uri {uri}" in out
    assert "Prefect flow run: http://127.0.0.1:" in out
    again = convoy("--json")  # finished: answered without a flow, the flow run that finished it named
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads(again.stdout)
    assert summary["final_step"] == 10 and summary["trained_chunks"] == 0 and summary["nothing_to_do"]
    assert "Starting temporary server" not in again.stderr and "Flow run" not in again.stderr
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:  # findable in the Prefect UI by the run's name
        flow_run = client.read_flow_run(summary["flow_run_id"])
    assert flow_run.name.startswith("summary-") and "run:summary" in flow_run.tags, (flow_run.name, flow_run.tags)
    assert flow_run.parameters["overrides"] == ["train.warmup_steps=5"]  # what -S said, visible in the UI
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        key = ArtifactFilterKey(any_=["convoy-summary-chunks"])
        tables = client.read_artifacts(artifact_filter=ArtifactFilter(key=key))
    assert tables and all("?workflowType=machine_learning" in (t.description or "") for t in tables)


def test_attempts_are_numbered_per_chunk_across_flow_runs_and_named_by_outcome() -> None:
    """Numbers come from every event of the chunk (attempts of a dead flow, preemption re-spawns),
    so a new flow's first attempt of chunk 2 is attempt 4, not a second "attempt 1"."""
    from training.event_records import EventLog
    from training.tracking.attempts import (
        ChunkHistory,
        attempt_name,
        chunk_history,
        next_attempt,
        open_attempts,
        outcome_label,
    )

    events = [
        {"kind": "attempt_started", "chunk": 1, "attempt": 1},
        {"kind": "chunk_done", "chunk": 1, "attempt": 1},
        {"kind": "attempt_started", "chunk": 2, "attempt": 1},
        {"kind": "failure", "chunk": 2, "attempt": 1, "failure": "killed"},
        {"kind": "attempt_started", "chunk": 2, "attempt": 2},
        {"kind": "failure", "chunk": 2, "attempt": 2, "failure": "preempted"},
        {"kind": "attempt_started", "chunk": 2, "attempt": 3},  # its flow was SIGKILLed: never ended
    ]
    log = EventLog(events)
    assert next_attempt(log, 1) == 2 and next_attempt(log, 2) == 4 and next_attempt(log, 3) == 1
    assert chunk_history(log, 2) == ChunkHistory(3, ("killed", "preempted"))
    assert [(e.chunk, e.attempt) for e in open_attempts(log)] == [(2, 3)]
    name = attempt_name(2, 3, outcome_label("killed", 290, 200))
    assert name == "killed 290→200 c2·a3" and name[:14] == "killed 290→200"  # what MLflow's table shows
    assert attempt_name(3, 1, outcome_label(None, resumed_from=600)) == "done→600 c3·a1"
    assert outcome_label("orphaned", 195, 150) == "orphan 195→150"  # ~14 characters show when nested


def test_failure_text_has_no_class_paths_or_unrelated_output() -> None:
    from tasks.supervision.failure_kinds import diskfull_message, error_line

    path = "training.checkpointing.store.CheckpointError: checkpoint save failed: [Errno 28] No space left on device"
    assert diskfull_message(["[worker rank 0] step 40", path]) == (
        "disk full: checkpoint save failed: No space left on device"
    )  # no module path, no class name where the message says it all, no errno number
    assert error_line(["Traceback (most recent call last):", '  File "x.py"', "torch.OutOfMemoryError: 2 GiB"]) == (
        "OutOfMemoryError: 2 GiB"
    )
    assert error_line(["[worker rank 0] MLflow run abc: copied 20 value(s)"]) is None  # chatter, not a cause


def test_timeline_labels_of_close_failures_never_overlap(tmp_path: Path) -> None:
    """Failures a few steps apart (a corrupt checkpoint found right after a kill) get labels at
    different heights, or one label, never two drawn over each other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from training.tracking.resume_audit import _mark_attempts

    rows = [
        {"failed_at_step": s, "kind": k, "resumed_from_step": r}
        for s, k, r in [(248, "killed", 200), (250, "corrupt", 200), (252, "hang", 250), (253, "dead", 250)]
        + [(255, "killed", 250), (255, "oom", 250), (420, "killed", 400)]
    ]
    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    try:
        ax.plot(range(1, 601), [1 / s for s in range(1, 601)])
        labels = _mark_attempts(ax, rows)
        fig.tight_layout()
        fig.canvas.draw()
        boxes = [t.get_window_extent() for t in labels]
        lines = list(ax.get_lines())
    finally:
        plt.close(fig)
    texts = [t.get_text() for t in labels]
    assert "killed, oom @ 255" in " ".join(texts) and any("@ 420" in t for t in texts)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            assert not a.overlaps(b), texts
    # No line crosses a label (issue 31): each sits on an opaque box drawn above every line.
    assert all(t.get_zorder() > max(ln.get_zorder() for ln in lines) for t in labels)
    assert all(t.get_bbox_patch() is not None and t.get_bbox_patch().get_facecolor()[:3] == (1, 1, 1) for t in labels)


def test_retry_delays_are_waited_by_convoy_and_prefect_is_given_one_number() -> None:
    """Prefect's task page shows ``Retry Delay`` from one number ("NaNs" for a list of delays):
    the chunk task gets 0, and waits the backoff itself, from the second retry on."""
    from tasks.chunk import retrying_chunk_task
    from tasks.retry_policy import retry_wait
    from training.config import load_config

    cfg = load_config(
        None, ["orchestration.retries=4", "orchestration.retry_delay_seconds=1", "orchestration.jitter=0.1"]
    )
    task = retrying_chunk_task(cfg)
    assert task.retries == 4 and task.retry_delay_seconds == 0
    assert "backoff 0s→1s→2s→4s ±10%" in task.tags  # convoy's waits, beside Prefect's "Retry Delay 0s"
    assert retry_wait(cfg, 1) == 0.0 and retry_wait(cfg, 2) == 0.0  # the first run, the first retry: at once
    assert 0.9 <= retry_wait(cfg, 3) <= 1.1 and 1.8 <= retry_wait(cfg, 4) <= 2.2 and 3.6 <= retry_wait(cfg, 5) <= 4.4


def test_the_result_message_says_why_the_attempt_is_not_prefects_run_count() -> None:
    """Prefect counts the runs of one task run; convoy counts worker attempts of the chunk in every
    flow run, a preempted worker re-spawned inside a run included (issue 31: "Run Count 3" beside
    "committed on attempt 4")."""
    from tasks.retry_policy import attempts_explained
    from training.event_records import EventLog
    from training.tracking.attempts import AttemptId

    def started(n: int, flow: str) -> dict[str, object]:
        return {"kind": "attempt_started", "chunk": 1, "attempt": n, "flow_run_id": flow}

    plain = [started(1, "f"), started(2, "f")]
    assert attempts_explained(EventLog(plain), AttemptId(1, 2, 0, 10, "f", "t"), 2) == ""
    preempted = [*plain, started(3, "f"), started(4, "f")]
    said = attempts_explained(EventLog(preempted), AttemptId(1, 4, 0, 10, "f", "t"), 3)
    assert said == " (Prefect run 3: 1 preempted worker re-spawned inside a run)"
    taken_over = [started(1, "dead"), started(2, "dead"), started(3, "f")]
    assert (
        attempts_explained(EventLog(taken_over), AttemptId(1, 3, 0, 10, "f", "t"), 1)
        == " (Prefect run 1: 2 in an earlier flow run)"
    )


def test_only_failures_without_progress_count_toward_the_backoff() -> None:
    """A crash loop (attempts that fail before training a step) is slowed down; a worker that
    trained and then died is replaced at once, however many failures the chunk had before
    (issue 30: the second of two kills 5 s apart waited the 1 s backoff)."""
    from training.event_records import EventLog
    from training.tracking.attempts import failures_without_progress

    def attempt(n: int, resumes: int, trained_to: int | None, chunk: int = 2) -> list[dict[str, object]]:
        started = {"kind": "attempt_started", "chunk": chunk, "attempt": n, "resumes_from": resumes}
        return [started, {"kind": "failure", "chunk": chunk, "attempt": n, "trained_to": trained_to}]

    killed_twice = attempt(1, 20, 45) + attempt(2, 40, 61)
    assert failures_without_progress(EventLog(killed_twice), 2) == 0
    crash_loop = attempt(1, 20, 45) + attempt(2, 40, 40) + attempt(3, 40, None)
    assert failures_without_progress(EventLog(crash_loop), 2) == 2
    assert failures_without_progress(EventLog(crash_loop + attempt(4, 40, 47)), 2) == 0  # progress resets it
    assert failures_without_progress(EventLog(crash_loop), 3) == 0


def test_a_crashed_task_runs_last_line_lists_the_failures_prefect_may_have_missed() -> None:
    """The failures of the chunk's attempts in the dead flow run, from the events (its last log
    lines can be lost with the process), not the orphaned one the takeover adds."""
    from tasks.takeover import failures_seen
    from training.event_records import EventLog

    def attempt(n: int, flow: str, kind: str, at: int) -> list[dict[str, object]]:
        started = {"kind": "attempt_started", "chunk": 2, "attempt": n, "flow_run_id": flow}
        return [started, {"kind": "failure", "chunk": 2, "attempt": n, "failure": kind, "trained_to": at}]

    events = (
        attempt(1, "old", "killed", 145) + attempt(2, "dead", "diskfull", 176) + attempt(3, "dead", "orphaned", 190)
    )
    assert failures_seen(EventLog(events), "dead", 2) == ["diskfull at step 176"]
    assert failures_seen(EventLog(events), "dead", 3) == []


def test_only_flow_runs_that_died_unseen_are_taken_over() -> None:
    """A flow that finished, failed or crashed with its hooks running ended; one SIGKILLed left
    only its ``flow_started``; one taken over once is not taken over again."""
    from tasks.takeover import unfinished_flow_runs
    from training.event_records import EventLog

    events = [
        {"kind": "flow_started", "flow_run_id": "done"},
        {"kind": "flow_done", "flow_run_id": "done"},
        {"kind": "flow_started", "flow_run_id": "failed"},
        {"kind": "flow_failed", "flow_run_id": "failed"},
        {"kind": "flow_started", "flow_run_id": "killed-1"},
        {"kind": "flow_started", "flow_run_id": "killed-2"},
        {"kind": "flow_taken_over", "flow_run_id": "killed-2", "previous": ["killed-1"]},
        {"kind": "flow_started", "flow_run_id": "now"},
    ]
    assert unfinished_flow_runs(EventLog(events), "now") == ["killed-2"]


def test_a_chunk_record_keeps_the_written_keys_and_reads_back_what_a_pool_parent_adds() -> None:
    """The ``chunk_done`` event and the pool artifact are read by older and newer code alike: the
    keys and their order are the ones written before the record had a type."""
    from tasks.records.chunk_record import ChunkRecord

    record = ChunkRecord(
        chunk=2,
        start_step=20,
        end_step=40,
        attempt=3,
        preemptions=1,
        resumed_from=None,
        digest="ab" * 32,
        loss=None,
        seconds=1.5,
        worker_seconds=1.2,
        node="a",
    )
    written = record.as_dict()
    assert list(written) == [
        "chunk",
        "start_step",
        "end_step",
        "attempt",
        "preemptions",
        "resumed_from",
        "digest",
        "loss",
        "seconds",
        "worker_seconds",
        "node",
    ]
    seen = {"flow_runs": ["f1"], "failure_kinds": ["killed"], "nodes": ["a", "b"], "fetched": [], "later_key": 1}
    parent = ChunkRecord.from_dict({**written, **seen})
    assert parent.flow_runs == ["f1"] and parent.nodes == ["a", "b"] and parent.fetched == []
    assert ChunkRecord.from_dict(written) == record


def test_a_dead_flow_runs_chunks_and_a_removed_boundarys_digest_come_from_the_events() -> None:
    """The chunks table of a flow run that died (published by its successor) and the digest of a
    committed chunk whose boundary retention removed are read from the run's events."""
    from tasks.takeover import dead_run_rows
    from training.event_records import EventLog
    from training.tracking.attempts import recorded_digest

    events = [
        {"kind": "attempt_started", "chunk": 1, "attempt": 1, "flow_run_id": "dead", "time": 10.0},
        {"kind": "failure", "chunk": 1, "attempt": 1, "failure": "killed", "time": 12.0},
        {"kind": "attempt_started", "chunk": 1, "attempt": 2, "flow_run_id": "dead", "time": 12.5},
        {"kind": "chunk_done", "chunk": 1, "attempt": 2, "digest": "d1", "loss": 2.5, "time": 15.0},
        {"kind": "attempt_started", "chunk": 2, "attempt": 1, "flow_run_id": "dead", "time": 15.1},
        {"kind": "failure", "chunk": 2, "attempt": 1, "failure": "orphaned", "time": 30.0},
        {"kind": "attempt_started", "chunk": 2, "attempt": 2, "flow_run_id": "next", "time": 30.5},
    ]
    one, two = dead_run_rows(EventLog(events), "dead", total_steps=50, chunk_steps=20)
    assert (one["status"], one["attempts"], one["failure_kinds"], one["digest"]) == ("trained", 2, ["killed"], "d1")
    assert (one["start_step"], one["end_step"], one["seconds"]) == (0, 20, 5.0)
    assert (two["status"], two["attempts"], two["failure_kinds"]) == ("died with this flow run", 1, ["orphaned"])
    assert recorded_digest(EventLog(events), 1) == "d1" and recorded_digest(EventLog(events), 2) is None


def test_a_launcher_report_names_the_rank_and_its_exception() -> None:
    """torchrun's failure report (its format, torch.distributed.elastic): the first failed rank and
    its exception's last line from the traceback ``@record`` left, or its signal without one."""
    from tasks.supervision.failure_kinds import error_line

    banner = [
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        "============================================================",
        "training.worker FAILED",
        "------------------------------------------------------------",
        "Failures:",
        "  <NO_OTHER_FAILURES>",
        "------------------------------------------------------------",
        "Root Cause (first observed failure):",
        "[0]:",
        "  time      : 2026-12-07_02:50:01",
        "  host      : node-a",
        "  rank      : 1 (local_rank: 1)",
        "  exitcode  : 1 (pid: 4242)",
        "  error_file: /tmp/torchelastic_x/none_y/attempt_0/1/error.json",
        "  traceback : Traceback (most recent call last):",
        '    File "/work/training/loop/step.py", line 80, in accumulate',
        "      loss = parts.loss_fn(runtime.model, batch)",
        "  ValueError: rank 1 saw a batch of the wrong shape in step 3",
        "  ",
        "============================================================",
    ]
    assert error_line(banner) == "rank 1: ValueError: rank 1 saw a batch of the wrong shape in step 3"
    killed = [*banner[:11], "  rank      : 0 (local_rank: 0)", "  exitcode  : -9 (pid: 4241) (SIGKILL)"]
    killed += ["  error_file: <N/A>", "  traceback : To enable traceback see: https://pytorch.org/docs/", "=" * 60]
    assert error_line(killed) == "rank 0: signal SIGKILL"


def test_a_survivors_sigterm_named_root_cause_is_not_the_exit(tmp_path: Path) -> None:
    """torchrun's root cause is picked by a timestamp of one-second resolution: a rank SIGKILLed and
    the survivor torchrun then SIGTERMed can tie, and the tie names the survivor. With no rank
    preempted, the killed rank's exit is the one that classifies the attempt."""
    from tasks.supervision.failure_kinds import launcher_exit

    def failure(rank: int, code: int) -> list[str]:
        return [f"[{rank}]:", f"  rank      : {rank} (local_rank: {rank})", f"  exitcode  : {code} (pid: 9{rank})"]

    root = "Root Cause (first observed failure):"
    report = ["Failures:", *failure(1, -9), "-" * 60, root, *failure(0, -15), "=" * 60]
    assert launcher_exit(tmp_path, 1, report, since=0.0) == -9
    alone = ["Failures:", "  <NO_OTHER_FAILURES>", "Root Cause (first observed failure):", *failure(0, -15)]
    assert launcher_exit(tmp_path, 1, alone, since=0.0) == -15
