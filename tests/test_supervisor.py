"""Supervisor unit tests against a *stand-in* worker (no torch, no Prefect, starts in ~50 ms).

The stand-in speaks the worker's contract — heartbeat JSON in ``heartbeat/rank-0.json``, exit
codes 0/75/78 — and misbehaves on request, so every detection path and the process-group cleanup
are exercised with real signals in a few seconds.  The real worker is covered by test_flow.py.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from tasks.supervision.attempt import AttemptSpec, ParkedSince, WorkerSlots
from tasks.supervision.failure_kinds import classify_exit
from tasks.supervision.handoff import Replacement
from tasks.supervision.replacement import replace_parked
from tasks.supervision.supervisor import ChunkFailed, supervise
from tasks.supervision.worker_handle import WorkerHandle, spawn
from tasks.supervision.worker_liveness import RANK_GONE_GRACE_S, DetectionLimits, Watch, failure_verdict, lost_rank
from training.config import load_config
from training.events import read_events
from training.heartbeat import Beat, read_heartbeat
from training.tracking.attempts import AttemptId
from training.tracking.failure_record import FailureDetails

STANDIN = textwrap.dedent(
    r'''
    """Stand-in worker for supervisor tests: beats like training.worker, misbehaves on request."""
    import json, os, signal, subprocess, sys, threading, time
    run_dir, mode, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    hb = os.path.join(run_dir, "heartbeat", "rank-0.json")
    os.makedirs(os.path.dirname(hb), exist_ok=True)
    state = {"step": 0, "phase": "init", "progress_time": time.time(), "beating": True}
    def beat():
        tmp = f"{hb}.{threading.get_ident()}.tmp"  # the beater and the last beat() may write at once
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "rank": 0, "step": state["step"], "phase": state["phase"],
                       "time": time.time(), "progress_time": state["progress_time"]}, f)
        os.replace(tmp, hb)
    def beater():
        while True:
            if state["beating"]:
                beat()
            time.sleep(0.05)
    def on_term(*_):
        print("emergency checkpoint", flush=True)
        sys.exit(75)
    if mode == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, on_term)
    beat()
    threading.Thread(target=beater, daemon=True).start()
    if mode in ("children", "setsid-child"):
        for _ in range(2):
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", run_dir],
                             start_new_session=(mode == "setsid-child"))
    if mode == "config":
        print("config error: data.path = 'x': file not found", file=sys.stderr, flush=True)
        sys.exit(78)
    if mode == "no-beat":
        state["beating"] = False
        time.sleep(600)
    if mode == "slow-save":
        state["phase"] = "save"; time.sleep(1.5)
    state["phase"] = "train"
    for i in range(1, steps + 1):
        time.sleep(0.05)
        state["step"] = i; state["progress_time"] = time.time()
        print(f"step {i}", flush=True)
        if i == steps // 2:
            if mode == "crash":
                print("Traceback: boom", file=sys.stderr, flush=True); sys.exit(3)
            if mode == "oom-text":
                print("RuntimeError: CUDA out of memory", file=sys.stderr, flush=True); sys.exit(1)
            if mode == "diskfull":
                print("Traceback (most recent call last):\n  ...", file=sys.stderr, flush=True)
                print("OSError: [Errno 28] No space left on device: 'ckpt'", file=sys.stderr, flush=True)
                sys.exit(1)
            if mode == "segv":
                os.kill(os.getpid(), signal.SIGSEGV)
            if mode in ("hang", "children", "setsid-child", "ignore-term"):
                time.sleep(600)  # alive, beating, no progress
            if mode == "silent":
                state["beating"] = False; time.sleep(600)
            if mode == "preempt-self":
                os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)
    state["phase"] = "done"; beat()
    if mode == "linger-after-done":  # beats stop at "done" by design; the exit may take a while
        state["beating"] = False; time.sleep(1.5)
    sys.exit(0)
    '''
)

#: Limits a stand-in crosses within seconds: a beat every 0.05 s (the poll follows it).
FAST_SETTINGS = [
    "heartbeat.interval_s=0.05",
    "heartbeat.stall_s=1",
    "heartbeat.timeout_s=1",
    "heartbeat.init_timeout_s=3",
    "heartbeat.save_timeout_s=3",
    "heartbeat.grace_s=1",
]


def limits(*overrides: str) -> DetectionLimits:
    """The detection limits of a config with :data:`FAST_SETTINGS` and then ``overrides``."""
    return DetectionLimits.from_config(load_config(None, [*FAST_SETTINGS, *overrides]))


FAST = limits()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    (d / "heartbeat").mkdir(parents=True)
    (d / "checkpoints").mkdir()
    return d


def standin(tmp_path: Path, run_dir: Path, mode: str, steps: int = 20) -> list[str]:
    script = tmp_path / "standin_worker.py"
    script.write_text(STANDIN)
    return [sys.executable, str(script), str(run_dir), mode, str(steps)]


def leftovers(run_dir: Path) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(run_dir) in " ".join(p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            continue
    return out


def run(
    tmp_path: Path, run_dir: Path, mode: str, limits: DetectionLimits = FAST, steps: int = 20
) -> ChunkFailed | float:
    t0 = time.monotonic()
    try:
        cmd = standin(tmp_path, run_dir, mode, steps)
        supervise(AttemptSpec(cmd, run_dir, limits, run_dir / "logs" / "x.log", id=AttemptId(0, 1)))
    except ChunkFailed as exc:
        assert not leftovers(run_dir), f"processes left after {mode}"
        return exc
    assert not leftovers(run_dir)
    return time.monotonic() - t0


def test_success_tees_output(tmp_path: Path, run_dir: Path) -> None:
    assert isinstance(run(tmp_path, run_dir, "ok"), float)
    log = (run_dir / "logs" / "x.log").read_text()
    assert "step 20" in log and "# convoy exit=0" in log
    assert not read_events(run_dir, "failure")


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("crash", "crash"),
        ("config", "config"),
        ("oom-text", "oom"),
        ("segv", "crash"),
        ("preempt-self", "preempted"),
        ("diskfull", "diskfull"),
    ],
)
def test_exit_classification(tmp_path: Path, run_dir: Path, mode: str, kind: str) -> None:
    exc = run(tmp_path, run_dir, mode)
    assert isinstance(exc, ChunkFailed) and exc.kind == kind, exc
    ev = read_events(run_dir, "failure")[-1]
    assert ev["failure"] == kind and ev["chunk"] == 0 and ev["attempt"] == 1
    assert ev["last_beat_step"] is not None or mode == "config"
    if kind == "config":
        assert "file not found" in exc.message and not exc.retryable


def test_hang_is_detected_and_group_stopped(tmp_path: Path, run_dir: Path) -> None:
    exc = run(tmp_path, run_dir, "hang")
    assert isinstance(exc, ChunkFailed) and exc.kind == "hang", exc
    assert "no step progress" in exc.message
    assert exc.details.detected_after_s is not None and 1.0 <= exc.details.detected_after_s < 2.0
    assert exc.details.last_beat_step == 10


def test_a_silent_worker_whose_process_lives_is_a_hang(tmp_path: Path, run_dir: Path) -> None:
    # stall_s > timeout_s so the missing beat, not the missing progress, is what fires; its
    # process is alive (asleep), so it is hung, not dead (issue 31: a hang is a hang).
    exc = run(tmp_path, run_dir, "silent", limits("heartbeat.stall_s=5"))
    assert isinstance(exc, ChunkFailed) and exc.kind == "hang", exc
    assert "no heartbeat for" in exc.message and "alive but silent" in exc.message, exc.message


def test_a_worker_that_stops_beating_after_its_first_beat_is_a_hang(tmp_path: Path, run_dir: Path) -> None:
    exc = run(tmp_path, run_dir, "no-beat", limits("heartbeat.timeout_s=0.5", "heartbeat.init_timeout_s=60"))
    # The first beat is written before the beat thread starts; after that, silence from a live process.
    assert isinstance(exc, ChunkFailed) and exc.kind == "hang", exc


def test_sigstop_with_the_default_limits_is_a_hang_and_sigkill_is_killed(tmp_path: Path, run_dir: Path) -> None:
    """The defaults have stall_s (20) > timeout_s (10), so a stopped worker's beats stop before
    its steps look stalled: still a hang, and the text names the missing signal of life."""
    defaults = limits("heartbeat.stall_s=3", "heartbeat.timeout_s=1")  # the defaults' order, in seconds
    signalled: set[int] = set()  # the first run's beat file stays behind: never signal its pid again
    for sig, kind, said in ((signal.SIGSTOP, "hang", "stopped"), (signal.SIGKILL, "killed", "SIGKILL")):
        threading.Thread(target=_signal_at_step, args=(run_dir, 10, sig, signalled), daemon=True).start()
        exc = run(tmp_path, run_dir, "hang", defaults)
        assert isinstance(exc, ChunkFailed) and exc.kind == kind, exc
        assert said in exc.message, exc.message
        if sig == signal.SIGSTOP:
            assert "no heartbeat for" in exc.message, exc.message


def _signal_at_step(run_dir: Path, step: int, sig: int, signalled: set[int]) -> None:
    """Signal the stand-in once its beat reports ``step`` (where the "hang" mode stops stepping);
    a beat from a pid in ``signalled`` is an earlier run's and is waited past."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        beat = read_heartbeat(run_dir, 0)
        if beat is not None and beat.step >= step and beat.phase == "train" and beat.pid not in signalled:
            signalled.add(beat.pid)
            os.kill(beat.pid, sig)
            return
        time.sleep(0.01)


