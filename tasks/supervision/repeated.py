"""A failure that repeats is not retried blindly.

When two consecutive attempts of a chunk (in one flow run) both crash with the same error at the
same step, the second getting no further than the first (no step trained in between), the failure
is a bug in the task or its data, not a fault of the machine: another attempt would fail the same
way and spend the retry budget (and GPU hours) on it.  The chunk then fails with the kind
``repeated``, which is never retried.

Only ``crash`` qualifies: kills, hangs, preemptions, OOM, a full disk and timeouts come from
outside the task and keep the full retry policy, and so does a crash at another step or with
another error.  Prefect-free: unit-tested on typed failure records.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from training.event_records import EventLog, FlowStarted
from training.events import FailureKind
from training.tracking.failure_record import FailureDetails, RecordedFailure

#: Failure kinds that a deterministic bug produces (the attempt ended by itself, non-zero).
DETERMINISTIC_KINDS = frozenset({FailureKind.CRASH})


def _this_flow_failures(run_dir: Path, chunk: int) -> list[RecordedFailure]:
    events = EventLog.read(run_dir).of(FlowStarted, RecordedFailure)
    since = max((i for i, e in enumerate(events) if isinstance(e, FlowStarted)), default=-1)
    return [f for f in events[since + 1 :] if isinstance(f, RecordedFailure) and f.chunk == chunk]


def same_failure(previous: RecordedFailure, latest: RecordedFailure) -> bool:
    """Whether ``latest`` repeats ``previous``: same deterministic kind, same error line, same step
    reached (the high-water mark of trained steps: the second attempt trained nothing the first
    had not).  Which checkpoint each resumed from does not matter: an asynchronous save may or may
    not have committed before the crash."""
    before, now = previous.details, latest.details
    return (
        previous.kind == latest.kind
        and latest.kind in DETERMINISTIC_KINDS
        and bool(now.error)
        and before.error == now.error
        and before.trained_to == now.trained_to
    )


@dataclass(frozen=True)
class Repeat:
    """Two attempts of one chunk that failed the same way: the chunk's ``repeated`` failure."""

    chunk: int
    previous: RecordedFailure
    latest: RecordedFailure

    @property
    def message(self) -> str:
        """One line: which attempts, the step, the error's last line, the log; why no retry."""
        step, latest = self.latest.details.trained_to, self.latest.details
        where = f"in step {step + 1}" if step is not None else "before the first step"
        return (
            f"chunk {self.chunk} repeated: attempts {self.previous.attempt} and {self.latest.attempt} both "
            f"crashed {where} with the same error, nothing trained in between; not retrying (a bug, not a "
            f"fault): {latest.error} (log {latest.log})"
        )

    def details(self, of_attempt: FailureDetails) -> FailureDetails:
        """The failing attempt's details, re-stated as the repeat of the attempt before."""
        return replace(of_attempt, reason=self.message, repeats_attempt=self.previous.attempt)

    def event_fields(self) -> dict[str, object]:
        """The ``repeated_failure`` event's fields."""
        d = self.latest.details
        return {
            "chunk": self.chunk,
            "attempts": [self.previous.attempt, self.latest.attempt],
            "step": d.trained_to,
            "error": d.error,
            "log": d.log,
        }


def repeated_failure(run_dir: Path, chunk: int) -> Repeat | None:
    """The chunk's repeat when its latest failure in this flow run repeats the one before."""
    failures = _this_flow_failures(run_dir, chunk)
    if len(failures) >= 2 and same_failure(failures[-2], failures[-1]):
        return Repeat(chunk, failures[-2], failures[-1])
    return None
