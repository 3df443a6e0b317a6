"""``convoy chaos`` end to end: every fault kind through the real flow, against a real Prefect API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chaos_params(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("chaos")
    params = {
        "run_name": "chaos",
        "runs_dir": str(d / "runs"),
        "data": {"prepared_dir": str(d / "data"), "synthetic_chars": 60000, "seq_len": 32},
        "task_args": {"d_model": 32, "n_head": 2},
        "train": {"total_steps": 300, "chunk_steps": 50, "batch_size": 8, "warmup_steps": 5},
        "checkpoint": {"every_steps": 10, "keep_last": 2},
        "heartbeat": {"interval_s": 0.2, "stall_s": 4, "timeout_s": 4, "grace_s": 2},
        "orchestration": {"retries": 3, "retry_delay_seconds": 0.2},
        "tracking": {"mlflow": False},
    }
    path = d / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    subprocess.run([sys.executable, "-m", "flows.cli.main", "prepare", str(path)], check=True, timeout=120)
    return path


def chaos(params: Path, api: str, *args: str) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "flows.cli.main", "chaos", str(params), "--json", *args],
        capture_output=True,
        text=True,
        timeout=1500,
        env={**os.environ, "PREFECT_API_URL": api},
    )
    print(proc.stderr[-3000:])
    return proc.returncode, json.loads(proc.stdout)


def test_every_fault_kind_is_survived(chaos_params: Path, prefect_api: str) -> None:
    code, report = chaos(chaos_params, prefect_api, "--faults", "all", "--seed", "3")
    for f in report["faults"]:
        print(
            f"{f['kind']:9s} step {f['injected_step']}: {f['detected_as']} after {f['detected_after_s']} s, "
            f"lost {f['steps_lost']}, recovered in {f['recovery_s']} s; {f['note']}"
        )
    print("goodput", report["goodput"], "wall", report["wall_s"], "flow exit", report["exit_code"])
    print("\n".join(report["diagnosis"]))  # why the flow ended early, if it did
    assert {f["kind"] for f in report["faults"]} == {
        "kill",
        "term",
        "hang",
        "slow",
        "corrupt",
        "delete",
        "diskfull",
        "flowkill",
    }
    assert all(f["survived"] for f in report["faults"]), report["faults"]
    detected = {f["kind"]: f["detected_as"] for f in report["faults"]}
    assert detected["hang"] == "hang" and detected["term"] == "preempted" and detected["kill"] == "killed"
    assert detected["slow"] == "no failure (correct)" and detected["diskfull"] == "diskfull"
    assert report["final_digest"] == report["reference_digest"]
    assert report["metrics_exactly_once"]
    assert code == 0 and report["survived"]
    check_prefect_artifacts(chaos_params.parent / "runs" / "chaos-chaos")


def check_prefect_artifacts(run_dir: Path) -> None:
    """Issue 31: every flow run of the chaos run has a chunks table (the one the flowkill took
    over too) and there is one failures artifact per failure, preemptions and the orphan
    included."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.artifacts import artifact_key
    from training.events import read_events
    from training.rundir import load_run_config

    name = load_run_config(run_dir).run_name
    flows = {e["flow_run_id"] for e in read_events(run_dir, "flow_started")}
    failures = read_events(run_dir, "failure")
    with get_client(sync_client=True) as client:

        def versions(what: str) -> list:
            wanted = ArtifactFilter(key=ArtifactFilterKey(any_=[artifact_key(name, what)]))
            return client.read_artifacts(artifact_filter=wanted)

        tables, notes = versions("chunks"), versions("failures")
    assert len(flows) >= 2 and flows <= {str(a.flow_run_id) for a in tables}, (flows, tables)
    assert len(notes) == len(failures), ([f["failure"] for f in failures], [a.description for a in notes])


def test_without_retries_a_fault_is_not_survived(chaos_params: Path, prefect_api: str) -> None:
    code, report = chaos(chaos_params, prefect_api, "--faults", "kill", "-S", "orchestration.retries=0")
    assert code == 1 and not report["survived"]
    assert report["exit_code"] != 0
    assert report["final_digest"] != report["reference_digest"]
    # The report says why: the flow's own last words and the failure it recorded.
    assert any(line.startswith("flow: ") for line in report["diagnosis"]), report["diagnosis"]
    assert any('"failure": "killed"' in line for line in report["diagnosis"]), report["diagnosis"]
