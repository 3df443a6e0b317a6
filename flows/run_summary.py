"""What flow ``train`` returns: :class:`RunSummary`, one typed record.

The flow returns it as a mapping (:meth:`RunSummary.as_dict`: Prefect stores the flow's result,
``convoy train --json`` prints it, scripts and tests read it); everything in the product that reads
a summary (the end-of-run table in :mod:`flows.report`) goes through :meth:`RunSummary.from_dict`,
so the keys are spelled in this one place.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.records.chunk_record import ChunkRow
from training.tracking.goodput import Goodput, StepJournal, run_goodput

log = logging.getLogger("convoy.flow")


@dataclass(frozen=True)
class RunSummary:
    """One flow run over one training run, as it ended."""

    run_name: str
    run_dir: str
    flow_run_id: str | None
    final_step: int
    digest: str | None
    trained_chunks: int
    skipped_chunks: int
    #: chunk → attempts (every flow run of the training run)
    attempts: dict[int, int]
    #: chunk → loss at its boundary
    losses: dict[int, float]
    #: ``{"chunk", "kinds"}`` per chunk that failed at least once
    failures: list[dict[str, Any]]
    chunks: list[ChunkRow]
    #: each boundary checkpoint DVC versioned (or could not)
    versioned: list[dict[str, Any]]
    #: the checkpoint fetched from the remote when the flow started (``tracking.dvc``), or None
    fetched: dict[str, Any] | None
    #: resumes, failures, steps_lost, nondeterministic (the resume audit's counts)
    audit: dict[str, Any]
    #: ``{"resumed_from_step", "passed_over"}`` per resume that passed a checkpoint over
    passed_over: list[dict[str, Any]]
    entropy_floor: float | None
    #: names (or ids) of the dead flow runs this one took over
    taken_over: list[str] | None
    model: dict[str, Any] | None
    #: the summary's one wall clock: the goodput's ``wall_s`` (the run's, to its last chunk's end
    #: when finished), or this command's time when goodput cannot be measured
    seconds: float
    #: the run's goodput so far (a fraction; :mod:`training.tracking.goodput`), its wall-clock
    #: seconds, productive seconds and badput seconds by bucket; None / empty when not measured
    goodput: float | None = None
    wall_s: float | None = None
    productive_s: float | None = None
    badput_s: dict[str, float] = field(default_factory=dict)
    #: chunks of a ``--from`` child up to its start: trained by the parent run, not counted here
    parent_chunks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def measured_goodput(self) -> Goodput | None:
        """The goodput fields as one :class:`~training.tracking.goodput.Goodput` (None if absent)."""
        if self.goodput is None or self.wall_s is None:
            return None
        productive = self.productive_s if self.productive_s is not None else self.goodput * self.wall_s
        return Goodput(self.goodput, self.wall_s, productive, dict(self.badput_s), self.final_step)

    @property
    def final_loss(self) -> float | None:
        return self.losses[max(self.losses)] if self.losses else None

    @property
    def failure_kinds(self) -> list[str]:
        return [k for f in self.failures for k in f["kinds"]]

    @property
    def registered_model(self) -> str | None:
        return (self.model or {}).get("registered")

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return out | {"chunks": [c.as_dict() for c in self.chunks]} | self.extra

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunSummary:
        """Read a summary back (a JSON round trip turns the chunk keys into strings: undone)."""
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        values = {k: data.get(k) for k in known}
        values["attempts"] = {int(k): v for k, v in (data.get("attempts") or {}).items()}
        values["losses"] = {int(k): v for k, v in (data.get("losses") or {}).items()}
        values["chunks"] = [ChunkRow.from_dict(c) for c in data.get("chunks") or []]
        for key in ("failures", "versioned", "passed_over"):
            values[key] = list(data.get(key) or [])
        values["audit"] = dict(data.get("audit") or {})
        values["badput_s"] = dict(data.get("badput_s") or {})
        values["parent_chunks"] = int(data.get("parent_chunks") or 0)
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})


def goodput_fields(run_dir: Path, until: float | None, journal: StepJournal | None = None) -> dict[str, Any]:
    """The summary's goodput fields for the run up to ``until`` (empty if it cannot be measured:
    the summary never fails for it); ``journal``: the run's reader of its journal, when the caller
    holds one (the flow's run resources)."""
    try:
        measured = run_goodput(run_dir, until=until, journal=journal)
    except (OSError, ValueError) as exc:  # a damaged journal: the summary says so elsewhere
        log.warning("goodput: could not measure run %s: %s", run_dir, exc)
        return {}
    if measured is None:
        return {}
    return {
        "goodput": measured.goodput,
        "wall_s": measured.wall_s,
        "productive_s": measured.productive_s,
        "badput_s": measured.badput_s,
    }
