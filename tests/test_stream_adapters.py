"""Third-party streams resumed exactly through convoy's adapters (training/datapipe/stream_adapters/):
Lightning's ``litdata.StreamingDataset`` over a dataset written by ``litdata.optimize``, MosaicML's
``StreamingDataset`` over one written by ``MDSWriter`` and an HF ``datasets.IterableDataset`` with
``.map`` augmentation — every dataset written here, in a temporary directory.

The end-to-end tests run real ``python -m training.worker`` processes, SIGKILL their process
groups (loader workers included) twice at random steps and resume (the machinery of
tests/pipeline_util.py); the reference and the killed run of one case run side by side.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine_util import final_digest, run_worker
from tests.flow_util import assert_no_leftovers, config, in_thread, params, wait_for_step
from tests.pipeline_tasks import add_noise, write_mds
from tests.pipeline_util import BASE, TOTAL, cli, side_by_side, step_ids
from training.checkpointing.store import CheckpointStore
from training.config import ConfigError
from training.datapipe.streams import make_stream_loader

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lit_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The samples written by ``litdata.optimize`` (in a subprocess: it switches the process's
    multiprocessing start method to spawn)."""
    pytest.importorskip("litdata")
    out = str(tmp_path_factory.mktemp("litdata"))
    code = f"from tests.pipeline_tasks import write_litdata; write_litdata({out!r})"
    rc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rc.returncode == 0, rc.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def mds_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The samples written by MosaicML's ``MDSWriter``.  Afterwards, the shared memory that this
    module's killed MosaicML processes left behind is removed (a run of the suite left ~40 files;
    ``clean_stale_shared_memory`` stops at the first free prefix, so it misses most of them)."""
    from training.datapipe.stream_adapters.mosaic import streaming_base

    try:
        streaming_base()
    except ConfigError as exc:
        pytest.skip(str(exc))
    from streaming.base.constant import SHM_TO_CLEAN  # MosaicML's own list of its names

    mosaic_shm = re.compile(rf"\d{{6}}_({'|'.join(map(re.escape, SHM_TO_CLEAN))})")  # <prefix>_<name>
    shm = Path("/dev/shm")
    before = set(os.listdir(shm)) if shm.is_dir() else set()
    out = str(tmp_path_factory.mktemp("mds"))
    write_mds(out)
    yield out
    for name in set(os.listdir(shm)) - before if shm.is_dir() else ():
        if mosaic_shm.fullmatch(name):
            (shm / name).unlink(missing_ok=True)


def lit_stream(path: str) -> Any:
    import litdata

    from training.datapipe.stream_adapters.litdata import LitDataStream

    return LitDataStream(litdata.StreamingDataset(path, shuffle=True, seed=7, transform=add_noise))


def mosaic_stream(path: str, batch: int = 4) -> Any:
    from training.datapipe.stream_adapters.mosaic import MosaicStream, streaming_base

    class Augmented(streaming_base().StreamingDataset):
        def __getitem__(self, i: int) -> dict[str, Any]:
            return add_noise(super().__getitem__(i))

    return MosaicStream(Augmented(local=path, batch_size=batch, shuffle=True, shuffle_seed=7))


def read(stream: Any, workers: int, batches: int, saved: dict[str, Any] | None = None) -> tuple[list, dict]:
    """``batches`` batches of 4 through convoy's stream loader, and its saved state after them."""
    loader = make_stream_loader(
        stream, seed=1, rank=0, per_rank_batch=4, num_workers=workers, collate_fn=None, saved=saved
    )
    try:
        out = [next(loader) for _ in range(batches)]
        return out, json.loads(json.dumps(loader.state_dict()))
    finally:
        loader.close()


def same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    """The same sample ids and bitwise the same (augmented) features, batch by batch."""
    return len(a) == len(b) and all(
        torch.equal(x["id"], y["id"]) and torch.equal(x["x"], y["x"]) for x, y in zip(a, b, strict=True)
    )


