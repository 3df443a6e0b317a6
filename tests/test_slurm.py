"""convoy on a real Slurm cluster (one node, started by the test: tests/slurm_cluster.py), through
the recommended path: ``convoy slurm script --submit``, the batch shell ``exec``-ing ``convoy
train``, a run of two nodes whose second node's agent is an ``srun`` job step.

One job meets, in this order, the three disruptions Slurm users meet: the allocation's time
limit (a real ``--time=2`` with ``--signal=B:USR1@50``: slurmctld checks limits every 30 s and
signals once at most ``50 + 30`` s are left, so 40-70 s after the start, while chunk 2 waits at
step 25: emergency checkpoint, ``scontrol requeue``, the next allocation resumes), ``scancel`` of
the running job step of node 1 (only that chunk re-runs, in the same allocation), and the node
set DOWN by the admin (Slurm kills and requeues the job; it resumes once the node is back).  It
ends bitwise equal to an uninterrupted two-node run, with nothing left in ``squeue`` or in the
process table.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from flows.cli.slurm import sbatch_script
from flows.slurm_job import SRUN_NODE_LAUNCH, SlurmJob, fit_to_allocation
from tests.flow_util import REPO, assert_no_leftovers, config, in_thread, params, two_node_reference
from tests.slurm_cluster import SlurmCluster, installed_or_reason
from training.checkpointing.store import CheckpointStore
from training.config import ConfigError
from training.events import read_events
from training.heartbeat import read_heartbeat

TOTAL, CHUNK = 60, 20
HOLD_AT = 25  # chunk 2's steps wait here, while the hold file exists, for Slurm's USR1


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = installed_or_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def _wait(what: str, ready: Callable[[], object], timeout: float = 180) -> object:
    deadline = time.monotonic() + timeout
    while not (value := ready()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return value


def _kinds(run_dir: Path, kind: str) -> list[dict]:
    return read_events(run_dir, kind)


def _mlflow_tags(uri: str, run_dir: Path) -> dict[str, str]:
    """The training run's MLflow tags, read with MLflow's own client from the run's store."""
    import json

    from mlflow.tracking import MlflowClient

    run_id = json.loads((run_dir / "run.json").read_text())["mlflow_run_id"]
    return MlflowClient(tracking_uri=uri).get_run(run_id).data.tags


def _rank1_step(run_dir: Path) -> int:
    beat = read_heartbeat(run_dir, 1)
    return beat.step if beat else -1


