"""MLflow: one run per training run, each (metric, step) exactly once across real SIGKILLs,
replay verification, non-determinism reported, nested attempt runs and the resume audit.

Real MLflow on a SQLite file in a tmp dir; real ``python -m training.worker`` processes killed
with SIGKILL, their ``metrics.jsonl`` shipped to MLflow by the chunk task's
:class:`tasks.records.metric_shipping.MetricShipper` as the flow does (the worker never talks to MLflow).
The kill point is made deterministic with the ``slow_step`` fault (the worker
sleeps before that step, the test kills it while it sleeps).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tasks.records.metric_shipping import MetricShipper, split_batches
from tasks.records.mlflow_audit import AttemptOutcome, end_attempt, refresh_audit, start_attempt
from tasks.records.mlflow_client import client_for, resolve_tracking_uri
from tasks.records.mlflow_runs import ensure_mlflow_run
from tests.engine_util import final_digest, kill_group, make_run, run_worker, start_worker, wait_for_step
from training.event_records import EventLog
from training.events import append_event, read_events
from training.rundir import load_run_config, run_info
from training.tracking.attempts import AttemptId
from training.tracking.metrics import metric_rows
from training.tracking.resume_audit import analyse_events

TOTAL = 150
#: Checkpoint cadence: chunk 1 is killed at 55 before its first checkpoint (restart from 0, replay
#: 1..54 against metrics.jsonl) and chunk 2 at 131 (checkpoint 75: replay 76..130).
EVERY = 70
KEYS = ("loss", "lr", "grad_norm", "step_time_s", "tokens_per_s")
DETERMINISTIC = ("loss", "lr", "grad_norm")


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One SQLite store per module: creating the schema costs ~10 s."""
    db = tmp_path_factory.mktemp("mlflow") / "mlflow.db"
    uri = f"sqlite:///{db}"
    client_for(uri).search_experiments()  # runs the migrations once
    return uri


def mlflow_run(tmp: Path, name: str, uri: str, extra: list[str] | None = None) -> tuple[Path, str]:
    overrides = [
        f"train.total_steps={TOTAL}",
        f"train.chunk_steps={TOTAL // 2}",
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep_last=3",
        # Resumes from disk checkpoints: the replayed steps are what these tests compare (the memory
        # tier would resume at the kill and replay nothing; tests/test_memory_tier.py covers it).
        "checkpoint.memory_every_steps=null",
        "tracking.mlflow=true",
        f"tracking.mlflow_uri={uri}",
        "tracking.experiment=convoy-test",
        *(extra or []),
    ]
    run_dir = make_run(tmp, name, overrides)
    return run_dir, ensure_mlflow_run(load_run_config(run_dir), run_dir)


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client_for(uri).get_metric_history(run_id, key))


def load_table(uri: str, experiment_id: str, run_id: str):
    """``MlflowClient.load_table`` searches with the *global* tracking URI (MLflow 3.17): set it."""
    from tasks.records.mlflow_model import global_tracking_uri

    # Not get/set_tracking_uri around it: putting back the resolved default left
    # $MLFLOW_TRACKING_URI=<checkout>/mlflow.db in this process for every later test's subprocess.
    with global_tracking_uri(uri):
        return client_for(uri).load_table(experiment_id, "convoy/resume_events.json", run_ids=[run_id])


def kill_at(run_dir: Path, until: int, step: int) -> None:
    """Start a worker, let it stall just before ``step`` (fault), SIGKILL it there."""
    p = start_worker(run_dir, until, {"CONVOY_FAULTS": f"slow_step={step}:60"})
    try:
        reached = wait_for_step(run_dir, p, step - 1, timeout=180)
        assert reached == step - 1, f"worker ended before step {step}: {p.communicate()[0]}"
        time.sleep(1.0)  # an async save commits
    finally:
        kill_group(p)
        p.wait()


