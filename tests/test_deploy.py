"""Deployments end to end: ``prefect deploy`` of the real ``prefect.yaml``, real process workers.

Against the session's ``prefect server`` on 127.0.0.1: work pools are created with the CLI, both
deployments are deployed, one process worker serves pool ``convoy`` (parent flows) and two serve
pool ``gpu`` (chunk flows, ``orchestration.mode: pool``).  The training worker of chunk 2 is
SIGKILLed: that chunk flow run fails and the parent re-runs the chunk as a *new* flow run, which
resumes from the newest checkpoint.  Slow (process start-up dominates), one test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.flow_util import CHUNK, REPO, assert_no_leftovers, config, params, stop_group, wait_for_step
from training.events import read_events

pytestmark = pytest.mark.slow
PREFECT = str(Path(sys.executable).parent / "prefect")


def prefect_cli(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([PREFECT, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"prefect {' '.join(args)}: {out.stdout[-2000:]} {out.stderr[-2000:]}"
    return out


def test_deploy_and_pool_mode_rerun_chunk_as_new_flow_run(
    prefect_api: str, data_dir: Path, tmp_path: Path, reference_digest: str
) -> None:
    env = {
        **os.environ,
        "PWD": str(REPO),
        "PREFECT_API_URL": prefect_api,
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
        "CONVOY_FAULTS": "step_delay=0.03",  # chunks last several heartbeats: the killer cannot miss chunk 2
    }
    for pool in ("convoy", "gpu"):
        prefect_cli("work-pool", "create", pool, "--type", "process", "--overwrite", env=env)
    # One chunk per GPU slot: a failed chunk's slot must be released for its re-run (no deadlock).
    prefect_cli("concurrency-limit", "create", "gpu", "1", env=env)
    out = prefect_cli("--no-prompt", "deploy", "--all", env=env)
    assert "train/nightly" in out.stdout and "train-chunk/gpu" in out.stdout, out.stdout
    from prefect.client.orchestration import get_client

    from flows.flow_liveness import CRASH_NAME, RESTART_NAME, ensure_liveness_automations

    with pytest.raises(ValueError, match="must exceed the flow heartbeat period"):
        ensure_liveness_automations("train/nightly", within_s=30)
    first_ids = ensure_liveness_automations("train/nightly")
    ids = ensure_liveness_automations("train/nightly")  # replaces, never duplicates
    assert len(ids) == 2 and set(ids).isdisjoint(first_ids)
    with get_client(sync_client=True) as client:
        for name in (CRASH_NAME, RESTART_NAME):
            found = client.read_automations_by_name(name=f"{name} (train/nightly)")
            assert len(found) == 1 and found[0].enabled and str(found[0].id) in ids
            # The restart automation would re-run this test's deployment after a deliberate crash.
            client.delete_automation(found[0].id)

    p = params(
        tmp_path,
        data_dir,
        "pooled",
        orchestration={"mode": "pool", "pool": "gpu", "retries": 2, "retry_delay_seconds": 0.5},
    )
    pfile = tmp_path / "params.yaml"
    pfile.write_text(yaml.safe_dump(p))
    run_dir = config(p).run_dir.resolve()

    workers = []
    try:
        for pool, name in (("convoy", "parent"), ("gpu", "gpu-a"), ("gpu", "gpu-b")):
            log = open(tmp_path / f"worker-{name}.log", "wb")  # noqa: SIM115
            workers.append(
                subprocess.Popen(
                    [PREFECT, "worker", "start", "--pool", pool, "--name", name],
                    cwd=REPO,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        killed: dict[str, int] = {}

        def killer() -> None:
            beat = wait_for_step(run_dir, CHUNK + 8, timeout=400)
            killed["step"] = beat.step
            os.kill(beat.pid, signal.SIGKILL)

        t = threading.Thread(target=killer, daemon=True)
        t.start()
        t0 = time.time()
        run = subprocess.run(
            [PREFECT, "deployment", "run", "train/nightly", "--params", json.dumps({"params": str(pfile)}), "--watch"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=540,
        )
        print(f"\ndeployment run took {time.time() - t0:.1f} s")
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        t.join(timeout=5)
        assert killed, "the chunk-2 worker was never killed"
    finally:
        for w in workers:
            stop_group(w)

    done = [e["chunk"] for e in read_events(run_dir, "chunk_done")]
    assert done == [1, 2, 3], done
    reruns = read_events(run_dir, "chunk_flow_run_failed")
    assert [(e["chunk"], e["failure"]) for e in reruns] == [(2, "killed")]

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="pooled-chunk-")))
    by_name = {r.name: r.state.type.value for r in runs}
    assert by_name == {
        "pooled-chunk-1-attempt-1": "COMPLETED",
        "pooled-chunk-2-attempt-1": "FAILED",
        "pooled-chunk-2-attempt-2": "COMPLETED",
        "pooled-chunk-3-attempt-1": "COMPLETED",
    }, by_name
    assert reruns[0]["flow_run_id"] != next(r.id for r in runs if r.name == "pooled-chunk-2-attempt-2").hex
    from training.checkpointing.store import CheckpointStore

    ck = CheckpointStore(run_dir).latest_valid(record=False)
    assert ck is not None and ck.step == 3 * CHUNK and ck.digest == reference_digest
    assert_no_leftovers(run_dir)