@pytest.mark.slow
def test_time_limit_scancel_and_node_down_end_bitwise(
    slurm: SlurmCluster, prefect_api: str, data_dir: Path, tmp_path: Path
) -> None:
    node = slurm.node
    p = params(
        tmp_path,
        data_dir,
        "on-slurm",
        train={"nnodes": 2, "hosts": [node, node]},
        heartbeat={"stall_s": 90, "grace_s": 15},  # the hold is no hang; room for the emergency save
        tracking={"mlflow": True, "mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    )
    two_nodes = {"nnodes": 2, "hosts": ["a", "b"]}
    reference: list[str] = []  # trained while the job waits for Slurm's signal (the ranks hold, idle)
    ref = in_thread(
        lambda: reference.append(two_node_reference(params(tmp_path / "ref", data_dir, "r", train=two_nodes), TOTAL))
    )
    pfile, hold = tmp_path / "params.yaml", tmp_path / "hold"
    pfile.write_text(yaml.safe_dump(p))
    hold.touch()
    run_dir = config(p).run_dir.resolve()
    # The session's Prefect server, outside the allocation (docs/slurm.md recommends one): no
    # temporary API per allocation, and flow states survive a whole-job SIGTERM.
    env = {**os.environ, **slurm.env, "PREFECT_API_URL": prefect_api}
    env["CONVOY_FAULTS"] = f"step_delay=0.3,hold_flag={hold}:{HOLD_AT}"
    env.pop("MLFLOW_TRACKING_URI", None)
    submit = [sys.executable, "-m", "flows.cli.main", "slurm", "script", str(pfile), "--time=2", "--signal-lead=50"]
    out = subprocess.run([*submit, "--submit"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job = out.stdout.split()[-1]

    # 1. The time limit: USR1 → emergency checkpoint → requeued, resumed in the next allocation.
    requeued = _wait("the time-limit requeue", lambda: _kinds(run_dir, "slurm_requeued"))[0]  # type: ignore[index]
    hold.unlink()
    slurm.run("scontrol", "update", f"jobid={job}", "TimeLimit=10")  # this allocation ends by itself
    assert requeued["saved_step"] > CHUNK, requeued  # mid chunk 2: an emergency checkpoint, not a periodic one
    saved = {e["rank"] for e in _kinds(run_dir, "preempted") if e["step"] == requeued["saved_step"]}
    assert saved == {0, 1}, _kinds(run_dir, "preempted")  # node 1's rank too, though srun SIGKILLs on SIGTERM

    # 2. scancel of node 1's job step mid-chunk: only that chunk re-runs, in this allocation.
    _wait("the requeued job's node step", lambda: _rank1_step(run_dir) >= 30 and slurm.job_steps(job))
    failed_before = len(_kinds(run_dir, "failure"))
    slurm.run("scancel", slurm.job_steps(job)[0])
    _wait("the retried chunk", lambda: len(_kinds(run_dir, "failure")) > failed_before and _rank1_step(run_dir) >= 45)

    # 3. The node set DOWN: Slurm kills and requeues the job; it resumes once the node is back.
    slurm.run("scontrol", "update", f"nodename={node}", "state=DOWN", "reason=convoy-test")
    _wait("the job killed", lambda: slurm.job_state(job) == "PENDING" and not slurm.stepds(), 120)
    slurm.run("scontrol", "update", f"nodename={node}", "state=RESUME")
    _wait("the job to finish", lambda: slurm.job_state(job) == "GONE", 240)

    ref.join(timeout=300)
    assert reference, ref.errors  # type: ignore[attr-defined]
    final = CheckpointStore(run_dir).latest_valid(record=False)
    starts = [e["slurm_restarts"] for e in _kinds(run_dir, "flow_started")]
    fails = [(e["chunk"], e["failure"]) for e in _kinds(run_dir, "failure")]
    firsts = [e for e in _kinds(run_dir, "first_step") if e["time"] > requeued["time"]]
    print(
        f"Slurm: USR1 → step {requeued['saved_step']} saved in {requeued['stop_s']} s; first step of the requeued "
        f"job {firsts[0]['time'] - requeued['warned_at']:.1f} s after USR1 (Slurm's requeue hold: 6 s here); "
        f"failures {fails}; flow starts (restarts) {starts}"
    )
    assert final is not None and final.step == TOTAL and final.digest == reference[0]
    assert starts[0] == 0 and 1 in starts and starts[-1] >= 2, starts  # three allocations of job <job>
    assert any(chunk >= 2 and kind == "crash" for chunk, kind in fails), fails  # the cancelled step
    assert slurm.queue() == [] and slurm.stepds() == []
    with contextlib.suppress(AssertionError):
        _wait("the job's processes to end", lambda: not slurm.job_processes(job), 15)
    assert slurm.job_processes(job) == []  # Prefect's temporary API and every worker included
    assert_no_leftovers(run_dir)
    tags = _mlflow_tags(p["tracking"]["mlflow_uri"], run_dir)
    assert tags["slurm.job_id"] == job and tags["slurm.restarts"] == str(starts[-1]), tags  # the newest job
    assert os.path.getsize(Path(p["runs_dir"]) / f"on-slurm.slurm-{job}.out") > 0  # one log, appended


def test_the_allocation_is_read_from_slurms_environment(data_dir: Path, tmp_path: Path) -> None:
    """No job: nothing changes.  A job: its id, restarts and nodes; the nodes become the hosts of a
    multi-node run (this node first), other nodes start as job steps; too few nodes or GPUs: one line."""
    assert SlurmJob.from_env({"PATH": "/bin"}) is None
    env = {
        "SLURM_JOB_ID": "81234",
        "SLURM_RESTART_COUNT": "2",
        "SLURM_JOB_NODELIST": "gpu-a,gpu-b",
        "SLURMD_NODENAME": "gpu-b",
    }
    job = SlurmJob.from_env(env)
    assert job == SlurmJob("81234", 2, ("gpu-a", "gpu-b"), "gpu-b")
    assert job.tags() == {"slurm.job_id": "81234", "slurm.restarts": "2", "slurm.nodes": "gpu-a,gpu-b"}
    one = config(params(tmp_path, data_dir, "s"))
    assert fit_to_allocation(one, job) is one
    two = config(params(tmp_path, data_dir, "s", train={"nnodes": 2, "hosts": ["x", "y"]}))
    two = two.model_copy(update={"train": two.train.model_copy(update={"hosts": []})})
    fitted = fit_to_allocation(two, job)
    assert fitted.train.hosts == ["gpu-b", "gpu-a"] and fitted.orchestration.node_launch == SRUN_NODE_LAUNCH
    assert fitted.fingerprint() == two.fingerprint()  # the same run on any allocation's nodes
    with pytest.raises(ConfigError, match=r"has 1 node\(s\) \(gpu-a\); submit with --nodes=2"):
        fit_to_allocation(two, SlurmJob("1", 0, ("gpu-a",), "gpu-a"))
    gpus = config(params(tmp_path, data_dir, "s", train={"device": "cuda", "ranks": 4}))
    with pytest.raises(ConfigError, match=r"train.ranks = 4 but Slurm gave this node 2 GPU\(s\)"):
        fit_to_allocation(gpus, SlurmJob("1", 0, ("gpu-a",), "gpu-a", gpus_on_node=2))


def test_the_batch_script_execs_convoy_train_with_the_warning_and_requeue(data_dir: Path, tmp_path: Path) -> None:
    cfg = config(params(tmp_path, data_dir, "s", train={"device": "cuda", "ranks": 8}))
    text = sbatch_script(cfg, Path("p.yaml"), ["train.lr=0.01"], "48:00:00", 300, ["--partition=gpu"], Path("/srv/x"))
    for line in ("#SBATCH --signal=B:USR1@300", "#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --nodes=1"):
        assert line in text.splitlines(), text
    assert "#SBATCH --gpus-per-node=8" in text and "#SBATCH --partition=gpu" in text and "cd /srv/x" in text
    assert text.rstrip().endswith("-m flows.cli.main train p.yaml -S train.lr=0.01"), text
    assert text.splitlines()[-1].startswith("exec ")  # the batch shell becomes convoy train: USR1 reaches it
