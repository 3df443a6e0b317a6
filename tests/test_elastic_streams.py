"""Elastic streams: a stream resumed with another world size or ``data.num_workers`` is exact, or
refused in one line, never silently another sample sequence (issue 28, Deliver 2).

* A stream that keeps its own position (per rank and loader worker shard: the sharded counter)
  is refused by ``convoy train`` before anything is touched: 2→1 ranks, 1→2 ranks, 2→0 workers,
  each one line, exit 2, no attempt, the run directory unchanged; a worker started on such a
  run directly (any way around the CLI) refuses it too.
* A stream in one canonical global order (``iter_global``, training/datapipe/stream_position.py) resumes
  after 2→1 ranks (through ``convoy train``), 1→2 ranks and 2→0→4 workers, killed on the way:
  every sample id once, in the uninterrupted run's global order; with the world size unchanged
  the final digest is the uninterrupted run's; after a world-size change the losses differ only
  by the floating-point order of the gradient sum.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from typer.testing import CliRunner

from flows.cli.main import app
from tests.elastic_tasks import GlobalCounter
from tests.engine_util import SMALL, final_digest, make_run, wait_for_step
from tests.torchrun_util import finish, losses, torchrun_cmd
from training.config import ConfigError, load_config
from training.datapipe.stream_position import ReaderPlan, SavedLayout, check_resume, make_global_loader
from training.events import read_events
from training.rundir import open_run

TOTAL, BATCH = 16, 8
BASE = [
    f"train.total_steps={TOTAL}",
    f"train.chunk_steps={TOTAL}",
    f"train.batch_size={BATCH}",
    "train.lr=0.05",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=2",
    "data.seq_len=16",
    "task_args={}",
    "orchestration.retries=2",
    "orchestration.retry_delay_seconds=0.5",
]
SHARDED = [*BASE, "task=tests.elastic_tasks:build_sharded"]
GLOBAL = [*BASE, "task=tests.elastic_tasks:build_global"]


# ---------------------------------------------------------------- unit tests (fast)
def _rows(plan: ReaderPlan, micro_batches: int) -> list[dict[str, Any]]:
    loader = make_global_loader(GlobalCounter(), seed=7, plan=plan, collate_fn=None)
    try:
        return list(itertools.islice(loader, micro_batches))
    finally:
        loader.close()


@pytest.mark.parametrize("world, workers", [(1, 0), (1, 2), (2, 0), (2, 3), (4, 1)])
def test_every_layout_reads_the_one_global_order_with_the_same_samples(world: int, workers: int) -> None:
    """Readers of any layout, from global sample 16: their micro-batches, ranks side by side,
    are the global order 16, 17, ...; each sample's noise (seeded by its index) is the same."""
    plans = [ReaderPlan(16, BATCH, r, world, num_workers=workers) for r in range(world)]
    per_rank = [_rows(p, 5) for p in plans]
    ids = [torch.cat([rank[j]["id"] for rank in per_rank]).tolist() for j in range(5)]
    assert sum(ids, []) == list(range(16, 16 + 5 * BATCH))
    x = torch.cat([torch.cat([rank[j]["x"] for rank in per_rank]) for j in range(5)])
    reference = torch.cat([b["x"] for b in _rows(ReaderPlan(16, BATCH), 5)])
    assert torch.equal(x, reference)


def test_a_shard_position_on_another_layout_is_refused_in_one_line() -> None:
    saved = SavedLayout(step=8, world_size=2, num_workers=0, is_global=False)
    check_resume(saved, 2, 0, stream_is_global=False)  # the same layout resumes
    for world, workers in ((1, 0), (4, 0), (2, 2)):
        with pytest.raises(ConfigError) as exc:
            check_resume(saved, world, workers, stream_is_global=False)
        line = str(exc.value)
        assert "\n" not in line and "world size 2 with data.num_workers=0" in line
        assert f"world size {world} with data.num_workers={workers}" in line and "new run" in line
    check_resume(SavedLayout(8, 2, None, is_global=True), 3, 4, stream_is_global=True)  # any layout
    with pytest.raises(ConfigError, match="does not implement iter_global"):
        check_resume(SavedLayout(8, 2, None, is_global=True), 2, 0, stream_is_global=False)


