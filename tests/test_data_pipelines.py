"""Exact resume for the data pipelines long runs use (invariant 9), with tasks written as a user
would (tests/pipeline_tasks.py): augmentation drawn in ``__getitem__`` inside loader workers, and
streams (a sharded stateful ``IterableDataset``, an HF ``datasets`` stream).  The end-to-end tests
run real ``python -m training.worker`` processes and SIGKILL their process groups (loader workers
included); the scenarios of one test run side by side (each worker start is seconds of imports).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from tests.pipeline_util import BASE, TOTAL, cli, side_by_side, step_ids
from training.config import ConfigError
from training.datapipe.data import Cursor, LoaderSpec, make_loader
from training.datapipe.streams import check_stream, make_stream_loader

CNN = [*BASE, "task=tests.pipeline_tasks:build_cnn"]
COUNTER = [*BASE, "task=tests.pipeline_tasks:build_counter"]
HF = [*BASE, "task=tests.pipeline_tasks:build_hf_logged"]


# ---------------------------------------------------------------- unit tests (fast)
class Draws(Dataset):
    """Sample i: (i, a draw from torch, numpy and python's global generators)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, torch.rand(1).item(), np.random.rand(), random.random()], dtype=torch.float64)


def _rows(spec: LoaderSpec, batches: int, num_workers: int = 0) -> torch.Tensor:
    loader = make_loader(Draws(), spec, num_workers=num_workers)
    return torch.cat(list(itertools.islice(iter(loader), batches)))


def test_a_sample_draws_the_same_whoever_fetches_it() -> None:
    """Same draws per sample with 0, 2 and 4 loader workers, on 1 rank or split over 2, with
    accumulation 4 x 2 or one batch of 8, and from a restored cursor."""
    one = _rows(LoaderSpec(8, 3, Cursor()), 10)  # two epochs of 5 batches
    assert torch.equal(one, _rows(LoaderSpec(8, 3, Cursor()), 10, num_workers=2))
    assert torch.equal(one, _rows(LoaderSpec(8, 3, Cursor()), 10, num_workers=4))
    assert torch.equal(one, _rows(LoaderSpec(2, 3, Cursor(), accum=4), 40))
    ranks = [_rows(LoaderSpec(8, 3, Cursor(), rank=r, world_size=2), 10) for r in (0, 1)]
    assert torch.equal(
        one, torch.cat([torch.cat([a, b]) for a, b in zip(ranks[0].split(4), ranks[1].split(4), strict=True)])
    )
    assert torch.equal(one[56:], _rows(LoaderSpec(8, 3, Cursor(1, 16)), 3))
    # Not a constant: epochs differ, samples differ.
    assert not torch.equal(one[:40, 1:].sort(0).values, one[40:, 1:].sort(0).values)


def test_a_task_naming_only_torch_gets_the_same_torch_draws_and_a_bad_name_is_refused() -> None:
    """``sample_rngs=("torch",)`` seeds torch alone: the torch column is the full seeding's and
    still independent of the worker count; an unknown generator name is a one-line error."""
    full = _rows(LoaderSpec(8, 3, Cursor()), 5)

    def torch_only(workers: int) -> torch.Tensor:
        loader = make_loader(Draws(), LoaderSpec(8, 3, Cursor()), num_workers=workers, sample_rngs=("torch",))
        return torch.cat(list(itertools.islice(iter(loader), 5)))

    assert torch.equal(full[:, :2], torch_only(0)[:, :2])
    assert torch.equal(full[:, :2], torch_only(2)[:, :2])
    with pytest.raises(ValueError, match="name one or more of"):
        make_loader(Draws(), LoaderSpec(8, 3, Cursor()), sample_rngs=("cuda",))


def test_fetching_in_the_training_process_leaves_its_generators_alone() -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    _rows(LoaderSpec(8, 3, Cursor()), 3)
    assert torch.equal(before[0], torch.get_rng_state())
    assert (before[1] == np.random.get_state()[1]).all() and before[2] == random.getstate()


def test_stream_loader_resumes_at_the_next_worker_without_losing_prefetched_batches() -> None:
    """Counter stream, 2 loader workers: batches handed out after a resume from the state saved
    after 5 batches (worker 1 next, batches of both workers prefetched) continue the stream."""
    from tests.pipeline_tasks import ShardedCounter

    def loader(saved: dict[str, Any] | None) -> Any:
        return make_stream_loader(
            ShardedCounter(0, 1), seed=1, rank=0, per_rank_batch=4, num_workers=2, collate_fn=None, saved=saved
        )

    first = loader(None)
    full = [next(first)["id"].tolist() for _ in range(9)]
    again = loader(None)
    head = [next(again)["id"].tolist() for _ in range(5)]
    state = json.loads(json.dumps(again.state_dict()))
    assert state["next_worker"] == 1 and head == full[:5]
    resumed = loader(state)
    assert [next(resumed)["id"].tolist() for _ in range(4)] == full[5:]
    # Worker 0 (shard 0: even ids) made 5 batches, worker 1 (odd ids) 4: every id once, in order.
    assert sum(full[::2], []) == list(range(0, 40, 2)) and sum(full[1::2], []) == list(range(1, 32, 2))


class Finite(torch.utils.data.IterableDataset):
    """Three samples, then the end."""

    def __iter__(self):  # noqa: ANN204 - a generator
        yield from (torch.tensor([i]) for i in range(3))

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_that_ends_is_a_one_line_data_error(workers: int) -> None:
    batches = make_stream_loader(
        Finite(), seed=1, rank=0, per_rank_batch=2, num_workers=workers, collate_fn=None, saved=None
    )
    next(batches)  # worker 0's first batch
    with pytest.raises(ConfigError) as exc:
        for _ in range(3):
            next(batches)
    assert str(exc.value).startswith("train_data: the stream of rank 0, loader worker") and "\n" not in str(exc.value)
    assert "endless stream" in str(exc.value)
    assert batches.it is None  # the loader's workers are stopped with the error, not left for exit


def test_streams_convoy_cannot_resume_are_refused_in_one_line() -> None:
    from tests.pipeline_tasks import Stateless

    with pytest.raises(ConfigError) as exc:
        check_stream(Stateless())
    assert "train_data" in str(exc.value) and "tests.pipeline_tasks.Stateless" in str(exc.value)
    assert "state_dict()" in str(exc.value) and "\n" not in str(exc.value)
    datasets = pytest.importorskip("datasets")
    shuffled = datasets.Dataset.from_dict({"id": list(range(8))}).to_iterable_dataset().shuffle(seed=0, buffer_size=4)
    with pytest.raises(ConfigError, match="shuffle buffer's contents are not in its state_dict"):
        check_stream(shuffled)


def test_validate_and_train_refuse_before_any_run_exists(tmp_path: Path, data_dir: Path) -> None:
    """A stream without state (validate and train), a collate error and a shuffle-buffer stream
    (validate): exit 2, one line naming the data, no run directory, nothing retried."""
    where = [f"runs_dir={tmp_path / 'runs'}", f"data.prepared_dir={data_dir}", "data.synthetic_chars=20000"]
    params = tmp_path / "absent.yaml"
    for command in ("validate", "train"):
        code, lines = cli(
            command,
            "params.yaml",
            "-S",
            "task=tests.pipeline_tasks:build_stateless",
            *sum([["-S", w] for w in where], []),
        )
        assert code == 2 and len(lines) == 1, lines
        assert "train_data is a tests.pipeline_tasks.Stateless" in lines[0] and "load_state_dict" in lines[0]
    code, lines = cli(
        "validate", "-S", "task=tests.pipeline_tasks:build_bad_collate", *sum([["-S", w] for w in where], [])
    )
    assert code == 2 and len(lines) == 1 and "train_data: fetching the first batch failed: TypeError" in lines[0], lines
    pytest.importorskip("datasets")
    hf = ["-S", "task=training.examples.hf_stream:build", "-S", "task_args.shuffle_buffer=16"]
    code, lines = cli("validate", *hf, *sum([["-S", w] for w in where], []))
    assert code == 2 and len(lines) == 1 and "shuffle(buffer_size=...)" in lines[0], lines
    code, lines = cli("validate", "-S", "task=training.examples.hf_stream:build", *sum([["-S", w] for w in where], []))
    assert code == 0 and "first batches fetched" in lines[-1], lines
    assert not (tmp_path / "runs").exists() and not params.exists()


# ---------------------------------------------------------------- end to end (real kills)
@pytest.mark.slow
def test_cnn_with_augmentation_in_workers_resumes_bitwise_whatever_the_workers(tmp_path: Path) -> None:
    """The CNN task: killed twice with 0, 2 and 4 loader workers, and started with 2 workers,
    killed, resumed with 0: every run ends with the digest of the uninterrupted 0-worker run
    (so a run with 2 workers and one with 0 end alike)."""
    workers = lambda n: [*CNN, f"data.num_workers={n}"]  # noqa: E731
    out = side_by_side(
        tmp_path,
        {
            "reference": (workers(0),),
            "killed-0": (workers(0), 1),
            "killed-2": (workers(2), 2),
            "killed-4": (workers(4), 4),
            "2-then-0": (workers(2), 5, workers(0)),
        },
    )
    for name, run in out.items():
        assert run["digest"] == out["reference"]["digest"], (name, run["kills"])
        assert len(run["kills"]) == (0 if name == "reference" else 2)


@pytest.mark.slow
def test_streams_resume_bitwise_and_train_each_sample_once_in_order(tmp_path: Path) -> None:
    """The sharded counter stream and the HF datasets stream, with 0 and 2 loader workers: killed
    twice, each ends with the uninterrupted run's digest and trained the same samples at every
    step, each sample once; the counter's ids are exactly its shards' in order."""
    pytest.importorskip("datasets")
    runs: dict[str, tuple] = {}
    for task, extra in (("counter", COUNTER), ("hf", HF)):
        for n in (0, 2):
            cfg = [*extra, f"data.num_workers={n}"]
            runs[f"{task}-{n}-ref"], runs[f"{task}-{n}-killed"] = (cfg,), (cfg, 10 + n)
    out = side_by_side(tmp_path, runs)
    for name in (n for n in out if n.endswith("-killed")):
        ref, killed = out[name.replace("-killed", "-ref")], out[name]
        assert killed["digest"] == ref["digest"] and len(killed["kills"]) == 2, (name, killed["kills"])
        ids = step_ids(killed["dir"])
        assert ids == step_ids(ref["dir"]), name
        flat = sum(ids, [])
        assert len(set(flat)) == len(flat) == TOTAL * 8, name
    counter_0, counter_2 = (sum(step_ids(out[f"counter-{n}-killed"]["dir"]), []) for n in (0, 2))
    assert counter_0 == list(range(TOTAL * 8))  # one shard: 0, 1, 2, ...
    assert sum(step_ids(out["counter-2-killed"]["dir"])[::2], []) == list(range(0, TOTAL * 8, 2))  # worker 0's shard
    assert sorted(counter_2) == list(range(TOTAL * 8))
