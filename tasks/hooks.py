"""Prefect state hooks that write the audit when a chunk or the whole flow ends badly.

Hooks run in the flow's own process, so they never run if that process is SIGKILLed (the
supervisor's events and the heartbeat-based flow liveness cover that case).  Each hook appends an
event to ``events.jsonl`` and publishes a markdown artifact naming the failure and the step the
next attempt resumes from.

Hooks receive ``(task_or_flow, run, state)`` only, so each says where its run lives without a
lookup (issue 47 item 4: nothing module-level owns a run):

- a chunk task's hook is :meth:`HookTarget.chunk_failed`, bound when the chunk is submitted
  (:func:`tasks.chunk.audited`) to the chunk's target: its run, its number, the run's checkpoint
  store.  It lives as long as the task object Prefect runs, so nothing outlives the chunk;
- the flow's hooks (:func:`flow_failed`, :func:`flow_crashed`) sit on the ``@flow`` itself (a
  deployment loads the flow from its entry point, so no caller can bind them) and read the run
  from the flow run's own parameters: the config the flow body keyed, keyed the same way here.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tasks.artifacts import publish_failure_note
from tasks.supervision.supervisor import ChunkFailed
from training.checkpointing.store import CheckpointStore
from training.event_records import ChunkTaskFailed, FlowCrashed, FlowFailed, HookFailure, append_record
from training.events import Event

#: The event each hook writes, by its kind.
_WRITES: dict[str, type[HookFailure]] = {
    Event.CHUNK_FAILED: ChunkTaskFailed,
    Event.FLOW_FAILED: FlowFailed,
    Event.FLOW_CRASHED: FlowCrashed,
}

log = logging.getLogger("convoy.hooks")


@dataclass(frozen=True)
class HookTarget:
    """What a failure hook writes to: the run, its chunk (None: the flow) and the flow run."""

    run_dir: Path
    run_name: str
    chunk: int | None = None
    flow_run_id: str | None = None
    #: The run's store when the caller holds one (its verdicts are reused), else None.
    checkpoints: CheckpointStore | None = None

    def resume_step(self) -> int | None:
        return (self.checkpoints or CheckpointStore(self.run_dir)).resume_point().step

    def chunk_failed(self, task: Any, task_run: Any, state: Any) -> None:
        """Task ``on_failure`` of this target's chunk: it failed for good (retries exhausted or not
        retryable).  Bound at submission, so the hook needs nothing of ``task_run``."""
        try:
            _audit(Event.CHUNK_FAILED, self, _exception(state), state)
        except Exception as exc:  # noqa: BLE001 - a hook must not mask the real failure
            log.warning("chunk failure hook: %s", exc)


def _exception(state: Any) -> BaseException | None:
    data = getattr(state, "data", None)
    if isinstance(data, BaseException):
        return data
    with contextlib.suppress(Exception):
        res = state.result(raise_on_failure=False)
        if isinstance(res, BaseException):
            return res
    return None


def _describe(exc: BaseException | None, state: Any) -> tuple[str, str]:
    if isinstance(exc, ChunkFailed):
        return exc.kind, exc.message
    if exc is not None:
        return type(exc).__name__, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return getattr(state, "type", "FAILED").__str__().lower(), getattr(state, "message", "") or ""


def flow_target(params: dict[str, Any]) -> HookTarget | None:
    """The run a ``train`` flow run with these parameters trains: its config keyed as the flow body
    keys it (:func:`training.rundir.keyed_config`: a ``new_run`` config trains ``<name>@<fp>``), so
    the hook writes where the body did; None when the parameters say no run or it was never made."""
    with contextlib.suppress(Exception):
        from training.config import config_from_dict, load_config
        from training.rundir import keyed_config

        cfg = params.get("config")
        if cfg is not None:
            cfg = config_from_dict(cfg if isinstance(cfg, dict) else cfg.model_dump(mode="json"), check_task=False)
        else:  # where the run lives is all a hook needs: no torch import in a Prefect worker (1+ s)
            cfg = load_config(params.get("params"), params.get("overrides") or [], check_task=False)
        cfg = keyed_config(cfg)
        return HookTarget(cfg.run_dir.resolve(), cfg.run_name) if cfg.run_dir.exists() else None
    return None


def _audit(kind: str, info: HookTarget, exc: BaseException | None, state: Any) -> None:
    if type(exc).__name__ == "RunLocked":
        return  # a refused second flow: the run itself did not fail, its holder is still going
    run_dir = info.run_dir
    failure, message = _describe(exc, state)
    try:
        resume = info.resume_step() or 0
    except Exception:  # noqa: BLE001
        resume = None
    append_record(
        run_dir,
        _WRITES[kind](
            failure=failure,
            message=message,
            chunk=info.chunk,
            resume_step=resume,
            flow_run_id=info.flow_run_id,  # a flow run that ended here was no dead one to take over
        ),
    )
    where = f"chunk {info.chunk}" if info.chunk is not None else "flow"
    title = f"{where} of run {info.run_name} {'crashed' if kind == Event.FLOW_CRASHED else 'failed'}: {failure}"
    lines = [f"error: `{message}`", f"next attempt resumes from step {resume} (newest verified checkpoint)"]
    if isinstance(exc, ChunkFailed):
        d = exc.details
        lines.append(
            f"detected after {d.detected_after_s} s; last beat step {d.last_beat_step}; "
            f"steps lost {d.steps_lost}; worker log `{d.log}`"
        )
        if not exc.retryable:
            lines.append("not retryable: fix the configuration or data, then run `convoy train` again")
    publish_failure_note(info.run_name, title, lines)


def _flow_hook(kind: str, flow_run: Any, state: Any) -> None:
    info = flow_target(dict(flow_run.parameters or {}))
    if info is None:
        return
    try:
        _audit(kind, replace(info, flow_run_id=str(flow_run.id)), _exception(state), state)
    except Exception as exc:  # noqa: BLE001
        log.warning("flow %s hook: %s", kind, exc)


def flow_failed(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow ``on_failure``."""
    _flow_hook(Event.FLOW_FAILED, flow_run, state)


def flow_crashed(flow: Any, flow_run: Any, state: Any) -> None:
    """Flow ``on_crashed`` (e.g. the flow process got SIGTERM)."""
    _flow_hook(Event.FLOW_CRASHED, flow_run, state)