# ---------------------------------------------------------------- helpers (real runs)
def settings(tmp: Path, name: str, extra: list[str]) -> list[str]:
    """The ``-S`` values :func:`make_run` builds the run ``name`` from."""
    return [*SMALL, f"runs_dir={tmp / 'runs'}", f"data.prepared_dir={tmp / 'data'}", f"run_name={name}", *extra]


def start(run_dir: Path, until: int, ranks: int, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        torchrun_cmd(run_dir, until, ranks),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def kill_at(run_dir: Path, ranks: int, step: int) -> int:
    """Train with ``ranks`` ranks, SIGKILL the launcher, ranks and loader workers at
    ``step``: the step after it stalls (an injected fault), so the kill provably lands mid-run."""
    p = start(run_dir, TOTAL, ranks, {"CONVOY_FAULTS": f"slow_step={step + 1}:60"})
    reached = wait_for_step(run_dir, p, step)
    assert reached is not None, p.communicate()[0][-3000:]
    # The stall leaves time for a save still being written to commit: on a loaded machine the kill
    # once came first, and the next layout started from step 0 instead of from a checkpoint.
    deadline = time.monotonic() + 30
    while list((run_dir / "checkpoints").glob(".tmp-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    kill_tree(p)
    assert p.returncode == -9, p.returncode  # killed, not finished
    return reached


def kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL ``p`` and every process below it.  Not by process group: torchrun starts each rank
    in a session of its own (``start_new_session``), so killing the launcher's group leaves the
    ranks training."""
    below = psutil.Process(p.pid).children(recursive=True)
    p.kill()
    for proc in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    p.wait()  # our child: reaped by Popen, so its return code is the signal's
    psutil.wait_procs(below, timeout=30)


def relayout(tmp: Path, name: str, extra: list[str]) -> None:
    """Reopen run ``name`` with other non-trajectory settings (what ``convoy train -S`` does)."""
    open_run(load_config(None, settings(tmp, name, extra)))


def cli_train(tmp: Path, name: str, extra: list[str]) -> tuple[int, list[str]]:
    params = tmp / "params.yaml"
    params.write_text("{}\n")
    args = sum([["-S", s] for s in settings(tmp, name, extra)], [])
    result = CliRunner().invoke(app, ["train", str(params), *args])
    return result.exit_code, [ln for ln in result.output.splitlines() if ln.strip()]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and link under ``root``: size and modification time."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for entry in (*dirs, *files):
            p = Path(folder) / entry
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


# ---------------------------------------------------------------- a shard-positioned stream: refused
@pytest.mark.slow
def test_a_sharded_stream_on_another_layout_is_refused_up_front(prefect_api: str, tmp_path: Path) -> None:
    """Runs saved at step 8 (2 ranks; 1 rank with 2 loader workers), resumed through
    ``convoy train`` with 1 rank, 2 ranks, 0 workers: one line naming old and new, exit 2,
    nothing trained or retried, not a byte of the runs directory changed.  A worker started
    directly on the run with 1 rank refuses it too (exit 78, the same line)."""
    layout = lambda ranks, workers: [*SHARDED, f"train.ranks={ranks}", f"data.num_workers={workers}"]  # noqa: E731
    runs = {
        "two-ranks": make_run(tmp_path, "two-ranks", layout(2, 0)),
        "two-workers": make_run(tmp_path, "two-workers", layout(1, 2)),
    }
    procs = [start(runs["two-ranks"], 8, 2), start(runs["two-workers"], 8, 1)]
    for p in procs:
        finish(p)
    before = snapshot(tmp_path / "runs")
    cases = [
        ("two-ranks", layout(1, 0), (2, 0), (1, 0)),
        ("two-workers", layout(2, 2), (1, 2), (2, 2)),
        ("two-workers", layout(1, 0), (1, 2), (1, 0)),
    ]
    for name, extra, old, new in cases:
        code, lines = cli_train(tmp_path, name, extra)
        assert code == 2 and len(lines) == 1, (name, extra, lines)
        named = "world size {} with data.num_workers={}"
        assert f"stream saved at step 8 by {named.format(*old)}, this resume has {named.format(*new)}" in lines[0]
        assert "resume with the saved values" in lines[0]
    assert snapshot(tmp_path / "runs") == before
    relayout(tmp_path, "two-ranks", layout(1, 0))
    p = start(runs["two-ranks"], TOTAL, 1)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 78, out[-3000:]
    assert "stream saved at step 8 by world size 2" in out
    assert not [r for r in (runs["two-ranks"] / "ids-rank0.jsonl").read_text().splitlines() if '"step": 9' in r]


# ---------------------------------------------------------------- a global-order stream: exact
def trained(run_dir: Path) -> list[int]:
    """The ids trained, step by step, ranks side by side (from each rank's log); each logged
    micro-batch (replays of killed steps included) must be exactly its canonical slice."""
    final: dict[int, dict[int, list[int]]] = {}
    for path in sorted(run_dir.glob("ids-rank*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            step, rank, ids = row["step"], row["rank"], row["ids"]
            per_rank = len(ids)
            lo = (step - 1) * BATCH + rank * per_rank
            assert ids == list(range(lo, lo + per_rank)), (path.name, row)
            final.setdefault(step, {})[lo] = ids
    assert sorted(final) == list(range(1, TOTAL + 1))
    out = []
    for step in range(1, TOTAL + 1):
        covered = sorted(set(sum(final[step].values(), [])))
        assert covered == list(range((step - 1) * BATCH, step * BATCH)), step
        out.extend(covered)
    return out


def shrink(tmp: Path, run: Path) -> list[int]:
    """2 ranks, killed at step 6 (resumed on 1 rank through ``convoy train`` afterwards)."""
    return [kill_at(run, 2, 6)]


def grow(tmp: Path, run: Path) -> list[int]:
    """1 rank, killed at step 6, resumed on 2 ranks, killed at step 11, resumed to the end."""
    kills = [kill_at(run, 1, 6)]
    relayout(tmp, run.name, [*GLOBAL, "train.ranks=2"])
    kills.append(kill_at(run, 2, 11))
    finish(start(run, TOTAL, 2))
    return kills


def workers(tmp: Path, run: Path) -> list[int]:
    """1 rank: 2 loader workers, killed at step 5; 0 workers, killed at step 10; then 4 workers."""
    kills = [kill_at(run, 1, 5)]
    relayout(tmp, run.name, [*GLOBAL, "data.num_workers=0"])
    kills.append(kill_at(run, 1, 10))
    relayout(tmp, run.name, [*GLOBAL, "data.num_workers=4"])
    finish(start(run, TOTAL, 1))
    return kills


def reference(tmp: Path, run: Path) -> list[int]:
    finish(start(run, TOTAL, 1))
    return []


@pytest.mark.slow
def test_a_global_order_stream_resumes_exactly_on_any_layout(prefect_api: str, tmp_path: Path) -> None:
    first = {"reference": [], "shrink": ["train.ranks=2"], "grow": [], "workers": ["data.num_workers=2"]}
    runs = {name: make_run(tmp_path, name, [*GLOBAL, *extra]) for name, extra in first.items()}  # one at a time
    scenarios = {"reference": reference, "shrink": shrink, "grow": grow, "workers": workers}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(fn, tmp_path, runs[name]) for name, fn in scenarios.items()}
        kills = {name: f.result() for name, f in futures.items()}
    code, lines = cli_train(tmp_path, "shrink", [*GLOBAL, "train.ranks=1"])
    assert code == 0, lines
    ref = runs["reference"]
    order = list(range(TOTAL * BATCH))
    assert trained(ref) == order
    for name in ("shrink", "grow", "workers"):
        assert trained(runs[name]) == order, name
        assert kills[name] and all(k < TOTAL for k in kills[name]), (name, kills[name])
    assert final_digest(runs["workers"]) == final_digest(ref)  # the same world size: bitwise
    assert losses(runs["workers"]) == losses(ref)
    for name, (old, new) in (("shrink", (2, 1)), ("grow", (1, 2))):
        assert {(e["old"], e["new"]) for e in read_events(runs[name], "world_size_changed")} == {(old, new)}, name
        ref_l, run_l = losses(ref), losses(runs[name])
        diff = max(abs(ref_l[s] - run_l[s]) for s in range(1, TOTAL + 1))
        print(f"{name}: max |loss - uninterrupted 1-rank loss| over {TOTAL} steps = {diff:.2e}")
        assert diff < 1e-5, (name, diff)  # the fp order of the gradient sum, nothing else
