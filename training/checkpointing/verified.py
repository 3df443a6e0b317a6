"""The resume point, and each checkpoint verified once for as long as it is unchanged.

Verifying a checkpoint hashes every byte of it.  One flow process asks "which checkpoint does the
next worker resume from?" several times per attempt (the attempt's start, its failure report, the
chunk's failure details, the failure hook, the flow's summary), and each used to walk and hash the
run's checkpoints again.  A :class:`Verdicts` memo, held by one :class:`~training.checkpointing.store.CheckpointStore`
object that those callers share, keeps each verdict (the checkpoint, or why it was rejected) keyed by
what is on disk: every file's inode, size and mtime.  A committed checkpoint is immutable (invariant
1), so an unchanged signature is an unchanged checkpoint; one replaced, corrupted, truncated or
deleted has another signature and is verified afresh.  The worker's own restore does not use it: it
loads (verifies and parses) in its own process, once.

:class:`ResumePoint` is the one answer to "the newest usable checkpoint": the checkpoint (or None)
and the newer ones passed over, each with the reason, newest first.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.verify import Checkpoint

log = logging.getLogger("convoy.checkpoint")

Signature = tuple[tuple[str, int, int, int], ...]


@dataclass(frozen=True)
class Candidate:
    """One checkpoint directory as the resume meets it, newest first (:meth:`CheckpointStore.candidates`).

    ``loaded`` is the verified checkpoint and its parts, or None when it was rejected: then
    ``reason`` says why (already recorded as ``checkpoint_skipped``)."""

    step: int
    path: Path
    reason: str
    loaded: tuple[Checkpoint, dict[str, Any]] | None


@dataclass(frozen=True)
class PassedOver:
    """A checkpoint newer than the resume point that did not verify, and why."""

    checkpoint: str
    step: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ResumePoint:
    """Where the next worker resumes: ``checkpoint`` (None: from step 0) and what it passed over."""

    checkpoint: Checkpoint | None
    passed_over: tuple[PassedOver, ...] = ()

    @property
    def step(self) -> int | None:
        return self.checkpoint.step if self.checkpoint is not None else None

    def passed_over_dicts(self) -> list[dict[str, Any]]:
        """The on-disk form (``failure`` events, the resume audit): ``{"checkpoint", "step", "reason"}``."""
        return [p.as_dict() for p in self.passed_over]


def signature(path: Path) -> Signature:
    """What a change to the checkpoint directory would change: each file's name, inode, size and
    mtime (nanoseconds).  Empty when the directory is gone."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return ()
    out = []
    for e in entries:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        out.append((e.name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(sorted(out))


class Verdicts:
    """Verdicts by (path, step) for as long as the directory's :func:`signature` is unchanged.

    ``counts`` says how often each checkpoint was really verified (a memo miss), which the tests
    read: once per unchanged checkpoint per store.  Thread-safe (chunk tasks and the versioning
    thread share the flow's store); two threads may both verify a checkpoint neither has seen."""

    def __init__(self) -> None:
        self._memo: dict[tuple[str, int | None], tuple[Signature, Checkpoint | CheckpointRejected]] = {}
        self._lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()

    def verify(self, path: Path, step: int | None, check: Callable[[Path, int | None], Checkpoint]) -> Checkpoint:
        key, sig = (str(path), step), signature(path)
        with self._lock:
            seen = self._memo.get(key)
        if seen is None or seen[0] != sig or not sig:
            seen = (sig, self._check(path, step, check))
            with self._lock:
                self._memo[key] = seen
        if isinstance(seen[1], CheckpointRejected):
            raise _again(seen[1])
        return seen[1]

    def _check(
        self, path: Path, step: int | None, check: Callable[[Path, int | None], Checkpoint]
    ) -> Checkpoint | CheckpointRejected:
        with self._lock:
            self.counts[path.name] += 1
        try:
            verdict: Checkpoint | CheckpointRejected = check(path, step)
        except CheckpointRejected as exc:
            verdict = exc
        log.debug("verified %s: %s", path.name, "ok" if isinstance(verdict, Checkpoint) else verdict)
        return verdict


def _again(rejected: CheckpointRejected) -> CheckpointRejected:
    """A fresh copy of a remembered rejection, with its cause (an OSError says the file could not
    be read): raising the remembered object itself would grow its traceback at every raise."""
    copy = CheckpointRejected(*rejected.args)
    copy.__cause__ = rejected.__cause__
    return copy


#: What a committed checkpoint that is no longer there is passed over as.
MISSING = "missing: it was committed and is gone (removed by something other than retention)"


def missing_commits(run_dir: Path, newer_than: int) -> list[PassedOver]:
    """Checkpoints newer than ``newer_than`` that were committed (``checkpoint_committed``) and
    are gone, not retired by retention nor moved aside by convoy: someone deleted them."""
    from training.events import Event, read_events
    from training.paths import RunPaths

    committed: dict[str, int] = {}
    for e in read_events(run_dir):
        kind, name = e.get("kind"), e.get("checkpoint")
        if kind == Event.CHECKPOINT_COMMITTED and int(e.get("step", 0)) > newer_than:
            committed[str(name)] = int(e["step"])
        elif kind == Event.CHECKPOINT_RETIRED or (
            kind in (Event.CHECKPOINT_INVALID, Event.CHECKPOINT_REPLACED) and e.get("moved_to")
        ):
            committed.pop(str(name), None)
    root = RunPaths(run_dir).checkpoints
    return [PassedOver(name, step, MISSING) for name, step in committed.items() if not (root / name).is_dir()]


def with_missing(passed: list[PassedOver], run_dir: Path, resumed_step: int) -> tuple[PassedOver, ...]:
    """``passed`` and the missing commits newer than the resume point, newest first."""
    return tuple(sorted([*passed, *missing_commits(run_dir, resumed_step)], key=lambda p: p.step, reverse=True))
