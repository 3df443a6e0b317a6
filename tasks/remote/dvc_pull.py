"""Pulling a run's versioned checkpoints back from the DVC remote (``convoy pull RUN``).

Another machine (or a fresh clone) has the run's ``checkpoints/step-N.dvc`` files from git but
none of the checkpoint bytes: :func:`pull_run` runs ``dvc pull`` on those files, verifies every
checkpoint that arrived with the store's own check, and records a ``checkpoints_pulled`` event.
The next worker then resumes from the newest checkpoint that verifies.  Which remote is asked
follows :func:`tasks.remote.dvc_version.resolve_remote`; every error names it and why it was
chosen, since "Is your cache up to date?" (DVC's own message) tells a user nothing.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tasks.remote.dvc_version import VersioningError, _with_repo, remote_label, resolve_remote
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.store import CheckpointStore, parse_step
from training.events import Event, append_event
from training.paths import RunPaths


@dataclass(frozen=True)
class PulledCheckpoint:
    """One checkpoint that arrived and verified."""

    checkpoint: str
    digest: str


@dataclass(frozen=True)
class Pulled:
    """What ``convoy pull`` restored: printed as JSON, so its keys are the command's output."""

    run_dir: str
    remote: str
    checkpoints: tuple[PulledCheckpoint, ...]
    pull_s: float
    fetched: int | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"checkpoints": [asdict(c) for c in self.checkpoints]}


def checkpoint_dvcfiles(run_dir: str | Path) -> list[Path]:
    """The run's ``checkpoints/step-N.dvc`` files, oldest first."""
    root = RunPaths(run_dir).checkpoints
    if not root.is_dir():
        return []
    files = [p for p in root.glob("step-*.dvc") if parse_step(p.name.removesuffix(".dvc")) is not None]
    return sorted(files, key=lambda p: parse_step(p.name.removesuffix(".dvc")) or 0)


def _pull_error(exc: Exception, run_dir: Path, label: str) -> VersioningError:
    """One line naming the remote and what it lacked (DVC's own says "Is your cache up to date?")."""
    if type(exc).__name__ == "CheckoutError":
        missing = ", ".join(sorted(Path(str(t)).name for t in getattr(exc, "target_infos", []))) or "some files"
        return VersioningError(
            f"dvc pull of {run_dir.name} from {label}: the remote does not have {missing} (pushed to another "
            f"remote, or never pushed); name the right one with --remote or tracking.dvc_remote"
        )
    return VersioningError(f"dvc pull of {run_dir.name} from {label} failed: {type(exc).__name__}: {exc}")


def pull_run(
    repo_root: str | Path | None,
    run_dir: str | Path,
    remote: str | None = None,
    latest_only: bool = False,
    source: str = "",
) -> Pulled:
    """Restore a run's versioned checkpoints from the DVC remote (``convoy pull RUN``).

    Pulls every ``checkpoints/step-N.dvc`` of the run (only the newest with ``latest_only``) and
    verifies what arrived.  The next worker then resumes from the newest valid checkpoint.
    ``source`` says where ``remote`` came from (or, empty ``remote``, why the repository's
    default applies); every error names the remote and its source.
    """
    run_dir = Path(run_dir).resolve()
    dvcfiles = checkpoint_dvcfiles(run_dir)
    if not dvcfiles:
        raise VersioningError(
            f"{run_dir}: no checkpoints/step-*.dvc files; nothing was versioned for this run "
            f"(or the .dvc files were not copied/committed); no remote was asked"
        )
    if latest_only:
        dvcfiles = dvcfiles[-1:]
    label = f"remote {remote!r} (from {source})" if remote else f"the repository's default remote ({source})"

    def work(repo: Any) -> Any:
        nonlocal label
        try:
            remote_name = resolve_remote(repo, remote)
        except VersioningError as exc:
            raise VersioningError(f"{exc} (from {source})" if source else str(exc)) from None
        label = remote_label(repo, remote_name, source)
        return repo.pull(targets=[str(p) for p in dvcfiles], remote=remote_name)

    t0 = time.perf_counter()
    try:
        stats = _with_repo(repo_root, run_dir, work)
    except VersioningError:
        raise
    except Exception as exc:
        raise _pull_error(exc, run_dir, label) from exc
    store = CheckpointStore(run_dir)
    verified = []
    for p in dvcfiles:
        path = p.with_suffix("")
        try:
            verified.append(PulledCheckpoint(path.name, store.verify(path).digest))
        except CheckpointRejected as exc:
            raise VersioningError(f"{path.name} pulled from {label} does not verify: {exc}") from None
    append_event(run_dir, Event.CHECKPOINTS_PULLED, checkpoints=[v.checkpoint for v in verified])
    fetched = stats.get("fetched") if isinstance(stats, dict) else None
    return Pulled(str(run_dir), label, tuple(verified), round(time.perf_counter() - t0, 3), fetched)
