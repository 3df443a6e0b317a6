"""The memory tier's writer thread (training/checkpointing/writer_thread.py): jobs in order, their
errors raised to whoever waits, a name the worker's thread audit knows, nothing left running."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from training.checkpointing.memory import memory_tier
from training.checkpointing.writer_thread import NAME, WriterThread
from training.loop import hermetic


def test_jobs_run_in_order_on_one_known_thread_and_errors_reach_the_caller() -> None:
    before = set(threading.enumerate())
    writer, seen = WriterThread(), []
    assert set(threading.enumerate()) == before  # started by its first job, not before
    first = writer.submit(lambda: seen.append(threading.current_thread().name) or 1)
    second = writer.submit(lambda x: seen.append(x) or x * 2, 21)
    assert (first.result(5), second.result(5)) == (1, 42)
    assert seen == [NAME, 21]
    assert hermetic.is_known(NAME)  # the audit of threads beside training knows it (invariant 12)

    def full() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        writer.submit(full).result(5)
    assert writer.submit(lambda: "still there").result(5) == "still there"
    (thread,) = set(threading.enumerate()) - before
    writer.shutdown()
    assert not thread.is_alive()


def test_a_writer_dropped_without_shutdown_stops_its_thread() -> None:
    before = set(threading.enumerate())
    writer = WriterThread()
    writer.submit(lambda: None).result(5)
    (thread,) = set(threading.enumerate()) - before
    assert thread.name == NAME
    del writer
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_the_worker_copies_beside_the_loop_only_with_a_cpu_left_free() -> None:
    """A copy beside the loop on a CPU the step uses too only moves its cost into the step
    (bench/RESULTS.md): the tier copies beside the loop only when torch's threads leave a CPU."""
    cpus, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        torch.set_num_threads(cpus)
        assert not memory_tier.spare_cpu()
        if cpus > 1:
            torch.set_num_threads(cpus - 1)
            assert memory_tier.spare_cpu()
            assert not memory_tier.spare_cpu(ranks=2)  # two ranks' threads on this node fill it
    finally:
        torch.set_num_threads(threads)