def test_save_phase_has_its_own_limit(tmp_path: Path, run_dir: Path) -> None:
    # A 1.5 s save with stall_s 1: must not count as a stalled step afterwards.
    assert isinstance(run(tmp_path, run_dir, "slow-save"), float)
    exc = run(tmp_path, run_dir, "slow-save", limits("heartbeat.save_timeout_s=0.5"))
    assert isinstance(exc, ChunkFailed) and exc.kind == "hang" and "phase save" in exc.message


def test_deadline(tmp_path: Path, run_dir: Path) -> None:
    exc = run(tmp_path, run_dir, "ok", limits("orchestration.chunk_deadline_s=0.4"), steps=100)
    assert isinstance(exc, ChunkFailed) and exc.kind == "timeout"


@pytest.mark.parametrize("mode", ["children", "setsid-child", "ignore-term"])
def test_every_descendant_is_reaped(tmp_path: Path, run_dir: Path, mode: str) -> None:
    """Grandchildren (also ones that left the group) and a SIGTERM-ignoring worker all end."""
    exc = run(tmp_path, run_dir, mode)
    assert isinstance(exc, ChunkFailed) and exc.kind == "hang"
    assert read_events(run_dir, "failure")[-1]["leftover_pids"] == []


def test_external_sigkill_is_killed(tmp_path: Path, run_dir: Path) -> None:
    import threading

    def killer() -> None:
        for _ in range(200):
            time.sleep(0.05)
            try:
                pid = int(__import__("json").loads((run_dir / "heartbeat" / "rank-0.json").read_text())["pid"])
            except (OSError, ValueError):
                continue
            os.kill(pid, signal.SIGKILL)
            return

    t = threading.Thread(target=killer)
    t.start()
    exc = run(tmp_path, run_dir, "ok", steps=200)
    t.join()
    assert isinstance(exc, ChunkFailed) and exc.kind == "killed" and "SIGKILL" in exc.message


