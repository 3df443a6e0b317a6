"""A whole job killed and relaunched by itself: kill → crashed → new flow run → first step (issue 30 item 4).

README's deployment set-up, for real: a ``prefect server`` (fresh, in a temporary PREFECT_HOME),
work pool ``convoy``, ``prefect deploy`` of ``prefect.yaml``, ``convoy prefect-setup`` (the
flow-liveness automations), one ``prefect worker start --pool convoy``, then ``prefect deployment
run train/nightly``.  Once the run trains, the flow-run process (the Prefect worker's child) and the
training worker are SIGKILLed together, ``--kills`` times, each time once the relaunched run trains
again.  Nothing else is done by hand: the Prefect worker marks the flow run Crashed, the restart
automation runs the deployment again, the worker picks it up and the new flow resumes.

Per kill, seconds after the SIGKILL:

* crashed     the flow run's Crashed state (the Prefect worker saw its child die)
* scheduled   the new flow run exists (the automation ran the deployment)
* running     the new flow run is Running (the worker polled, started its process, the engine began)
* flow        the new flow's ``flow_started`` event (its process imported convoy, took the run lock)
* restored    the resumed worker's state is loaded (its ``resumed`` event)
* first_step  the first training step after the kill is done (goal: <= 5 s on every kill)

    .venv/bin/python bench/relaunch.py [--kills 5] [--prefect-defaults]

``--prefect-defaults`` runs the worker without the settings convoy ships (the baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.flow_util import flow_run_processes  # noqa: E402
from training.events import Event, read_events  # noqa: E402
from training.heartbeat import read_heartbeat  # noqa: E402

BIN = Path(sys.executable).parent
RUN = {
    "run_name": "relaunch",
    "train": {"total_steps": 100000, "chunk_steps": 400},
    "checkpoint": {"every_steps": 10},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(env: dict[str, str], *args: str) -> str:
    out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise SystemExit(f"{' '.join(args)} failed: {out.stdout[-1500:]} {out.stderr[-1500:]}")
    return out.stdout


def start(env: dict[str, str], log: Path, *args: str) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_health(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return
        time.sleep(0.3)
    raise SystemExit(f"no Prefect API at {url}")


def wait_training(run_dir: Path, after: float, timeout: float = 300) -> Any:
    """The first heartbeat in phase train written after ``after`` (a worker that trains now)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beat = read_heartbeat(run_dir, 0)
        if beat and beat.phase == "train" and beat.time > after and psutil.pid_exists(beat.pid):
            return beat
        time.sleep(0.02)
    raise SystemExit(f"no training step in {run_dir} for {timeout} s")


def flow_runs(api: str) -> list[Any]:
    from prefect.client.orchestration import get_client

    os.environ["PREFECT_API_URL"] = api
    with get_client(sync_client=True) as client:
        return client.read_flow_runs()


def state_time(run: Any, name: str) -> float | None:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for s in client.read_flow_run_states(run.id):
            if s.name == name:
                return s.timestamp.timestamp()
    return None


