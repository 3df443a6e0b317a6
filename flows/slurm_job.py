"""The Slurm allocation ``convoy train`` runs in: what convoy reads of it, and its time limit.

Why this exists: on a Slurm cluster the disruption a long run meets most is not a crash but the
allocation's **time limit** (24-48 h on most clusters): Slurm then SIGTERMs every process of the
job and SIGKILLs what is left ``KillWait`` seconds later.  The recommended path (docs/slurm.md,
``convoy slurm script``) makes the batch shell *be* ``convoy train`` (``exec``), submitted with
``--requeue`` and ``--signal=B:USR1@<lead>``, and this module turns that warning into a bitwise
continuation in the next allocation, with no human:

1. SIGUSR1 arrives about ``<lead>`` s before the limit (Slurm's resolution: up to 60 s earlier).
   :class:`TimeLimitStop` sends this process SIGTERM, the flow's own preemption path: the chunk
   task's supervisor stops its workers, each saves an emergency checkpoint and exits 75, the flow
   ends Crashed with its audit written.
2. Then ``scontrol requeue <job id>``: Slurm ends this allocation and queues the same job again
   (eligible ``cred_expire`` + 1 s later: 121 s by default).  Its ``convoy train`` resumes from
   that checkpoint: only the interrupted chunk re-runs, from its newest verified step.
3. Event ``slurm_requeued`` (job id, restarts, when the signal came, the step saved) is the audit;
   every ``flow_started`` records the job id and restart count, MLflow tags ``slurm.*`` them.

Invariants:

1. Nothing here runs outside a Slurm job (:meth:`SlurmJob.from_env` is ``None``): a plain
   ``convoy train`` is unchanged.
2. A run that finished is never requeued (a signal during the summary changes nothing).
3. A SIGTERM that was not preceded by SIGUSR1 (``scancel``, or the limit itself) stops the run as
   everywhere else (emergency checkpoint) and ends this process by that SIGTERM: Slurm decides.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from training.config import ConfigError, RunConfig
from training.events import Event, append_event

#: What ``orchestration.node_launch`` becomes inside an allocation when it was left at its ssh
#: default: each other node's agent is a job step on that node (``scancel <job>.<step>`` stops
#: one node, Slurm accounts and cleans up each step).  ``--overlap``: the batch step holds the
#: allocation's CPUs; ``bash -c``: the launcher passes one shell command (cd + torchrun).
SRUN_NODE_LAUNCH = "srun --nodes=1 --ntasks=1 --overlap --kill-on-bad-exit=1 --job-name=convoy-node -w {host} bash -c"
SSH_DEFAULT = "ssh -tt -o BatchMode=yes {host}"


class SlurmStop(BaseException):
    """This process was told to stop inside a Slurm job (a BaseException, like Prefect's
    TerminationSignal, so that no ``except Exception`` on the way swallows it)."""


@dataclass(frozen=True)
class SlurmJob:
    """The job this process runs in, as Slurm's environment describes it."""

    job_id: str
    #: How many times Slurm requeued the job before this start (``SLURM_RESTART_COUNT``).
    restarts: int
    #: The allocation's nodes, expanded (``scontrol show hostnames``), in Slurm's order.
    nodes: tuple[str, ...]
    #: The node this process runs on (``SLURMD_NODENAME``).
    node: str
    #: GPUs Slurm gave this node (``SLURM_GPUS_ON_NODE``); None when it says nothing.
    gpus_on_node: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> SlurmJob | None:
        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        return cls(
            job_id=job_id,
            restarts=int(env.get("SLURM_RESTART_COUNT") or 0),
            nodes=expand_nodelist(nodelist),
            node=env.get("SLURMD_NODENAME") or "",
            gpus_on_node=int(env["SLURM_GPUS_ON_NODE"]) if env.get("SLURM_GPUS_ON_NODE") else None,
        )

    def fields(self) -> dict[str, object]:
        """What every ``flow_started`` event of a run trained in this job records."""
        return {"slurm_job_id": self.job_id, "slurm_restarts": self.restarts, "slurm_nodes": ",".join(self.nodes)}

    def tags(self) -> dict[str, str]:
        """MLflow tags of the run (the newest job that trained it)."""
        return {"slurm.job_id": self.job_id, "slurm.restarts": str(self.restarts), "slurm.nodes": ",".join(self.nodes)}


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """``gpu[01-03],cpu7`` → its host names, as Slurm expands them (``scontrol``, present in every
    allocation); a list without brackets needs no Slurm command."""
    if not nodelist:
        return ()
    if "[" not in nodelist:
        return tuple(n for n in nodelist.split(",") if n)
    done = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
    )
    return tuple(done.stdout.split())