def test_classify_exit_oom_counter() -> None:
    assert classify_exit(-9, [], 0, 1) == "oom"
    assert classify_exit(137, [], 3, 4) == "oom"
    assert classify_exit(-9, [], 0, 0) == "killed"
    assert classify_exit(-9, [], None, None) == "killed"
    assert classify_exit(137, [], None, None) == "killed"
    assert classify_exit(-11, [], None, None) == "crash"
    assert classify_exit(1, ["MemoryError"], None, None) == "oom"


def test_chunk_failed_pickles() -> None:
    import pickle

    details = FailureDetails(detected_after_s=1.5, last_committed_step=40, reason="x", tail=["step 41"])
    exc = pickle.loads(pickle.dumps(ChunkFailed("hang", "chunk 1 hang: x", details)))
    assert exc.kind == "hang" and exc.details == details and str(exc) == "chunk 1 hang: x"


def test_done_phase_without_beats_is_not_dead(tmp_path: Path, run_dir: Path) -> None:
    assert isinstance(run(tmp_path, run_dir, "linger-after-done"), float)


def test_a_vanished_rank_is_a_crash_after_the_launcher_grace() -> None:
    """Multi-rank: a rank's pid gone (not finished) while the launcher still runs."""
    import subprocess

    gone = subprocess.Popen(["true"])
    gone.wait()
    now = time.time()
    beats = [
        Beat.from_dict({"rank": 0, "pid": os.getpid(), "phase": "train", "step": 5, "time": now}),
        Beat.from_dict({"rank": 1, "pid": gone.pid, "phase": "train", "step": 5, "time": now - 0.1}),
    ]
    w = Watch(started=now - 10)
    assert lost_rank(w, beats, 2, now) is None  # the launcher gets its grace first
    verdict = lost_rank(w, beats, 2, now + RANK_GONE_GRACE_S)
    assert verdict is not None and verdict.kind == "crash" and "rank 1" in verdict.reason
    assert verdict.detected_after_s >= RANK_GONE_GRACE_S
    assert lost_rank(Watch(started=now), [Beat.from_dict({**beats[1].as_dict(), "phase": "done"})], 2, now + 10) is None
    assert lost_rank(Watch(started=now), beats, 1, now + 10) is None  # single rank: exit code decides


