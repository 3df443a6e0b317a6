"""Nothing outside training moves its trajectory (docs/architecture.md, invariant 12).

A task that draws from python's, numpy's and torch's generators every step, trained by the real
flow into a real ``mlflow server`` that is frozen (SIGSTOP, longer than the client's timeout) and
later SIGKILLed and started again on the same port 15 s after: the final checkpoint is the
uninterrupted run's (tracking off), no attempt failed, every loss is the reference's and MLflow
holds exactly one point per (metric, step) once it is back.  Before invariant 12 the MLflow client
ran in the worker and urllib3's retry jitter drew from ``random`` while the server was down: every
loss right, ``rng.python.state`` in the checkpoint wrong.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.flow_util import TOTAL, assert_no_leftovers, config, in_thread, params, uninterrupted_digest, wait_for_step
from training.events import read_events
from training.rundir import run_info
from training.tracking.metrics import metric_rows, read_journal

#: The task, and 0.4 s per step (the numbers do not depend on it): a run the outage can hit.
TASK: dict[str, Any] = {
    "task": "tests.hermetic_tasks:build_host_draws",
    "task_args": {"n_layer": 1, "n_head": 2, "d_model": 32, "dropout": 0.1, "step_sleep_s": 0.4},
}


def run_params(tmp: Path, data_dir: Path, name: str, **tracking: Any) -> dict[str, Any]:
    return params(tmp, data_dir, name, tracking={"mlflow": False, **tracking}, **TASK)


def points(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key))


def check_mlflow(uri: str, run_dir: Path, reference: list[tuple[int, dict[str, float]]]) -> None:
    """One point per (metric, step) for every metric the worker journaled, the losses the
    reference's."""
    run_id = run_info(run_dir).mlflow_run_id
    rows, _ = read_journal(run_dir / "metrics.jsonl")
    keys = {k for r in rows for k in r.metrics}
    assert {"loss", "lr", "grad_norm", "step_time_s"} <= keys
    for key in sorted(keys):
        steps = [s for s, _ in points(uri, run_id, key)]
        assert steps == sorted({r.step for r in rows if key in r.metrics}), key
    assert points(uri, run_id, "loss") == [(s, m["loss"]) for s, m in reference]


@pytest.mark.slow
def test_a_frozen_then_killed_tracking_server_leaves_the_trajectory_alone(
    prefect_api: str, mlflow_outage: Any, data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.train import run_training
    from tasks import MLFLOW_DEFAULTS

    for name, value in MLFLOW_DEFAULTS.items():  # convoy's own client defaults, not the test's
        monkeypatch.setenv(name, value)
    freeze_s = int(MLFLOW_DEFAULTS["MLFLOW_HTTP_REQUEST_TIMEOUT"]) + 4  # past the client's timeout
    # The reference: tracking off, and no sleep (it moves no number; 24 s of the suite saved).
    # (A run with tracking on and no outage used to come first: this one is tracking on as well,
    # and asserts all it did, so it went, ~35 s of the suite.)
    fast = {**TASK, "task_args": {**TASK["task_args"], "step_sleep_s": 0}}
    reference_digest = uninterrupted_digest(tmp_path, data_dir, "off", **fast)
    reference = metric_rows(config(params(tmp_path, data_dir, "off", tracking={"mlflow": False}, **fast)).run_dir)

    cfg = config(run_params(tmp_path, data_dir, "outage", mlflow=True, mlflow_uri=mlflow_outage.url, ship_drain_s=300))

    def outage() -> None:
        wait_for_step(cfg.run_dir, 5)
        mlflow_outage.signal(signal.SIGSTOP)  # frozen: requests hang past the client's timeout
        time.sleep(freeze_s)
        mlflow_outage.signal(signal.SIGCONT)
        wait_for_step(cfg.run_dir, 42)
        mlflow_outage.kill()
        time.sleep(15)
        mlflow_outage.restart()

    injector = in_thread(outage)
    out = run_training(cfg)
    injector.join(timeout=300)
    assert not injector.errors, injector.errors
    assert out["digest"] == reference_digest, "an outage of the tracking server changed the trajectory"
    assert out["final_step"] == TOTAL
    assert not read_events(cfg.run_dir, "failure")
    assert [(s, m["loss"]) for s, m in metric_rows(cfg.run_dir)] == [(s, m["loss"]) for s, m in reference]
    check_mlflow(mlflow_outage.url, cfg.run_dir, reference)
    done = read_events(cfg.run_dir, "worker_done")
    assert done and all(e["network_clients"] == [] for e in done)  # no MLflow, urllib3... in a worker
    assert_no_leftovers(cfg.run_dir.resolve())


@pytest.mark.parametrize(
    "extra",
    [
        ["data.num_workers=2"],  # map-style data through two loader worker processes
        ["task=tests.pipeline_tasks:build_counter", "data.num_workers=2", "train.total_steps=20"],  # a stream
    ],
    ids=["map-2-workers", "stream-2-workers"],
)
def test_a_worker_runs_only_its_own_threads_and_no_network_client(tmp_path: Path, extra: list[str]) -> None:
    """The audit of invariant 12, on a real worker with MLflow on: the threads alive at its end
    are the ones docs/architecture.md names, no network client library was imported, and no
    save saw a thread of no known purpose."""
    from tests.engine_util import make_run, run_worker
    from training.loop.hermetic import is_known

    run_dir = make_run(
        tmp_path, "threads", ["train.total_steps=20", "train.chunk_steps=20", "tracking.mlflow=true", *extra]
    )
    code, out = run_worker(run_dir, 20)
    assert code == 0, out
    (done,) = read_events(run_dir, "worker_done")
    assert all(is_known(name) for name in done["threads"]), done["threads"]
    assert done["network_clients"] == []
    assert not read_events(run_dir, "foreign_threads")


def test_a_thread_of_no_known_purpose_is_named_at_the_first_save(tmp_path: Path) -> None:
    """A task whose import starts a library thread (here one that draws from ``random``, as an
    HTTP client's retry loop does) is warned about, once, naming the thread."""
    from tests.engine_util import make_run, run_worker

    run_dir = make_run(
        tmp_path,
        "foreign",
        ["train.total_steps=20", "train.chunk_steps=20", "task=tests.hermetic_tasks:build_with_a_thread"],
    )
    code, out = run_worker(run_dir, 20)
    assert code == 0, out
    assert out.count("WARNING: thread(s) jitter-thread run beside training") == 1, out
    (event,) = read_events(run_dir, "foreign_threads")
    assert event["threads"] == ["jitter-thread"]


def test_an_unnamed_thread_is_known_only_by_its_target() -> None:
    from training.loop.hermetic import is_known

    assert is_known("Thread-3 (_pin_memory_loop)") and is_known("convoy-ckpt")
    assert not is_known("Thread-3 (_jitter)") and not is_known("Thread-3")
    assert is_known("ThreadPoolExecutor-0_1", ("ThreadPoolExecutor-",)) and not is_known("ThreadPoolExecutor-0_1")
