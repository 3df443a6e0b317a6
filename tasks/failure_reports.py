"""What a chunk task says about a failure, in Prefect's log and the run's failures artifact.

One line per recovery (a warning with the kind, the detection, when the retry starts and where it
resumes) and a markdown note; the final failure is the on-failure hook's to say
(:mod:`tasks.hooks`).  Kept apart from :mod:`tasks.chunk`, which decides what happens, so the
words are in one place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tasks.artifacts import note_title
from tasks.retry_policy import retry_start, will_retry
from tasks.supervision.handoff import Replacement
from tasks.supervision.supervisor import ChunkFailed
from training.config import RunConfig


def passed_over_clause(passed_over: list[dict[str, Any]]) -> str:
    """``; passed over step 250 (reason)``: why a resume goes further back than the newest
    checkpoint; empty when it does not."""
    if not passed_over:
        return ""
    return "; passed over " + "; ".join(f"step {p['step']} ({p['reason']})" for p in passed_over)


#: How a note is published: :meth:`tasks.artifacts.FailureNotes.publish` (run name, title, lines).
Publish = Callable[[str, str, list[str]], None]


def report_failure(
    logger: Any,
    cfg: RunConfig,
    exc: ChunkFailed,
    attempt: tuple[int, int, int],
    resume_at: int,
    publish: Publish,
    wait: float = 0.0,
) -> None:
    """One log line per recovery, plus a markdown note (the final failure is the hook's job).
    ``attempt``: (chunk, its attempt number, Prefect's run count, which decides the retry);
    ``wait``: the backoff this run waits before raising."""
    chunk, number, try_number = attempt
    d = exc.details
    short = d.reason if d.reason is not None else exc.message
    passed = passed_over_clause(d.passed_over or [])
    if will_retry(cfg, exc, try_number):
        when = retry_start(wait)
        logger.warning(
            "chunk %d %s detected after %.1f s: %s; retry %d starts %s, resuming from step %d%s",
            chunk,
            exc.kind,
            d.detected_after_s or 0.0,
            short,
            try_number,
            when,
            resume_at,
            passed,
        )
        publish(
            cfg.run_name,
            note_title(chunk, number, exc.kind),
            [
                f"{short}",
                f"detected after {d.detected_after_s} s; last beat step {d.last_beat_step}",
                f"retry {try_number} starts {when}; resumes from step {resume_at} (steps lost: {d.steps_lost}){passed}",
            ],
        )
    else:
        logger.error("chunk %d %s after %.1f s: %s; not retrying", chunk, exc.kind, d.detected_after_s or 0.0, short)


def say_replaced(logger: Any, cfg: RunConfig, r: Replacement, try_number: int, publish: Publish) -> None:
    """A worker killed while parked, replaced at once (:mod:`tasks.supervision.replacement`):
    the warning and note a Prefect retry would have had, saying that no retry was needed."""
    d, dead, new = r.failure, r.dead_attempt, r.attempt
    short = d.reason or r.message
    when = ""
    if r.dead.died_at is not None:
        when = f" {r.worker.started - r.dead.died_at:.2f} s after its death"
    logger.warning(
        "chunk %d attempt %d %s while parked between chunk tasks (detected after %.2f s): %s; attempt %d "
        "(%s) started%s, inside Prefect run %d, resuming from step %d",
        dead.chunk,
        dead.attempt,
        r.kind,
        d.detected_after_s or 0.0,
        short,
        new.attempt,
        r.source,
        when,
        try_number,
        new.resumes_from or 0,
    )
    publish(
        cfg.run_name,
        note_title(dead.chunk, dead.attempt, r.kind),
        [
            f"{short} (while parked between chunk tasks)",
            f"detected after {d.detected_after_s} s; last beat step {d.last_beat_step}",
            f"replaced at once{when} as attempt {new.attempt} ({r.source}), no Prefect retry; "
            f"resumes from step {new.resumes_from} (steps lost: {d.steps_lost})",
        ],
    )
