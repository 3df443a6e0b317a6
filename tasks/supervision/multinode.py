"""Multi-node launcher: one ``torchrun`` elastic agent per node, all in one rendezvous, one exit.

Why one local process for all nodes: the supervisor owns exactly one process group per attempt
(watch, stop, reap; :mod:`tasks.supervision.supervisor`).  This launcher is that group's leader when
``train.nnodes > 1``.  It starts node 0's agent here and every other node's through
``orchestration.node_launch`` (``ssh -tt host`` by default, an ``srun`` job step inside a Slurm
allocation: flows/slurm_job.py; a host named ``localhost`` or ``127.0.0.1`` is started here
directly, which is how the multi-node path is tested on one machine; any other name, this
machine's own included, goes through ``node_launch``), all joining a c10d rendezvous hosted on
node 0 at a port free when the attempt starts.

Its contract with the supervisor is the single-launcher one:

* exit 0 when every node's agent exited 0;
* as soon as one agent exits non-zero, the others get :data:`PEER_EXIT_GRACE_S` to end by
  themselves (their ranks are blocked in a collective or fail the rendezvous), then SIGTERM, then
  SIGKILL; the exit code is the first failure's (so a preemption's 75 and a config error's 78 pass
  through, and the ranks' own audit events still classify it);
* SIGTERM (the supervisor stopping the group, or the flow dying: PDEATHSIG) is forwarded to every
  agent, which forwards it to its ranks: they save an emergency checkpoint.

Remote nodes need the same code path, Python path and run directory path (shared storage); see
docs/distributed.md.  A node that vanishes (power, network) is noticed by the supervisor through
its ranks' heartbeats on the shared run directory, not through this process.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from tasks.supervision.process_group import child_setup
from training.events import EXIT_CONFIG

#: How long the other nodes get to exit by themselves after one node's agent failed.
PEER_EXIT_GRACE_S = 5.0
#: SIGTERM → SIGKILL for agents that did not exit by themselves.
STOP_GRACE_S = 10.0
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
#: What the launcher's lines start with; a node failing first prints ``PREFIX + "node …"`` and the
#: supervisor quotes that in the audit (:func:`failed_node`).
PREFIX = "convoy multinode: "


def is_local(host: str) -> bool:
    """True for names of this machine (node 0 must be one: it hosts the rendezvous)."""
    return host in LOCAL_NAMES or host in {socket.gethostname(), socket.getfqdn()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def failed_node(tail: Sequence[str]) -> str | None:
    """``node 1 (gpu-b) exited 137`` from the launcher's output, if a node failed first."""
    line = next((x for x in reversed(tail) if x.startswith(PREFIX + "node ")), None)
    return line.removeprefix(PREFIX).split(";")[0] if line else None


def launcher_command(hosts: Sequence[str], ranks_per_node: int, node_launch: str, tail: Sequence[str]) -> list[str]:
    """The command the supervisor spawns for a multi-node attempt (``tail``: ``-m training.worker …``)."""
    return [
        sys.executable,
        "-m",
        "tasks.supervision.multinode",
        "--hosts",
        ",".join(hosts),
        "--ranks",
        str(ranks_per_node),
        "--node-launch",
        node_launch,
        "--",
        *tail,
    ]


@dataclass(frozen=True)
class Rendezvous:
    """Where and under which id every node's agent meets (c10d, hosted on node 0)."""

    endpoint: str
    id: str


def node_commands(
    hosts: Sequence[str],
    ranks_per_node: int,
    rendezvous: Rendezvous,
    node_launch: str,
    tail: Sequence[str],
    cwd: str,
) -> list[list[str]]:
    """One torchrun command per node; remote ones wrapped in ``node_launch`` + ``cd cwd && exec …``."""
    cmds = []
    for i, host in enumerate(hosts):
        agent = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={len(hosts)}",
            f"--nproc-per-node={ranks_per_node}",
            f"--node-rank={i}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={rendezvous.endpoint}",
            f"--rdzv-id={rendezvous.id}",
            f"--rdzv-conf=is_host={int(i == 0)}",
            "--max-restarts=0",
            *tail,
        ]
        if i == 0 or host in LOCAL_NAMES:  # node 0 is this machine (checked in main)
            cmds.append(agent)
        else:
            remote = f"cd {shlex.quote(cwd)} && PYTHONUNBUFFERED=1 exec {shlex.join(agent)}"
            cmds.append([*shlex.split(node_launch.format(host=host)), remote])
    return cmds


class NodeGroup:
    """The agents of one attempt; see the module docstring for the exit contract."""

    def __init__(self, cmds: list[list[str]], hosts: Sequence[str]) -> None:
        self.hosts = list(hosts)
        self.procs = [subprocess.Popen(c, stdin=subprocess.DEVNULL, preexec_fn=child_setup(os.getpid())) for c in cmds]

    def signal_all(self, sig: int) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)

    def on_sigterm(self, signum: int, frame: object) -> None:
        self.signal_all(signal.SIGTERM)  # run() then sees the agents' exits as usual

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not (done := all(p.poll() is not None for p in self.procs)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return done

    def run(self) -> int:
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                node, code = failed[0]
                first_failure = code if code > 0 else 128 - code  # killed by signal n: 128+n, as a shell says
                print(
                    f"{PREFIX}node {node} ({self.hosts[node]}) exited {first_failure}; stopping the other nodes",
                    file=sys.stderr,
                    flush=True,
                )
                if not self.wait_all(PEER_EXIT_GRACE_S):
                    self.signal_all(signal.SIGTERM)
                    if not self.wait_all(STOP_GRACE_S):
                        self.signal_all(signal.SIGKILL)
                        self.wait_all(STOP_GRACE_S)
                return first_failure
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.supervision.multinode", description=__doc__.splitlines()[0])
    ap.add_argument("--hosts", required=True, help="comma-separated, node 0 (this machine) first")
    ap.add_argument("--ranks", type=int, required=True, help="ranks per node")
    ap.add_argument("--node-launch", default="ssh -tt -o BatchMode=yes {host}")
    ap.add_argument("tail", nargs=argparse.REMAINDER, help="-- -m training.worker ...")
    args = ap.parse_args(argv)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    tail = args.tail[1:] if args.tail[:1] == ["--"] else args.tail
    if not is_local(hosts[0]):
        print(
            f"config error: train.hosts[0] = {hosts[0]!r} is not this machine ({socket.gethostname()}); node 0 "
            "must be the machine running the chunk task (it hosts the rendezvous)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_CONFIG
    # Remote agents must reach the rendezvous: name node 0 as the others know it.
    host0 = "127.0.0.1" if all(is_local(h) for h in hosts) else socket.getfqdn()
    rdzv = Rendezvous(f"{host0}:{free_port()}", uuid.uuid4().hex[:12])
    cmds = node_commands(hosts, args.ranks, rdzv, args.node_launch, tail, os.getcwd())
    print(
        f"{PREFIX}{len(hosts)} nodes x {args.ranks} ranks, rendezvous {rdzv.endpoint} id {rdzv.id}",
        file=sys.stderr,
        flush=True,
    )
    group = NodeGroup(cmds, hosts)
    signal.signal(signal.SIGTERM, group.on_sigterm)
    return group.run()


if __name__ == "__main__":
    sys.exit(main())