def attempt(cfg, run_dir: Path, chunk: int, number: int, start: int, end: int, kill_step: int | None) -> None:
    """What the chunk task does around one attempt, with a real worker (killed or not): the
    attempt's MLflow run, the metric shipper following ``metrics.jsonl``, the audit refresh."""
    child = start_attempt(cfg, run_dir, AttemptId(chunk, number, start, end))
    shipper = MetricShipper.for_run(cfg, run_dir)
    assert shipper is not None
    t0 = time.time()
    if kill_step is not None:
        kill_at(run_dir, end, kill_step)
        failed = AttemptOutcome("FAILED", "killed", steps=kill_step - 1 - start, seconds=time.time() - t0)
        end_attempt(child, failed, config=cfg, run_dir=run_dir)
    else:
        code, out = run_worker(run_dir, end)
        assert code == 0, out
        end_attempt(
            child,
            AttemptOutcome("FINISHED", None, steps=end - start, seconds=time.time() - t0),
            config=cfg,
            run_dir=run_dir,
        )
    report = shipper.stop(drain_s=30)
    assert report.waiting == 0 and report.error is None, report
    refresh_audit(cfg, run_dir)


@pytest.mark.slow
def test_two_kills_exactly_one_point_per_step_and_audit(tmp_path: Path, tracking_uri: str) -> None:
    ref_dir = make_run(tmp_path, "reference", [f"train.total_steps={TOTAL}", f"train.chunk_steps={TOTAL // 2}"])
    code, out = run_worker(ref_dir, TOTAL)  # uninterrupted, no MLflow (its metrics.jsonl is the reference)
    assert code == 0, out
    reference = metric_rows(ref_dir)

    run_dir, run_id = mlflow_run(tmp_path, "killed", tracking_uri)
    cfg = load_run_config(run_dir)
    half = TOTAL // 2
    # Chunk 1 [0, 75): killed at step 55 (no checkpoint yet, metrics logged through 50) → restarted.
    attempt(cfg, run_dir, 1, 1, 0, half, kill_step=55)
    attempt(cfg, run_dir, 1, 2, 0, half, kill_step=None)
    # Chunk 2 [75, 150): killed at step 131 (checkpoint 75, logged through 125) → resumed.
    attempt(cfg, run_dir, 2, 1, half, TOTAL, kill_step=131)
    attempt(cfg, run_dir, 2, 2, half, TOTAL, kill_step=None)

    assert final_digest(run_dir) == final_digest(ref_dir)
    # The same MLflow run was used by every worker (id in run.json).
    assert run_info(run_dir).mlflow_run_id == run_id
    assert ensure_mlflow_run(cfg, run_dir) == run_id
    # Exactly one point per (metric, step), 1..N, equal to the uninterrupted run's values.
    for key in KEYS:
        points = history(tracking_uri, run_id, key)
        assert [s for s, _ in points] == list(range(1, TOTAL + 1)), key
    for key in DETERMINISTIC:
        assert history(tracking_uri, run_id, key) == [(s, m[key]) for s, m in reference], key

    events = read_events(run_dir)
    assert len([e for e in events if e["kind"] == "started"]) == 2
    assert [e["step"] for e in events if e["kind"] == "resumed"] == [75, 75]
    verified = [e for e in events if e["kind"] == "replay_verified"]
    assert len(verified) == 2 and all(e["values_compared"] > 0 and e["mismatches"] == 0 for e in verified)
    assert not [e for e in events if e["kind"] in ("replay_mismatch", "nondeterministic_resume")]

    client = client_for(tracking_uri)
    parent = client.get_run(run_id)
    tags = parent.data.tags
    assert tags["convoy.resumes"] == "2"
    assert tags["convoy.failures"] == "2"
    assert tags["convoy.replay_verified"] == "2"
    assert "convoy.nondeterministic" not in tags
    assert tags["convoy.fingerprint"] == cfg.fingerprint()
    assert parent.data.params["train.total_steps"] == str(TOTAL)
    children = client.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{run_id}'")
    statuses = sorted((c.data.tags["convoy.chunk"], c.data.tags["convoy.attempt"], c.info.status) for c in children)
    assert statuses == [("1", "1", "FAILED"), ("1", "2", "FINISHED"), ("2", "1", "FAILED"), ("2", "2", "FINISHED")]
    failed = [c for c in children if c.info.status == "FAILED"]
    assert all(c.data.tags["convoy.failure_kind"] == "killed" for c in failed)
    assert all(float(c.data.tags["convoy.seconds"]) > 0 and not c.data.metrics for c in children)
    # The resume table (MLflow table artifact) and the timeline picture.
    table = load_table(tracking_uri, parent.info.experiment_id, run_id)
    assert len(table) == 2
    assert list(table["resumed_from_step"]) == [0, 75]
    assert list(table["replay_verified"]) == [True, True]
    assert table["checkpoint_digest"].iloc[1] == next(e["digest"] for e in events if e["kind"] == "resumed")
    names = {a.path for a in client.list_artifacts(run_id, "convoy")}
    assert names == {"convoy/resume_events.json", "convoy/timeline.png"}
    png = Path(client.download_artifacts(run_id, "convoy/timeline.png", str(tmp_path)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A refresh is idempotent: the table is replaced, not appended to.
    refresh_audit(cfg, run_dir)
    assert len(load_table(tracking_uri, parent.info.experiment_id, run_id)) == 2


@pytest.mark.slow
def test_nondeterministic_task_is_reported(tmp_path: Path, tracking_uri: str) -> None:
    run_dir, run_id = mlflow_run(tmp_path, "noisy", tracking_uri, ["task_args.noise=true"])
    cfg = load_run_config(run_dir)
    shipper = MetricShipper.for_run(cfg, run_dir)
    assert shipper is not None
    kill_at(run_dir, TOTAL // 2, 55)
    code, out = run_worker(run_dir, TOTAL // 2)
    assert code == 0, out
    assert shipper.stop(drain_s=30).waiting == 0
    assert "non-deterministic resume at step 1:" in out
    kinds = [e["kind"] for e in read_events(run_dir)]
    assert "nondeterministic_resume" in kinds and "replay_mismatch" in kinds
    summary = refresh_audit(cfg, run_dir)
    assert summary["nondeterministic"] and summary["rows"][0]["replay_verified"] is False
    tags = client_for(tracking_uri).get_run(run_id).data.tags
    assert tags["convoy.nondeterministic"] == "true"
    assert tags["convoy.nondeterministic_first_step"] == "1"
    # Even so, the history keeps exactly one point per step (the first value is kept).
    assert [s for s, _ in history(tracking_uri, run_id, "loss")] == list(range(1, TOTAL // 2 + 1))


def test_tracking_uri_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from training.config import load_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = load_config(None, [f"runs_dir={tmp_path / 'runs'}"])
    assert resolve_tracking_uri(cfg) == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert resolve_tracking_uri(cfg) == "http://127.0.0.1:5000"
    cfg = load_config(None, ["tracking.mlflow_uri=sqlite:///rel/x.db"])
    assert resolve_tracking_uri(cfg) == f"sqlite:///{tmp_path.resolve()}/rel/x.db"  # absolute for workers


def unit_run(tmp_path: Path, name: str, tracking_uri: str):
    from training.config import load_config

    cfg = load_config(
        None,
        [f"runs_dir={tmp_path}", f"run_name={name}", f"tracking.mlflow_uri={tracking_uri}", "tracking.experiment=unit"],
    )
    run_dir = tmp_path / name
    run_dir.mkdir()
    return cfg, run_dir, ensure_mlflow_run(cfg, run_dir)


def test_shipper_sends_the_journal_bit_exact_in_few_batches(tmp_path: Path, tracking_uri: str) -> None:
    from training.tracking.metrics import JsonlBackend

    cfg, run_dir, run_id = unit_run(tmp_path, "unit", tracking_uri)
    assert ensure_mlflow_run(cfg, run_dir) == run_id  # idempotent
    values = [0.1 + 1e-17 * i for i in range(3)] + [1 / 3, 2.0**-40, 123456.789e-7]
    rows = [(s, {"loss": values[s % len(values)] * s, "lr": 0.5 / s}) for s in range(1, 601)]
    journal = JsonlBackend(run_dir / "metrics.jsonl")
    journal.write(rows[:300])
    shipper = MetricShipper.for_run(cfg, run_dir)
    assert shipper is not None
    for s in range(300, 600):  # the worker appends one step at a time while the shipper follows
        journal.write(rows[s : s + 1])
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 601, "metrics": {"lo')  # a row being appended: not shipped half-written
    report = shipper.stop(drain_s=30)
    assert report.shipped == 1200 and report.error is None
    assert history(tracking_uri, run_id, "loss") == [(s, m["loss"]) for s, m in rows]  # bit-exact round trip
    assert [s for s, _ in history(tracking_uri, run_id, "lr")] == list(range(1, 601))


def test_an_attempt_run_gets_the_points_of_its_own_steps_once(tmp_path: Path, tracking_uri: str) -> None:
    """Issue 31: child runs had 0 metrics.  An attempt mirrored after some of its steps were read
    (a pipelined worker adopted late) still gets them; steps outside its window go only to the
    training run; a deleted attempt run does not stop the training run's points."""
    from training.tracking.metrics import JsonlBackend

    cfg, run_dir, run_id = unit_run(tmp_path, "mir", tracking_uri)
    client = client_for(tracking_uri)
    experiment = client.get_run(run_id).info.experiment_id
    child, gone = (client.create_run(experiment).info.run_id for _ in range(2))
    journal = JsonlBackend(run_dir / "metrics.jsonl")
    journal.write([(s, {"loss": 1.0 / s}) for s in range(1, 26)])
    shipper = MetricShipper.for_run(cfg, run_dir)
    assert shipper is not None
    deadline = time.time() + 30
    while shipper.shipped < 25 and time.time() < deadline:  # steps 1..25 read and sent before the mirror
        time.sleep(0.1)
    client.delete_run(gone)
    shipper.mirror(gone, 1, 40)
    shipper.mirror(child, 21, 40)
    journal.write([(s, {"loss": 1.0 / s}) for s in range(26, 51)])
    report = shipper.stop(drain_s=30)
    assert report.shipped == 50 and report.error is None
    assert history(tracking_uri, child, "loss") == [(s, 1.0 / s) for s in range(21, 41)]
    assert [s for s, _ in history(tracking_uri, run_id, "loss")] == list(range(1, 51))


def test_the_loss_picture_in_the_charts_is_one_image_the_newest(tmp_path: Path, tracking_uri: str) -> None:
    """MLflow's image chart opens at the series' only step, or at step 0 (blank) when there are
    several: each audit refresh logs its picture and removes the older ones (issue 31 item 5)."""
    from PIL import Image

    from tasks.records.mlflow_audit import CHART_IMAGE_KEY, _log_chart_image

    _, _, run_id = unit_run(tmp_path, "pic", tracking_uri)
    client = client_for(tracking_uri)
    png = tmp_path / "timeline.png"
    Image.new("RGB", (40, 20), "white").save(png)
    for step in (100, 200, 200, 300):  # a refresh at a step already shown adds nothing
        _log_chart_image(client, run_id, png, step)
    names = sorted(Path(f.path).name for f in client.list_artifacts(run_id, "images"))
    assert len(names) == 2 and all(n.startswith(f"{CHART_IMAGE_KEY}+step+300+") for n in names), names


def test_split_batches_never_splits_a_step() -> None:
    from mlflow.entities import Metric

    metrics = [Metric(f"k{j}", 1.0, 0, s) for s in range(1, 301) for j in range(7)]
    batches = split_batches(metrics, limit=1000)
    assert sum(len(b) for b in batches) == len(metrics)
    assert all(len(b) <= 1000 for b in batches)
    for a, b in zip(batches, batches[1:], strict=False):
        assert a[-1].step != b[0].step


def test_analyse_events_with_supervisor_failures(tmp_path: Path) -> None:
    run = tmp_path
    append_event(run, "started", rank=0, until_step=100)
    append_event(run, "worker_done", rank=0, step=100, digest="d1")
    append_event(run, "resumed", rank=0, step=100, checkpoint="step-000000100", digest="d1", load_s=0.1)
    append_event(
        run,
        "failure",
        failure="hang",
        detected_after_s=20.5,
        last_beat_step=130,
        last_committed_step=120,
        steps_lost=10,
        chunk=2,
        attempt=1,
    )
    append_event(run, "resumed", rank=0, step=120, checkpoint="step-000000120", digest="d2", load_s=0.2)
    append_event(run, "replay_verified", values_compared=30, mismatches=0)
    append_event(run, "preempted", rank=0, step=150)
    append_event(
        run,
        "failure",
        failure="preempted",
        detected_after_s=0.1,
        last_beat_step=150,
        last_committed_step=150,
        steps_lost=0,
        chunk=2,
        attempt=2,
    )
    append_event(run, "resumed", rank=0, step=150, checkpoint="step-000000150", digest="d3", load_s=0.2)
    append_event(run, "worker_done", rank=0, step=200, digest="d4")
    s = analyse_events(EventLog.read(run))
    assert (s["resumes"], s["failures"], s["steps_lost"]) == (2, 2, 10)
    first, second = s["rows"]
    assert first["kind"] == "hang" and first["detected_after_s"] == 20.5 and first["resumed_from_step"] == 120
    assert first["replay_verified"] is True and first["chunk"] == 2 and first["recovery_s"] is not None
    assert second["kind"] == "preempted" and second["lost_steps"] == 0 and second["replay_verified"] is None
    # Without MLflow the audit files are still written.
    from training.config import load_config

    cfg = load_config(None, ["tracking.mlflow=false"])
    refresh_audit(cfg, run)
    table = json.loads((run / "audit" / "resume_events.json").read_text())
    assert len(table["data"]) == 2 and "replay_verified" in table["columns"]
    assert (run / "audit" / "timeline.png").stat().st_size > 1000


def test_a_second_shipper_sends_only_what_mlflow_lacks_and_a_late_copy_is_no_second_point(
    tmp_path: Path, tracking_uri: str
) -> None:
    """A chunk task killed while shipping leaves MLflow behind the journal: the next one sends the
    rest, once.  A request of the dead one that arrives late (a frozen server answering when it
    thaws) carries the same timestamp as the row, so it is the same point, kept once."""
    from mlflow.entities import Metric

    from training.tracking.metrics import JsonlBackend, read_journal

    cfg, run_dir, run_id = unit_run(tmp_path, "rec", tracking_uri)
    rows = [(s, {"loss": 1.0 / s, "lr": 0.1, "step_time_s": 0.01}) for s in range(1, 61)]
    JsonlBackend(run_dir / "metrics.jsonl").write(rows)
    journal, _ = read_journal(run_dir / "metrics.jsonl")
    assert all(r.time_ms is not None for r in journal)  # the time each row was logged travels with it
    sent = [Metric(k, v, r.time_ms, r.step) for r in journal[:40] for k, v in sorted(r.metrics.items())]
    client = client_for(tracking_uri)
    client.log_batch(run_id, metrics=sent, synchronous=True)  # the dead shipper got 1..40 through
    second = MetricShipper.for_run(cfg, run_dir)
    assert second is not None
    JsonlBackend(run_dir / "metrics.jsonl").write([(s, {"loss": 1.0 / s, "lr": 0.1}) for s in range(61, 71)])
    report = second.stop(drain_s=30)
    assert report.shipped == 20 * 3 + 10 * 2 and report.waiting == 0
    client.log_batch(run_id, metrics=sent, synchronous=True)  # the late copy of 1..40
    for key in ("loss", "lr"):
        assert [s for s, _ in history(tracking_uri, run_id, key)] == list(range(1, 71)), key
    assert [s for s, _ in history(tracking_uri, run_id, "step_time_s")] == list(range(1, 61))


def test_registering_a_model_leaves_the_tracking_uri_environment_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow's ``set_tracking_uri`` writes $MLFLOW_TRACKING_URI; the registration's temporary
    global URI must put back exactly what was there (unset stays unset: a full suite once found
    the working directory's default there afterwards, and runs of later tests landed in it)."""
    import os

    from tasks.records.mlflow_model import global_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with global_tracking_uri("sqlite:////tmp/elsewhere.db"):
        assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:////tmp/elsewhere.db"
    assert "MLFLOW_TRACKING_URI" not in os.environ
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////tmp/mine.db")
    with global_tracking_uri("sqlite:////tmp/elsewhere.db"):
        pass
    assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:////tmp/mine.db"
