"""Real models plug in: batches of any structure, gradient accumulation, in-loop validation,
per-group learning rates, still bitwise under SIGKILL.

The dict-batch task below is what a user would write (the HF convention: a dict with
``input_ids`` and ``labels``, plus a nested entry, a custom ``collate_fn`` and two parameter
groups); the end-to-end tests run it in real ``python -m training.worker`` processes and kill
them with SIGKILL, like tests/test_resume.py.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from tests.engine_util import (
    final_digest,
    kill_at_random_steps,
    kill_group,
    make_run,
    reference_digest,
    run_worker,
    start_worker,
    wait_for_step,
)
from tests.torchrun_util import finish, torchrun
from training.checkpointing.store import CheckpointStore
from training.config import RunConfig, load_config
from training.datapipe.batch import batch_len, to_device, tree_map
from training.datapipe.data import Cursor, LoaderSpec, ResumableBatchSampler
from training.events import read_events
from training.examples import char_gpt
from training.task import TaskParts
from training.tracking.metrics import metric_rows

TOTAL = 40
#: A short run: one chunk, a checkpoint every 5 steps, a small model; a 30 ms pause per step
#: (``step_delay``) so the heartbeat-driven kills land inside the run, not after it.
SHORT = [
    f"train.total_steps={TOTAL}",
    f"train.chunk_steps={TOTAL}",
    "checkpoint.every_steps=5",
    "checkpoint.keep_last=2",
    "train.batch_size=4",
    "data.seq_len=16",
]
SLOW = {"CONVOY_FAULTS": "step_delay=0.03"}


# ---------------------------------------------------------------- the user's dict-batch task
class DictWindows(Dataset):
    """Samples as dicts, HF style, with a nested entry the loss reads too."""

    def __init__(self, windows: Dataset) -> None:
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> dict[str, Any]:
        x, y = self.windows[i]
        return {"input_ids": x, "labels": y, "extra": {"weight": torch.tensor(1.0), "source": "corpus"}}


def collate_dicts(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """A custom collate: stacks the tensors, keeps the strings as a list."""
    return {
        "input_ids": torch.stack([s["input_ids"] for s in samples]),
        "labels": torch.stack([s["labels"] for s in samples]),
        "extra": {
            "weight": torch.stack([s["extra"]["weight"] for s in samples]),
            "source": [s["extra"]["source"] for s in samples],
        },
    }


def build_dict_task(config: RunConfig, device: torch.device) -> TaskParts:
    """The char GPT with dict batches, a custom collate and two parameter groups (decay / none)."""
    parts = char_gpt.build(config, device)
    model, tc = parts.model, config.train
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": tc.weight_decay},
            {"params": no_decay, "weight_decay": 0.0, "lr": tc.lr * 0.5},
        ],
        lr=tc.lr,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, char_gpt.warmup_cosine(tc.warmup_steps, tc.total_steps))

    def loss_fn(m: torch.nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        assert batch["input_ids"].device.type == device.type and batch["extra"]["source"][0] == "corpus"
        logits = m(batch["input_ids"])
        per_sample = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").mean(1)
        return (per_sample * batch["extra"]["weight"]).mean()

    return TaskParts(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_data=DictWindows(parts.train_data),
        val_data=DictWindows(parts.val_data),
        loss_fn=loss_fn,
        tokens_per_sample=parts.tokens_per_sample,
        collate_fn=collate_dicts,
    )


DICT_TASK = ["task=tests.test_real_models:build_dict_task"]


# ---------------------------------------------------------------- unit tests (fast)
def test_tree_map_moves_every_tensor_and_keeps_structure() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    batch = {
        "x": torch.ones(3, 2),
        "nested": [(torch.zeros(3), "s"), {"y": torch.arange(3)}],
        "pair": Pair(torch.ones(3), 7),
        "none": None,
    }
    moved = to_device(batch, torch.device("meta"))
    assert moved["x"].device.type == "meta" and moved["nested"][0][0].device.type == "meta"
    assert moved["nested"][0][1] == "s" and moved["none"] is None and isinstance(moved["nested"][0], tuple)
    assert isinstance(moved["pair"], Pair) and moved["pair"].b == 7 and moved["pair"].a.device.type == "meta"
    assert moved["nested"][1]["y"].device.type == "meta"
    assert batch_len(batch) == 3
    assert tree_map(lambda t: t * 2, (torch.ones(1),))[0].item() == 2.0


@pytest.mark.parametrize("n", [40, 37])
def test_accumulation_reads_the_samples_of_one_big_batch(n: int) -> None:
    """accum 4 x b yields, per optimizer step, exactly the 4b samples of accum 1 x 4b (epoch tails
    included), and resuming from the cursor after k optimizer steps continues the same stream."""

    def take(sampler: ResumableBatchSampler, k: int) -> list[list[int]]:
        it = iter(sampler)
        return [next(it) for _ in range(k)]

    big = take(ResumableBatchSampler(n, LoaderSpec(8, 3, Cursor())), 12)
    micro = take(ResumableBatchSampler(n, LoaderSpec(2, 3, Cursor(), accum=4)), 48)
    assert [sum(micro[4 * i : 4 * i + 4], []) for i in range(12)] == big
    cursor = Cursor()
    for _ in range(7):
        cursor = cursor.advance(8, n)
    assert take(ResumableBatchSampler(n, LoaderSpec(2, 3, cursor, accum=4)), 20) == micro[28:48]
    # Two ranks: each takes its half of every global micro-batch.
    halves = [
        take(ResumableBatchSampler(n, LoaderSpec(2, 3, Cursor(), rank=r, world_size=2, accum=4)), 8) for r in (0, 1)
    ]
    assert [a + b for a, b in zip(*halves, strict=True)] == micro[:8]


# ---------------------------------------------------------------- end to end (real kills)
@pytest.fixture(scope="module")
def dict_reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Digest of the dict task run uninterrupted, eval off (shared: each worker start costs seconds)."""
    return reference_digest(tmp_path_factory.mktemp("dict-ref"), SHORT + DICT_TASK, until=TOTAL)


