"""The worker zygote (issue: no interpreter start on any recovery path).

A worker forked by the run's zygote trains bitwise what a spawned one does (with and without
loader workers); the zygote is fork-safe (no CUDA, no thread but its main one); a killed worker's
status comes back through the zygote, a killed zygote is replaced while its workers train on, and
every recovery of a real flow run — a kill in chunk 1, a kill of the adopted pipelined worker, two
kills 5 s apart, the zygote itself killed — is a fork of the zygote, ending on the uninterrupted
digest with no process left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from engine_util import make_run, run_worker

from tasks.supervision.worker_zygote import WorkerZygote
from tests.flow_util import CHUNK, TOTAL, assert_no_leftovers, config, in_thread, params, wait_for_step
from training.checkpointing.store import CheckpointStore
from training.events import Event, read_events
from training.heartbeat import read_heartbeat


def _cmd(run_dir: Path, until: int) -> list[str]:
    return [sys.executable, "-m", "training.worker", "--run-dir", str(run_dir), "--until-step", str(until)]


def _fork(zygote: WorkerZygote, run_dir: Path, until: int, env: dict[str, str] | None = None) -> Any:
    handle = zygote.fork(
        _cmd(run_dir, until),
        run_dir / "logs" / "forked.log",
        "test",
        cwd=os.getcwd(),
        env={**os.environ, **(env or {})},
    )
    assert handle is not None, "the zygote did not fork"
    return handle


def _digest(run_dir: Path) -> str:
    checkpoint = CheckpointStore(run_dir).latest_valid(record=False)
    assert checkpoint is not None
    return checkpoint.digest


CNN = ["task=tests.pipeline_tasks:build_cnn", "data.num_workers=2", "train.batch_size=16"]


@pytest.mark.parametrize("extra", [[], CNN], ids=["char-gpt", "cnn-2-loader-workers"])
def test_a_forked_worker_trains_bitwise_what_a_spawned_one_does(tmp_path: Path, extra: list[str]) -> None:
    forked, spawned = make_run(tmp_path / "f", extra=extra), make_run(tmp_path / "s", extra=extra)
    zygote = WorkerZygote(forked)
    try:
        ready = zygote.wait_ready(120)
        assert ready is not None and ready.pid == zygote.pid
        assert ready.cuda_initialized is False and ready.hazards == [], ready  # the fork-safety rules
        t0 = time.monotonic()
        handle = _fork(zygote, forked, 30)
        fork_s = time.monotonic() - t0
        assert psutil.Process(handle.pid).ppid() == zygote.pid  # no interpreter was started for it
        assert handle.proc.wait(300) == 0, (forked / "logs" / "forked.log").read_text()
    finally:
        zygote.close()
    code, out = run_worker(spawned, 30)
    assert code == 0, out
    assert _digest(forked) == _digest(spawned)
    started = read_events(forked, Event.STARTED)
    assert [e["forked_by"] for e in started] == [ready.pid] and read_events(spawned, Event.STARTED)[0][
        "forked_by"
    ] is None
    print(f"\nfork took {fork_s * 1000:.1f} ms, the zygote's imports {ready.import_s:.2f} s")
    assert not psutil.pid_exists(ready.pid) or psutil.Process(ready.pid).status() == psutil.STATUS_ZOMBIE


def test_a_killed_zygote_is_replaced_and_its_worker_trains_on(tmp_path: Path) -> None:
    run_dir = make_run(tmp_path)
    zygote = WorkerZygote(run_dir)
    try:
        first = zygote.wait_ready(120)
        assert first is not None
        slow = _fork(zygote, run_dir, 60, {"CONVOY_FAULTS": "step_delay=0.05"})
        wait_for_step(run_dir, 5)
        os.kill(first.pid, signal.SIGKILL)  # the worker's parent: it goes on training
        deadline = time.monotonic() + 120
        while zygote.pid == first.pid and time.monotonic() < deadline:
            time.sleep(0.05)
        second = zygote.wait_ready(120)
        assert second is not None and second.pid != first.pid
        assert slow.proc.wait(300) == 0  # its own word: the zygote that would have reported it is gone
        assert _digest(run_dir) and read_events(run_dir, Event.ZYGOTE_REPLACED)[0]["pid"] == first.pid
        victim = _fork(zygote, run_dir, 120, {"CONVOY_FAULTS": "step_delay=0.05"})
        assert psutil.Process(victim.pid).ppid() == second.pid
        wait_for_step(run_dir, 65)
        os.kill(victim.pid, signal.SIGKILL)
        assert victim.proc.wait(30) == -signal.SIGKILL  # reported by the new zygote
    finally:
        zygote.close()
    assert_no_leftovers(run_dir)


def test_every_recovery_of_a_flow_run_is_a_fork_of_the_zygote(
    prefect_api: str,
    data_dir: Path,
    tmp_path: Path,
    reference_digest: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Kills: in chunk 1 (the worker the first attempt forked), between chunks 1 and 2 (the worker
    parked at the boundary, before chunk 2's task adopts it: replaced at once, issue 30 item 2), in
    chunk 2 (the pipelined worker chunk 2 adopted), the zygote itself in chunk 2, and two in chunk 3,
    5 s apart (the second lands in a stall of the replacement, armed by the first).  Every worker
    start is a fork (``forked_by``), the run ends on the uninterrupted digest, and nothing is left
    running."""
    from flows.train import run_training
    from training import faults

    flag = tmp_path / "stall"
    # Chunk 2's task waits (a slow Prefect) until the parked worker was killed and reported.  Each
    # worker stalls 5 s at step CHUNK + 7, so the adopted kill (after its step CHUNK + 6) lands in
    # chunk 2 however long that task takes to adopt the replacement: at 20 steps a second it once
    # took 2 s, and the replacement had passed the boundary (a parked death, one life short).
    hold = tmp_path / "chunk-2-may-start"
    faults_spec = f"step_delay=0.05,slow_flag={flag}:20,handoff_hold=2:{hold},slow_step={CHUNK + 7}:5"
    monkeypatch.setenv("CONVOY_FAULTS", faults_spec)
    faults.reset()  # this process reads CONVOY_FAULTS once (the flow's tasks are its threads)
    caplog.set_level(logging.INFO, logger="convoy.handoff")  # why a parked worker was not replaced
    cfg = config(params(tmp_path, data_dir, "zygote", heartbeat={"stall_s": 30}, orchestration={"retries": 3}))
    run_dir = cfg.run_dir.resolve()
    kills: list[tuple[str, int]] = []

    def kill(step: int, what: str) -> float:
        beat = wait_for_step(run_dir, step)
        os.kill(beat.pid, signal.SIGKILL)
        kills.append((what, beat.step))
        return time.monotonic()

    def killer() -> None:
        kill(8, "chunk 1")
        while not read_events(run_dir, Event.CHUNK_DONE):  # chunk 1 committed: its worker is parked
            time.sleep(0.01)
        kills.append(("parked", -1))
        parked_at = time.time()
        os.kill(read_heartbeat(run_dir, 0).pid, signal.SIGKILL)
        replaced_at.append(parked_at)
        deadline = time.monotonic() + 90
        while not [e for e in read_events(run_dir, Event.ATTEMPT_STARTED) if e.get("replaces")]:
            if time.monotonic() > deadline:  # say why, and let the run go on (chunk 2's task adopts it dead)
                hold.touch()
                handoff = [r.getMessage() for r in caplog.records if r.name == "convoy.handoff"]
                kinds = [(e["kind"], e.get("chunk"), e.get("attempt")) for e in read_events(run_dir)]
                raise AssertionError(f"the parked worker was not replaced: {handoff} {kinds[-12:]}")
            time.sleep(0.01)  # reported and replaced by the parking, no task: chunk 2's may go on now
        hold.touch()
        released_at.append(time.time())  # not the file's mtime: the kernel stamps it from a coarse clock (~4 ms)
        while not read_events(run_dir, Event.ATTEMPT_RECORDED):  # chunk 2's task has the replacement
            time.sleep(0.01)
        kill(CHUNK + 6, "adopted")
        wait_for_step(run_dir, CHUNK + 8)  # the retry trains: forked by the first zygote
        first_zygote = read_events(run_dir, Event.STARTED)[0]["forked_by"]
        os.kill(first_zygote, signal.SIGKILL)
        kills.append(("zygote", first_zygote))
        first = kill(2 * CHUNK + 3, "chunk 3")
        flag.touch()  # the replacement stalls at its next step: the second kill lands there
        time.sleep(max(0.0, first + 5.0 - time.monotonic()))
        beat = wait_for_step(run_dir, 2 * CHUNK)
        os.kill(beat.pid, signal.SIGKILL)
        kills.append(("5 s later", beat.step))

    replaced_at: list[float] = []
    released_at: list[float] = []
    t = in_thread(killer)
    try:
        summary = run_training(cfg)
    finally:
        monkeypatch.delenv("CONVOY_FAULTS")
        faults.reset()
    t.join(timeout=5)
    assert not t.errors, t.errors  # type: ignore[attr-defined]
    assert [k[0] for k in kills] == ["chunk 1", "parked", "adopted", "zygote", "chunk 3", "5 s later"], kills
    assert summary["final_step"] == TOTAL and summary["digest"] == reference_digest
    events = read_events(run_dir)
    starts = [e for e in events if e["kind"] in (Event.STARTED, Event.RESUMED)]
    assert len(starts) == 6 and all(e["forked_by"] for e in starts), starts
    assert len({e["forked_by"] for e in starts}) == 2  # the killed zygote, then its replacement
    assert [e["failure"] for e in events if e["kind"] == Event.FAILURE] == ["killed"] * 5
    assert len(read_events(run_dir, Event.ZYGOTE_REPLACED)) == 1
    check_replaced_at_once(events, replaced_at[0], released_at[0])
    assert_no_leftovers(run_dir)


