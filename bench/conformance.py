"""The conformance matrix: random trials that disturb everything a run depends on, each judged
against an uninterrupted reference.

    python bench/conformance.py --trials N --seed S [--steps 40] [--json out.json]

A trial is a cell — pipeline (``map-aug``: images with random flip and crop drawn from the global
generators in ``__getitem__``; ``stream``: a stateful, worker-sharded ``IterableDataset``;
``third-party``: an HF ``datasets`` stream with ``.map`` augmentation, through convoy's adapter) × ``data.num_workers``
{0, 2} × ranks {1, 2}, plus FSDP2 cells (``train.parallel: fsdp``, 2 ranks, ``map-aug`` and
``stream`` × 0 and 2 loader workers, named ``…-r2-fsdp``) — a fault and a moment.  Faults:
SIGKILL, SIGTERM or SIGSTOP of the worker,
the newest checkpoint corrupted (then SIGKILL), the next save failing with ENOSPC, the MLflow
server killed (started again 10 s later) or frozen (SIGSTOP past convoy's 10 s client timeout),
the S3 remote (moto's server, the stand-in for AWS/MinIO) frozen, the Prefect server stopped
(started again 10 s later).  Moments: ``mid-step`` (at a drawn step), ``mid-save`` (while an
asynchronous checkpoint is being written), ``after-commit`` (within the uploader's poll of a new
``LATEST``: the upload of that checkpoint starting).

The services are real and this script's own: ``prefect server``, ``mlflow server`` and moto's
server, each in its own process group; every trial runs ``convoy train`` (the real flow) in a
subprocess with versioning to the S3 remote on.  Per cell a reference is trained once, without
faults and with tracking off.  A trial passes when

* ``convoy train`` exits 0 and its final checkpoint has the reference's digest,
* every per-step loss in ``metrics.jsonl`` equals the reference's,
* MLflow holds exactly one point per (metric, step) for every metric the worker journaled,
* no committed step was lost: every resume after a failure starts at the newest checkpoint
  committed before it (one older when the fault corrupted that one).

Trials are drawn reproducibly from ``--seed``; one line per trial (cell, fault, moment, verdict),
then the pass count per cell and the plain line ``N passed, M failed``.  Exit 1 if any failed.
Not part of the test suite's time budget (tests/test_conformance.py runs a fixed subset).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PIPELINES = {
    "map-aug": "tests.pipeline_tasks:build_cnn",
    "stream": "tests.pipeline_tasks:build_counter",
    "third-party": "tests.pipeline_tasks:build_hf_map",
}
WORKERS = (0, 2)
RANKS = (1, 2)
FAULTS = (
    "sigkill",
    "sigterm",
    "sigstop",
    "corrupt",
    "diskfull",
    "mlflow-kill",
    "mlflow-freeze",
    "s3-freeze",
    "prefect-stop",
)
MOMENTS = ("mid-step", "mid-save", "after-commit")
#: How long a service fault lasts: past convoy's MLflow client timeout (10 s) for a freeze.
OUTAGE_S = 14.0


@dataclass(frozen=True)
class Cell:
    pipeline: str
    workers: int
    ranks: int
    #: ``train.parallel``: ``fsdp`` cells shard the model with FSDP2 (2 ranks, sharded checkpoints).
    parallel: str = "ddp"

    @property
    def name(self) -> str:
        return f"{self.pipeline}-w{self.workers}-r{self.ranks}" + ("-fsdp" if self.parallel == "fsdp" else "")


@dataclass(frozen=True)
class Trial:
    number: int
    cell: Cell
    fault: str
    moment: str
    at_step: int


@dataclass
class Verdict:
    trial: Trial
    reasons: list[str] = field(default_factory=list)
    injected_step: int | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.reasons


#: The pipelines of the FSDP2 cells (2 ranks each).
FSDP_PIPELINES = ("map-aug", "stream")


def all_cells() -> list[Cell]:
    replicated = [Cell(p, w, r) for p, w, r in itertools.product(PIPELINES, WORKERS, RANKS)]
    return replicated + [Cell(p, w, 2, "fsdp") for p, w in itertools.product(FSDP_PIPELINES, WORKERS)]


def draw_trials(
    n: int, seed: int, steps: int, cells: list[str] | None = None, faults: list[str] | None = None
) -> list[Trial]:
    """``n`` trials drawn from ``seed`` alone (and the optional cell and fault filters): the same
    command lists the same trials."""
    rng = random.Random(seed)
    pool = [c for c in all_cells() if not cells or c.name in cells]
    kinds = [f for f in FAULTS if not faults or f in faults]
    if not pool or not kinds:
        raise SystemExit(
            f"no trial matches --cells {cells} --faults {faults}; cells are {[c.name for c in all_cells()]}"
        )
    return [
        Trial(i + 1, rng.choice(pool), rng.choice(kinds), rng.choice(MOMENTS), rng.randrange(3, steps * 2 // 3))
        for i in range(n)
    ]


# ---------------------------------------------------------------------------------- services
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


class Service:
    """A server in its own process group, started again on the same port and data on demand."""

    def __init__(self, name: str, cmd: Callable[[int], list[str]], health: str, home: Path, env: dict[str, str]):
        self.name, self._cmd, self.port, self.home, self.env = name, cmd, _free_port(), home, env
        self.url = f"http://127.0.0.1:{self.port}"
        self._health = health
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 240, tries: int = 3) -> None:
        """Start the server and wait until it answers.  Its port was free when this service was
        made; a server of another test started since may hold it (the server exits at once):
        then a new free port, up to ``tries`` times (CI saw moto lose that race once).  A
        restart (after a fault) keeps its port: clients know it."""
        if self.proc is not None:
            tries = 1
        for attempt in range(tries):
            log = open(self.home / f"{self.name}.log", "ab")  # noqa: SIM115 - lives as long as the server
            self.proc = subprocess.Popen(
                self._cmd(self.port), cwd=self.home, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )  # fmt: skip
            deadline = time.monotonic() + timeout_s
            while not _answers(self.url + self._health):
                if self.proc.poll() is not None and attempt + 1 < tries:
                    break  # exited before it answered: the port, most likely
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not start; see {self.home / f'{self.name}.log'}")
                time.sleep(0.5)
            else:
                return
            self.port = _free_port()
            self.url = f"http://127.0.0.1:{self.port}"

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)


class RunningService(Service):
    """A server this script did not start (``--prefect-api``): waited for, never signalled."""

    def __init__(self, name: str, url: str, health: str, home: Path) -> None:
        self.name, self.url, self._health, self.home, self.proc = name, url.rstrip("/"), health, home, None

    def start(self, timeout_s: float = 240, tries: int = 1) -> None:
        deadline = time.monotonic() + timeout_s
        while not _answers(self.url + self._health):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} at {self.url} does not answer {self._health}")
            time.sleep(0.5)


class Services:
    """Prefect, MLflow and an S3 endpoint, all this script's own; or a Prefect API already running
    (a test suite's shared server: the suite's trial went from 82-91 s to 70 s with it)."""

    def __init__(self, home: Path, prefect_api: str | None = None) -> None:
        py = Path(sys.executable).parent
        base = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_ENABLED": "false"}
        self.prefect: Service = (
            RunningService("prefect", prefect_api.rstrip("/").removesuffix("/api"), "/api/health", home)
            if prefect_api
            else Service(
                "prefect",
                lambda p: [str(py / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(p)],
                "/api/health",
                home,
                {**base, "PREFECT_HOME": str(home / "prefect-home")},
            )
        )
        self.mlflow = Service(
            "mlflow",
            lambda p: [str(py / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
                       "--host", "127.0.0.1", "--port", str(p), "--workers", "1"],
            "/health",
            home,
            {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},  # no huey jobs: unused here
        )  # fmt: skip
        self.s3 = Service(
            "s3",
            lambda p: [str(py / "moto_server"), "-H", "127.0.0.1", "-p", str(p)],
            "/moto-api/",
            home,
            dict(os.environ),
        )
        self.all = (self.prefect, self.mlflow, self.s3)

    def start(self) -> None:
        # All three at once: the setup waits for the slowest (Prefect's), not the sum; on two
        # cores they mostly compete for the CPU, so it went from ~25 s to ~23.5 s here only.
        with ThreadPoolExecutor(len(self.all)) as pool:
            list(pool.map(lambda service: service.start(), self.all))
        import boto3

        boto3.client("s3", endpoint_url=self.s3.url, **self.s3_credentials()).create_bucket(Bucket="convoy")

    @staticmethod
    def s3_credentials() -> dict[str, str]:
        return {"aws_access_key_id": "convoy", "aws_secret_access_key": "convoy-secret", "region_name": "us-east-1"}

    def env(self) -> dict[str, str]:
        """What ``convoy train`` runs with: this Prefect API, the S3 endpoint and its credentials."""
        creds = self.s3_credentials()
        return {
            **os.environ,
            "PREFECT_API_URL": f"{self.prefect.url}/api",
            "AWS_ENDPOINT_URL": self.s3.url,
            "AWS_ACCESS_KEY_ID": creds["aws_access_key_id"],
            "AWS_SECRET_ACCESS_KEY": creds["aws_secret_access_key"],
            "AWS_DEFAULT_REGION": creds["region_name"],
        }

    def stop(self) -> None:
        for service in self.all:
            service.kill()


# ---------------------------------------------------------------------------------- one trial
class Bench:
    """The services, a git + DVC project folder and the cells' references."""

    def __init__(
        self, home: Path, steps: int, log: Callable[[str], None] = print, prefect_api: str | None = None
    ) -> None:
        self.home, self.steps, self.log = home, steps, log
        self.services = Services(home, prefect_api)
        self.project = home / "project"
        self.references: dict[Cell, tuple[str, list[tuple[int, float]]]] = {}

    def setup(self) -> None:
        self.log(f"starting Prefect, MLflow and S3 (moto) servers in {self.home}")
        self.services.start()
        self.project.mkdir()
        subprocess.run(["git", "init", "-q"], cwd=self.project, check=True)
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=self.project, check=True)
        (self.project / "data").mkdir()
        from training.config import load_config
        from training.datapipe.corpus import prepare

        cfg = load_config(None, [f"data.prepared_dir={self.project / 'data'}", "data.seq_len=16"])
        prepare(cfg.data, cfg.train.seed)  # for tasks that read the corpus

    def params(self, cell: Cell, name: str, tracking: bool) -> Path:
        """The params file of one run of ``cell`` (tracking: MLflow and versioning to S3 on)."""
        p: dict[str, Any] = {
            "run_name": name,
            "runs_dir": str(self.project / "runs"),
            "task": PIPELINES[cell.pipeline],
            "task_args": {},
            "data": {"prepared_dir": str(self.project / "data"), "seq_len": 16, "num_workers": cell.workers},
            "train": {"total_steps": self.steps, "chunk_steps": self.steps // 2, "batch_size": 8, "lr": 0.05,
                      "ranks": cell.ranks, "parallel": cell.parallel},
            "checkpoint": {"every_steps": 4, "async_save": True, "keep_last": 3},
            "heartbeat": {"interval_s": 0.2, "stall_s": 6, "timeout_s": 6, "init_timeout_s": 120,
                          "save_timeout_s": 40, "grace_s": 3},
            "orchestration": {"retries": 4, "retry_delay_seconds": 0.5, "backoff": 2, "jitter": 0.1},
            "tracking": {"mlflow": tracking, "mlflow_uri": self.services.mlflow.url, "ship_drain_s": 120,
                         "dvc": tracking, "dvc_remote": f"s3://convoy/{name}"},
        }  # fmt: skip
        path = self.project / f"{name}.json"
        path.write_text(json.dumps(p))
        return path

    def train(self, params: Path, env: dict[str, str], timeout_s: float) -> subprocess.Popen[bytes]:
        log = open(params.with_suffix(".log"), "ab")  # noqa: SIM115 - kept by Popen
        cmd = [sys.executable, "-m", "flows.cli.main", "train", str(params)]
        return subprocess.Popen(
            cmd, cwd=self.project, env={**env, "PYTHONPATH": str(REPO)}, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def run_dir(self, name: str) -> Path:
        return (self.project / "runs" / name).resolve()

    def reference(self, cell: Cell) -> tuple[str, list[tuple[int, float]]]:
        """The cell's uninterrupted run (tracking off): its digest and per-step losses."""
        if cell not in self.references:
            name = f"ref-{cell.name}"
            self.log(f"reference {cell.name}: training")
            p = self.train(self.params(cell, name, tracking=False), self.services.env(), 900)
            if p.wait(timeout=900) != 0:
                raise RuntimeError(f"reference {cell.name} failed; see {self.project / (name + '.log')}")
            self.references[cell] = final_digest(self.run_dir(name)), losses(self.run_dir(name))
        return self.references[cell]

    def run(self, trial: Trial) -> Verdict:
        try:
            digest, ref_losses = self.reference(trial.cell)
        except RuntimeError as exc:  # a cell that cannot even train undisturbed fails its trials
            return Verdict(trial, [str(exc)])
        name = f"t{trial.number:04d}-{trial.cell.name}"
        run_dir = self.run_dir(name)
        flag = self.project / f".{name}.diskfull"
        env = {**self.services.env(), "CONVOY_FAULTS": f"diskfull_flag={flag}"}
        verdict = Verdict(trial)
        t0 = time.time()
        flow = self.train(self.params(trial.cell, name, tracking=True), env, 900)
        injector = Injector(self, trial, run_dir, flag, verdict)
        thread = threading.Thread(target=injector.run, name="conformance-injector", daemon=True)
        thread.start()
        try:
            code = flow.wait(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(flow.pid, signal.SIGKILL)
            code = flow.wait()
            verdict.reasons.append("timed out after 900 s")
        thread.join(timeout=OUTAGE_S + 60)
        injector.restore()
        verdict.seconds = round(time.time() - t0, 1)
        judge(verdict, code, run_dir, digest, ref_losses, self.services.mlflow.url)
        return verdict


_UNSEEN = object()


class Injector:
    """Waits for the trial's moment, then injects its fault (and ends a service outage)."""

    def __init__(self, bench: Bench, trial: Trial, run_dir: Path, flag: Path, verdict: Verdict) -> None:
        self.bench, self.trial, self.run_dir, self.flag, self.verdict = bench, trial, run_dir, flag, verdict
        self.frozen: Service | None = None

    def run(self) -> None:
        from training.heartbeat import read_heartbeat

        step = self.wait_for_moment()
        if step is None:
            self.verdict.reasons.append(f"{self.trial.moment} at step {self.trial.at_step} never came")
            return
        self.verdict.injected_step = step
        fault, services = self.trial.fault, self.bench.services
        beat = read_heartbeat(self.run_dir, 0)
        pid = beat.pid if beat else 0
        if fault in ("sigkill", "sigterm", "sigstop"):
            sig = {"sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigstop": signal.SIGSTOP}[fault]
            with contextlib.suppress(ProcessLookupError):
                _signal(pid, sig)
        elif fault == "corrupt":
            corrupt_newest(self.run_dir)
            with contextlib.suppress(ProcessLookupError):
                _signal(pid, signal.SIGKILL)
        elif fault == "diskfull":
            self.flag.touch()
        elif fault in ("mlflow-kill", "prefect-stop"):
            service = services.mlflow if fault == "mlflow-kill" else services.prefect
            service.kill()
            time.sleep(10)
            service.start()
        elif fault in ("mlflow-freeze", "s3-freeze"):
            self.frozen = services.mlflow if fault == "mlflow-freeze" else services.s3
            self.frozen.signal(signal.SIGSTOP)
            time.sleep(OUTAGE_S)
            self.restore()

    def restore(self) -> None:
        if self.frozen is not None:
            self.frozen.signal(signal.SIGCONT)
            self.frozen = None

    def wait_for_moment(self, timeout_s: float = 600) -> int | None:
        """The step at which the moment came (None: the run ended first)."""
        from training.heartbeat import read_heartbeat

        deadline = time.monotonic() + timeout_s
        checkpoints = self.run_dir / "checkpoints"
        latest = checkpoints / "LATEST"
        seen_latest: str | None | object = _UNSEEN  # LATEST may not exist yet: None is a state too
        while time.monotonic() < deadline:
            beat = read_heartbeat(self.run_dir, 0)
            step = beat.step if beat and beat.phase in ("train", "save") else -1
            if step >= self.trial.at_step:
                if self.trial.moment == "mid-step":
                    return step
                if self.trial.moment == "mid-save" and any(p.name.startswith(".tmp-") for p in _ls(checkpoints)):
                    return step
                if self.trial.moment == "after-commit":
                    now = latest.read_text() if latest.exists() else None
                    if seen_latest is not _UNSEEN and now != seen_latest:
                        return step
                    seen_latest = now
            if beat and beat.done and beat.step >= self.bench.steps:
                return None
            time.sleep(0.005)
        return None


def _signal(pid: int, sig: int) -> None:
    """Signal the worker; without a beat (pid 0) nothing: ``os.kill(0, ...)`` would signal the
    bench's own process group."""
    if pid > 0:
        os.kill(pid, sig)


def _ls(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError:
        return []


def corrupt_newest(run_dir: Path) -> None:
    """Flip one byte in the middle of the newest committed checkpoint's largest file."""
    from training.checkpointing.store import CheckpointStore

    dirs = CheckpointStore(run_dir).step_dirs()
    if not dirs:
        return
    target = max((p for p in dirs[0][1].iterdir() if p.is_file()), key=lambda p: p.stat().st_size)
    with open(target, "r+b") as fh:
        fh.seek(target.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))


# ---------------------------------------------------------------------------------- verdict
def final_digest(run_dir: Path) -> str | None:
    from training.checkpointing.store import CheckpointStore

    ck = CheckpointStore(run_dir).latest_valid(record=False)
    return ck.digest if ck else None


def losses(run_dir: Path) -> list[tuple[int, float]]:
    from training.tracking.metrics import metric_rows

    return [(s, m["loss"]) for s, m in metric_rows(run_dir)]


def judge(verdict: Verdict, code: int, run_dir: Path, digest: str, ref: list[tuple[int, float]], uri: str) -> None:
    """Append to ``verdict.reasons`` every way the trial differs from its reference."""
    reasons = verdict.reasons
    if code != 0:
        reasons.append(f"convoy train exited {code}")
    if final_digest(run_dir) != digest:
        reasons.append("final digest differs from the reference")
    got = losses(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    if got != ref:
        diff = next((a for a, b in zip(got, ref, strict=False) if a != b), None)
        reasons.append(f"per-step losses differ (first at {diff}, {len(got)} vs {len(ref)} steps)")
    reasons.extend(mlflow_differences(run_dir, uri))
    reasons.extend(lost_commits(run_dir, verdict.trial.fault == "corrupt"))


def mlflow_differences(run_dir: Path, uri: str) -> list[str]:
    """Every journaled metric must be in MLflow once per step it was journaled at."""
    from mlflow.tracking import MlflowClient

    from training.rundir import run_info
    from training.tracking.metrics import read_journal

    run_id = getattr(run_info(run_dir), "mlflow_run_id", None)
    if not run_id:
        return ["no MLflow run"]
    rows, _ = read_journal(run_dir / "metrics.jsonl")
    client = MlflowClient(uri)
    out = []
    for key in sorted({k for r in rows for k in r.metrics}):
        want = sorted({r.step for r in rows if key in r.metrics})
        have = sorted(m.step for m in client.get_metric_history(run_id, key))
        if have != want:
            dup = [s for s, n in collections.Counter(have).items() if n > 1]
            out.append(f"MLflow {key}: {len(have)} points for {len(want)} steps (duplicated: {dup[:5]})")
    return out


def lost_commits(run_dir: Path, corrupted: bool) -> list[str]:
    """A resume after a failure must start at the newest checkpoint committed before it."""
    from training.events import read_events

    events = read_events(run_dir)
    saved = sorted({int(e["step"]) for e in events if e["kind"] == "checkpoint_saved"})
    out = []
    for failure in (e for e in events if e["kind"] == "failure"):
        resumed = next((e for e in events if e["kind"] == "resumed" and e["time"] > failure["time"]), None)
        committed = failure.get("last_committed_step") or 0
        if resumed is None or committed == 0:
            continue
        floor = max([s for s in saved if s < committed], default=0) if corrupted else committed
        if int(resumed["step"]) < floor:
            out.append(f"resumed at {resumed['step']} after a failure with step {committed} committed")
    return out


# ---------------------------------------------------------------------------------- report
def line(v: Verdict) -> str:
    t = v.trial
    verdict = "pass" if v.passed else "FAIL: " + "; ".join(v.reasons)
    return (
        f"trial {t.number:4d}  {t.cell.name:22} {t.fault:13} {t.moment:12} step {v.injected_step or '-':>3}"
        f"  {v.seconds:6.1f}s  {verdict}"
    )


def summary(verdicts: list[Verdict]) -> list[str]:
    per: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for v in verdicts:
        for key in (v.trial.cell.name, f"fault {v.trial.fault}"):
            per[key][0 if v.passed else 1] += 1
    out = [f"{k:28} {p} passed, {f} failed" for k, (p, f) in sorted(per.items())]
    passed = sum(v.passed for v in verdicts)
    return [*out, f"{passed} passed, {len(verdicts) - passed} failed"]


def read_verdicts(path: Path, trials: list[Trial]) -> list[Verdict]:
    """The verdicts an earlier, cut-short run of the same draw wrote to ``path`` (``--resume``):
    trials are drawn from the seed alone, so a trial with the same number, cell, fault, moment and
    step is the same trial and is not run again.  Refuses a file of another draw."""
    by_number = {t.number: t for t in trials}
    out = []
    for raw in json.loads(path.read_text()):
        t = raw["trial"]
        trial = Trial(t["number"], Cell(**t["cell"]), t["fault"], t["moment"], t["at_step"])
        if by_number.get(trial.number) != trial:
            raise SystemExit(f"{path}: trial {trial.number} is not this draw's (another --seed or --steps?)")
        out.append(Verdict(trial, raw["reasons"], raw["injected_step"], raw["seconds"]))
    return out


def write_verdicts(path: Path, verdicts: list[Verdict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps([{**asdict(v), "passed": v.passed} for v in verdicts], indent=1))
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=40, help="steps per run (two chunks)")
    ap.add_argument("--json", type=Path, help="write every verdict here")
    ap.add_argument("--resume", action="store_true", help="skip the trials --json already holds (same draw)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (servers' logs, runs)")
    ap.add_argument("--cells", nargs="*", help="draw only from these cells (e.g. map-aug-w0-r1)")
    ap.add_argument("--faults", nargs="*", choices=FAULTS, help="draw only these faults")
    ap.add_argument(
        "--prefect-api",
        help="use this running Prefect API (e.g. http://127.0.0.1:4200/api), not one of the bench's own",
    )
    args = ap.parse_args(argv)
    if args.prefect_api and (args.faults is None or "prefect-stop" in args.faults):
        ap.error("--prefect-api needs --faults without prefect-stop: that fault stops the bench's own Prefect server")
    trials = draw_trials(args.trials, args.seed, args.steps, args.cells, args.faults)
    home = Path(tempfile.mkdtemp(prefix="convoy-conformance-"))
    bench = Bench(home, args.steps, prefect_api=args.prefect_api)
    verdicts = read_verdicts(args.json, trials) if args.resume and args.json and args.json.exists() else []
    done = {v.trial.number for v in verdicts}
    for v in verdicts:
        print(line(v) + "  (earlier run)", flush=True)
    try:
        bench.setup()
        for trial in (t for t in trials if t.number not in done):
            verdicts.append(bench.run(trial))
            print(line(verdicts[-1]), flush=True)
            if args.json:  # after every trial: a run of hours that is cut short still has its record
                write_verdicts(args.json, verdicts)
    finally:
        bench.services.stop()
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    for text in summary(verdicts):
        print(text)
    return 0 if all(v.passed for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
