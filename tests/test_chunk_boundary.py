"""The chunk-boundary hand-off protocol's rules (training.chunk_boundary), without processes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from training import chunk_boundary as cb


def test_the_worker_waits_for_the_boundary_before_the_one_it_commits() -> None:
    assert cb.previous_boundary(20, 10) == 10  # committing boundary 20 needs 10 acknowledged
    assert cb.previous_boundary(25, 10) == 20  # the final save at 25 needs 20
    assert cb.previous_boundary(10, 10) == 0  # the first boundary needs nothing (step 0)


def test_a_worker_waits_until_the_flow_acknowledges_and_not_for_what_it_did_not_produce(tmp_path: Path) -> None:
    assert cb.acknowledged_step(tmp_path) == -1
    assert cb.wait_for_previous_boundary(tmp_path, 20, 10, resumed_step=10, stop=lambda: False) == 0.0
    threading.Timer(0.2, cb.acknowledge, (tmp_path, 10)).start()
    waited = cb.wait_for_previous_boundary(tmp_path, 20, 10, resumed_step=0, stop=lambda: False)
    assert waited >= 0.15 and cb.acknowledged_step(tmp_path) == 10


def test_a_stop_request_ends_the_wait(tmp_path: Path) -> None:
    t0 = time.monotonic()
    cb.wait_for_previous_boundary(tmp_path, 20, 10, resumed_step=0, stop=lambda: time.monotonic() - t0 > 0.1)
    assert time.monotonic() - t0 < 2


def test_the_flow_acknowledges_only_once_the_version_is_staged(tmp_path: Path) -> None:
    staged = threading.Event()
    threading.Timer(0.2, staged.set).start()
    t0 = time.monotonic()
    cb.acknowledge(tmp_path, 10, staged, timeout_s=5)
    assert time.monotonic() - t0 >= 0.15 and cb.acknowledged_step(tmp_path) == 10


def test_only_pipelined_chunks_before_the_last_hand_their_worker_over() -> None:
    assert cb.boundary_step(10, 30, pipelined=True) == 10
    assert cb.boundary_step(30, 30, pipelined=True) is None  # the last chunk ends with the worker's exit
    assert cb.boundary_step(10, 30, pipelined=False) is None


def test_a_boundary_counts_as_committed_once_its_manifest_exists(tmp_path: Path) -> None:
    from training.paths import RunPaths

    assert not cb.boundary_committed(tmp_path, 10)
    ck = RunPaths(tmp_path).checkpoint(10)
    ck.mkdir(parents=True)
    assert not cb.boundary_committed(tmp_path, 10)  # a directory being written is not a commit
    (ck / "manifest.json").write_text("{}")
    assert cb.boundary_committed(tmp_path, 10)


def test_retention_keeps_the_newest_boundary_while_the_newest_checkpoint_is_not_one() -> None:
    assert cb.boundary_to_keep(25, [24, 20, 12, 10], 10) == 20
    assert cb.boundary_to_keep(30, [25, 20], 10) is None  # the newest is itself the boundary
    assert cb.boundary_to_keep(25, [24, 20], 0) is None  # no chunks: no extra keep
    assert cb.boundary_to_keep(5, [3, 1], 10) is None  # no boundary yet
