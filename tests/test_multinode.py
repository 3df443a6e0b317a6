"""Multi-node chunks (``train.nnodes``): one torchrun agent per node in one c10d rendezvous.

Two "nodes" here are two agents on this machine (hosts ``127.0.0.1`` and ``localhost``, both
started directly): the rendezvous, the rank assignment across agents and the launcher's exit
contract are the real multi-node ones; only ssh to another machine is not exercised.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from tasks.supervision.multinode import Rendezvous, failed_node, is_local, node_commands
from tasks.supervision.worker_liveness import Watch, lost_rank
from tests.flow_util import assert_no_leftovers, config, in_thread, params, two_node_reference, wait_for_step
from training.checkpointing.store import CheckpointStore
from training.config import ConfigError
from training.events import read_events
from training.heartbeat import Beat

TOTAL, CHUNK = 30, 15


def test_nnodes_needs_one_host_per_node(data_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train.nnodes = 2 needs exactly 2 host names"):
        config(params(tmp_path, data_dir, "n", train={"nnodes": 2}))
    with pytest.raises(ConfigError, match=r"not divisible by the world size 6"):
        config(params(tmp_path, data_dir, "n", train={"nnodes": 2, "ranks": 3, "hosts": ["a", "b"]}))
    cfg = config(params(tmp_path, data_dir, "n", train={"nnodes": 2, "ranks": 2, "hosts": ["a", "b"]}))
    assert cfg.train.world_size == 4


def test_remote_nodes_go_through_node_launch_local_ones_do_not() -> None:
    tail = ["-m", "training.worker", "--run-dir", "/shared/runs/x", "--until-step", "100"]
    hosts = ["localhost", "gpu-node-7"]
    local, remote = node_commands(hosts, 8, Rendezvous("head:29500", "abc"), "ssh -tt {host}", tail, "/srv/app")
    assert local[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--node-rank=0" in local
    assert "--rdzv-conf=is_host=1" in local and "--nproc-per-node=8" in local and "--nnodes=2" in local
    assert remote[:3] == ["ssh", "-tt", "gpu-node-7"]
    assert remote[3].startswith("cd /srv/app && PYTHONUNBUFFERED=1 exec ") and "--node-rank=1" in remote[3]
    assert "--rdzv-conf=is_host=0" in remote[3] and remote[3].endswith("--until-step 100")
    assert is_local("127.0.0.1") and not is_local("gpu-node-7")


def test_the_first_node_to_fail_is_named() -> None:
    tail = ["noise", "convoy multinode: node 1 (gpu-b) exited 137; stopping the other nodes", "Root Cause ..."]
    assert failed_node(tail) == "node 1 (gpu-b) exited 137"
    assert failed_node(["[worker rank 0] done"]) is None


def test_a_remote_ranks_pid_is_not_checked_here() -> None:
    """A pid from another machine means nothing here: such a rank is judged by its beats only."""
    now = time.time()
    gone = {"pid": 2**22 + 12345, "rank": 1, "step": 5, "phase": "train", "time": now}
    w = Watch(started=now - 10)
    assert lost_rank(w, [Beat.from_dict({**gone, "host": "elsewhere"})], 2, now) is None
    assert lost_rank(w, [Beat.from_dict({**gone, "host": "elsewhere"})], 2, now + 5) is None
    w = Watch(started=now - 10)
    lost_rank(w, [Beat.from_dict(gone)], 2, now)  # this machine's (no host = an older beat, read as local)
    assert lost_rank(w, [Beat.from_dict(gone)], 2, now + 5) is not None


TWO_NODES = {"nnodes": 2, "hosts": ["127.0.0.1", "localhost"]}


def _params(tmp: Path, data_dir: Path, name: str) -> dict:
    return params(
        tmp,
        data_dir,
        name,
        train={"total_steps": TOTAL, "chunk_steps": CHUNK, **TWO_NODES},
        checkpoint={"every_steps": 5, "keep_last": 2},
    )


@pytest.fixture(scope="module")
def two_node_digest(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> str:
    """Digest of an uninterrupted run on the same two nodes (the launcher alone, no Prefect)."""
    return two_node_reference(_params(tmp_path_factory.mktemp("multinode-ref"), data_dir, "uninterrupted"), TOTAL)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["killed", "frozen"])
def test_two_nodes_one_lost_mid_chunk_is_retried_and_bitwise_equal(
    prefect_api: str,
    data_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    two_node_digest: str,
    loss: str,
) -> None:
    """The node of rank 1 (its agent and its rank) is lost in chunk 2: SIGKILLed (a crash: its
    processes are gone), or SIGSTOPped (power or network loss: nothing exits, the beats stop, as for
    a remote node).  The chunk fails, nothing of the attempt is left, the retry re-forms both nodes
    and the run ends bitwise equal to an uninterrupted run of the same two nodes.  (Not to one node
    x 2 ranks: torchrun sets OMP_NUM_THREADS=1 only when a node has several ranks, and another
    intra-op thread count sums in another order.)"""
    from flows.train import run_training

    monkeypatch.setenv("CONVOY_FAULTS", "step_delay=0.03")
    cfg = config(_params(tmp_path, data_dir, f"two-nodes-{loss}"))
    run_dir = cfg.run_dir.resolve()
    lost: dict[str, int] = {}

    def lose_node() -> None:
        beat = wait_for_step(run_dir, CHUNK + 5, rank=1)
        agent = psutil.Process(beat.pid).parent()
        lost.update(agent=agent.pid, rank_pid=beat.pid, step=beat.step)
        sig = signal.SIGKILL if loss == "killed" else signal.SIGSTOP
        os.kill(agent.pid, sig)  # the whole node at once: its agent and its rank
        os.kill(beat.pid, sig)

    t = in_thread(lose_node)
    summary = run_training(cfg)
    t.join(timeout=5)
    assert lost, t.errors  # type: ignore[attr-defined]
    fail = read_events(run_dir, "failure")
    print(
        f"node of rank 1 {loss} at step {lost['step']}: detected as {fail[0]['failure']} after "
        f"{fail[0]['detected_after_s']} s ({fail[0]['reason']})"
    )
    assert summary["final_step"] == TOTAL and summary["attempts"] == {1: 1, 2: 2}
    assert len(fail) == 1 and fail[0]["chunk"] == 2, fail
    expected = ("killed", "crash") if loss == "killed" else ("dead", "hang")  # the heartbeat limits (5 s)
    assert fail[0]["failure"] in expected, fail
    if loss == "killed" and not fail[0]["reason"].startswith("rank "):  # the launcher's exit, not our pid check
        assert "first to fail: node " in fail[0]["reason"], fail  # the audit names the lost node
    b = CheckpointStore(run_dir).latest_valid()
    assert b.manifest["world_size"] == 2 and b.digest == two_node_digest
    assert not psutil.pid_exists(lost["agent"]) and not psutil.pid_exists(lost["rank_pid"])
    assert_no_leftovers(run_dir)
