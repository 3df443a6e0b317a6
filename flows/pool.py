"""``orchestration.mode: pool`` — each chunk is its own flow run on a work pool (e.g. GPU nodes).

Why: in local mode the flow's machine runs every worker.  In pool mode the parent flow only plans
and dispatches; each chunk runs as flow ``train-chunk`` on whichever worker of the pool picks it up
(deployment ``train-chunk/<orchestration.pool>``, see ``prefect.yaml``).  A chunk flow run that
fails or crashes (its worker, or the node under it, died) is re-run by the parent as a *new* flow
run, which resumes from the newest valid checkpoint.  Inside a chunk flow ``run_chunk`` does not
retry: one place owns the retry policy (``orchestration.retries`` with backoff), and that place
survives a node's death.

No shared disk needed (invariant 10) with ``tracking.dvc`` on: the parent sends the run's config
(not a path), each node trains in its own ``runs_dir`` (relative paths are the node's, under the
directory the ``flows.node`` pull step entered), fetches the newest uploaded checkpoint from the
DVC remote before its worker restores, uploads committed checkpoints while it trains and, before
it reports, the newest one.  The parent learns the outcome (committed step, digest, failure kind,
steps lost) from a Prefect artifact of the chunk flow run (:func:`publish_outcome`), which also
carries the node's audit events of the chunk into the parent's ``events.jsonl``; metrics reach
the MLflow tracking server from the node directly.  Without ``tracking.dvc`` every node must see
``runs_dir`` (shared storage), as before.

A tag-based concurrency limit (``prefect concurrency-limit create <concurrency_tag> <slots>``)
caps chunk tasks per GPU slot: ``run_chunk`` carries the tag in pool mode.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.deployments import run_deployment

from tasks.artifacts import artifact_key
from tasks.chunk import audited, chunk_record, run_chunk, should_retry
from tasks.records import run_records
from tasks.records.chunk_record import ChunkRecord
from tasks.remote.remote_index import node_name
from tasks.run_resources import RunResources
from tasks.supervision.failure_kinds import NOT_RETRYABLE
from tasks.supervision.supervisor import ChunkFailed
from training.config import ConfigError, RunConfig
from training.event_records import CheckpointFetched, event_time, typed
from training.events import Event, FailureKind, append_event, carry_events, read_events
from training.run_identity import RunInfo
from training.rundir import open_run, run_info, update_run_info
from training.tracking.failure_record import FailureDetails

CHUNK_FLOW = "train-chunk"
#: Prefect artifact type of a chunk flow run's outcome (one per flow run, read by the parent).
OUTCOME_TYPE = "convoy-chunk-outcome"
_MLFLOW_KEYS = ("mlflow_run_id", "mlflow_tracking_uri", "mlflow_experiment_id")


def chunk_deployment(config: RunConfig) -> str:
    """Deployment name for chunks: one chunk deployment per work pool, named after the pool."""
    return f"{CHUNK_FLOW}/{config.orchestration.pool}"


def open_node_run(config: RunConfig, mlflow_run: dict[str, Any] | None) -> Path:
    """This node's directory of the run (created on a node new to it; the fingerprint check as
    everywhere), logging into the parent's MLflow run."""
    run_dir = open_run(config).resolve()
    wanted = {k: v for k, v in (mlflow_run or {}).items() if k in _MLFLOW_KEYS and v}
    if wanted and any((run_info(run_dir) or RunInfo()).to_json().get(k) != v for k, v in wanted.items()):
        update_run_info(run_dir, **wanted)
    return run_dir


