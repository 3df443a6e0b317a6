"""``run.json`` as records: a run's identity (name, fingerprint, the trajectories it accepted),
where it forked from, and its links (MLflow, Prefect's UI).

Why typed: ``run.json`` is read in some thirty places, each by string key (``(run_info(d) or
{}).get("mlflow_run_id")``), so a misspelt key read None silently and nothing said which keys
exist.  The file on disk keeps its keys (runs written by earlier releases read as before, and a
key this release does not know is kept in :attr:`RunInfo.other` and written back unchanged);
only the readers changed.  Written by :func:`training.rundir.update_run_info`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class Lineage:
    """Where a run forked from (``convoy train --from``): ``run.json``'s ``parent``."""

    run: str
    run_name: str
    step: int
    digest: str | None = None
    fingerprint: str | None = None
    mlflow_run_id: str | None = None
    dvc_md5: str | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Lineage:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class RunInfo:
    """``run.json``, typed (see the module docstring); an empty one for a run not created yet."""

    name: str | None = None
    #: The fingerprint of the config the run trains now; ``accepted_fingerprints`` the earlier
    #: ones the user accepted (``--allow-config-change``), whose checkpoints may be resumed.
    fingerprint: str | None = None
    accepted_fingerprints: tuple[str, ...] = ()
    #: Each fingerprint's trajectory settings (what a config change is compared against).
    trajectories: Mapping[str, Any] = field(default_factory=dict)
    #: When the run directory was created (epoch seconds): part of its memory tier's key.
    created: float | None = None
    parent: Lineage | None = None
    mlflow_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_id: str | None = None
    mlflow_ui: str | None = None
    prefect_ui: str | None = None
    #: Keys this release does not read, kept as they were.
    other: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunInfo:
        known = {f.name for f in fields(cls)} - {"other"}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("parent") is not None:
            values["parent"] = Lineage.from_json(values["parent"])
        values["accepted_fingerprints"] = tuple(values.get("accepted_fingerprints") or ())
        values["trajectories"] = dict(values.get("trajectories") or {})
        return cls(**values, other={k: v for k, v in data.items() if k not in known})

    def to_json(self) -> dict[str, Any]:
        """The dict ``run.json`` holds: the keys as written before, unknown ones included."""
        out: dict[str, Any] = dict(self.other)
        for f in fields(self):
            if f.name == "other":
                continue
            value = getattr(self, f.name)
            if f.name == "parent":
                value = value.to_json() if value is not None else None
            elif f.name == "accepted_fingerprints":
                value = list(value)
            elif f.name == "trajectories":
                value = dict(value)
            out[f.name] = value
        return out

    @property
    def created_text(self) -> str:
        """``created`` as the memory tier's key reads it (empty when unknown)."""
        return str(self.created) if self.created is not None else ""
