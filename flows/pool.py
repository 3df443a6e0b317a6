"""``orchestration.mode: pool`` — each chunk is its own flow run on a work pool (e.g. GPU nodes).

Why: in local mode the flow's machine runs every worker.  In pool mode the parent flow only plans
and dispatches; each chunk runs as flow ``train-chunk`` on whichever worker of the pool picks it up
(deployment ``train-chunk/<orchestration.pool>``, see ``prefect.yaml``).  A chunk flow run that
fails or crashes (its worker, or the node under it, died) is re-run by the parent as a *new* flow
run, which resumes from the newest valid checkpoint: the run directory must be on storage every
node of the pool can see.  Inside a chunk flow ``run_chunk`` does not retry: one place owns the
retry policy (``orchestration.retries`` with backoff), and that place survives a node's death.

A tag-based concurrency limit (``prefect concurrency-limit create <concurrency_tag> <slots>``)
caps chunk tasks per GPU slot: ``run_chunk`` carries the tag in pool mode.

What failed is read from the run's ``events.jsonl`` (written by the supervisor on the node), not
from Prefect results, so no result persistence is needed.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.deployments import run_deployment

from tasks import run_records
from tasks.chunk import chunk_record, run_chunk, should_retry
from tasks.supervisor import NOT_RETRYABLE, ChunkFailed
from training.config import RunConfig
from training.events import FailureKind, append_event, read_events
from training.rundir import load_run_config

CHUNK_FLOW = "train-chunk"


def chunk_deployment(config: RunConfig) -> str:
    """Deployment name for chunks: one chunk deployment per work pool, named after the pool."""
    return f"{CHUNK_FLOW}/{config.orchestration.pool}"


@flow(name=CHUNK_FLOW, log_prints=True)
def train_chunk(run_dir: str, chunk: int, start_step: int, end_step: int) -> dict[str, Any]:
    """One chunk on a pool worker: ``run_chunk`` without retries (the parent re-dispatches)."""
    cfg = load_run_config(run_dir)
    task = run_chunk.with_options(
        retries=0,
        retry_condition_fn=should_retry,
        tags=["convoy", f"run:{cfg.run_name}", cfg.orchestration.concurrency_tag],
    )
    with run_records.system_metrics(cfg, Path(run_dir)):  # sampled on the node that trains
        return chunk_record(task(run_dir, chunk, start_step, end_step))


def _since(run_dir: Path, kind: str, chunk: int, t0: float) -> list[dict[str, Any]]:
    return [e for e in read_events(run_dir, kind) if e.get("chunk") == chunk and e.get("time", 0) >= t0]


def dispatch_chunk(config: RunConfig, run_dir: Path, chunk: int, start: int, end: int) -> dict[str, Any]:
    """Run one chunk as flow runs of the chunk deployment until it commits or retries run out."""
    logger = get_run_logger()
    o = config.orchestration
    delays = [o.retry_delay_seconds * o.backoff**i for i in range(max(o.retries, 1))]
    flow_runs: list[str] = []
    kinds: list[str] = []
    for attempt in range(1, o.retries + 2):
        t0 = time.time()
        fr = run_deployment(
            name=chunk_deployment(config),
            parameters={"run_dir": str(run_dir), "chunk": chunk, "start_step": start, "end_step": end},
            flow_run_name=f"{config.run_name}-chunk-{chunk}-attempt-{attempt}",
            timeout=None,
            poll_interval=1,
            tags=["convoy", f"run:{config.run_name}"],
        )
        flow_runs.append(str(fr.id))
        done = _since(run_dir, "chunk_done", chunk, t0)
        if fr.state is not None and fr.state.is_completed() and done:
            return {**done[-1], "attempt": attempt, "flow_runs": flow_runs, "failure_kinds": kinds}
        failures = _since(run_dir, "failure", chunk, t0)
        kind = failures[-1]["failure"] if failures else FailureKind.CRASH  # no event: the node itself went away
        message = failures[-1].get("reason", "") if failures else f"chunk flow run ended {fr.state}"
        kinds.append(kind)
        append_event(
            run_dir,
            "chunk_flow_run_failed",
            chunk=chunk,
            attempt=attempt,
            flow_run_id=str(fr.id),
            state=str(fr.state.type if fr.state else None),
            failure=kind,
        )
        if kind in NOT_RETRYABLE or attempt > o.retries:
            raise ChunkFailed(kind, f"chunk {chunk} {kind}: {message}", {"flow_runs": flow_runs})
        delay = 0.0 if kind == FailureKind.PREEMPTED else delays[min(attempt - 1, len(delays) - 1)]
        delay *= 1 + random.uniform(-o.jitter, o.jitter)
        resume = (failures[-1].get("last_committed_step") if failures else None) or 0
        logger.warning(
            "chunk %d %s (flow run %s); re-running as a new flow run in %.1f s, resuming from step %d",
            chunk,
            kind,
            fr.name,
            delay,
            resume,
        )
        time.sleep(max(delay, 0.0))
    raise AssertionError("unreachable")  # pragma: no cover
