"""The fault drill behind ``convoy chaos``: a real training run through the real flow, with real
faults injected.  Not a flow itself: it drives flow ``train`` in subprocesses and injects the
faults from outside, as a failing machine would.

The seeds' acceptance test — kill -9 the training mid-run and check it comes back by itself near
where it died — generalised to every failure convoy claims to survive.  Two runs are made from
the same params: ``<run_name>-reference`` (fault-free, reused when already complete) and
``<run_name>-chaos`` (fresh), in which the faults are injected at seeded random steps:

=========  =================================================================================
kill       SIGKILL the worker
term       SIGTERM the worker (preemption: emergency checkpoint, exit 75, re-submitted at once)
hang       SIGSTOP the worker (the supervisor must see no step progress and kill it)
slow       one step stalls for half of ``heartbeat.stall_s`` (must *not* be called a hang)
corrupt    flip a byte in the newest checkpoint, then SIGKILL (resume must skip it)
delete     remove the newest checkpoint directory, then SIGKILL (resume from an older one)
diskfull   the next save fails with ENOSPC — an injected writer error (CONVOY_FAULTS
           ``diskfull_flag``), not a size-capped filesystem
flowkill   SIGKILL the flow process itself (and its Prefect API), then run ``convoy train`` again
=========  =================================================================================

The verdict: the chaos run's final state digest equals the reference's, every (metric, step) was
logged exactly once, and goodput with its badput by bucket (:mod:`training.tracking.goodput`: the
time of the steps the run kept over its wall-clock from its first flow start; ``wall_s`` here is
the drill's own, Prefect's first start-up included).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from training.checkpointing.store import CheckpointStore
from training.config import RunConfig, load_config
from training.event_records import EventLog, Resumed, read_records
from training.events import Phase
from training.heartbeat import read_heartbeat
from training.paths import RunPaths
from training.rundir import keyed_config
from training.tracking.failure_record import RecordedFailure
from training.tracking.goodput import run_goodput
from training.tracking.metrics import read_metric_lines
from training.tracking.resume_audit import analyse, steps_lost

FAULT_KINDS = ("kill", "term", "hang", "slow", "corrupt", "delete", "diskfull", "flowkill")


@dataclass
class Fault:
    kind: str
    at_step: int
    injected_at: float | None = None
    injected_step: int | None = None
    detected_as: str | None = None
    detected_after_s: float | None = None
    steps_lost: int | None = None
    recovery_s: float | None = None
    survived: bool | None = None
    note: str = ""


@dataclass
class ChaosReport:
    faults: list[Fault] = field(default_factory=list)
    reference_digest: str | None = None
    final_digest: str | None = None
    final_step: int = 0
    metrics_exactly_once: bool = False
    #: :mod:`training.tracking.goodput` of the chaos run: its kept step time over its wall-clock
    #: (from its first ``flow_started``), and the rest by badput bucket
    goodput: float | None = None
    badput_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    exit_code: int | None = None
    #: Why the flow ended without finishing the run: its last output lines and the run's last
    #: audit events (empty when it finished).  A fault not survived must be explainable.
    diagnosis: list[str] = field(default_factory=list)

    @property
    def survived(self) -> bool:
        return (
            self.exit_code == 0
            and self.final_digest is not None
            and self.final_digest == self.reference_digest
            and self.metrics_exactly_once
            and all(f.survived for f in self.faults)
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "survived": self.survived}


def parse_faults(spec: str) -> list[str]:
    kinds = [k.strip() for k in spec.split(",") if k.strip()]
    if kinds == ["all"]:
        return list(FAULT_KINDS)
    bad = [k for k in kinds if k not in FAULT_KINDS]
    if bad or not kinds:
        raise ValueError(f"--faults {spec!r}: unknown fault(s) {bad}; choose from {', '.join(FAULT_KINDS)} or all")
    return kinds


def plan_faults(kinds: list[str], total_steps: int, seed: int) -> list[Fault]:
    """Distinct, seeded steps spread over the early-middle of the run, in the order given."""
    rng = random.Random(seed)
    # Faults are injected one at a time, each once the previous one recovered, so the actual
    # steps drift later than planned: plan them in the first 60 % to leave room for the drift.
    lo, hi = max(2, total_steps // 10), max(3, total_steps * 6 // 10)
    slots = sorted(rng.sample(range(lo, hi), len(kinds))) if hi - lo >= len(kinds) else list(range(lo, lo + len(kinds)))
    return [Fault(kind, step) for kind, step in zip(kinds, slots, strict=True)]


def failure_steps_lost(failure: RecordedFailure, audit_rows: list[dict[str, Any]]) -> int | None:
    """Steps lost by one failure as the audit counts them (training/tracking/resume_audit.py: the resume row that
    followed it, the same figure as MLflow's resume table and `convoy status`), else the failure
    event's own figure when no worker resumed after it."""
    row = next((r for r in audit_rows if r.get("failure_time") == failure.time), None)
    return row["lost_steps"] if row is not None else failure.details.steps_lost


class ChaosRunner:
    def __init__(
        self, params: Path, overrides: list[str], kinds: list[str], seed: int, log: Any = print, timeout_s: float = 1800
    ) -> None:
        self.params, self.overrides, self.seed, self.log, self.timeout_s = params, overrides, seed, log, timeout_s
        base = load_config(params, overrides)
        # The directories the runs really train in (runs/<name>@<fp8> under on_config_change:
        # new_run): the fault flags must be in the run directory the worker watches.
        self.ref_cfg = keyed_config(load_config(params, [*overrides, f"run_name={base.run_name}-reference"]))
        self.cfg = keyed_config(load_config(params, [*overrides, f"run_name={base.run_name}-chaos"]))
        self.faults = plan_faults(kinds, self.cfg.train.total_steps, seed)
        self.run_dir = self.cfg.run_dir
        self.flag = (self.run_dir / ".fault-diskfull").resolve()
        self.slow_flag = (self.run_dir / ".fault-slow").resolve()
        self.slow_s = self.cfg.heartbeat.stall_s / 2
        self.env = {
            **os.environ,
            "CONVOY_FAULTS": f"diskfull_flag={self.flag},slow_flag={self.slow_flag}:{self.slow_s}",
        }

    # ------------------------------------------------------------------ processes
    def _train_cmd(self, cfg: RunConfig) -> list[str]:
        cmd = [sys.executable, "-m", "flows.cli.main", "train", str(self.params)]
        for o in [*self.overrides, f"run_name={cfg.run_name}"]:
            cmd += ["-S", o]
        return cmd

    @staticmethod
    def _log_path(cfg: RunConfig) -> Path:
        """The output of every ``convoy train`` this runner started for ``cfg`` (appended)."""
        return Path(cfg.runs_dir) / f"{cfg.run_name}.chaos.log"

    def _start(self, cfg: RunConfig, env: dict[str, str] | None = None) -> subprocess.Popen:
        logf = open(self._log_path(cfg), "a")  # noqa: SIM115 - kept by Popen
        return subprocess.Popen(
            self._train_cmd(cfg),
            stdout=logf,
            stderr=subprocess.STDOUT,
            env=env or dict(os.environ),
            start_new_session=True,
        )

    @staticmethod
    def _killpg(p: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass

    def reference(self) -> str:
        store = CheckpointStore(self.ref_cfg.run_dir) if RunPaths(self.ref_cfg.run_dir).checkpoints.exists() else None
        ck = store.latest_valid(record=False) if store else None
        if ck is None or ck.step != self.ref_cfg.train.total_steps:
            self.log(f"reference run {self.ref_cfg.run_name}: training fault-free")
            Path(self.ref_cfg.runs_dir).mkdir(parents=True, exist_ok=True)
            p = self._start(self.ref_cfg)
            if p.wait(timeout=self.timeout_s) != 0:
                raise RuntimeError(f"reference run failed (exit {p.returncode}); see {self._log_path(self.ref_cfg)}")
            ck = CheckpointStore(self.ref_cfg.run_dir).latest_valid(record=False)
        else:
            self.log(f"reference run {self.ref_cfg.run_name}: reusing its final checkpoint")
        assert ck is not None
        return ck.digest

    # ------------------------------------------------------------------ injection
    def _worker_pid(self) -> int | None:
        hb = read_heartbeat(self.run_dir, 0)
        return hb.pid if hb and not hb.done else None

    def _signal_worker(self, sig: int) -> bool:
        pid = self._worker_pid()
        if pid is None:
            return False
        try:
            os.kill(pid, sig)
            return True
        except ProcessLookupError:
            return False

    def _inject(self, fault: Fault, flow: subprocess.Popen) -> subprocess.Popen:
        store = CheckpointStore(self.run_dir)
        newest = store.step_dirs()[0][1] if store.step_dirs() else None
        if fault.kind == "kill":
            self._signal_worker(signal.SIGKILL)
        elif fault.kind == "term":
            self._signal_worker(signal.SIGTERM)
        elif fault.kind == "hang":
            self._signal_worker(signal.SIGSTOP)
        elif fault.kind == "slow":
            self.slow_flag.touch()
            fault.note = f"the next step stalls {self.slow_s:g} s (injected in the worker)"
        elif fault.kind in ("corrupt", "delete"):
            if newest is None:
                fault.note = "no checkpoint yet to damage"
            elif fault.kind == "corrupt":
                target = newest / "state.safetensors"
                with open(target, "r+b") as fh:  # bit rot in place: same size, one byte flipped
                    fh.seek(target.stat().st_size // 2)
                    byte = fh.read(1)
                    fh.seek(-1, os.SEEK_CUR)
                    fh.write(bytes([byte[0] ^ 0xFF]))
                fault.note = f"flipped a byte in {newest.name}"
            else:
                shutil.rmtree(newest)
                fault.note = f"deleted {newest.name}"
            self._signal_worker(signal.SIGKILL)
        elif fault.kind == "diskfull":
            self.flag.touch()
            fault.note = "next save fails with ENOSPC (injected writer error)"
        elif fault.kind == "flowkill":
            self._killpg(flow)
            flow.wait()
            self.log("flow process killed; starting `convoy train` again")
            flow = self._start(self.cfg, self.env)
        return flow

    def _wait_for_step(self, step: int, flow: subprocess.Popen, deadline: float) -> int | None:
        while time.time() < deadline and flow.poll() is None:
            hb = read_heartbeat(self.run_dir, 0)
            if hb and hb.phase == Phase.TRAIN and hb.step >= step:
                return hb.step
            time.sleep(0.02)
        return None

    def _wait_for_recovery(self, fault: Fault, flow: subprocess.Popen, deadline: float) -> None:
        """One fault at a time: the next is injected only once this one was detected and the run
        resumed (a slow step: once the worker took the stall and trained the step after it).
        Otherwise two faults overlap and neither is measured — e.g. a flowkill orphaning the
        worker that would hit the ENOSPC, or a kill landing in the slow step's scoring window."""
        if fault.kind == "slow":
            done = Path(f"{self.slow_flag}.done")
            while time.time() < deadline and flow.poll() is None and not done.exists():
                time.sleep(0.02)
            if done.exists():
                stalled = json.loads(done.read_text())
                fault.note = f"step {stalled['step']} stalled {stalled['seconds']:.2f} s"
                fault.detected_after_s = None
                self._wait_for_step(int(stalled["step"]) + 1, flow, deadline)
            return
        while time.time() < deadline and flow.poll() is None:
            resumed = [
                e for e in read_records(self.run_dir, Resumed) if e.on_rank0 and e.time >= (fault.injected_at or 0)
            ]
            if resumed:
                return
            time.sleep(0.1)

    # ------------------------------------------------------------------ verdict
    def _score(self, report: ChaosReport) -> None:
        log = EventLog.read(self.run_dir)
        audit_rows = analyse(log).rows  # the same rows as MLflow's resume table
        failures = log.of(RecordedFailure)
        resumes = [e for e in log.of(Resumed) if e.on_rank0]
        rows = [{"step": s, "metrics": m} for s, m in read_metric_lines(RunPaths(self.run_dir).metrics)]
        # Each failure belongs to one fault: the first fault injected before it that has none yet.
        # A recovery takes a fraction of a second now, so the next fault can follow the previous
        # failure closer than any fixed tolerance, and must not be scored with it.
        unclaimed = list(failures)
        for f in report.faults:
            if f.injected_at is None:
                f.survived = False
                f.note = f.note or "never injected (the run ended or failed before this step)"
                continue
            nxt = next((e for e in unclaimed if e.time >= f.injected_at - 0.5), None)
            if f.kind == "slow":
                later = [g.injected_at for g in report.faults if g.injected_at and g.injected_at > f.injected_at]
                end = min([*later, f.injected_at + self.slow_s + self.cfg.heartbeat.stall_s + 5])
                window = [e for e in unclaimed if f.injected_at - 0.5 <= e.time < end]
                delivered = Path(f"{self.slow_flag}.done").exists()
                f.survived = not window and delivered
                f.detected_as = window[0].kind if window else "no failure (correct)"
                if not delivered:
                    f.note = "no step stalled: the slow fault was not delivered"
                continue
            if f.kind == "flowkill":
                nxt = None
            if nxt is not None:
                unclaimed = unclaimed[unclaimed.index(nxt) + 1 :]
                f.detected_as, f.detected_after_s = nxt.kind, nxt.details.detected_after_s
                f.steps_lost = failure_steps_lost(nxt, audit_rows)
            res = next((e for e in resumes if e.time >= f.injected_at), None)
            f.recovery_s = round(res.time - f.injected_at, 2) if res else None
            if f.kind == "flowkill" and res:
                f.detected_as = "flow restarted"
                f.steps_lost = steps_lost(f.injected_step, res.resumed_from)
            f.survived = res is not None or report.final_step == self.cfg.train.total_steps
        steps = [r["step"] for r in rows]
        total = self.cfg.train.total_steps
        report.metrics_exactly_once = steps == list(range(1, total + 1))
        measured = run_goodput(self.run_dir)  # over the run's own wall-clock, from its first flow start
        report.goodput = measured.goodput if measured is not None else None
        report.badput_s = measured.badput_s if measured is not None else {}
        if measured is not None:
            self.log(f"goodput {measured.describe(n=len(measured.badput_s))}")

    def run(self) -> ChaosReport:
        report = ChaosReport(faults=self.faults)
        report.reference_digest = self.reference()
        if self.run_dir.is_symlink():  # runs/<name> linking to a fingerprint-named run: only the link goes
            self.run_dir.unlink()
        elif self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        self.log(f"chaos run {self.cfg.run_name}: faults " + ", ".join(f"{f.kind}@{f.at_step}" for f in self.faults))
        t0 = time.time()
        deadline = t0 + self.timeout_s
        log = self._log_path(self.cfg)
        log_offset = log.stat().st_size if log.exists() else 0
        flow = self._start(self.cfg, self.env)
        for fault in self.faults:
            reached = self._wait_for_step(fault.at_step, flow, deadline)
            if reached is None:
                break
            fault.injected_at, fault.injected_step = time.time(), reached
            self.log(f"inject {fault.kind} at step {reached}")
            flow = self._inject(fault, flow)
            self._wait_for_recovery(fault, flow, deadline)
        try:
            report.exit_code = flow.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            self._killpg(flow)
            report.exit_code = flow.wait()
        report.wall_s = round(time.time() - t0, 2)
        ck = CheckpointStore(self.run_dir).latest_valid(record=False)
        report.final_digest, report.final_step = (ck.digest, ck.step) if ck else (None, 0)
        self._score(report)
        if report.exit_code != 0 or report.final_step != self.cfg.train.total_steps:
            report.diagnosis = self._diagnose(log, log_offset)
        return report

    def _diagnose(self, log: Path, log_offset: int) -> list[str]:
        """The flow's last output lines (this chaos run's only) and the run's last audit events."""
        lines = []
        if log.exists():
            with open(log, "rb") as fh:
                fh.seek(log_offset)
                lines = [f"flow: {x}" for x in fh.read().decode(errors="replace").splitlines()[-40:]]
        keep = (
            "failure",
            "resumed",
            "chunk_done",
            "flow_started",
            "flow_done",
            "config_error",
            "preempted",
            "resubmitted",
            "checkpoint_skipped",
            "stale_worker_stopped",
            "reap_failed",
        )
        events = [e.as_json() for e in EventLog.read(self.run_dir).all() if e.event_kind in keep][-15:]
        return lines + [
            "event: " + json.dumps({k: v for k, v in e.items() if k not in ("log", "tail")}, default=str)
            for e in events
        ]
