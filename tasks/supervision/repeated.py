"""A failure that repeats is not retried blindly.

When two consecutive attempts of a chunk (in one flow run) both crash with the same error at the
same step, the second getting no further than the first (no step trained in between), the failure
is a bug in the task or its data, not a fault of the machine: another attempt would fail the same
way and spend the retry budget (and GPU hours) on it.  The chunk then fails with the kind
``repeated``, which is never retried.

Only ``crash`` qualifies: kills, hangs, preemptions, OOM, a full disk and timeouts come from
outside the task and keep the full retry policy, and so does a crash at another step or with
another error.  Prefect-free: unit-tested on event records.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from training.events import Event, FailureKind, read_events

#: Failure kinds that a deterministic bug produces (the attempt ended by itself, non-zero).
DETERMINISTIC_KINDS = frozenset({FailureKind.CRASH})


def _this_flow_failures(run_dir: Path, chunk: int) -> list[dict[str, Any]]:
    events = read_events(run_dir)
    since = max((i for i, e in enumerate(events) if e["kind"] == Event.FLOW_STARTED), default=-1)
    return [e for e in events[since + 1 :] if e["kind"] == Event.FAILURE and e.get("chunk") == chunk]


def same_failure(previous: dict[str, Any], latest: dict[str, Any]) -> bool:
    """Whether ``latest`` repeats ``previous`` (two ``failure`` event records): same deterministic
    kind, same error line, same step reached (the high-water mark of trained steps: the second
    attempt trained nothing the first had not).  Which checkpoint each resumed from does not
    matter: an asynchronous save may or may not have committed before the crash."""
    return (
        previous.get("failure") == latest.get("failure")
        and latest.get("failure") in DETERMINISTIC_KINDS
        and bool(latest.get("error"))
        and previous.get("error") == latest.get("error")
        and previous.get("trained_to") == latest.get("trained_to")
    )


def repeated_failure(run_dir: Path, chunk: int) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The chunk's last two failures of this flow run when the latest repeats the one before."""
    failures = _this_flow_failures(run_dir, chunk)
    if len(failures) >= 2 and same_failure(failures[-2], failures[-1]):
        return failures[-2], failures[-1]
    return None


def repeated_message(chunk: int, previous: dict[str, Any], latest: dict[str, Any]) -> str:
    """One line: which attempts, the step, the error's last line, the log; why no retry."""
    step = latest.get("trained_to")
    where = f"in step {step + 1}" if step is not None else "before the first step"
    return (
        f"chunk {chunk} repeated: attempts {previous.get('attempt')} and {latest.get('attempt')} both crashed "
        f"{where} with the same error, nothing trained in between; not retrying (a bug, not a fault): "
        f"{latest.get('error')} (log {latest.get('log')})"
    )


def as_repeated(exc: Any, chunk: int, previous: dict[str, Any], latest: dict[str, Any]) -> Any:
    """The attempt's ``ChunkFailed`` re-stated as the ``repeated`` failure (same details)."""
    message = repeated_message(chunk, previous, latest)
    details = replace(exc.details, reason=message, repeats_attempt=previous.get("attempt"))
    return type(exc)(FailureKind.REPEATED, message, details)