def test_a_worker_stopped_right_after_a_phase_change_is_hung_not_dead() -> None:
    """stall_s == timeout_s (as in `convoy chaos`): the stall clock starts at the beat that first
    shows the phase, never at the later moment the supervisor read it, so a SIGSTOP just after an
    adoption or a boundary save is a hang, as it is anywhere else (a CI run called it dead)."""
    lim = DetectionLimits.from_config(load_config(None, ["heartbeat.stall_s=4", "heartbeat.timeout_s=4"]))
    t = time.time()
    w = Watch(started=t - 0.5, phase="save", phase_since=t - 0.5, progress=t - 0.5)
    beat = Beat(os.getpid(), 0, 69, "train", t, t - 0.01)
    assert failure_verdict(w, [beat], 1, lim, t + 0.35) is None  # the new phase seen a poll and a bit late
    verdict = failure_verdict(w, [beat], 1, lim, t + 4.05)  # the worker was stopped right after t
    assert verdict is not None and verdict.kind == "hang", verdict


DIES_AFTER_BOUNDARY = textwrap.dedent(
    r"""
    import json, os, sys, time
    run_dir = sys.argv[1]
    hb = os.path.join(run_dir, "heartbeat", "rank-0.json")
    def beat(step):
        with open(hb + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "rank": 0, "step": step, "phase": "train", "time": time.time(),
                       "progress_time": time.time()}, f)
        os.replace(hb + ".tmp", hb)
    for step in range(1, 13):
        beat(step)
        if step % 10 == 0:  # a boundary every 10 steps
            d = os.path.join(run_dir, "checkpoints", f"step-{step:09d}")
            os.makedirs(d, exist_ok=True)
            open(os.path.join(d, "manifest.json"), "w").write("{}")
        time.sleep(0.1)
    print("Traceback: RuntimeError: boom between the two chunk tasks", flush=True)
    sys.exit(1)
    """
)


