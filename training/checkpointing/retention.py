"""Which older checkpoints retention keeps (``checkpoint.keep_last``, the boundary pipelining
needs), and why a checkpoint a resume passed over does not count.

Why a module of its own: the rule grew a case the store's commit path should not carry inline.
Measured (the chaos test, CI 2026-12-08): a byte flipped in step 140, the resume passed it over
(``checkpoint_skipped``) and trained on from the memory tier; step 150's commit then kept 140 and
150 (``keep_last: 2``) and retired 130, the newest checkpoint that verified besides 150.  When 150
was deleted next, nothing restored and the run refused to start again from step 0.  A checkpoint
known not to restore is no checkpoint to keep: it is left on disk for inspection and the
``keep_last`` newest are counted among the others.

Rules:
1. Kept: the ``keep_last - 1`` newest older checkpoints not passed over since they were written
   (the newest verified one, ``protect``, is the store's and never a candidate), and the boundary
   :func:`training.chunk_boundary.boundary_to_keep` names.
2. A checkpoint passed over by a resume after it was written (its manifest's time) is neither
   counted nor retired; one written again after the pass is counted as any other.
"""

from __future__ import annotations

from pathlib import Path

from training.checkpointing.verify import MANIFEST
from training.chunk_boundary import boundary_to_keep
from training.event_records import CheckpointSkipped, EventLog


def passed_over(run_dir: Path, candidates: list[tuple[int, Path, int]]) -> set[Path]:
    """Rule 2: the candidates a resume passed over after they were written."""
    skipped: dict[str, float] = {}
    for e in EventLog.read(run_dir).of(CheckpointSkipped):
        if e.checkpoint:
            skipped[e.checkpoint] = max(skipped.get(e.checkpoint, 0.0), e.time)
    bad = set()
    for _step, path, _size in candidates:
        when = skipped.get(path.name)
        if when is not None and when > _written_at(path):
            bad.add(path)
    return bad


def _written_at(path: Path) -> float:
    try:
        return (path / MANIFEST).stat().st_mtime
    except OSError:
        return 0.0


def kept(
    run_dir: Path, protect_step: int, candidates: list[tuple[int, Path, int]], keep_last: int, every: int
) -> tuple[set[Path], int | None]:
    """Rule 1: the candidates (newest first: step, path, bytes) retention keeps, the passed-over
    ones included (left, rule 2), and the boundary step kept (``every``: the chunk length)."""
    bad = passed_over(run_dir, candidates)
    good = [c for c in candidates if c[1] not in bad]
    keep = {p for _, p, _ in good[: max(keep_last - 1, 0)]} | bad
    boundary = boundary_to_keep(protect_step, (s for s, _, _ in candidates), every)
    return keep | {p for s, p, _ in candidates if s == boundary}, boundary