# ---------------------------------------------------------------- in process (fast)
def test_litdata_and_mosaic_resume_at_any_batch(lit_dir: str, mds_dir: str) -> None:
    """Two loader workers, a resume after 5 batches (worker 1's turn, both workers' batches
    prefetched): the batches continue bitwise, augmentation included.  litdata's state is computed
    in the training process (it raises in a worker); MosaicML re-stripes the rest of its order
    from worker 0, so its resume with 0 workers is exact too, and so is its run."""
    for name, make in (("litdata", lambda: lit_stream(lit_dir)), ("mosaic", lambda: mosaic_stream(mds_dir))):
        full, full_state = read(make(), 2, 12)
        head, state = read(make(), 2, 5)
        assert state["batches"] == 5 and "main" in state, name
        assert state["next_worker"] == (1 if name == "litdata" else 0), name  # MosaicML: from worker 0
        tail, tail_state = read(make(), 2, 7, state)
        assert same(head + tail, full) and tail_state == full_state, name  # the saved state too
        assert len({i for b in full for i in b["id"].tolist()}) == 48, name
    tail_0, _ = read(mosaic_stream(mds_dir), 0, 7, state)
    assert same(head + tail_0, full)
    assert same(read(mosaic_stream(mds_dir), 0, 12)[0], full)  # the same run whatever the workers


def test_what_an_adapter_cannot_resume_exactly_is_refused_in_one_line(lit_dir: str, mds_dir: str) -> None:
    """litdata resumed with other loader workers, a MosaicML dataset partitioned for another batch
    size, an HF stream with a shuffle buffer or fewer shards than workers, a foreign dataset."""
    datasets = pytest.importorskip("datasets")
    from training.datapipe.stream_adapters.hf_datasets import HFStream
    from training.datapipe.stream_adapters.litdata import LitDataStream

    _, state = read(lit_stream(lit_dir), 2, 3)
    table = datasets.Dataset.from_dict({"id": list(range(8))})
    refusals = {
        "-S data.num_workers=2": lambda: read(lit_stream(lit_dir), 0, 1, state),
        "build it with batch_size=4": lambda: read(mosaic_stream(mds_dir, batch=8), 0, 1),
        "shuffle buffer's contents are not in its state_dict": lambda: HFStream(
            table.to_iterable_dataset().shuffle(seed=0, buffer_size=4)
        ),
        "num_shards=2": lambda: HFStream(table.to_iterable_dataset(num_shards=1), num_workers=2),
        "wraps a litdata.StreamingDataset": lambda: LitDataStream(table),
    }
    for needle, refused in refusals.items():
        with pytest.raises(ConfigError) as exc:
            refused()
        assert needle in str(exc.value) and "\n" not in str(exc.value), (needle, str(exc.value))


def test_validate_builds_each_adapter_task_and_fetches_its_first_batches(
    tmp_path: Path, data_dir: Path, lit_dir: str, mds_dir: str
) -> None:
    """``convoy validate`` (the CLI) on each adapter task with 2 loader workers: exit 0; a MosaicML
    dataset built for another batch size: exit 2, one line.  No run directory either way."""
    pytest.importorskip("datasets")
    where = [f"runs_dir={tmp_path / 'runs'}", f"data.prepared_dir={data_dir}", "data.synthetic_chars=20000"]
    common = sum([["-S", w] for w in [*where, "data.num_workers=2", "train.batch_size=8"]], [])
    for task, path in (("litdata", lit_dir), ("mosaic", mds_dir), ("hf_map", None)):
        args = ["-S", f"task=tests.pipeline_tasks:build_{task}", *(["-S", f"task_args.dir={path}"] if path else [])]
        code, lines = cli("validate", *args, *common)
        assert code == 0 and "first batches fetched" in lines[-1], (task, lines)
    code, lines = cli(
        "validate", "-S", "task=tests.pipeline_tasks:build_mosaic", "-S", f"task_args.dir={mds_dir}",
        "-S", "task_args.batch=16", *common,
    )  # fmt: skip
    assert code == 2 and len(lines) == 1 and "build it with batch_size=8" in lines[0], lines
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- end to end (real kills)
@pytest.mark.slow
@pytest.mark.parametrize("library", ["litdata", "mosaic", "hf_map"])
def test_a_third_party_stream_killed_twice_resumes_bitwise_each_sample_once_in_order(
    tmp_path: Path, library: str, request: pytest.FixtureRequest
) -> None:
    """With 0 and 2 loader workers, a run SIGKILLed twice at random steps ends with the
    uninterrupted run's digest and trained the same sample ids at every step, each once.  MosaicML
    (one global order, samples seeded by their place in it) also trains the same model, optimizer
    and RNG states with 0 and 2 workers, and a run killed with 2 workers and resumed with 0 ends
    bitwise as the 0-worker run."""
    pytest.importorskip("datasets")
    path = {"litdata": "lit_dir", "mosaic": "mds_dir"}.get(library)
    args = [f"task_args.dir={request.getfixturevalue(path)}"] if path else []
    cfg = lambda n: [*BASE, f"task=tests.pipeline_tasks:build_{library}", *args, f"data.num_workers={n}"]  # noqa: E731
    runs = {f"{n}-ref": (cfg(n),) for n in (0, 2)} | {f"{n}-killed": (cfg(n), 20 + n) for n in (0, 2)}
    if library == "mosaic":  # killed with 2 loader workers, resumed with 0
        runs["2-then-0"] = (cfg(2), 24, cfg(0))
    out = side_by_side(tmp_path, runs)
    for n in (0, 2):
        ref, killed = out[f"{n}-ref"], out[f"{n}-killed"]
        assert len(killed["kills"]) == 2 and killed["digest"] == ref["digest"], (library, n, killed["kills"])
        ids = step_ids(killed["dir"])
        assert ids == step_ids(ref["dir"]), (library, n)
        flat = sum(ids, [])
        assert len(flat) == len(set(flat)) == TOTAL * 8, (library, n)
    if library == "mosaic":  # only the stream's own record (num_workers) differs
        for name in ("2-ref", "2-then-0"):
            assert trained_state(out[name]["dir"]) == trained_state(out["0-ref"]["dir"]), name
            assert step_ids(out[name]["dir"]) == step_ids(out["0-ref"]["dir"]), name
        assert out["2-then-0"]["digest"] == out["0-ref"]["digest"]  # ends as a 0-worker run