def test_a_worker_that_dies_between_chunk_tasks_is_reported_with_its_last_words(tmp_path: Path, run_dir: Path) -> None:
    """Pipelined: chunk 1 parks the worker at its boundary; it dies before chunk 2 adopts it.  Chunk 2
    reads the log on from where chunk 1 stopped, so its failure quotes what the worker said."""
    script = tmp_path / "dies_after_boundary.py"
    script.write_text(DIES_AFTER_BOUNDARY)
    cmd = [sys.executable, str(script), str(run_dir)]
    log = run_dir / "logs" / "chunk-1.log"
    slots = WorkerSlots.empty(run_dir)  # the run's: chunk 1 parks in it, chunk 2 adopts from it
    out = supervise(AttemptSpec(cmd, run_dir, FAST, log, id=AttemptId(1, 1), boundary_step=10, slots=slots))
    assert out.returncode == 0  # the boundary was committed: chunk 1 is done, the worker parked
    time.sleep(1.5)  # the worker dies while no task watches it
    with pytest.raises(ChunkFailed) as info:
        supervise(
            AttemptSpec(
                cmd, run_dir, FAST, run_dir / "logs" / "chunk-2.log", id=AttemptId(2, 1), boundary_step=20, slots=slots
            )
        )
    assert info.value.kind == "crash" and "boom between the two chunk tasks" in str(info.value), info.value
    assert not leftovers(run_dir)


def test_a_worker_stopped_between_chunk_tasks_is_a_hang_not_a_worker_that_never_beat(
    tmp_path: Path, run_dir: Path
) -> None:
    """Pipelined: the parked worker is SIGSTOPped before chunk 2 adopts it (a fast worker is a few
    steps into the next chunk by then).  Its beats are older than chunk 2's start but its own:
    chunk 2 reports a hang within stall_s, not "no heartbeat" after init_timeout_s."""
    script = tmp_path / "dies_after_boundary.py"
    script.write_text(DIES_AFTER_BOUNDARY)
    cmd = [sys.executable, str(script), str(run_dir)]
    slots = WorkerSlots.empty(run_dir)  # the run's: chunk 1 parks in it, chunk 2 adopts from it
    out = supervise(
        AttemptSpec(cmd, run_dir, FAST, run_dir / "logs" / "c1.log", id=AttemptId(1, 1), boundary_step=10, slots=slots)
    )
    assert out.returncode == 0
    beat = read_heartbeat(run_dir, 0)
    os.kill(beat.pid, signal.SIGSTOP)
    time.sleep(0.5)  # stopped while no task watches it
    t0 = time.monotonic()
    with pytest.raises(ChunkFailed) as info:
        supervise(
            AttemptSpec(
                cmd, run_dir, FAST, run_dir / "logs" / "c2.log", id=AttemptId(2, 1), boundary_step=20, slots=slots
            )
        )
    assert info.value.kind == "hang", info.value
    assert time.monotonic() - t0 < FAST.init_timeout_s + FAST.grace_s, "judged as a worker that never beat"
    assert not leftovers(run_dir)


DIES_AT_BOUNDARY = textwrap.dedent(
    r"""
    import json, os, sys, time
    run_dir = sys.argv[1]
    hb = os.path.join(run_dir, "heartbeat", "rank-0.json")
    with open(hb + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "rank": 0, "step": 10, "phase": "train", "time": time.time()}, f)
    os.replace(hb + ".tmp", hb)
    print("OSError: [Errno 28] No space left on device: 'step-000000011'", flush=True)
    os.makedirs(os.path.join(run_dir, "checkpoints", "step-000000010"))
    open(os.path.join(run_dir, "checkpoints", "step-000000010", "manifest.json"), "w").write("{}")
    sys.exit(1)
    """
)


