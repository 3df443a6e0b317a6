"""The chunk task's retry policy, in one place: which failures Prefect retries, how long the failed
task run waits before it raises (the backoff), how the policy is shown beside Prefect's own
"Retry Delay", and why an attempt number can differ from Prefect's run count.

Why convoy waits and Prefect does not: Prefect takes a per-retry list of delays, but its UI can
show only one number (a list reads "NaNs" on the task page), so Prefect is given
``retry_delay_seconds=0`` and the failed task run waits convoy's delay itself before raising;
Prefect's next line, "Retry 2/3 will start immediately", is then true (docs/architecture.md,
"Recovery path").
"""

from __future__ import annotations

import random
from typing import Any

from tasks.supervision.replacement import REPLACED
from tasks.supervision.supervisor import ChunkFailed
from training.config import ConfigError, RunConfig
from training.event_records import AttemptStarted, EventLog, Resubmitted
from training.tracking.attempts import AttemptId


def retry_delays(config: RunConfig) -> list[float]:
    """The first retry at once (a killed or crashed worker is replaced without waiting: every
    second of recovery is paid by every GPU), then ``retry_delay_seconds * backoff**i``."""
    o = config.orchestration
    return [0.0] + [round(o.retry_delay_seconds * o.backoff**i, 3) for i in range(max(o.retries, 1) - 1)]


def should_retry(task: Any, task_run: Any, state: Any) -> bool:
    """``retry_condition_fn``: retry every failure except a configuration error."""
    exc = getattr(state, "data", None)
    if not isinstance(exc, BaseException):
        try:
            exc = state.result(raise_on_failure=False)
        except Exception:  # noqa: BLE001 - unknown failure: retrying is the safe default
            return True
    if isinstance(exc, ChunkFailed):
        return exc.retryable
    return not isinstance(exc, ConfigError)


def retry_wait(config: RunConfig, try_number: int) -> float:
    """Seconds a task run waits before its worker starts: 0 for the first run and the first
    retry, then ``retry_delays`` with ``jitter`` (uniform, ±jitter of the delay).  ``try_number``
    counts the failures in a row that made no progress, plus one
    (:func:`training.tracking.attempts.failures_without_progress`): a worker that trained, then
    died, is replaced at once however many failures the chunk had before."""
    delays = retry_delays(config)
    if try_number < 2:
        return 0.0
    delay = delays[min(try_number - 2, len(delays) - 1)]
    return max(0.0, delay * (1 + random.uniform(-config.orchestration.jitter, config.orchestration.jitter)))


def attempts_explained(log: EventLog, attempt: AttemptId, run_count: int) -> str:
    """`` (Prefect run 3: 1 preempted worker re-spawned inside a run)``: why the chunk's attempt
    number differs from Prefect's run count of its task run, which counts neither the attempts of
    an earlier flow run nor a worker re-spawned inside one run (preempted, or killed while parked
    and replaced at once: a ``resubmitted`` event says which); empty when they agree."""
    chunk = attempt.chunk
    started = [e for e in log.of(AttemptStarted) if e.chunk == chunk]
    here = [e for e in started if attempt.flow_run_id and e.flow_run_id == attempt.flow_run_id]
    earlier = len(started) - len(here) if attempt.flow_run_id else 0
    respawned = max(0, attempt.attempt - earlier - run_count)
    resubmitted = [e for e in log.of(Resubmitted) if e.chunk == chunk]
    replaced = min(respawned, sum(1 for e in resubmitted if e.reason == REPLACED))
    preempted = respawned - replaced
    parts = [f"{earlier} in an earlier flow run"] if earlier else []
    if preempted:
        parts.append(f"{preempted} preempted worker{'s' if preempted > 1 else ''} re-spawned inside a run")
    if replaced:
        parts.append(f"{replaced} worker{'s' if replaced > 1 else ''} killed while parked, replaced at once")
    return f" (Prefect run {run_count}: {'; '.join(parts)})" if parts else ""


def will_retry(cfg: RunConfig, exc: ChunkFailed, try_number: int) -> bool:
    """Whether Prefect retries the task run that raises ``exc`` (what ``should_retry`` and
    ``retries`` decide), so the failed run can say so and wait the backoff before raising."""
    return exc.retryable and try_number <= cfg.orchestration.retries


def retry_start(wait: float) -> str:
    """When the retry starts, as convoy's log and failure note say it."""
    return f"in {wait:.1f} s (backoff)" if wait > 0 else "at once"


def backoff_tag(config: RunConfig) -> str:
    """``backoff 0s→1s→2s ±10%``: the waits before each retry that convoy applies (to a crash loop;
    a worker that trained and then died is replaced at once), on the task run next to Prefect's
    "Retry Delay 0s", which is what Prefect adds to them."""
    waits = "→".join(f"{d:g}s" for d in retry_delays(config))
    jitter = config.orchestration.jitter
    return f"backoff {waits}" + (f" ±{jitter * 100:g}%" if jitter else "")
