"""Resumable data order: pure epoch order, O(1) cursor restore, disjoint rank slices."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

from training.datapipe.data import Cursor, LoaderSpec, ResumableBatchSampler, TokenWindows, epoch_order, make_loader


class CountingDataset(Dataset):
    """Sample i is the tensor [i]; counts every read."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.reads += 1
        return torch.tensor([i])


def test_epoch_order_is_a_pure_function_of_seed_and_epoch() -> None:
    assert torch.equal(epoch_order(1000, 7, 3), epoch_order(1000, 7, 3))
    assert not torch.equal(epoch_order(1000, 7, 3), epoch_order(1000, 7, 4))
    assert not torch.equal(epoch_order(1000, 7, 3), epoch_order(1000, 8, 3))


def test_restoring_cursor_touches_no_earlier_sample() -> None:
    n, batch = 2_000_000, 64
    ds = CountingDataset(n)
    start = Cursor(epoch=3, offset=1_000_000)
    loader = make_loader(ds, LoaderSpec(batch, seed=5, start=start))
    first = next(iter(loader))
    assert ds.reads == batch  # exactly one batch materialised, nothing before the cursor
    expected = epoch_order(n, 5, 3)[1_000_000 : 1_000_000 + batch]
    assert torch.equal(first.flatten(), expected)


def test_resumed_stream_equals_uninterrupted_stream_across_epochs() -> None:
    n, batch = 100, 16  # 6 batches per epoch, 4 samples dropped
    full = list(itertools.islice(iter(ResumableBatchSampler(n, LoaderSpec(batch, 1, Cursor()))), 20))
    cursor = Cursor()
    for _ in range(9):
        cursor = cursor.advance(batch, n)
    assert cursor == Cursor(epoch=1, offset=48)
    resumed = list(itertools.islice(iter(ResumableBatchSampler(n, LoaderSpec(batch, 1, cursor))), 11))
    assert resumed == full[9:]


def test_ranks_take_disjoint_slices_of_the_global_batch() -> None:
    n, batch, world = 500, 12, 3
    global_batches = list(itertools.islice(iter(ResumableBatchSampler(n, LoaderSpec(batch, 2, Cursor()))), 5))
    per_rank = [
        list(itertools.islice(iter(ResumableBatchSampler(n, LoaderSpec(batch, 2, Cursor(), r, world))), 5))
        for r in range(world)
    ]
    for i, gb in enumerate(global_batches):
        parts = [per_rank[r][i] for r in range(world)]
        assert sum(parts, []) == gb
        assert len(set(sum(parts, []))) == batch


def test_worker_processes_give_the_same_batches() -> None:
    ds = TokenWindows(torch.arange(5000) % 251, seq_len=8)
    start = Cursor(1, 40)
    a = list(itertools.islice(iter(make_loader(ds, LoaderSpec(8, 3, start), num_workers=0)), 6))
    b = list(itertools.islice(iter(make_loader(ds, LoaderSpec(8, 3, start), num_workers=2)), 6))
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_loader_start_does_not_consume_global_rng() -> None:
    ds = TokenWindows(torch.arange(5000) % 251, seq_len=8)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    next(iter(make_loader(ds, LoaderSpec(8, 3, Cursor()), num_workers=2)))
    assert torch.equal(before, torch.get_rng_state())


def test_metrics_reader_skips_only_a_torn_last_line(tmp_path: Path) -> None:
    """One rule for every reader of metrics.jsonl: a torn last line is a kill mid-append and is
    skipped; a damaged line before it is an error that names the line."""
    from training.tracking.metrics import read_metric_lines

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "metrics": {"loss": 2.5}}\n{"step": 2, "metrics": {"loss": 2.4}}\n{"step": 3, "met')
    assert list(read_metric_lines(path)) == [(1, {"loss": 2.5}), (2, {"loss": 2.4})]
    path.write_text('{"step": 1, "metrics": {"loss": 2.5}}\nnot json\n{"step": 3, "metrics": {"loss": 2.3}}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a metrics row"):
        list(read_metric_lines(path))
    assert list(read_metric_lines(tmp_path / "absent.jsonl")) == []


def test_metrics_reader_windows_drop_only_a_line_cut_at_their_start(tmp_path: Path) -> None:
    """``from_byte`` (one attempt's rows) and ``tail_bytes`` (status) start inside the file: a line
    the window cuts is left out, a line the window starts exactly at is kept."""
    from training.tracking.metrics import read_metric_lines
    from training.tracking.resume_audit import trained_high_water

    path = tmp_path / "metrics.jsonl"
    rows = ['{"step": 1, "metrics": {"loss": 2.5}}', '{"step": 2, "metrics": {"loss": 2.4}}']
    path.write_text("\n".join(rows) + "\n")
    second = len(rows[0]) + 1
    assert [s for s, _ in read_metric_lines(path, from_byte=second)] == [2]
    assert [s for s, _ in read_metric_lines(path, from_byte=second - 5)] == [2]  # inside row 1
    assert [s for s, _ in read_metric_lines(path, from_byte=10_000)] == []
    assert [s for s, _ in read_metric_lines(path, tail_bytes=len(rows[1]) + 1)] == [2]
    # A worker cut a torn row off and appended: the attempt's old end offset lands inside a row.
    assert trained_high_water(tmp_path, beat_step=1, metrics_offset=second + 3) == 1
    assert trained_high_water(tmp_path, beat_step=None, metrics_offset=0) == 2


def test_samples_consumed_counts_every_trained_sample_across_epochs_and_for_streams() -> None:
    """Each optimizer step consumes one global batch, whichever epoch it falls in (the dropped
    tail of an epoch is never trained on, so it is not counted); a stream's cursor is the count."""
    size, batch = 50, 16  # 3 whole batches an epoch, 2 samples dropped
    cursor, stream = Cursor(), Cursor()
    for step in range(1, 11):
        cursor, stream = cursor.advance(batch, size), stream.advance(batch, None)
        assert cursor.samples_consumed(batch, size) == step * batch
        assert stream.samples_consumed(batch, None) == step * batch
    assert cursor.epoch == 3 and stream.epoch == 0