def test_a_worker_dead_by_the_time_its_boundary_is_seen_is_classified_by_the_next_chunk(
    tmp_path: Path, run_dir: Path
) -> None:
    """Pipelined: the worker said why it fails, committed the boundary and exited before chunk 1
    saw the commit.  Chunk 1 read those last words and parks the dead worker; chunk 2, which
    reports the death, gets them with it (a disk-full exit is ``diskfull``, not ``crash``)."""
    script = tmp_path / "dies_at_boundary.py"
    script.write_text(DIES_AT_BOUNDARY)
    cmd = [sys.executable, str(script), str(run_dir)]
    slots = WorkerSlots.empty(run_dir)  # the run's: chunk 1 parks in it, chunk 2 adopts from it
    out = supervise(
        AttemptSpec(
            cmd, run_dir, FAST, run_dir / "logs" / "chunk-1.log", id=AttemptId(1, 1), boundary_step=10, slots=slots
        )
    )
    assert out.returncode == 0
    with pytest.raises(ChunkFailed) as info:
        supervise(
            AttemptSpec(
                cmd, run_dir, FAST, run_dir / "logs" / "chunk-2.log", id=AttemptId(2, 1), boundary_step=20, slots=slots
            )
        )
    assert info.value.kind == "diskfull", info.value
    assert not leftovers(run_dir)


def test_disk_full_is_one_line(tmp_path: Path, run_dir: Path) -> None:
    """ENOSPC is its own kind, reported as the line that names it, not the traceback."""
    exc = run(tmp_path, run_dir, "diskfull")
    assert isinstance(exc, ChunkFailed) and exc.kind == "diskfull" and exc.retryable
    assert exc.message == "chunk 0 diskfull: disk full: No space left on device: 'ckpt'"


TRAINS_ON_AFTER_BOUNDARY = textwrap.dedent(
    r"""
    import json, os, sys, time
    run_dir = sys.argv[1]
    hb = os.path.join(run_dir, "heartbeat", "rank-0.json")
    step = 0
    while True:
        step += 1
        with open(hb + ".tmp", "w") as f:
            json.dump({"pid": os.getpid(), "rank": 0, "step": step, "phase": "train", "time": time.time(),
                       "progress_time": time.time()}, f)
        os.replace(hb + ".tmp", hb)
        if step % 10 == 0:  # a boundary every 10 steps
            d = os.path.join(run_dir, "checkpoints", f"step-{step:09d}")
            os.makedirs(d, exist_ok=True)
            open(os.path.join(d, "manifest.json"), "w").write("{}")
        time.sleep(0.05)
    """
)


def test_a_parked_worker_killed_between_chunk_tasks_is_detected_when_it_dies(tmp_path: Path, run_dir: Path) -> None:
    """Pipelined: nobody's task watches the worker between two chunk tasks, but the hand-off
    registry does (its pidfd): the death is detected when it happens, not when the next chunk
    adopts the worker a second later."""
    script = tmp_path / "trains_on.py"
    script.write_text(TRAINS_ON_AFTER_BOUNDARY)
    cmd = [sys.executable, str(script), str(run_dir)]
    slots = WorkerSlots.empty(run_dir)  # the run's: chunk 1 parks in it, chunk 2 adopts from it
    out = supervise(
        AttemptSpec(cmd, run_dir, FAST, run_dir / "logs" / "c1.log", id=AttemptId(1, 1), boundary_step=10, slots=slots)
    )
    assert out.returncode == 0
    killed_at = time.time()
    os.kill(int(read_heartbeat(run_dir, 0).pid), signal.SIGKILL)
    time.sleep(1.0)  # the gap between the two chunk tasks
    with pytest.raises(ChunkFailed) as info:
        supervise(
            AttemptSpec(
                cmd, run_dir, FAST, run_dir / "logs" / "c2.log", id=AttemptId(2, 1), boundary_step=20, slots=slots
            )
        )
    assert info.value.kind == "killed", info.value
    event = read_events(run_dir, "failure")[-1]
    assert event["detected_at"] - killed_at < 0.5, event  # adopted 1 s after the kill
    assert "while parked" in (run_dir / "logs" / "c1.log").read_text()
    assert not leftovers(run_dir)


