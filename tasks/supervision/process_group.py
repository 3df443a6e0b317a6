"""Process-group lifecycle of a worker: die with the supervisor, stop and reap every descendant.

Why: a killed worker must leave nothing behind (no orphaned ranks, no zombies, no held ports), and a
worker must not outlive a supervisor that died (it would keep writing checkpoints while a re-run
starts a second one).  Linux-specific where it has to be (``prctl(PR_SET_PDEATHSIG)``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from training.events import EXIT_PREEMPTED, Event, append_event
from training.heartbeat import read_heartbeat

_PR_SET_PDEATHSIG = 1
try:  # resolved in the parent: dlopen inside a forked child of a threaded process can deadlock
    _PRCTL: Any = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def child_setup(parent_pid: int) -> Callable[[], None]:
    """preexec: ask the kernel to SIGTERM the worker if the supervising thread dies.

    Without this a SIGKILLed flow process leaves its worker training on, unsupervised, writing
    checkpoints while a re-run starts a second one.  SIGTERM lets it save an emergency checkpoint.
    """

    def setup() -> None:
        if _PRCTL is not None:
            _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(EXIT_PREEMPTED)

    return setup


def pid_gone(pid: int) -> bool:
    """Exited (or a zombie awaiting its parent); False when we cannot tell."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> list[int]:
    """SIGTERM the worker's group, wait ``grace_s``, SIGKILL, reap. Returns pids still alive (bug).

    Descendants are collected *before* anything is signalled: once the worker dies its children
    are re-parented and can no longer be found from it.  Any that left the process group
    (``setsid``) are signalled one by one.
    """
    try:
        root = psutil.Process(proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []
    pgid = proc.pid  # start_new_session=True: the group id is the worker's pid

    def signal_all(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)

    signal_all(signal.SIGTERM)
    # A stopped (SIGSTOPped) process only acts on SIGTERM once continued; this lets it save.
    signal_all(signal.SIGCONT)
    _wait_gone(proc, procs, grace_s)
    if _alive(procs) or proc.poll() is None:
        signal_all(signal.SIGKILL)
        _wait_gone(proc, procs, 10.0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    return [p.pid for p in procs if _is_live(p)]


def _is_live(p: psutil.Process) -> bool:
    """Running and not a zombie.  A zombie whose parent is not us is its parent's to reap."""
    try:
        if p.status() == psutil.STATUS_ZOMBIE:
            if p.ppid() == os.getpid():
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(p.pid, os.WNOHANG)
            return False
        return p.is_running()
    except psutil.Error:
        return False


def _alive(procs: list[psutil.Process]) -> bool:
    return any(_is_live(p) for p in procs)


def _wait_gone(proc: subprocess.Popen[bytes], procs: list[psutil.Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.poll()  # reap the direct child as soon as it exits
        if proc.returncode is not None and not _alive(procs):
            return
        time.sleep(0.05)


def reap_stale_worker(run_dir: Path, ranks: int = 1, grace_s: float = 5.0) -> list[int]:
    """Stop a worker of this run left over from a supervisor that died (caller holds the run lock).

    Identified by the heartbeat's pid *and* a command line naming the run directory, so a recycled
    pid is never touched.  Returns the pids that were stopped.
    """
    stopped = []
    for r in range(ranks):
        beat = read_heartbeat(run_dir, r)
        if not beat or not beat.is_local:  # a remote node's ranks end with their launcher
            continue
        try:
            p = psutil.Process(beat.pid)
            if str(run_dir) not in " ".join(p.cmdline()) or p.status() == psutil.STATUS_ZOMBIE:
                continue
            group = [p, *p.children(recursive=True)]
            for q in group:
                with contextlib.suppress(psutil.Error):
                    q.terminate()
            _gone, alive = psutil.wait_procs(group, timeout=grace_s)
            for q in alive:
                with contextlib.suppress(psutil.Error):
                    q.kill()
            psutil.wait_procs(alive, timeout=5)
            stopped.append(p.pid)
        except (psutil.Error, KeyError, ValueError):
            continue
    if stopped:
        append_event(run_dir, Event.STALE_WORKER_STOPPED, pids=stopped)
    return stopped