def trained_state(run_dir: Path) -> dict[str, str]:
    """Hashes of the final checkpoint's model, optimizer, scheduler, cursor and RNG files: all but
    ``rank-<r>.json``, which holds the stream's position (and so ``data.num_workers``)."""
    ck = CheckpointStore(run_dir).latest_valid(record=False)
    assert ck is not None
    files = json.loads((ck.path / "manifest.json").read_text())["files"]
    return {name: f["xxh3_128"] for name, f in files.items() if name != "rank-0.json"}


@pytest.mark.slow
def test_litdata_through_the_flow_killed_in_both_chunks_resumes_bitwise(
    prefect_api: str, data_dir: Path, tmp_path: Path, lit_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Prefect flow (two chunks of 12 steps, 2 loader workers): the worker SIGKILLed inside
    each chunk, each chunk retried once, and the run ends with the digest and the per-step sample
    ids of one uninterrupted worker."""
    from flows.train import run_training
    from training.rundir import open_run

    monkeypatch.setenv("CONVOY_FAULTS", "step_delay=0.05")  # a step lasts a few heartbeats
    sections: dict[str, Any] = {
        "task": "tests.pipeline_tasks:build_litdata",
        "task_args": {"dir": lit_dir},
        "train": {"total_steps": TOTAL, "chunk_steps": TOTAL // 2, "batch_size": 8, "lr": 0.05},
        "data": {"num_workers": 2},
        "checkpoint": {"every_steps": 4, "keep_last": 2},
    }
    ref_dir = open_run(config(params(tmp_path / "ref", data_dir, "ref", **sections))).resolve()
    code, output = run_worker(ref_dir, TOTAL)
    assert code == 0, output
    cfg = config(params(tmp_path, data_dir, "flow", **sections))
    killed: list[int] = []

    def killer() -> None:
        for target in (7, 18):  # inside chunk 1 ([0, 12)) and chunk 2 ([12, 24))
            beat = wait_for_step(cfg.run_dir, target)
            os.kill(beat.pid, signal.SIGKILL)
            killed.append(beat.step)

    t = in_thread(killer)
    summary = run_training(cfg)
    t.join(timeout=10)
    assert not t.errors and len(killed) == 2, (t.errors, killed)  # type: ignore[attr-defined]
    assert summary["attempts"] == {1: 2, 2: 2}, summary["attempts"]
    assert summary["digest"] == final_digest(ref_dir), killed
    run_dir = cfg.run_dir.resolve()
    assert step_ids(run_dir) == step_ids(ref_dir)
    assert_no_leftovers(run_dir)
