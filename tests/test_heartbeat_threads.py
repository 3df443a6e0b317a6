"""Two threads of one worker write one heartbeat file (issue 28.4).

The worker beats from its main thread as it enters training while the heartbeat thread beats
on its interval. With one temporary name per process, one thread renamed the other's file away
and the rename of the second failed with FileNotFoundError (28 in 2,148 beats at 0.1 s).
"""

from __future__ import annotations

import threading
import time

from training.fsutil import atomic_write_json, read_json
from training.heartbeat import Heartbeat, read_heartbeat


def test_main_thread_beats_beside_the_heartbeat_thread_without_error(tmp_path):
    hb = Heartbeat(tmp_path, rank=0, interval_s=0.01).start()
    errors: list[BaseException] = []
    beats = 0
    deadline = time.monotonic() + 3.0
    try:
        while time.monotonic() < deadline:
            try:
                hb.set(step=beats)
                hb.beat()
            except OSError as exc:  # the failure this test exists for
                errors.append(exc)
            beats += 1
    finally:
        hb.stop()
    assert beats > 1000, f"only {beats} beats in 3 s: the test did not race"
    assert errors == [], f"{len(errors)} of {beats} beats failed, first: {errors[0]!r}"
    beat = read_heartbeat(tmp_path, 0)
    assert beat is not None and beat.phase == "done"
    assert not list((tmp_path / "heartbeat").glob(".*.tmp")), "a temporary file was left behind"


def test_the_atomic_write_helper_is_safe_from_many_threads(tmp_path):
    """The fix lives in the one helper, so every writer of a shared file has it."""
    target = tmp_path / "shared.json"
    errors: list[BaseException] = []

    def write(n: int) -> None:
        for i in range(400):
            try:
                atomic_write_json(target, {"writer": n, "i": i}, durable=False)
            except OSError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert read_json(target)["i"] == 399
