"""The audit events that the run's readers look into, as typed records.

Why: ``events.jsonl`` is written by the worker, the supervisor, the chunk task, the hooks and the
flow, and read by the audit, goodput, the status, the takeover and the reports.  Read as mappings,
every reader spelt every key again (``e.get("flow_run_id")``) and a key renamed by a writer was
found by nobody.  Each record class here names one kind's keys once; a reader asks for the kinds it
needs (:func:`typed`, :meth:`EventLog.of`) and reads attributes.

Rules every record keeps:

* The line on disk does not change: :meth:`EventRecord.as_fields` gives a record's keys exactly as
  its writers have always written them (a field marked :func:`optional` only when it is set), and
  :func:`append_record` writes through :func:`training.events.append_event`.
* Reading is lenient, because logs written by older releases must read: a missing key is the
  field's default, and a key this version does not know is kept in ``extra`` (and written again
  by :meth:`~EventRecord.as_fields`, so nothing a newer writer said is lost on the way through).
* Two records are equal when they say the same: ``time`` and ``extra`` are not compared.

Training's base: it imports the event vocabulary and the run's paths alone, so every room may read
records (the ``failure`` event's record, :class:`training.tracking.failure_record.RecordedFailure`,
lives with the failure's other facts and is an :class:`EventRecord` too).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar, overload

from training.events import Event, append_event, read_events

R = TypeVar("R", bound="EventRecord")
R2 = TypeVar("R2", bound="EventRecord")

#: The keys of every line that are no record's own field.
_ENVELOPE = ("kind", "time")
#: Field metadata: leave the key out of the line when the field is None (a key some writers add).
_OMIT_NONE = "omit_none"


def optional() -> Any:
    """A field that some writers of its kind add and others do not: None, and then not written."""
    return field(default=None, metadata={_OMIT_NONE: True})


@dataclass(frozen=True)
class EventRecord:
    """One line of ``events.jsonl``: ``KIND`` (an :class:`~training.events.Event`) says which
    lines a class reads; ``time`` is when it was appended; ``extra`` holds the keys the class does
    not name (a newer writer's, or fields a reader never looks at)."""

    KIND: ClassVar[str] = ""

    time: float = field(default=0.0, kw_only=True, compare=False)
    extra: dict[str, Any] = field(default_factory=dict, kw_only=True, compare=False, repr=False)

    @property
    def event_kind(self) -> str:
        """The ``kind`` this record is written with."""
        return self.KIND

    @classmethod
    def own_fields(cls) -> tuple[str, ...]:
        """The keys this class names (every field but ``time`` and ``extra``)."""
        return tuple(f.name for f in fields(cls) if f.init and f.name not in ("time", "extra"))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """The record of one line read back: missing keys take their default, unknown ones go to ``extra``."""
        names = cls.own_fields()
        extra = {k: v for k, v in data.items() if k not in names and k not in _ENVELOPE}
        return cls(**{k: data[k] for k in names if k in data}, time=event_time(data), extra=extra)

    def as_fields(self) -> dict[str, Any]:
        """The keys its writers give :func:`~training.events.append_event` (no ``kind``, no ``time``)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("time", "extra") or (value is None and f.metadata.get(_OMIT_NONE)):
                continue
            out[f.name] = value
        return {**out, **self.extra}

    def as_json(self) -> dict[str, Any]:
        """The whole line as a mapping: ``time``, ``kind`` and :meth:`as_fields`."""
        return {"time": self.time, "kind": self.event_kind, **self.as_fields()}


def event_time(data: Mapping[str, Any]) -> float:
    """A line's ``time`` (0.0 for a line without one: a hand-written or damaged line)."""
    try:
        return float(data.get("time") or 0.0)
    except (TypeError, ValueError):
        return 0.0


@dataclass(frozen=True)
class OtherEvent(EventRecord):
    """A line of a kind the reader did not ask to type (:meth:`EventLog.all`): its kind and time,
    the rest in ``extra``."""

    name: str = ""

    @property
    def event_kind(self) -> str:
        return self.name

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        extra = {k: v for k, v in data.items() if k not in _ENVELOPE}
        return cls(name=str(data.get("kind") or ""), time=event_time(data), extra=extra)

    def as_fields(self) -> dict[str, Any]:
        return dict(self.extra)  # its name is the line's kind, no key of its own


# ---------------------------------------------------------------------------------- reading
@overload
def typed(events: Iterable[Mapping[str, Any]], record_type: type[R], /) -> list[R]: ...
@overload
def typed(events: Iterable[Mapping[str, Any]], record_type: type[R], other: type[R2], /) -> list[R | R2]: ...
@overload
def typed(events: Iterable[Mapping[str, Any]], *record_types: type[EventRecord]) -> list[EventRecord]: ...
def typed(events: Iterable[Mapping[str, Any]], *record_types: type[EventRecord]) -> list[Any]:
    """The lines of ``events`` (one whole-log read) of the kinds of ``record_types``, as those
    records, in the log's order: a reader that reads the log once and looks at several kinds."""
    by_kind = {t.KIND: t for t in record_types}
    return [by_kind[kind].from_json(e) for e in events if (kind := e.get("kind")) in by_kind]


def read_records(run_dir: str | Path, record_type: type[R]) -> list[R]:
    """The run's lines of one kind, as ``record_type``, oldest first."""
    return typed(read_events(run_dir, record_type.KIND), record_type)


def append_record(run_dir: str | Path, record: R) -> R:
    """Append ``record`` (a line exactly as :func:`~training.events.append_event` writes it);
    returns it as written, with its time."""
    written = append_event(run_dir, record.event_kind, **record.as_fields())
    return type(record).from_json(written)


class EventLog:
    """One read of the whole log, typed on demand: what a function that looks at several kinds
    takes, so its caller reads the file once and the function names the kinds it reads."""

    def __init__(self, events: Iterable[Mapping[str, Any]] = ()) -> None:
        self.events: list[Mapping[str, Any]] = list(events)

    @classmethod
    def read(cls, run_dir: str | Path) -> EventLog:
        """The run's whole log as it is now (a torn last line left out, as :func:`read_events` does)."""
        return cls(read_events(run_dir))

    @classmethod
    def view(cls, events: EventLog | Iterable[Mapping[str, Any]]) -> EventLog:
        """``events`` as a log (a log stays itself)."""
        return events if isinstance(events, EventLog) else cls(events)

    def __len__(self) -> int:
        return len(self.events)

    @overload
    def of(self, record_type: type[R], /) -> list[R]: ...
    @overload
    def of(self, record_type: type[R], other: type[R2], /) -> list[R | R2]: ...
    @overload
    def of(self, *record_types: type[EventRecord]) -> list[EventRecord]: ...
    def of(self, *record_types: type[EventRecord]) -> list[Any]:
        """The lines of those kinds, as their records, in the log's order (:func:`typed`)."""
        return typed(self.events, *record_types)

    def all(self, *record_types: type[EventRecord]) -> list[EventRecord]:
        """Every line in the log's order: those of ``record_types`` as their records, the others
        as :class:`OtherEvent` (their kind and time)."""
        by_kind = {t.KIND: t for t in record_types}
        return [by_kind.get(e.get("kind"), OtherEvent).from_json(e) for e in self.events]


# ---------------------------------------------------------------------------------- the flow
@dataclass(frozen=True)
class FlowStarted(EventRecord):
    """A flow run began on the run (written once it holds the run's lock and took it over)."""

    KIND = Event.FLOW_STARTED
    flow_run_id: str | None = None
    flow_run_name: str | None = None
    #: When the flow process started: its clock begins before its MLflow run and takeover.
    started_at: float | None = optional()
    committed_step: int | None = None
    chunks: int | None = None

    @property
    def clock_start(self) -> float:
        """When the flow's wall-clock began (``started_at``, else the event's own time)."""
        return self.started_at if self.started_at is not None else self.time


@dataclass(frozen=True)
class FlowDone(EventRecord):
    """A flow run ended by itself, having trained the run to ``final_step``."""

    KIND = Event.FLOW_DONE
    final_step: int | None = None
    digest: str | None = None
    trained_chunks: int | None = None
    flow_run_id: str | None = None


@dataclass(frozen=True)
class HookFailure(EventRecord):
    """What a Prefect failure hook (tasks/hooks.py) wrote: the flow run or chunk task ended failed."""

    failure: str | None = None
    message: str | None = None
    chunk: int | None = None
    resume_step: int | None = None
    flow_run_id: str | None = None


@dataclass(frozen=True)
class FlowFailed(HookFailure):
    KIND = Event.FLOW_FAILED


@dataclass(frozen=True)
class FlowCrashed(HookFailure):
    KIND = Event.FLOW_CRASHED


@dataclass(frozen=True)
class ChunkTaskFailed(HookFailure):
    """The chunk task failed for good (retries spent, or not retryable)."""

    KIND = Event.CHUNK_FAILED


@dataclass(frozen=True)
class FlowTakenOver(EventRecord):
    """A flow run closed what the run's dead flow runs left open (tasks/takeover.py)."""

    KIND = Event.FLOW_TAKEN_OVER
    flow_run_id: str | None = None
    previous: list[str] = field(default_factory=list)
    previous_names: list[str] = field(default_factory=list)
    orphaned: list[dict[str, Any]] = field(default_factory=list)
    mlflow_runs_closed: list[str] = field(default_factory=list)
    crashed_task_runs: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------- attempts
@dataclass(frozen=True)
class AttemptStarted(EventRecord):
    """The chunk task (or the parking, for a worker killed while parked) started worker attempt
    ``attempt`` of ``chunk``; ``metrics_offset``: where its steps begin in ``metrics.jsonl``."""

    KIND = Event.ATTEMPT_STARTED
    chunk: int | None = None
    attempt: int | None = None
    flow_run_id: str | None = None
    task_run_id: str | None = None
    mlflow_run_id: str | None = None
    resumes_from: int | None = None
    metrics_offset: int | None = None
    #: A parked worker's attempt, recorded when it was killed (its task came later).
    parked: bool | None = optional()
    #: The attempt this one replaces at once.
    replaces: int | None = optional()


@dataclass(frozen=True)
class AttemptRecorded(EventRecord):
    """The task run and MLflow run of an attempt whose ``attempt_started`` came before its task."""

    KIND = Event.ATTEMPT_RECORDED
    chunk: int | None = None
    attempt: int | None = None
    task_run_id: str | None = None
    mlflow_run_id: str | None = None


@dataclass(frozen=True)
class Resubmitted(EventRecord):
    """A worker re-spawned inside one task run (``reason``: preempted, or replaced while parked)."""

    KIND = Event.RESUBMITTED
    chunk: int | None = None
    attempt: int | None = None
    reason: str | None = None
    resume_step: int | None = None


@dataclass(frozen=True)
class ChunkDone(EventRecord):
    """A chunk committed: its steps [start_step, end_step), by ``attempt``, with ``digest``
    (:class:`tasks.records.chunk_record.ChunkRecord` is this record as the flow receives it)."""

    KIND = Event.CHUNK_DONE
    chunk: int | None = None
    start_step: int | None = None
    end_step: int | None = None
    attempt: int | None = None
    preemptions: int | None = None
    resumed_from: int | None = None
    digest: str | None = None
    loss: float | None = None
    seconds: float | None = None
    worker_seconds: float | None = None
    node: str | None = None


# ---------------------------------------------------------------------------------- the worker
@dataclass(frozen=True)
class RankRecord(EventRecord):
    """An event a worker rank writes about itself."""

    rank: int | None = 0

    @property
    def on_rank0(self) -> bool:
        return int(self.rank or 0) == 0


@dataclass(frozen=True)
class WorkerStart(RankRecord):
    """A worker began: :class:`Started` from step 0, or :class:`Resumed` from a checkpoint."""

    until_step: int | None = None
    #: Its predecessor's last heartbeat step (how far a worker that vanished got).
    previous_beat_step: int | None = None
    intraop_threads: int | None = None
    #: The zygote's pid when it was forked by one (None: a new interpreter).
    forked_by: int | None = None

    @property
    def resumed_from(self) -> int:
        """The step it restored (0: it started from scratch)."""
        return 0

    @property
    def restore_s(self) -> float:
        """Seconds it took to restore (0 without a checkpoint)."""
        return 0.0


@dataclass(frozen=True)
class Started(WorkerStart):
    KIND = Event.STARTED


@dataclass(frozen=True)
class Resumed(WorkerStart):
    """A worker restored ``checkpoint`` (``tier``: disk or memory) in ``load_s``."""

    KIND = Event.RESUMED
    step: int | None = None
    checkpoint: str | None = None
    digest: str | None = None
    load_s: float | None = None
    tier: str | None = None

    @property
    def resumed_from(self) -> int:
        return int(self.step or 0)

    @property
    def restore_s(self) -> float:
        return float(self.load_s or 0.0)


@dataclass(frozen=True)
class Preempted(RankRecord):
    """SIGTERM: the worker saved an emergency checkpoint at ``step`` and left."""

    KIND = Event.PREEMPTED
    step: int | None = None


@dataclass(frozen=True)
class WorkerDone(RankRecord):
    """A worker ended cleanly at ``step`` (``digest``: its newest committed checkpoint's)."""

    KIND = Event.WORKER_DONE
    step: int | None = None
    digest: str | None = None
    loss: float | None = None
    threads: list[str] | None = None
    network_clients: list[str] | None = None


@dataclass(frozen=True)
class WorkerConfigError(RankRecord):
    """A worker refused its configuration or data (exit :data:`~training.events.EXIT_CONFIG`)."""

    KIND = Event.CONFIG_ERROR
    message: str | None = None


@dataclass(frozen=True)
class FirstStep(EventRecord):
    """A worker's first step done (``step_s``: its time, compilation included)."""

    KIND = Event.FIRST_STEP
    step: int | None = None
    step_s: float | None = None


# ---------------------------------------------------------------------------------- checkpoints
@dataclass(frozen=True)
class CheckpointSaved(EventRecord):
    """A disk save: the loop stalled ``stall_s``, the persist took ``persist_s`` beside it."""

    KIND = Event.CHECKPOINT_SAVED
    step: int | None = None
    stall_s: float | None = None
    blocking: bool | None = None
    persist_s: float | None = None


@dataclass(frozen=True)
class CheckpointSkipped(EventRecord):
    """A resume passed ``checkpoint`` over (it does not verify, or does not fit), for ``reason``."""

    KIND = Event.CHECKPOINT_SKIPPED
    checkpoint: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class CheckpointPublished(EventRecord):
    """A versioned checkpoint became visible in the remote index, ``upload_lag_s`` after its commit."""

    KIND = Event.CHECKPOINT_PUBLISHED
    step: int | None = None
    digest: str | None = None
    dvc_md5: str | None = None
    index: str | None = None
    upload_s: float | None = None
    upload_lag_steps: int | None = None
    upload_lag_s: float | None = None


@dataclass(frozen=True)
class CheckpointFetched(EventRecord):
    """A checkpoint downloaded from the remote and verified before a resume (``fetch_s`` in all)."""

    KIND = Event.CHECKPOINT_FETCHED
    step: int | None = None
    digest: str | None = None
    bytes: int | None = None
    download_s: float | None = None
    verify_s: float | None = None
    fetch_s: float | None = None
    metric_rows: int | None = None
    from_node: str | None = None
    node: str | None = None
    remote: str | None = None
    #: The newer remote copies it refused first, each with why.
    refused: list[dict[str, Any]] | None = None


# ---------------------------------------------------------------------------------- the replay check
@dataclass(frozen=True)
class ReplayChecked(EventRecord):
    """A resumed worker compared ``values_compared`` replayed metric values with the first pass."""

    values_compared: int | None = None
    mismatches: int | None = None


@dataclass(frozen=True)
class ReplayVerified(ReplayChecked):
    KIND = Event.REPLAY_VERIFIED


@dataclass(frozen=True)
class ReplayMismatch(ReplayChecked):
    KIND = Event.REPLAY_MISMATCH


@dataclass(frozen=True)
class NondeterministicResume(EventRecord):
    """The first replayed value that differed from the first pass: ``metric`` at ``step``."""

    KIND = Event.NONDETERMINISTIC_RESUME
    step: int | None = None
    metric: str | None = None
    logged: Any = None
    replayed: Any = None
