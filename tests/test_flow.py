"""End-to-end tests of flow ``train``: real Prefect API, the real worker, real signals.

Every test uses a tiny char-GPT run (3 chunks of 20 steps, checkpoints every 5 steps, 5 s hang /
dead limits) and checks at the end that no process of its run is left.  The uninterrupted
reference digest comes from one worker run straight to the last step: exact resume (invariant 4)
means any chunking and any number of failures must land on the same bytes.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.flow_run_util import start_flow, train_killed_in_chunk_3
from tests.flow_util import CHUNK, REPO, TOTAL, assert_no_leftovers, config, in_thread, params, wait_for_step
from training.events import read_events

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _steps_last_several_heartbeats(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an idle machine a 20-step chunk can finish between two 0.2 s heartbeats, and a test
    waiting for a step inside it would miss it; 30 ms per step keeps every chunk >= 0.6 s."""
    monkeypatch.setenv("CONVOY_FAULTS", "step_delay=0.03")


def task_runs(flow_run_id: str) -> dict[str, Any]:
    """Task runs of one flow run, read back from the Prefect API, by name (``chunk-<k>``)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {r.name: r for r in runs}


@pytest.fixture
def verified() -> Iterator[collections.Counter[str]]:
    """How often this process really verified each checkpoint (the store's debug line; Prefect's
    logging set-up bypasses caplog, so a handler of our own counts)."""
    counts: collections.Counter[str] = collections.Counter()
    logger = logging.getLogger("convoy.checkpoint")

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if str(record.msg).startswith("verified") and record.args:
                counts[str(record.args[0])] += 1  # type: ignore[index]

    handler, level = Count(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield counts
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_sigkill_mid_chunk_3_retries_only_chunk_3(
    prefect_api: str,
    data_dir: Path,
    tmp_path: Path,
    reference_digest: str,
    monkeypatch: pytest.MonkeyPatch,
    verified: collections.Counter[str],
) -> None:
    """Also: the flow process verifies each checkpoint once (the run's one store), although the
    failed attempt's report, the retry's start and the summary all ask for the resume point."""
    from flows.train import run_training

    # A 20-step chunk can finish between two heartbeats; stall the step after 2*CHUNK+8 for 2 s
    # (below the 5 s hang limit) so the killer reliably lands inside chunk 3.
    monkeypatch.setenv("CONVOY_FAULTS", f"step_delay=0.03,slow_step={2 * CHUNK + 9}:2")
    cfg = config(params(tmp_path, data_dir, "kill9"))
    run_dir = cfg.run_dir.resolve()
    summary, killed = train_killed_in_chunk_3(run_training, cfg)
    assert summary["final_step"] == TOTAL
    assert summary["digest"] == reference_digest, "resumed run diverged from the uninterrupted one"
    assert summary["attempts"] == {1: 1, 2: 1, 3: 2}
    runs = task_runs(summary["flow_run_id"])
    # On a loaded machine the kill can land before chunk 3's task adopted its worker: then the
    # parking replaced it at once, inside Prefect's first run of chunk 3 (issue 30 item 2).
    replaced = [e for e in read_events(run_dir, "resubmitted") if e.get("reason") == "replaced"]
    chunk3_runs = 1 if replaced else 2
    assert {name: r.run_count for name, r in runs.items()} == {"chunk-1": 1, "chunk-2": 1, "chunk-3": chunk3_runs}
    assert all(r.state.is_completed() for r in runs.values())
    policy = runs["chunk-3"].empirical_policy  # one number, which Prefect's UI shows ("NaNs" for a list)
    assert isinstance(policy.retry_delay, int | float) and policy.retries == 2, policy
    fail = read_events(run_dir, "failure")
    assert [(e["chunk"], e["failure"]) for e in fail] == [(3, "killed")]
    assert fail[0]["last_committed_step"] >= 2 * CHUNK and fail[0]["steps_lost"] >= 0
    resumed = [e["step"] for e in read_events(run_dir, "resumed")]
    assert resumed[-1] == fail[0]["last_committed_step"]  # the retry resumed inside chunk 3
    print(
        f"\nSIGKILL at step {killed['step']}: detected after {fail[0]['detected_after_s']} s, "
        f"resumed from step {resumed[-1]}, {fail[0]['steps_lost']} step(s) lost"
    )
    boundaries = {f"step-{s:09d}" for s in (CHUNK, 2 * CHUNK, 3 * CHUNK)}
    assert boundaries <= set(verified) and set(verified.values()) == {1}, verified
    table, note = artifacts("convoy-kill9-chunks"), artifacts("convoy-kill9-failures")
    text = table[0].data if isinstance(table[0].data, str) else json.dumps(table[0].data)
    assert len(table) == 1 and '"failures": "killed"' in text and summary["digest"] in text
    assert note and "resumes from step" in str(note[-1].data)
    assert_no_leftovers(run_dir)


def artifacts(key: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))


def test_sigstop_is_a_hang_and_is_retried(prefect_api: str, data_dir: Path, tmp_path: Path) -> None:
    from flows.train import run_training

    cfg = config(
        params(
            tmp_path,
            data_dir,
            "stop",
            train={"total_steps": 30, "chunk_steps": 30},
            heartbeat={"stall_s": 3, "timeout_s": 6},
        )
    )
    run_dir = cfg.run_dir.resolve()
    stopped: dict[str, Any] = {}

    def stopper() -> None:
        beat = wait_for_step(run_dir, 12)
        stopped.update(pid=beat.pid, step=beat.step, time=time.time())
        os.kill(beat.pid, signal.SIGSTOP)

    t = in_thread(stopper)
    summary = run_training(cfg)
    t.join(timeout=5)
    assert stopped and summary["final_step"] == 30
    fail = read_events(run_dir, "failure")
    assert [e["failure"] for e in fail] == ["hang"]
    latency = fail[0]["detected_at"] - stopped["time"]
    print(
        f"\nSIGSTOP at step {stopped['step']}: hang detected {latency:.2f} s after the stop "
        f"(stall_s = 3, detector's own figure {fail[0]['detected_after_s']} s)"
    )
    assert 2.5 <= latency < 3 + 1.5
    assert task_runs(summary["flow_run_id"])["chunk-1"].run_count == 2
    assert_no_leftovers(run_dir)


def test_config_error_is_not_retried(prefect_api: str, data_dir: Path, tmp_path: Path) -> None:
    from flows.train import run_training
    from tasks.supervision.supervisor import ChunkFailed

    empty = tmp_path / "no-data"
    empty.mkdir()
    cfg = config(params(tmp_path, data_dir, "cfgerr", data={"prepared_dir": str(empty)}))
    with pytest.raises(ChunkFailed) as info:
        run_training(cfg)
    assert info.value.kind == "config"
    assert "run `convoy prepare` first" in str(info.value)
    run_dir = cfg.run_dir.resolve()
    fail = read_events(run_dir, "failure")
    assert [e["failure"] for e in fail] == ["config"]  # exactly one attempt
    assert [e["kind"] for e in read_events(run_dir) if e["kind"] in ("chunk_failed", "flow_failed")] == [
        "chunk_failed",
        "flow_failed",
    ]
    flow_run_id = read_events(run_dir, "flow_started")[-1]["flow_run_id"]
    runs = task_runs(flow_run_id)
    assert runs["chunk-1"].run_count == 1 and runs["chunk-1"].state.is_failed()
    assert "chunk-2" not in runs
    assert_no_leftovers(run_dir)


def test_killed_flow_resumes_and_second_flow_is_refused(
    prefect_api: str, data_dir: Path, tmp_path: Path, reference_digest: str
) -> None:
    """One run, three faults, what a person reads afterwards.  In chunk 1 the newest checkpoint is
    corrupted and the worker SIGKILLed: the failed attempt's MLflow run and the summary name the
    passed-over step and why.  In chunk 2 a second flow is refused, then the first flow is
    SIGKILLed: the next flow crashes the dead flow run (and its task runs) in Prefect, ends its
    RUNNING MLflow attempt run KILLED, links both flow runs both ways, and numbers attempts per
    chunk across both flows (no name twice)."""
    from training.checkpointing.store import newest_verified_step

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    p = params(tmp_path, data_dir, "flowkill", heartbeat={"stall_s": 30}, tracking={"mlflow": True, "mlflow_uri": uri})
    pfile = tmp_path / "params.yaml"
    pfile.write_text(yaml.safe_dump(p))
    run_dir = config(p).run_dir.resolve()
    cmd = [sys.executable, "-m", "flows.cli.main", "train", str(pfile)]  # `convoy train PARAMS`
    # Step 28 (inside chunk 2) stalls up to 90 s in the first flow only, so the second flow and the
    # kill land while the first one is mid-run however slow this machine is (CI once took over 15 s
    # to refuse the second flow); the stall ends at the worker's SIGTERM, so its emergency save is
    # prompt.  The flag stalls one step of chunk 1 on demand, so the corruption and the kill land
    # before the next save.
    stall = tmp_path / "stall"
    env = {**os.environ, "CONVOY_FAULTS": f"step_delay=0.03,slow_step=28:90,slow_flag={stall}:20"}
    first = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    try:
        corrupted = corrupt_newest_then_kill(run_dir, stall, at_step=12)
        wait_for_step(run_dir, CHUNK + 7)
        second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert "already being trained by another flow" in second.stderr
        assert first.poll() is None, "the second flow disturbed the first"
        os.kill(first.pid, signal.SIGKILL)  # the flow's machine "dies"; the worker must not live on
        first.wait(timeout=10)
        assert_no_leftovers(run_dir, wait_s=40)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    before = [e["chunk"] for e in read_events(run_dir, "chunk_done")]
    assert before in ([1], [1, 2]), before
    committed_at_kill = newest_verified_step(run_dir)
    assert committed_at_kill is not None and committed_at_kill > CHUNK
    if before == [1]:  # killed inside the slow step: the orphaned worker got SIGTERM from the
        assert read_events(run_dir, "preempted")  # kernel (PDEATHSIG) and saved an emergency checkpoint

    again = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "COLUMNS": "250"}
    )
    assert again.returncode == 0, again.stderr[-3000:]
    from training.checkpointing.store import CheckpointStore

    final = CheckpointStore(run_dir).latest_valid(record=False)
    assert final is not None and final.step == TOTAL and final.digest == reference_digest
    rerun = [e for e in read_events(run_dir, "flow_done")][-1]
    assert rerun["trained_chunks"] == 3 - committed_at_kill // CHUNK  # each chunk not yet committed
    done = [e["chunk"] for e in read_events(run_dir, "chunk_done")]
    assert done == [1, 2, 3], done  # no committed chunk trained twice
    rerun_started = read_events(run_dir, "flow_started")[-1]["time"]
    first_resume = [e for e in read_events(run_dir, "resumed") if e["time"] > rerun_started]
    assert first_resume[0]["step"] == committed_at_kill  # continued from the newest checkpoint
    assert "passed over" in again.stdout and f"step {corrupted} (" in again.stdout, again.stdout
    assert "entropy floor" in again.stdout
    print(again.stdout)
    check_takeover(run_dir, uri, before, corrupted)
    assert_no_leftovers(tmp_path)


def corrupt_newest_then_kill(run_dir: Path, stall: Path, at_step: int) -> int:
    """Stall the worker after ``at_step`` (the flag fault), flip a byte in its newest committed
    checkpoint, SIGKILL it; returns the corrupted checkpoint's step."""
    beat = wait_for_step(run_dir, at_step)
    stall.touch()
    deadline = time.monotonic() + 60
    while stall.exists() and time.monotonic() < deadline:  # the worker took the flag: it is stalled
        time.sleep(0.05)
    time.sleep(1.0)  # an asynchronous save in flight commits meanwhile
    newest = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if p.is_dir() and "." not in p.name)[-1]
    target = max(newest.glob("*.safetensors"), key=lambda f: f.stat().st_size)
    with open(target, "r+b") as fh:
        fh.seek(target.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.kill(int(beat.pid), signal.SIGKILL)
    return int(newest.name.removeprefix("step-"))


def check_takeover(run_dir: Path, uri: str, before: list[int], corrupted: int) -> None:
    """Prefect and MLflow after a flow was SIGKILLed and the next one finished the run."""
    from mlflow.tracking import MlflowClient
    from prefect.client.orchestration import get_client

    from training.rundir import run_info

    old, new = [e["flow_run_id"] for e in read_events(run_dir, "flow_started")]
    taken = read_events(run_dir, "flow_taken_over")
    assert len(taken) == 1 and taken[0]["previous"] == [old] and taken[0]["flow_run_id"] == new
    with get_client(sync_client=True) as client:
        dead, live = client.read_flow_run(old), client.read_flow_run(new)
    assert dead.state.is_crashed() and live.state.is_completed(), (dead.state, live.state)
    assert all(r.state.is_final() for r in task_runs(old).values())
    assert f"continued-by:{live.name}" in dead.tags and f"continues:{dead.name}" in live.tags
    # A task run crashed by the takeover ends its log saying what happened to it (issue 31).
    from prefect.client.schemas.filters import LogFilter, LogFilterTaskRunId
    from prefect.client.schemas.sorting import LogSort

    crashed = [r for r in task_runs(old).values() if r.state.is_crashed()]
    assert len(crashed) == len(taken[0]["crashed_task_runs"])
    with get_client(sync_client=True) as client:
        for tr in crashed:
            logs = client.read_logs(
                LogFilter(task_run_id=LogFilterTaskRunId(any_=[tr.id])), sort=LogSort.TIMESTAMP_DESC
            )
            assert logs and "its flow process was killed" in logs[0].message and live.name in logs[0].message
    links = artifacts("convoy-flowkill-flow-runs")
    assert any(dead.name in str(a.data) for a in links if str(a.flow_run_id) == new), links
    client = MlflowClient(uri)
    parent = client.get_run(run_info(run_dir).mlflow_run_id)
    assert parent.info.status == "FINISHED" and old in parent.data.tags["convoy.flows"]
    assert parent.data.tags["convoy.flow_run"] == new
    runs = client.search_runs([parent.info.experiment_id])
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    names = [r.info.run_name for r in children]
    print("\nattempt runs:", sorted(names))
    assert len(names) == len(set(names)), names
    for chunk in (1, 2, 3):  # numbered per chunk across both flows: 1..n, no gap, no repeat
        numbers = sorted(
            int(r.data.tags["convoy.attempt"]) for r in children if r.data.tags["convoy.chunk"] == str(chunk)
        )
        assert numbers == list(range(1, len(numbers) + 1)), (chunk, names)
    killed = [r for r in children if r.info.run_name.startswith("killed ") and r.info.run_name.endswith(" c1·a1")]
    assert len(killed) == 1 and killed[0].info.status == "FAILED", names
    tags = killed[0].data.tags
    assert f"step {corrupted} (" in tags["convoy.skipped"] and "passed over" in tags["mlflow.note.content"]
    if before == [1]:  # the dead flow's attempt at chunk 2 was running: closed, named, counted
        orphan = [r for r in children if r.info.run_name.startswith("orphan ") and r.info.run_name.endswith(" c2·a1")]
        assert len(orphan) == 1 and orphan[0].info.status == "KILLED", names
        assert f"found by flow run {live.name}" in orphan[0].data.tags["mlflow.note.content"]  # a name, not a UUID
        assert any(n == "done→40 c2·a2" for n in names), names
    tables = {str(a.flow_run_id): a.data for a in artifacts("convoy-flowkill-chunks")}
    text = tables[new] if isinstance(tables[new], str) else json.dumps(tables[new])
    assert "not committed" not in text and '"failures": "killed"' in text  # chunk 1's failure, from flow 1
    # The dead flow run got the chunks table it died before publishing, and the note naming its
    # successor carries a key (so Prefect's Artifacts index lists it).
    dead_rows = json.loads(tables[old]) if isinstance(tables[old], str) else tables[old]
    assert dead_rows and any(r["status"] == "died with this flow run" for r in dead_rows), dead_rows
    assert old in {str(a.flow_run_id) for a in links}, [(a.flow_run_id, a.description) for a in links]


def test_finished_run_trains_nothing_and_is_tracked_in_mlflow(prefect_api: str, data_dir: Path, tmp_path: Path) -> None:
    """Also the one flow test with MLflow on: one training run, one nested run per attempt."""
    from flows.train import run_training

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = config(
        params(
            tmp_path,
            data_dir,
            "again",
            train={"total_steps": 10, "chunk_steps": 5},
            tracking={"mlflow": True, "mlflow_uri": uri, "system_metrics_s": 0.2},
        )
    )
    first = run_training(cfg)
    assert first["trained_chunks"] == 2 and first["final_step"] == 10
    spawned = len(read_events(cfg.run_dir, "worker_done"))
    second = run_training(cfg)
    assert second["trained_chunks"] == 0 and second["skipped_chunks"] == 2
    assert second["digest"] == first["digest"]
    assert len(read_events(cfg.run_dir, "worker_done")) == spawned  # no worker was started
    assert (cfg.run_dir / "audit" / "resume_events.json").exists()

    from mlflow.tracking import MlflowClient

    from training.rundir import run_info

    client = MlflowClient(uri)
    parent = client.get_run(run_info(cfg.run_dir).mlflow_run_id)
    assert parent.info.status == "FINISHED"
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(r.data.tags["convoy.chunk"] for r in children) == ["1", "2"]
    assert all(r.info.status == "FINISHED" for r in children)
    losses = client.get_metric_history(parent.info.run_id, "loss")
    assert sorted(m.step for m in losses) == list(range(1, 11))  # the worker logged into this run
    check_mlflow_run(client, parent.info.run_id, first)
    assert_no_leftovers(cfg.run_dir.resolve())


def tag_key_shows(key: str, value: str) -> bool:
    """Whether MLflow 3.17's run page shows a tag's key whole: a chip of key and value over 30
    characters cuts the longer one, and both when the shorter is over 15 (its ``KeyValueTag``).
    ``convoy.fingerprint`` (18) with its 16 hex digits fits both halves (seen in the browser)."""
    return len(key) + len(value) <= 30 or len(key) <= 15 or key == "convoy.fingerprint"


def check_mlflow_run(client: Any, run_id: str, summary: dict[str, Any]) -> None:
    """What an MLflow user expects of a finished run: only what defines the run as params (no
    None, no launch string), git source tags, the Prefect flow run, the corpus as a dataset
    input, MLflow's system metrics, and the final model logged (safetensors) and registered once,
    however often the flow ran."""
    import subprocess as sp

    run = client.get_run(run_id)
    params, tags = run.data.params, run.data.tags
    assert "None" not in params.values() and not [k for k in params if k.startswith(("orchestration", "tracking"))]
    assert params["train.lr"] and params["task_args.d_model"] == "32" and "train.chunk_steps" not in params
    head = sp.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert tags["mlflow.source.git.commit"] == head and tags["mlflow.source.type"] == "LOCAL"
    assert tags["convoy.flow_url"].endswith(f"/runs/flow-run/{tags['convoy.flow_run']}")
    assert summary["flow_run_id"] in tags["convoy.flows"]
    inputs = run.inputs.dataset_inputs
    assert [i.dataset.name for i in inputs] == ["corpus-synthetic"]  # named after the corpus: one per digest
    assert [(t.key, t.value) for t in inputs[0].tags] == [("mlflow.data.context", "training")]
    assert any(k.startswith("system/cpu_utilization") for k in run.data.metrics), sorted(run.data.metrics)
    models = client.search_logged_models([run.info.experiment_id])
    assert len(models) == 1 and models[0].source_run_id == run_id, models
    assert tags["convoy.digest"] == summary["digest"] == models[0].tags["convoy.digest"]
    files = {a.path for a in client.list_logged_model_artifacts(models[0].model_id)}
    assert files == {"model.safetensors", "config.json", "convoy-model.json"}, files
    versions = client.search_model_versions("name = 'again'")
    assert [(v.source, v.run_id) for v in versions] == [(f"models:/{models[0].model_id}", run_id)]
    # The logged model links to its registered version on a SQLite store too (MLflow's UI then
    # says "Registered", not "Not registered"); the link is there once.
    model = client.get_logged_model(models[0].model_id)
    linked = model.tags["mlflow.modelVersions"]
    assert json.loads(linked) == [{"name": "again", "version": str(versions[0].version)}], linked
    # Issue 31 item 9: filled where MLflow users look.  The model has its metrics, on the corpus.
    loss = [m for m in model.metrics or [] if m.key == "loss"]
    assert len(loss) == 1 and loss[0].dataset_name == inputs[0].dataset.name, model.metrics
    assert tags.get("mlflow.user") and client.get_experiment(run.info.experiment_id).tags.get("mlflow.note.content")
    ui = tags["convoy.flow_url"].split("/runs/")[0]
    assert f"]({tags['convoy.flow_url']})" in tags["mlflow.note.content"]  # a link to click
    # The loss picture on the Overview page: a markdown image of the run's own artifact.
    assert f"(get-artifact?path=convoy%2Ftimeline.png&run_uuid={run_id})" in tags["mlflow.note.content"]
    assert "convoy/timeline.png" in {a.path for a in client.list_artifacts(run_id, "convoy")}
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    for shown in [tags] + [c.data.tags for c in children]:  # MLflow's tag chips cut a long key (issue 31)
        assert not [k for k, v in shown.items() if k.startswith("convoy.") and not tag_key_shows(k, v)], shown
    for child in children:
        c = child.data
        start, end = int(c.tags["convoy.start_step"]), int(c.tags["convoy.end_step"])
        assert c.params["chunk"] == c.tags["convoy.chunk"] and c.params["train.lr"] == params["train.lr"]
        assert c.tags["mlflow.source.git.commit"] == head and c.tags["mlflow.user"] == tags["mlflow.user"]
        steps = [m.step for m in client.get_metric_history(child.info.run_id, "loss")]
        assert steps == list(range(start + 1, end + 1)), (child.info.run_name, steps)  # its own window, once
        note = c.tags["mlflow.note.content"]
        assert note.startswith("**done**") and f"]({ui}/runs/task-run/{c.tags['convoy.task_run']})" in note
        assert f"](#/experiments/{run.info.experiment_id}/runs/{run_id})" in note, note


def test_two_ranks_a_killed_rank_fails_the_chunk_and_is_retried(
    prefect_api: str, data_dir: Path, tmp_path: Path
) -> None:
    """torchrun exits 1 whatever its ranks did; the supervisor still names the rank's SIGKILL."""
    from flows.train import run_training

    cfg = config(params(tmp_path, data_dir, "ranks2", train={"total_steps": 30, "chunk_steps": 30, "ranks": 2}))
    run_dir = cfg.run_dir.resolve()
    killed: dict[str, Any] = {}

    def killer() -> None:
        beat = wait_for_step(run_dir, 12, rank=1)
        killed.update(pid=beat.pid, step=beat.step)
        os.kill(beat.pid, signal.SIGKILL)

    t = in_thread(killer)
    summary = run_training(cfg)
    t.join(timeout=5)
    assert killed and summary["final_step"] == 30 and summary["attempts"] == {1: 2}
    fail = read_events(run_dir, "failure")
    # Either torchrun reports the rank's SIGKILL before we look, or the supervisor sees the rank's pid
    # gone while rank 0 sits blocked in an all-reduce: detected within ~2 s, not after stall_s.
    assert [e["failure"] for e in fail] in (["killed"], ["crash"]), fail
    assert "SIGKILL in a rank" in fail[0]["reason"] or "rank 1" in fail[0]["reason"], fail
    assert fail[0]["detected_after_s"] < 4.5, fail
    assert_no_leftovers(run_dir)


def test_preemption_is_resubmitted_at_once(
    prefect_api: str, data_dir: Path, tmp_path: Path, reference_digest: str
) -> None:
    """SIGTERM = preemption: emergency checkpoint, exit 75, re-spawned at once in the same attempt."""
    from flows.train import run_training

    cfg = config(params(tmp_path, data_dir, "preempt"))
    run_dir = cfg.run_dir.resolve()
    sent: dict[str, Any] = {}

    def preempter() -> None:
        beat = wait_for_step(run_dir, CHUNK + 7)
        sent.update(step=beat.step)
        os.kill(beat.pid, signal.SIGTERM)

    t = in_thread(preempter)
    summary = run_training(cfg)
    t.join(timeout=5)
    assert sent and summary["final_step"] == TOTAL and summary["digest"] == reference_digest
    assert summary["attempts"] == {1: 1, 2: 2, 3: 1}  # the re-spawn is attempt 2 of chunk 2, but no Prefect retry
    assert [e["failure"] for e in read_events(run_dir, "failure")] == ["preempted"]
    resub = read_events(run_dir, "resubmitted")
    assert len(resub) == 1 and resub[0]["chunk"] == 2
    saved = read_events(run_dir, "preempted")[0]["step"]
    assert resub[0]["resume_step"] == saved >= sent["step"]  # nothing lost: resumed from the emergency save
    assert task_runs(summary["flow_run_id"])["chunk-2"].run_count == 1
    assert_no_leftovers(run_dir)


def test_sigterm_to_the_flow_crashes_it_cleanly(prefect_api: str, data_dir: Path, tmp_path: Path) -> None:
    """SIGTERM to the flow process: on_crashed writes the audit, the worker saves and stops."""
    p = params(tmp_path, data_dir, "flowterm", heartbeat={"grace_s": 15})  # room for the emergency save
    run_dir, flow = start_flow(tmp_path, p)
    try:
        wait_for_step(run_dir, 8)
        flow.send_signal(signal.SIGTERM)
        assert flow.wait(timeout=60) != 0
    finally:
        if flow.poll() is None:
            os.killpg(flow.pid, signal.SIGKILL)
            flow.wait()
    kinds = [e["kind"] for e in read_events(run_dir)]
    assert "flow_crashed" in kinds, kinds
    assert "preempted" in kinds  # the supervisor's cleanup sent SIGTERM: an emergency checkpoint
    assert_no_leftovers(run_dir)


def test_pipelined_worker_never_outruns_the_flow_and_chunks_are_identical(
    prefect_api: str, data_dir: Path, tmp_path: Path, reference_digest: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full-speed steps (no step pause), 10-step chunks, a checkpoint every 2 steps, keep_last 1:
    a pipelined worker would retire a boundary checkpoint before its chunk task verified it if it
    ran ahead of the flow.  It waits for each acknowledgement instead, and every chunk's artifact
    is bitwise the one a worker restarted per chunk commits."""
    from flows.train import run_training

    monkeypatch.delenv("CONVOY_FAULTS", raising=False)
    tight = {"train": {"chunk_steps": 10}, "checkpoint": {"every_steps": 2, "keep_last": 1}}
    summaries = {}
    for pipe in (True, False):
        p = params(tmp_path, data_dir, f"pipe-{pipe}", **tight, orchestration={"pipeline": pipe})
        summaries[pipe] = run_training(config(p))
        assert_no_leftovers(config(p).run_dir.resolve())
    digests = {pipe: [c["digest"] for c in s["chunks"]] for pipe, s in summaries.items()}
    assert len(digests[True]) == TOTAL // 10 and all(digests[True])
    assert digests[True] == digests[False]
    assert summaries[True]["digest"] == summaries[False]["digest"] == reference_digest
    logs = sorted((tmp_path / "runs" / "pipe-True" / "logs").glob("chunk-*.log"))
    # One worker trained all six chunks: one file, named after each attempt it served (issue 31).
    assert [p.name for p in logs] == [f"chunk-{c}-attempt-1.log" for c in range(1, TOTAL // 10 + 1)]
    assert len({p.stat().st_ino for p in logs}) == 1