def check_replaced_at_once(events: list[dict[str, Any]], killed_at: float, task_released: float) -> None:
    """The worker killed while parked (chunk 2's attempt 1, ``parked``) was reported and replaced
    by the parking while chunk 2's task was held (a slow Prefect): its failure, then the
    replacement's attempt, before the task was let go, then its worker restoring, in the order every
    reader of the events expects; the task recorded attempt 2 (``attempt_recorded``) and Prefect saw
    no retry (``resubmitted``: replaced)."""
    chunk2 = [e for e in events if e.get("chunk") == 2 and e["time"] >= killed_at]
    kinds = [(e["kind"], e.get("attempt")) for e in chunk2 if e["kind"] != Event.CHECKPOINT_SAVED][:5]
    assert kinds[:3] == [(Event.ATTEMPT_STARTED, 1), (Event.FAILURE, 1), (Event.ATTEMPT_STARTED, 2)], kinds
    started = [e for e in chunk2 if e["kind"] == Event.ATTEMPT_STARTED]
    assert started[0]["parked"] and started[1]["replaces"] == 1, started
    assert started[1]["time"] <= task_released + 0.001, started  # before chunk 2's task could (ms-rounded)
    recorded = next(e for e in chunk2 if e["kind"] == Event.ATTEMPT_RECORDED)
    resumed = next(e for e in events if e["kind"] == Event.RESUMED and e["time"] >= killed_at)
    assert started[1]["time"] <= resumed["time"] and recorded["attempt"] == 2, (resumed, recorded)
    resubmitted = [e for e in events if e["kind"] == Event.RESUBMITTED]
    # The kill in chunk 3 may land while that chunk's worker is parked too: replaced the same way.
    assert [(e["chunk"], e["reason"]) for e in resubmitted][:1] == [(2, "replaced")], resubmitted
    assert {e["reason"] for e in resubmitted} == {"replaced"}, resubmitted