@dataclass
class NodeOutcome:
    """What a chunk flow run on a node reports to the parent (its Prefect artifact): where it
    ran, the committed chunk's record or how it failed, and the node's events of the chunk.

    Why a type: it is written by :func:`train_chunk` in the node's process and read by
    :func:`dispatch_chunk` in the parent's; the artifact's JSON keeps these field names."""

    node: str | None
    ok: bool = False
    run_dir: str | None = None
    record: ChunkRecord | None = None
    kind: str | None = None
    message: str | None = None
    details: FailureDetails = field(default_factory=FailureDetails)
    events: list[dict[str, Any]] = field(default_factory=list)

    def failed(self, exc: BaseException) -> None:
        """How the chunk flow run failed, in the words the parent needs to decide on a retry."""
        if isinstance(exc, ChunkFailed):
            self.kind, self.message, self.details = exc.kind, exc.message, exc.details
        elif isinstance(exc, ConfigError):
            self.kind, self.message = FailureKind.CONFIG, str(exc)
        else:
            self.kind, self.message = FailureKind.CRASH, f"{type(exc).__name__}: {exc}"

    def fetches(self) -> list[dict[str, Any]]:
        """The node's checkpoint downloads of the chunk (its ``checkpoint_fetched`` events), as the
        chunk row shows them."""
        keep = ("step", "fetch_s", "bytes", "from_node", "node", "refused")
        return [{k: getattr(e, k) for k in keep} for e in typed(self.events, CheckpointFetched)]

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(record=self.record.as_dict() if self.record else None, details=self.details.as_dict())
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeOutcome:
        """Read an artifact back (one written before this type, too: the same keys)."""
        record = data.get("record")
        return cls(
            node=data.get("node"),
            ok=bool(data.get("ok")),
            run_dir=data.get("run_dir"),
            record=ChunkRecord.from_dict(record) if record else None,
            kind=data.get("kind"),
            message=data.get("message"),
            details=FailureDetails.from_dict(data.get("details") or {}),
            events=list(data.get("events") or []),
        )


def publish_outcome(run_name: str, outcome: NodeOutcome) -> None:
    """The chunk flow run's outcome as an artifact of that flow run (best effort: without it the
    parent treats the run as a node that went away)."""
    from prefect.artifacts import Artifact

    try:
        data = json.loads(json.dumps(outcome.as_dict(), default=str))
        description = f"convoy chunk outcome on node {outcome.node}: {'ok' if outcome.ok else 'failed'}"
        key = artifact_key(run_name, "chunk-outcome")
        Artifact(type=OUTCOME_TYPE, key=key, description=description, data=data).create()
    except Exception as exc:  # noqa: BLE001
        print(f"WARNING: could not publish the chunk outcome: {exc}", flush=True)


@flow(name=CHUNK_FLOW, log_prints=True)
def train_chunk(
    config: RunConfig, chunk: int, start_step: int, end_step: int, mlflow_run: dict[str, Any] | None = None
) -> dict[str, Any]:
    """One chunk on a pool worker, in this node's directory of the run: ``run_chunk`` without
    retries (the parent re-dispatches); the outcome and this node's events of the chunk go to the
    parent as an artifact, after the newest committed checkpoint went to the remote."""
    t0 = time.time()
    outcome = NodeOutcome(node_name())
    run_dir: Path | None = None
    resources: RunResources | None = None
    try:
        run_dir = open_node_run(config, mlflow_run)
        resources = RunResources(config, run_dir)
        outcome.run_dir = str(run_dir)
        task = run_chunk.with_options(
            retries=0,
            retry_condition_fn=should_retry,
            tags=["convoy", f"run:{config.run_name}", config.orchestration.concurrency_tag],
        )
        task = audited(task, resources, chunk)  # the node's own audit of the chunk, as in local mode
        with run_records.system_metrics(config, run_dir):  # sampled on the node that trains
            record = chunk_record(task(str(run_dir), chunk, start_step, end_step, resources))
        outcome.ok, outcome.record = True, record
        return record.as_dict()
    except BaseException as exc:
        outcome.failed(exc)
        raise
    finally:
        if resources is not None:
            resources.close()  # the newest checkpoint uploaded before the parent hears of it (tracking.dvc)
        if run_dir is not None:
            outcome.events = [e for e in read_events(run_dir) if event_time(e) >= t0]
        publish_outcome(config.run_name, outcome)