@pytest.mark.slow
def test_dict_batches_sigkill_at_random_steps_bitwise(tmp_path: Path, dict_reference: str) -> None:
    run_dir = make_run(tmp_path, "killed", SHORT + DICT_TASK)
    rng = random.Random(13)
    # One kill inside a background persist, one at a random moment of a random step.
    kills = kill_at_random_steps(run_dir, TOTAL, [rng.randrange(12, TOTAL - 6)], rng, SLOW)
    code, out = run_worker(run_dir, TOTAL)
    assert code == 0, out
    assert len(kills) == 2, kills
    assert final_digest(run_dir) == dict_reference
    rows = metric_rows(run_dir)
    assert [s for s, _ in rows] == list(range(1, TOTAL + 1))
    # Two parameter groups: each group's LR is logged, group 1 at half of group 0.
    for _, m in rows:
        assert m["lr"] == m["lr/group-0"] and math.isclose(m["lr/group-1"], 0.5 * m["lr/group-0"])


def deterministic(run_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """The logged values a replay must reproduce exactly (not the timings)."""
    return [
        (s, {k: v for k, v in m.items() if k in ("loss", "lr", "grad_norm", "val_loss")})
        for s, m in metric_rows(run_dir)
    ]


ACCUM = ["task_args.dropout=0.0"]  # dropout masks are drawn per micro-batch: off for the tolerance check


@pytest.mark.slow
def test_grad_accum_kill_inside_window_bitwise_and_close_to_big_batch(tmp_path: Path) -> None:
    micro = SHORT + ACCUM + ["train.grad_accum_steps=4", "train.batch_size=2"]
    ref_dir = make_run(tmp_path, "accum4", micro)
    big_dir = make_run(tmp_path, "big", SHORT + ACCUM + ["train.batch_size=8"])
    run_dir = make_run(tmp_path, "killed", micro)
    flag = tmp_path / "in-window"
    # The two uninterrupted runs and the one to kill start together (each start is seconds of
    # imports; the results do not depend on the machine's load).
    refs = [start_worker(d, TOTAL) for d in (ref_dir, big_dir)]
    # The kill, provably inside an accumulation window: micro-batches 1-2 of step 13 are done
    # (their gradients accumulated), 3-4 and the optimizer step are not.
    p = start_worker(run_dir, TOTAL, {"CONVOY_FAULTS": f"micro_stall=13:3:60:{flag}"})
    deadline = time.time() + 180
    while not flag.exists() and p.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert flag.exists(), p.communicate()[0]
    kill_group(p)
    p.wait()
    code, out = run_worker(run_dir, TOTAL)
    assert code == 0, out
    for ref in refs:
        out, _ = ref.communicate(timeout=300)
        assert ref.returncode == 0, out
    # Step 13's window was redone: the resume is from a whole optimizer step before it — a memory
    # tier snapshot (its auto interval follows the machine's load, so any step up to 12), or a disk
    # checkpoint (10, or 5 when a loaded machine had not committed 10 yet at the kill).
    (resumed,) = [e["step"] for e in read_events(run_dir, "resumed")]
    assert 0 < resumed <= 12, resumed
    assert final_digest(run_dir) == final_digest(ref_dir)
    assert deterministic(run_dir) == deterministic(ref_dir)

    # accum 4 x 2 vs accum 1 x 8: the same samples per step, summed in another order.
    a, b = dict(metric_rows(ref_dir)), dict(metric_rows(big_dir))
    worst_loss = max(abs(a[s]["loss"] - b[s]["loss"]) / abs(b[s]["loss"]) for s in a)
    ma = CheckpointStore(ref_dir).load_latest()[1]["state"]["model"]
    mb = CheckpointStore(big_dir).load_latest()[1]["state"]["model"]
    worst_param = max(float((ma[k] - mb[k]).abs().max()) for k in ma)
    rel_norm = math.sqrt(
        sum(float(((ma[k] - mb[k]) ** 2).sum()) for k in ma) / sum(float((mb[k] ** 2).sum()) for k in mb)
    )
    print(
        f"accum 4x2 vs 1x8 over {TOTAL} steps: loss rel diff {worst_loss:.2e}, "
        f"param rel norm diff {rel_norm:.2e}, param max abs diff {worst_param:.2e}"
    )
    # The tolerance README documents: losses within 1e-5 (relative), weights within 1e-3 of their
    # norm and no element further apart than one LR-sized AdamW update (lr 3e-3).
    assert worst_loss < 1e-5 and rel_norm < 1e-3 and worst_param < 3e-3


@pytest.mark.slow
def test_eval_leaves_the_trajectory_alone_and_logs_val_loss_once(tmp_path: Path, dict_reference: str) -> None:
    """The dict task with validation every 4 steps (dict val batches through the task's collate),
    killed twice, ends where the same task without validation ends."""
    from tasks.records.metric_shipping import MetricShipper
    from tasks.records.mlflow_client import client_for
    from tasks.records.mlflow_runs import ensure_mlflow_run
    from training.rundir import load_run_config

    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    run_dir = make_run(
        tmp_path,
        "eval-on",
        SHORT
        + DICT_TASK
        + [
            "train.eval_every=4",
            "train.eval_samples=24",
            "tracking.mlflow=true",
            f"tracking.mlflow_uri={uri}",
            "checkpoint.every_steps=10",
            "checkpoint.memory_every_steps=null",  # resumes from disk: the evaluated steps are replayed
        ],
    )
    cfg = load_run_config(run_dir)
    run_id = ensure_mlflow_run(cfg, run_dir)
    shipper = MetricShipper.for_run(cfg, run_dir)  # what the chunk task runs beside the worker
    assert shipper is not None
    # Two kills past an eval step and before the next checkpoint: steps 12 and 24 (evaluated,
    # logged) are replayed after resuming from 10 and 20.
    for target in (13, 25):
        p = start_worker(run_dir, TOTAL, {"CONVOY_FAULTS": f"slow_step={target + 1}:60"})
        assert wait_for_step(run_dir, p, target, timeout=180) == target, p.communicate()[0]
        time.sleep(1.5)  # an async save commits
        kill_group(p)
        p.wait()
    code, out = run_worker(run_dir, TOTAL)
    assert code == 0, out
    assert shipper.stop(drain_s=30).waiting == 0
    assert final_digest(run_dir) == dict_reference  # eval on, killed twice == eval off, uninterrupted
    assert [e["step"] for e in read_events(run_dir, "resumed")] == [10, 20]
    points = sorted((m.step, m.value) for m in client_for(uri).get_metric_history(run_id, "val_loss"))
    assert [s for s, _ in points] == list(range(4, TOTAL + 1, 4))  # exactly once per eval step
    assert points == [(s, m["val_loss"]) for s, m in metric_rows(run_dir) if "val_loss" in m]
    verified = read_events(run_dir, "replay_verified")
    assert len(verified) == 2 and not read_events(run_dir, "replay_mismatch")


def test_eval_phase_has_its_own_limit() -> None:
    """A validation longer than stall_s (and save_timeout_s) is not a hang; past eval_timeout_s it is."""
    import os

    from tasks.supervision.worker_liveness import DetectionLimits, Watch, failure_verdict
    from training.heartbeat import Beat

    heartbeat = ["stall_s=2", "timeout_s=4", "save_timeout_s=3", "eval_timeout_s=10"]
    lim = DetectionLimits.from_config(load_config(None, [f"heartbeat.{h}" for h in heartbeat]))
    t = time.time()
    w = Watch(started=t - 1, phase="eval", phase_since=t - 1, progress=t - 1)
    for after in (3.0, 8.0):  # past stall_s and save_timeout_s, beats still coming
        beat = Beat(os.getpid(), 0, 12, "eval", t + after, t - 1)
        assert failure_verdict(w, [beat], 1, lim, t + after) is None
    beat = Beat(os.getpid(), 0, 12, "eval", t + 9.5, t - 1)
    verdict = failure_verdict(w, [beat], 1, lim, t + 9.6)
    assert verdict is not None and verdict.kind == "hang"
    assert "phase eval" in verdict.reason and "limit 10" in verdict.reason


def build_custom_step_task(config: RunConfig, device: torch.device) -> TaskParts:
    """The char GPT with its own update: clipping per parameter instead of the global norm."""
    parts = char_gpt.build(config, device)

    def train_step(model: torch.nn.Module, batch: Any, optimizer: torch.optim.Optimizer, scaler: Any) -> dict:
        loss = parts.loss_fn(model, batch)
        loss.backward()
        for p in model.parameters():
            if p.grad is not None:
                torch.nn.utils.clip_grad_norm_([p], 0.5)
        optimizer.step()
        return {"loss": float(loss.detach()), "custom": 1.0}

    parts.train_step = train_step
    return parts


def test_task_train_step_escape_hatch(tmp_path: Path) -> None:
    """The task's own update runs; convoy still steps the schedule, moves the cursor, saves and
    logs.  Run in this process (no subprocess start) for a few steps."""
    from training.config import ConfigError
    from training.rundir import load_run_config
    from training.task import build_task
    from training.worker import Worker

    task = ["task=tests.test_real_models:build_custom_step_task", "train.total_steps=6", "train.chunk_steps=6"]
    run_dir = make_run(tmp_path, "custom", SHORT + task)
    worker = Worker(run_dir, 6)
    try:
        assert worker.run() == 0
    finally:
        if worker.lease is not None:
            worker.lease.release()
    rows = metric_rows(run_dir)
    assert [s for s, _ in rows] == list(range(1, 7)) and all(m["custom"] == 1.0 for _, m in rows)
    assert rows[0][1]["lr"] != rows[3][1]["lr"]  # the scheduler was stepped by convoy
    ck = CheckpointStore(run_dir).latest_valid(record=False)
    assert ck is not None and ck.step == 6
    cfg = load_run_config(run_dir).model_copy(deep=True)
    cfg.train.grad_accum_steps = 2
    with pytest.raises(ConfigError, match="grad_accum_steps"):
        build_task(cfg, torch.device("cpu"))


def build_random_eval_task(config: RunConfig, device: torch.device) -> TaskParts:
    """A loss that draws from every global RNG stream, in training and in validation alike."""
    import random as py_random

    import numpy as np

    parts = char_gpt.build(config, device)
    plain = parts.loss_fn

    def loss_fn(m: torch.nn.Module, batch: Any) -> torch.Tensor:
        noise = torch.rand(()) + py_random.random() + float(np.random.rand())
        return plain(m, batch) + 0.0 * noise

    parts.loss_fn = loss_fn
    return parts


def test_evaluate_restores_every_rng_stream_and_the_train_mode(tmp_path: Path) -> None:
    """In-process: whatever the task's loss draws during validation, the training streams are
    as before it, and the model is back in train mode."""
    import random as py_random

    import numpy as np

    from training.worker import Worker

    run_dir = make_run(
        tmp_path,
        "rng",
        SHORT + ["task=tests.test_real_models:build_random_eval_task", "train.eval_every=1", "train.eval_samples=8"],
    )
    worker = Worker(run_dir, TOTAL)
    try:
        worker.setup()
        worker.restore()
        worker.parts.model.train()
        before = (torch.get_rng_state().clone(), py_random.getstate(), np.random.get_state()[1].copy())
        val = worker.evaluate()["val_loss"]
        after = (torch.get_rng_state(), py_random.getstate(), np.random.get_state()[1])
        assert math.isfinite(val) and worker.parts.model.training
        assert torch.equal(before[0], after[0]) and before[1] == after[1] and (before[2] == after[2]).all()
        assert worker.evaluate() == {"val_loss": val}  # deterministic order, same weights: same value
    finally:
        worker.hb.stop()
        if worker.lease is not None:
            worker.lease.release()


@pytest.mark.slow
def test_two_ranks_accumulate_and_evaluate_like_one(tmp_path: Path) -> None:
    """DDP (gloo, 2 ranks): no_sync on the first micro-batch, one all-reduce per optimizer step,
    validation split over the ranks and all-reduced; same losses as one rank on the same global
    micro-batches up to the all-reduce's summation order (dropout off)."""
    extra = (
        SHORT
        + ACCUM
        + [
            "train.total_steps=12",
            "train.chunk_steps=12",
            "train.grad_accum_steps=2",
            "train.eval_every=6",
            "train.eval_samples=12",
        ]
    )
    one = make_run(tmp_path, "one-rank", extra)
    two = make_run(tmp_path, "two-ranks", extra + ["train.ranks=2"])
    p2 = torchrun(two, 12, 2)
    code, out = run_worker(one, 12)
    assert code == 0, out
    finish(p2)
    a, b = dict(metric_rows(one)), dict(metric_rows(two))
    assert sorted(a) == sorted(b) == list(range(1, 13))
    for step in a:
        assert math.isclose(a[step]["loss"], b[step]["loss"], rel_tol=1e-5), step
    assert [s for s in b if "val_loss" in b[s]] == [6, 12]
    for step in (6, 12):
        assert math.isclose(a[step]["val_loss"], b[step]["val_loss"], rel_tol=1e-5)