def one_kill(run_dir: Path, worker: subprocess.Popen, api: str, spy: str | None = None) -> dict[str, Any]:
    """Kill the flow process and the training worker; the timeline of the relaunch.  ``spy``:
    a ``py-spy`` binary that samples the Prefect worker and its children through the relaunch."""
    beat = wait_training(run_dir, time.time() + 1.5)  # a few steps into the (re)launched run
    if spy:
        out = run_dir.parent.parent / f"spy-{int(time.time())}.txt"
        cmd = [spy, "record", "--pid", str(worker.pid), "--subprocesses", "--duration", "14", "--rate", "250"]
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        subprocess.Popen([*cmd, "--format", "raw", "-o", str(out)], **quiet)
        time.sleep(1.0)
    flows = flow_run_processes(worker.pid, beat.pid)
    before = {r.id for r in flow_runs(api)}
    t = time.time()
    for pid in (beat.pid, *flows):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    new_beat = wait_training(run_dir, t)
    runs = flow_runs(api)
    new = [r for r in runs if r.id not in before]
    killed = [r for r in runs if r.id in before and r.state_name == "Crashed"]
    crashed_t = max((state_time(r, "Crashed") or 0.0) for r in killed) if killed else None
    resumed = [e for e in read_events(run_dir, Event.RESUMED) if e["time"] > t]
    first = [e for e in read_events(run_dir, Event.FIRST_STEP) if e["time"] > t]
    started = [e for e in read_events(run_dir, Event.FLOW_STARTED) if e["time"] > t]
    row: dict[str, Any] = {
        "killed": len(flows) + 1,
        "killed_step": beat.step,
        "resumed_step": resumed[0].get("step") if resumed else None,
        "crashed": crashed_t - t if crashed_t else None,
        "scheduled": new[0].created.timestamp() - t if new else None,
        "running": (state_time(new[0], "Running") or t) - t if new else None,
        "flow": started[0]["time"] - t if started else None,
        "restored": resumed[0]["time"] - t if resumed else None,
        "first_step": first[0]["time"] - t if first else new_beat.time - t,
    }
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def set_up(env: dict[str, str], api: str, root: Path, procs: list[subprocess.Popen]) -> Path:
    """README's deployment set-up on a fresh server; returns the run's params file."""
    port = api.rsplit(":", 1)[1].split("/")[0]
    procs.append(
        start(env, root / "server.log", str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", port)
    )
    wait_health(api)
    for pool in ("convoy", "gpu"):
        cli(env, str(BIN / "prefect"), "work-pool", "create", pool, "--type", "process", "--overwrite")
    cli(env, str(BIN / "prefect"), "--no-prompt", "deploy", "--all")
    cli(env, str(BIN / "convoy"), "prefect-setup")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params.update(RUN, runs_dir=str(root / "runs"))
    params["data"]["prepared_dir"] = str(root / "data")
    pfile = root / "params.yaml"
    pfile.write_text(yaml.safe_dump(params))
    cli(env, str(BIN / "convoy"), "prepare", str(pfile))
    return pfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--prefect-defaults", action="store_true", help="no convoy Prefect settings (baseline)")
    ap.add_argument("--spy", help="a py-spy binary: sample the relaunch (files spy-*.txt beside the runs)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="convoy-relaunch-"))
    api = f"http://127.0.0.1:{free_port()}/api"
    env = {
        **os.environ,
        "PWD": str(REPO),
        "PREFECT_HOME": str(root / "prefect"),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "false",
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
    }
    if args.prefect_defaults:  # Prefect's default poll (over the project's prefect.toml), no flow server
        env["PREFECT_WORKER_QUERY_SECONDS"] = "10"
    os.environ.update({k: env[k] for k in ("PREFECT_HOME", "PREFECT_API_URL")})
    procs: list[subprocess.Popen] = []
    try:
        pfile = set_up(env, api, root, procs)
        plain = [str(BIN / "prefect"), "worker", "start"]
        how = plain if args.prefect_defaults else [str(BIN / "convoy"), "prefect-worker"]
        worker = start(env, root / "worker.log", *how, "--pool", "convoy")
        procs.append(worker)
        t0 = time.time()
        run = [str(BIN / "prefect"), "deployment", "run", "train/nightly"]
        cli(env, *run, "--params", json.dumps({"params": str(pfile)}))
        run_dir = next((root / "runs").glob("relaunch@*")) if (root / "runs").exists() else None
        while run_dir is None:
            time.sleep(0.2)
            run_dir = next((root / "runs").glob("relaunch@*"), None) if (root / "runs").exists() else None
        first = wait_training(run_dir, t0)
        print(json.dumps({"first_launch_to_step_s": round(first.time - t0, 3)}))
        rows = []
        for _ in range(args.kills):
            rows.append(one_kill(run_dir, worker, api, args.spy))
            print(json.dumps(rows[-1]), flush=True)
        steps = sorted(r["first_step"] for r in rows)
        print(f"kill -> first new step: min {steps[0]:.2f} s, median {steps[len(steps) // 2]:.2f} s, "
              f"max {steps[-1]:.2f} s over {len(steps)} kills (goal <= 5 s on every kill)")  # fmt: skip
    finally:
        for p in reversed(procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=15)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        print(f"logs in {root}")


if __name__ == "__main__":
    main()