def read_outcome(flow_run_id: Any) -> NodeOutcome | None:
    """The outcome artifact of a chunk flow run (None: the node died before it could report)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    flt = ArtifactFilter(
        flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=[OUTCOME_TYPE])
    )
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=flt)
    if not found:
        return None
    data = found[-1].data
    return NodeOutcome.from_dict(json.loads(data) if isinstance(data, str) else data)


def _parameters(config: RunConfig, run_dir: Path, chunk: int, start: int, end: int) -> dict[str, Any]:
    info = (run_info(run_dir) or RunInfo()).to_json()
    return {
        "config": config.model_dump(mode="json"),
        "chunk": chunk,
        "start_step": start,
        "end_step": end,
        "mlflow_run": {k: info[k] for k in _MLFLOW_KEYS if info.get(k)},
    }


def _record_failure(run_dir: Path, chunk: int, attempt: int, fr: Any, outcome: NodeOutcome) -> tuple[str, str]:
    """Audit a failed chunk flow run (``chunk_flow_run_failed``); returns its kind and message."""
    kind = outcome.kind or FailureKind.CRASH  # no outcome: the node itself went away
    message = outcome.message or f"chunk {chunk} {kind}: its flow run ended {fr.state} without an outcome"
    append_event(
        run_dir,
        Event.CHUNK_FLOW_RUN_FAILED,
        chunk=chunk,
        attempt=attempt,
        flow_run_id=str(fr.id),
        state=str(fr.state.type if fr.state else None),
        failure=kind,
        node=outcome.node,
    )
    return kind, message


def dispatch_chunk(config: RunConfig, run_dir: Path, chunk: int, start: int, end: int) -> ChunkRecord:
    """Run one chunk as flow runs of the chunk deployment until it commits or retries run out;
    the record says on which node each attempt ran and what the attempts fetched."""
    logger = get_run_logger()
    o = config.orchestration
    delays = [o.retry_delay_seconds * o.backoff**i for i in range(max(o.retries, 1))]
    seen: dict[str, list[Any]] = {"flow_runs": [], "failure_kinds": [], "nodes": [], "fetched": []}
    for attempt in range(1, o.retries + 2):
        fr = run_deployment(
            name=chunk_deployment(config),
            parameters=_parameters(config, run_dir, chunk, start, end),
            flow_run_name=f"{config.run_name}-chunk-{chunk}-attempt-{attempt}",
            timeout=None,
            poll_interval=1,
            tags=["convoy", f"run:{config.run_name}"],
        )
        seen["flow_runs"].append(str(fr.id))
        outcome = read_outcome(fr.id) or NodeOutcome(None)
        carry_events(run_dir, outcome.events)
        seen["nodes"].append(outcome.node)
        seen["fetched"].extend({"attempt": attempt, **f} for f in outcome.fetches())
        if fr.state is not None and fr.state.is_completed() and outcome.ok and outcome.record is not None:
            return dataclasses.replace(outcome.record, attempt=attempt, **seen)
        kind, message = _record_failure(run_dir, chunk, attempt, fr, outcome)
        seen["failure_kinds"].append(kind)
        details = outcome.details
        if kind in NOT_RETRYABLE or attempt > o.retries:
            raise ChunkFailed(kind, message, dataclasses.replace(details, flow_runs=seen["flow_runs"]))
        delay = 0.0 if kind == FailureKind.PREEMPTED else delays[min(attempt - 1, len(delays) - 1)]
        delay *= 1 + random.uniform(-o.jitter, o.jitter)
        logger.warning(
            "chunk %d %s on node %s (flow run %s); re-running as a new flow run in %.1f s, resuming from step %d "
            "or a newer uploaded checkpoint",
            chunk,
            kind,
            outcome.node or "?",
            fr.name,
            delay,
            details.last_committed_step or 0,
        )
        time.sleep(max(delay, 0.0))
    raise AssertionError("unreachable")  # pragma: no cover
