"""A real one-node Slurm cluster on this machine, for the tests: munged, slurmctld and slurmd
(Debian's ``slurm-wlm`` 22.05 and ``munge``), each a process of the test, their config, state,
spool and logs in one folder, the clients pointed at it by ``SLURM_CONF``; nothing under /etc is
read or written.

Why these settings: ``proctrack/linuxproc`` and ``task/none`` need no systemd or cgroup
delegation (a container has neither); ``cred_expire=5`` in ``AuthInfo`` shortens the hold Slurm
puts on a requeued job (``cred_expire`` + 1 s; 121 s by default, docs/slurm.md says so) from two
minutes to six seconds; ``sched_interval=2`` starts it then, not at the next minute;
``JobRequeue=1`` requeues a job whose node fails; ``ReturnToService=1`` keeps a node set DOWN by
hand down until ``state=RESUME`` (as an admin's would be: with 2 it returned while the old job's
processes were still ending, and the requeued job's launch failed on the duplicate).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil

PACKAGES = ("slurm-wlm", "munge")
DAEMONS = ("munged", "slurmctld", "slurmd")


def installed_or_reason() -> str | None:
    """None when the daemons are here (installed now with apt where missing and we are root);
    otherwise why not, for the skip."""
    if all(shutil.which(d) for d in DAEMONS):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "Slurm is not installed and cannot be (needs root and apt-get: apt-get install slurm-wlm munge)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:  # an old package index: refresh it once
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, env=env, timeout=600)
        done = subprocess.run(install, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0 or not all(shutil.which(d) for d in DAEMONS):
        return f"apt-get install {' '.join(PACKAGES)} failed: {(done.stderr or done.stdout).strip()[-300:]}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SlurmCluster:
    """The cluster: :meth:`start`, the client commands the tests use, :meth:`stop`."""

    def __init__(self, root: Path, cred_expire_s: int = 5) -> None:
        self.root, self.cred_expire_s = root, cred_expire_s
        self.node = socket.gethostname()
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def write_config(self) -> None:
        r = self.root
        for d in ("ctld", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        lines = [
            "ClusterName=convoytest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "AuthType=auth/munge",
            f"AuthInfo=socket={r / 'munge.sock'},cred_expire={self.cred_expire_s}",
            "CredType=cred/munge",
            f"StateSaveLocation={r / 'ctld'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log/slurmctld.log'}",
            f"SlurmdLogFile={r / 'log/slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "JobRequeue=1",
            "ReturnToService=1",
            "KillWait=30",
            "MinJobAge=5",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory=1000 State=UNKNOWN",
            f"PartitionName=main Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        key = r / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)

    def _spawn(self, cmd: list[str]) -> subprocess.Popen:
        log = open(self.root / "log" / f"{Path(cmd[0]).name}.out", "ab")  # noqa: SIM115 - the daemon's
        p = subprocess.Popen(cmd, stdout=log, stderr=log, env=self.env, start_new_session=True)
        self.procs.append(p)
        return p

    def start(self) -> None:
        """munged, slurmctld, then slurmd under the first cgroup plugin this kernel takes."""
        self.write_config()
        r = self.root
        files = [f"--{k}-file={r / v}" for k, v in (("key", "munge.key"), ("pid", "munged.pid"))]
        files += [f"--seed-file={r / 'munged.seed'}", f"--log-file={r / 'log/munged.log'}"]
        self._spawn(["munged", "-F", "--force", f"--socket={r / 'munge.sock'}", *files])
        self._wait(lambda: (r / "munge.sock").exists(), 10, "munged did not create its socket")
        self._spawn(["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for plugin in ("cgroup/v1", "cgroup/v2", "autodetect"):
            (r / "cgroup.conf").write_text(f"CgroupPlugin={plugin}\n")
            slurmd = self._spawn(["slurmd", "-D", "-f", str(self.conf)])
            with contextlib.suppress(TimeoutError):
                self._wait(lambda d=slurmd: self.node_state() == "idle" or d.poll() is not None, 20, "")
            if slurmd.poll() is None and self.node_state() == "idle":
                return
            with contextlib.suppress(ProcessLookupError):
                slurmd.kill()
            slurmd.wait()
        raise RuntimeError(f"slurmd did not start: {(r / 'log/slurmd.log').read_text()[-800:]}")

    @staticmethod
    def _wait(ready, timeout: float, what: str) -> None:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.2)

    def run(self, *cmd: str, check: bool = True) -> str:
        done = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env, timeout=60)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
        return done.stdout

    def node_state(self) -> str:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env, timeout=30
        ).stdout
        return out.strip().split("\n")[0].rstrip("*~#") if out.strip() else ""

    def job_state(self, job: str) -> str:
        out = self.run("squeue", "-h", "-j", job, "-o", "%T", check=False).strip()
        return out or "GONE"

    def job_steps(self, job: str) -> list[str]:
        """Running steps of ``job`` other than its batch step (``<job>.<n>``)."""
        out = self.run("squeue", "-h", "-s", "-j", job, "-o", "%i", check=False)
        return [s for s in out.split() if s.split(".")[-1].isdigit()]

    def queue(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i %T").split("\n")[:-1]

    def stepds(self) -> list[int]:
        """slurmstepd processes of this cluster (they outlive slurmd by design)."""
        pids = []
        for p in psutil.process_iter(["name", "pid"]):
            with contextlib.suppress(psutil.Error):
                if (p.info["name"] or "").startswith("slurmstepd") and p.environ().get("SLURM_CONF") == str(self.conf):
                    pids.append(p.info["pid"])
        return pids

    def job_processes(self, job: str) -> list[str]:
        """Every process still alive that Slurm started for ``job`` (its environment names it)."""
        out = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            with contextlib.suppress(psutil.Error):
                if p.info["status"] != psutil.STATUS_ZOMBIE and p.environ().get("SLURM_JOB_ID") == job:
                    out.append(f"{p.info['pid']} {' '.join(p.info['cmdline'] or [])}")
        return out

    def stop(self) -> None:
        """Cancel every job, wait for the queue and the job steps to go, stop the daemons."""
        with contextlib.suppress(Exception):
            self.run("scancel", "--full", "-u", "root", check=False)
            self._wait(lambda: not self.queue() and not self.stepds(), 60, "jobs did not end")
        for pid in self.stepds():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