def fit_to_allocation(cfg: RunConfig, job: SlurmJob) -> RunConfig:
    """``cfg`` with the allocation's nodes as ``train.hosts`` (this node first: it hosts the
    rendezvous) where the config names none, and other nodes started as job steps where
    ``node_launch`` is the ssh default.  Neither setting is part of the trajectory (the same run
    continues on another allocation's nodes).  Raises ConfigError when the allocation has fewer
    nodes than ``train.nnodes``, or a CUDA run fewer GPUs per node than ``train.ranks``.  Ranks are
    torchrun's (one agent per node), not Slurm's tasks: ``SLURM_PROCID`` is not read."""
    train, orch = cfg.train, cfg.orchestration
    if train.device == "cuda" and job.gpus_on_node is not None and job.gpus_on_node < train.ranks:
        raise ConfigError(
            f"train.ranks = {train.ranks} but Slurm gave this node {job.gpus_on_node} GPU(s); submit with "
            f"--gpus-per-node={train.ranks} (convoy slurm script does) or lower train.ranks"
        )
    if train.nnodes <= 1:
        return cfg
    hosts = list(train.hosts)
    if not hosts:
        if len(job.nodes) < train.nnodes:
            raise ConfigError(
                f"train.nnodes = {train.nnodes} but Slurm job {job.job_id} has {len(job.nodes)} node(s) "
                f"({','.join(job.nodes)}); submit with --nodes={train.nnodes} (convoy slurm script does)"
            )
        here = [n for n in job.nodes if n == job.node] or list(job.nodes[:1])
        hosts = (here + [n for n in job.nodes if n not in here])[: train.nnodes]
    launch = SRUN_NODE_LAUNCH if orch.node_launch == SSH_DEFAULT else orch.node_launch
    return cfg.model_copy(
        update={
            "train": train.model_copy(update={"hosts": hosts}),
            "orchestration": orch.model_copy(update={"node_launch": launch}),
        }
    )


class TimeLimitStop:
    """Around ``run_training`` in a Slurm job: SIGUSR1 (the time limit is near) → the run stops as
    on SIGTERM (emergency checkpoints) → event ``slurm_requeued`` → ``scontrol requeue``.

    Prefect's flow engine replaces the SIGTERM handler while the flow runs and, once the crash is
    handled, puts back the previous one and sends SIGTERM again: the previous one is ours, which
    raises :class:`SlurmStop`, so ``__exit__`` runs whatever state the flow was in."""

    def __init__(self, job: SlurmJob, run_dir: Path, say: Callable[[str], None], newest_step: Callable[[], int]):
        self.job, self.run_dir, self.say, self.newest_step = job, run_dir, say, newest_step
        #: When SIGUSR1 came (``time.time()``); None: it never did.
        self.warned_at: float | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> TimeLimitStop:
        for sig, handler in ((signal.SIGUSR1, self._on_usr1), (signal.SIGTERM, self._on_term)):
            self._previous[sig] = signal.signal(sig, handler)
        return self

    def _on_usr1(self, signum: int, frame: FrameType | None) -> None:
        if self.warned_at is None:
            self.warned_at = time.time()
            os.kill(os.getpid(), signal.SIGTERM)  # the flow's preemption path, wherever it is now

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        raise SlurmStop

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        if exc is None or not isinstance(exc, BaseException) or isinstance(exc, KeyboardInterrupt):
            return False  # finished (invariant 2), or Ctrl-C: nothing of Slurm's to do
        if self.warned_at is None:
            if isinstance(exc, SlurmStop) or type(exc).__name__ == "TerminationSignal":
                os.kill(os.getpid(), signal.SIGTERM)  # invariant 3: ends by SIGTERM, as before
            return False
        self.requeue()
        return True

    def requeue(self) -> None:
        """Record what was saved and hand the job back to Slurm's queue (Slurm then ends us)."""
        step = self.newest_step()
        waited = round(time.time() - (self.warned_at or time.time()), 3)
        append_event(
            self.run_dir,
            Event.SLURM_REQUEUED,
            slurm_job_id=self.job.job_id,
            slurm_restarts=self.job.restarts,
            warned_at=self.warned_at,
            saved_step=step,
            stop_s=waited,
        )
        saved = f"step {step} saved" if step else "no step trained yet"
        self.say(
            f"convoy: Slurm's time limit is near (SIGUSR1): stopped in {waited:.1f} s, {saved}; "
            f"requeueing job {self.job.job_id} (it resumes from there)"
        )
        done = subprocess.run(["scontrol", "requeue", self.job.job_id], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            self.say(f"convoy: scontrol requeue {self.job.job_id} failed: {done.stderr.strip()}; resubmit the job")