def test_a_worker_killed_while_parked_is_replaced_at_once_and_one_that_exited_is_not(
    tmp_path: Path, run_dir: Path
) -> None:
    """Issue 30 item 2: the parking's watcher reports a worker killed between two chunk tasks as the
    next chunk's attempt 1 and starts attempt 2's worker there and then, no task involved; the
    events come in the order their readers expect; the next task takes the replacement and adopts
    it like any parked worker.  A parked worker that exited by itself is left to the next task."""
    script = tmp_path / "trains_on.py"
    script.write_text(TRAINS_ON_AFTER_BOUNDARY)
    cmd = [sys.executable, str(script), str(run_dir)]
    slots = WorkerSlots.empty(run_dir)

    def spec_for(attempt: AttemptId) -> AttemptSpec:
        log = run_dir / "logs" / f"c{attempt.chunk}-a{attempt.attempt}.log"
        return AttemptSpec(cmd, run_dir, FAST, log, id=attempt, boundary_step=attempt.end, slots=slots)

    def successor(dead: WorkerHandle, since: ParkedSince) -> Replacement | None:
        return replace_parked(dead, since, AttemptId(2, 0, 10, 20), spec_for)

    first = dataclasses.replace(spec_for(AttemptId(1, 1, 0, 10)), successor=successor)
    assert supervise(first).returncode == 0  # boundary 10 committed: the worker is parked
    parked = slots.parking.parked_pid()
    assert parked is not None
    os.kill(parked, signal.SIGKILL)
    time.sleep(0.5)  # a task comes later: the parking has replaced it by then, on its own
    replaced = slots.parking.take_replacement()
    assert replaced is not None and replaced.kind == "killed", replaced
    assert (replaced.dead_attempt.attempt, replaced.attempt.attempt, replaced.source) == (1, 2, "spawned")
    order = [(e["kind"], e.get("attempt")) for e in read_events(run_dir) if e.get("chunk") == 2]
    assert order == [("attempt_started", 1), ("failure", 1), ("attempt_started", 2)], order
    assert slots.parking.parked_pid() == replaced.worker.pid and replaced.worker.poll() is None
    adopted = supervise(spec_for(AttemptId(2, 2, 10, 20)))  # the next task adopts the replacement
    assert adopted.returncode == 0 and slots.parking.parked_pid() == replaced.worker.pid
    slots.release()
    exited = spawn([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "exited.log", "t", cwd=None, env={})
    assert exited.wait_exit(30)
    assert replace_parked(exited, ParkedSince(0, None), AttemptId(3, 0, 20, 30), spec_for) is None
    assert not [e for e in read_events(run_dir) if e.get("chunk") == 3]  # the next task judges it
    assert not leftovers(run_dir)


def test_failure_details_read_back_as_they_were_written() -> None:
    """The failure event lists every field the supervisor fills, None included (readers of older
    runs expect the keys); the rest only when set; a pool node's mapping reads back the same."""
    details = FailureDetails(detected_after_s=0.2, last_committed_step=40, reason="signal SIGKILL", log="x.log")
    written = details.as_dict()
    assert list(written)[:10] == [
        "detected_after_s",
        "last_beat_step",
        "trained_to",
        "last_committed_step",
        "steps_lost",
        "passed_over",
        "returncode",
        "reason",
        "error",
        "log",
    ]
    assert written["trained_to"] is None and "tail" not in written and "flow_runs" not in written
    assert FailureDetails.from_dict({**written, "added_by_a_newer_node": 1}) == details
    assert details.resume_step == 40 and FailureDetails().resume_step is None


@pytest.mark.parametrize("pidfd", [True, False])
def test_the_death_of_a_process_that_is_not_our_child_wakes_its_watch(
    pidfd: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker adopted or called from the standby may not be this thread's child: its death is
    seen through a pidfd as soon as it happens (or by polling where the kernel has no pidfd)."""
    import subprocess

    from tasks.supervision.worker_handle import DeathWatch

    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    shell = subprocess.run(
        ["sh", "-c", "sleep 30 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True, check=True
    )
    orphan = int(shell.stdout.strip())  # its parent (the shell) is gone: not our child
    watch = DeathWatch(orphan)
    assert (watch.fd is not None) == pidfd, "this kernel has no pidfd: only the fallback is tested"
    assert not watch.wait(0.1)
    os.kill(orphan, signal.SIGKILL)
    t0 = time.monotonic()
    assert watch.wait(5.0)
    assert time.monotonic() - t0 < 0.5
    watch.close()
