"""The orchestrator is wrong, training is not (issue 45, item 6).

Prefect's server says a live flow run, and the chunk task run inside it, Crashed (what its
liveness automation does when heartbeats are suppressed, e.g. a network partition; here set
through the API, forced).  The flow must not stop training or lose anything, no second worker may
train the same steps (a second flow is refused by the run's lock), and the audit must say what
happened.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tests.flow_util import REPO, TOTAL, config, params, stop_group, wait_for_step
from training.events import read_events

pytestmark = pytest.mark.slow


def _crash_through_the_api(flow_run_id: str) -> list[str]:
    """Force the flow run and its running task runs to Crashed, as the liveness automation
    would; the ids of the task runs it crashed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Crashed(message="test: no heartbeat"), force=True)
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        running = [str(t.id) for t in runs if t.state is None or not t.state.is_final()]
        for task_run_id in running:
            client.set_task_run_state(uuid.UUID(task_run_id), Crashed(message="test: no heartbeat"), force=True)
    return running


def test_a_live_flow_marked_crashed_by_prefect_trains_on_and_nothing_is_trained_twice(
    prefect_api: str, data_dir: Path, tmp_path: Path, reference_digest: str
) -> None:
    import os

    p = params(tmp_path, data_dir, "marked", heartbeat={"stall_s": 60})
    pfile = tmp_path / "params.yaml"
    pfile.write_text(yaml.safe_dump(p))
    run_dir = config(p).run_dir.resolve()
    cmd = [sys.executable, "-m", "flows.cli.main", "train", str(pfile)]
    stall = tmp_path / "stall"  # made below: one step stalls 25 s while Prefect says Crashed
    env = {**os.environ, "CONVOY_FAULTS": f"step_delay=0.05,slow_flag={stall}:25"}
    first = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        wait_for_step(run_dir, 25)  # inside chunk 2
        stall.touch()
        (started,) = read_events(run_dir, "flow_started")
        crashed_tasks = _crash_through_the_api(started["flow_run_id"])
        assert crashed_tasks, "no running task run to crash"
        second = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "already being trained by another flow" in second.stderr, second.stderr
        out, err = first.communicate(timeout=600)
    finally:
        if first.poll() is None:
            stop_group(first, check=False)
    assert first.returncode == 0, err[-3000:]
    from training.checkpointing.store import CheckpointStore

    final = CheckpointStore(run_dir).latest_valid(record=False)
    assert final is not None and final.step == TOTAL and final.digest == reference_digest
    assert [e["chunk"] for e in read_events(run_dir, "chunk_done")] == [1, 2, 3]
    workers = [e for e in read_events(run_dir) if e["kind"] in ("started", "resumed")]
    assert len(workers) == 1, workers  # one pipelined worker trained every step, none twice
    (marked,) = read_events(run_dir, "flow_marked_while_alive")  # the audit says what happened
    assert (marked["flow_run_id"], marked["state"]) == (started["flow_run_id"], "CRASHED"), marked
    assert "Prefect marks this live flow run CRASHED" in err, err[-3000:]
