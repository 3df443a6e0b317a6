"""Checkpoint versioning with DVC: a committed checkpoint goes to DVC's cache and the remote.

After a chunk commits, :func:`version_checkpoint` runs ``dvc add`` on the checkpoint directory
(``runs/<name>/checkpoints/step-N`` → ``step-N.dvc`` next to it; content-addressed, so unchanged
files cost nothing) and ``dvc push``es it to the remote, through the ``dvc.repo.Repo`` API.  A
committed checkpoint directory is immutable and is hard-linked to a private stage before DVC reads
it, so retention deleting it meanwhile is harmless: this can run on a background thread while the
next chunk trains (:class:`Versioning`).  Once every object of the checkpoint is
in the remote, it is added to the run's index there (:mod:`tasks.remote.remote_index`), which is how
another machine finds it without a git commit (:mod:`tasks.remote.remote_checkpoints` uploads the
checkpoints between chunk boundaries too, and fetches them).
Pulling a run's checkpoints back on another machine lives in :mod:`tasks.remote.dvc_pull`.

Remote selection: ``tracking.dvc_remote`` may be the *name* of a configured DVC remote, or a URL
/ directory path (``/mnt/shared/dvc``, ``s3://bucket/prefix``, ...) which is configured as the remote
``convoy`` in the repository's local config.  Empty: the repository's default remote
(``dvc remote add -d``), or if there is none a local directory remote (``$CONVOY_DVC_REMOTE``,
default ``~/.cache/convoy/dvc-remote``).  A URL remote lives in ``.dvc/config.local`` (not in
git): a fresh clone re-derives it from ``params.yaml`` on ``convoy pull``, whose precedence is
``--remote``, the params' ``tracking.dvc_remote``, the run's ``config.json``, the repository's
committed default remote, then the fallback above (``flows/cli/main.py``); its errors name the remote.
Git must not ignore ``checkpoints/step-N.dvc`` files
(DVC refuses to create them); ignore ``runs/**`` but re-include ``runs/**/`` and the ``.dvc`` files.
The run directory must not be a declared output of a running
``dvc repro`` stage (DVC refuses to ``add`` a path inside a stage's outs).

DVC calls in one process are serialised (one lock) and retried when another DVC process holds the
repository lock.  ``dvc`` is imported lazily (on first use).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from tasks.remote import remote_index
from training import faults
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.store import CheckpointStore, parse_step
from training.config import RunConfig
from training.events import Event, append_event
from training.fsutil import atomic_write_bytes
from training.paths import RunPaths
from training.tracking.metrics import read_metric_lines

log = logging.getLogger("convoy.dvc")

#: Prefix of the private hard-link stage of a checkpoint being versioned (ignored by the store).
STAGE_PREFIX = ".stage-"
#: Name given to a remote configured from a URL or path in ``tracking.dvc_remote``.
URL_REMOTE_NAME = "convoy"

#: DVC's repository in this process: one call at a time (DVC's own lock is per process tree).
_dvc_lock = threading.Lock()
_version_lock = threading.Lock()


class VersioningError(RuntimeError):
    """DVC could not version or restore a checkpoint (message says what and how to fix it)."""


def _is_url(remote: str) -> bool:
    return "://" in remote or remote.startswith(("/", "./", "../", "~")) or os.sep in remote


def _find_root(path: Path) -> Path:
    for p in [path, *path.parents]:
        if (p / ".dvc").is_dir():
            return p
    raise VersioningError(f"{path} is not inside a DVC repository (no .dvc/ folder above it); run `dvc init`")


def _with_repo(repo_root: str | Path | None, anchor: Path, fn: Any, retries: int = 30) -> Any:
    """Run ``fn(repo)`` under the process-wide DVC lock, retrying while another process holds the
    repository lock (e.g. ``dvc status`` in a terminal)."""
    from dvc.lock import LockError
    from dvc.repo import Repo

    root = Path(repo_root).resolve() if repo_root else _find_root(anchor.resolve())
    delay = 0.2
    with _dvc_lock:
        for attempt in range(retries + 1):
            try:
                with Repo(str(root)) as repo:
                    return fn(repo)
            except LockError:
                if attempt == retries:
                    raise
                time.sleep(delay)
                delay = min(delay * 1.5, 3.0)
    raise AssertionError("unreachable")


def default_remote_dir() -> Path:
    """The local directory remote used when nothing is configured (``$CONVOY_DVC_REMOTE`` overrides)."""
    return Path(os.environ.get("CONVOY_DVC_REMOTE") or Path.home() / ".cache" / "convoy" / "dvc-remote")


def resolve_remote(repo: Any, remote: str | None) -> str | None:
    """The remote *name* to push to / pull from.

    ``remote`` empty: the repository's default remote, else the ``convoy`` remote if one was
    configured before, else a local directory remote (:func:`default_remote_dir`) as ``convoy``.
    A name: that remote.  A URL or path: configured as the remote ``convoy`` (in
    ``.dvc/config.local``, never committed).
    """
    remotes = repo.config.get("remote", {})
    if not remote:
        if repo.config.get("core", {}).get("remote"):
            return None  # DVC uses the default
        if URL_REMOTE_NAME in remotes:
            return URL_REMOTE_NAME  # configured earlier from tracking.dvc_remote
        remote = str(default_remote_dir())
    elif not _is_url(remote):
        if remote not in remotes:
            raise VersioningError(
                f"tracking.dvc_remote = {remote!r}: no DVC remote of that name "
                f"(known: {sorted(remotes) or 'none'}); give a name, a directory or a URL"
            )
        return remote
    url = remote
    if "://" not in url:
        url = str(Path(url).expanduser().resolve())
        Path(url).mkdir(parents=True, exist_ok=True)
    if remotes.get(URL_REMOTE_NAME, {}).get("url") != url:
        with repo.config.edit("local") as conf:
            conf.setdefault("remote", {})[URL_REMOTE_NAME] = {"url": url}
    return URL_REMOTE_NAME


def _snapshot(ckpt: Path) -> Path:
    """Hard-link the (immutable) checkpoint directory to ``checkpoints/.stage-step-N``.

    Instant, no extra bytes, and the links keep the data alive if retention deletes ``step-N``
    while DVC is still hashing it — which is what makes versioning safe to overlap with the next
    chunk.  Built under a temporary name and renamed, so the stage is complete or absent.  The
    name is no checkpoint name (the store ignores it) and its ``.dvc`` file matches the same
    ``checkpoints/*.dvc`` git rule as the real one."""
    # Not named .tmp-*: a starting worker sweeps those away.
    tmp = ckpt.parent / f"{STAGE_PREFIX}tmp-{ckpt.name}-{os.getpid()}-{threading.get_ident()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        for f in sorted(ckpt.rglob("*")):  # sharded checkpoints keep their shards under dcp/
            target = tmp / f.relative_to(ckpt)
            if f.is_dir():
                target.mkdir(exist_ok=True)
                continue
            try:
                os.link(f, target)
            except OSError:  # a filesystem without hard links: copy
                shutil.copy2(f, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    final = ckpt.parent / f"{STAGE_PREFIX}{ckpt.name}"
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


def _clean_stale_stages(checkpoints: Path) -> None:
    """Remove stages (and their ``.dvc`` files / ignore lines) left by a versioner that was killed.

    One flow per run (the run lock) and one versioning at a time per process: none is in use."""
    stale = sorted(checkpoints.glob(f"{STAGE_PREFIX}*"))
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    gitignore = checkpoints / ".gitignore"
    if stale and gitignore.exists():
        lines = gitignore.read_text().splitlines()
        kept = [ln for ln in lines if not ln.startswith(f"/{STAGE_PREFIX}")]
        if kept != lines:
            gitignore.write_text("".join(f"{ln}\n" for ln in kept))


def _move_dvcfile(stage: Path, ckpt: Path) -> Path:
    """``.stage-step-N.dvc`` (tracking ``.stage-step-N``) → ``step-N.dvc`` tracking ``step-N``;
    the git-ignore entry DVC wrote for the stage becomes the checkpoint's."""
    import yaml

    src = stage.with_name(stage.name + ".dvc")
    spec = yaml.safe_load(src.read_text())
    for out in spec.get("outs", []):
        if out.get("path") == stage.name:
            out["path"] = ckpt.name
    dst = ckpt.with_name(ckpt.name + ".dvc")
    atomic_write_bytes(dst, yaml.safe_dump(spec, sort_keys=False).encode())
    src.unlink()
    gitignore = ckpt.parent / ".gitignore"
    if gitignore.exists():
        lines = [ln for ln in gitignore.read_text().splitlines() if ln != f"/{stage.name}"]
        if f"/{ckpt.name}" not in lines:
            lines.append(f"/{ckpt.name}")
        gitignore.write_text("\n".join(lines) + "\n")
    return dst


@dataclass(frozen=True)
class Versioned:
    """One checkpoint versioned by DVC: the ``checkpoint_versioned`` event's fields, and what the
    flow's summary lists under ``versioned``."""

    checkpoint: str
    step: int
    digest: str
    dvc_md5: str | None
    dvcfile: str
    remote: str | None  # None: added, not pushed
    files_pushed: int
    add_s: float
    push_s: float
    published: bool  # named in the run's remote index (another machine can fetch it)
    index: str | None

    @property
    def upload_s(self) -> float:
        return round(self.add_s + self.push_s, 3)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Versioned:
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})


@dataclass(frozen=True)
class NotVersioned:
    """A checkpoint whose background versioning failed (it is safe on disk all the same)."""

    checkpoint: str
    error: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PendingVersion:
    """A checkpoint being versioned on the background thread; ``staged`` is set once it is
    hard-linked to its stage (from then on retention may delete it)."""

    checkpoint: str
    future: concurrent.futures.Future[Versioned]
    staged: threading.Event

    def outcome(self) -> Versioned | NotVersioned:
        """Wait for it; a failure is a warning, not an error (the checkpoint is safe on disk)."""
        try:
            return self.future.result()
        except Exception as exc:  # noqa: BLE001
            log.warning("DVC: could not version %s: %s", self.checkpoint, exc)
            return NotVersioned(self.checkpoint, str(exc))


def version_checkpoint(
    repo_root: str | Path | None,
    checkpoint_path: str | Path,
    remote: str | None = None,
    push: bool = True,
    staged: threading.Event | None = None,
) -> Versioned:
    """``dvc add`` a committed checkpoint directory and ``dvc push`` it; returns what was done.

    The checkpoint is hard-linked to a private stage first (see :func:`_snapshot`) and the stage is
    verified (manifest + hashes): an invalid or half-written directory is never versioned, and a
    retention delete of ``step-N`` during the add cannot break it.  The ``.dvc`` file is written
    as ``checkpoints/step-N.dvc`` tracking ``step-N`` (so ``dvc pull`` restores it in place).
    Raises :class:`VersioningError` with a one-line reason.  ``staged`` is set once the stage
    exists (or versioning gave up): from then on retention may delete the checkpoint.
    """
    try:
        ckpt = Path(checkpoint_path).resolve()
        step = parse_step(ckpt.name)
        if step is None or not ckpt.is_dir():
            raise VersioningError(f"{ckpt}: not a checkpoint directory (expected checkpoints/step-NNNNNNNNN)")
        with _version_lock:  # one versioning at a time per process: stages are not shared
            return _version_locked(repo_root, ckpt, step, remote, push, staged)
    finally:
        if staged is not None:
            staged.set()


def _version_locked(
    repo_root: str | Path | None,
    ckpt: Path,
    step: int,
    remote: str | None,
    push: bool,
    staged: threading.Event | None = None,
) -> Versioned:
    run_dir = ckpt.parent.parent
    _clean_stale_stages(ckpt.parent)
    try:
        stage = _snapshot(ckpt)
    except FileNotFoundError:
        raise VersioningError(f"{ckpt.name} was retired (deleted by retention) before it could be versioned") from None
    finally:
        if staged is not None:
            staged.set()
    try:
        try:
            manifest = CheckpointStore(run_dir).verify(stage, step=step).manifest  # the store's own check
        except CheckpointRejected as exc:
            raise VersioningError(f"{ckpt.name} does not verify, not versioning it: {exc}") from None
        snap = _StagedCheckpoint(ckpt, stage, step, manifest["digest"], manifest)
        result = _with_repo(repo_root, ckpt, lambda repo: _add_and_push(repo, snap, remote, push))
    except VersioningError:
        raise
    except Exception as exc:  # DVC raises many types; the caller needs one line
        if type(exc).__name__ == "FileIsGitIgnored":
            raise VersioningError(
                f"git ignores {ckpt.name}.dvc, so DVC refuses to track {ckpt.name}: in .gitignore replace a "
                f"blanket 'runs/' with 'runs/**', '!runs/**/', '!runs/*/checkpoints/*.dvc', "
                f"'!runs/*/checkpoints/.gitignore'"
            ) from None
        raise VersioningError(f"dvc add/push of {ckpt.name} failed: {type(exc).__name__}: {exc}") from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        stage.with_name(stage.name + ".dvc").unlink(missing_ok=True)
    append_event(run_dir, Event.CHECKPOINT_VERSIONED, **result.as_dict())
    if result.published:
        _record_published(run_dir, result, manifest)
    return result


def _record_published(run_dir: Path, result: Versioned, manifest: dict[str, Any]) -> None:
    """The upload lag of a checkpoint that just became visible in the remote index: how many
    steps the newest committed checkpoint is ahead of it, and how long after its commit it became
    visible (``checkpoint_published`` event, ``convoy status``, MLflow metrics)."""
    latest = parse_step(_read_latest(run_dir)) or result.step
    lag = {
        "upload_lag_steps": max(0, latest - result.step),
        "upload_lag_s": round(max(0.0, time.time() - float(manifest.get("created") or time.time())), 3),
    }
    append_event(
        run_dir,
        Event.CHECKPOINT_PUBLISHED,
        step=result.step,
        digest=result.digest,
        dvc_md5=result.dvc_md5,
        index=result.index,
        upload_s=result.upload_s,
        **lag,
    )
    from tasks.records.run_records import log_upload_lag

    log_upload_lag(run_dir, result.step, lag)


def _read_latest(run_dir: Path) -> str:
    try:
        return RunPaths(run_dir).latest.read_text().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class _StagedCheckpoint:
    """A verified checkpoint and its private hard-linked stage: what ``dvc add`` tracks (the stage)
    and what its ``.dvc`` file must name once pushed (the checkpoint)."""

    ckpt: Path
    stage: Path
    step: int
    digest: str
    manifest: dict[str, Any]


def _add_and_push(repo: Any, snap: _StagedCheckpoint, remote: str | None, push: bool) -> Versioned:
    """``dvc add`` the stage, ``dvc push`` it if asked, then move its ``.dvc`` file beside the checkpoint."""
    ckpt, stage = snap.ckpt, snap.stage
    remote_name = resolve_remote(repo, remote) if push else None
    t0 = time.perf_counter()
    stages = repo.add([str(stage)], relink=False)  # the stage is deleted next: no re-checkout
    add_s = time.perf_counter() - t0
    out = stages[0].outs[0]
    md5 = out.hash_info.value if out.hash_info else None
    pushed, push_s, published, index = 0, 0.0, False, None
    if push:
        t1 = time.perf_counter()
        pushed = repo.push(targets=[str(stage.with_name(stage.name + ".dvc"))], remote=remote_name)
        push_s = time.perf_counter() - t1
        # Every object of the checkpoint is in the remote now: only then may the index name it.
        faults.upload_stall(snap.step)
        run = remote_run(repo, remote_name, ckpt.parent.parent)
        entry = remote_index.entry_for(snap.step, snap.digest, out, snap.manifest)
        published = remote_index.publish(run, entry, list(read_metric_lines(RunPaths(ckpt.parent.parent).metrics)))
        index = run.path(remote_index.INDEX_NAME)
    # Only now does checkpoints/step-N.dvc appear (same content hash, naming the real checkpoint):
    # a .dvc file is never there before its data is in the remote, even if this process is killed.
    dvcfile = _move_dvcfile(stage, ckpt)
    return Versioned(
        checkpoint=ckpt.name,
        step=snap.step,
        digest=snap.digest,
        dvc_md5=md5,
        dvcfile=str(dvcfile),
        remote=(remote_name or "(default)") if push else None,
        files_pushed=pushed,
        add_s=round(add_s, 3),
        push_s=round(push_s, 3),
        published=published,
        index=index,
    )


def remote_run(repo: Any, remote_name: str | None, run_dir: Path) -> remote_index.RemoteRun:
    """The run's folder in the remote ``remote_name`` (None: the default remote), named by what a
    fresh clone computes from the params alone: the run name and the config fingerprint."""
    from training.rundir import load_run_config

    cfg = load_run_config(run_dir)
    remote = repo.cloud.get_remote(remote_name)
    return remote_index.RemoteRun.of(remote, remote_label(repo, remote_name, ""), cfg.run_name, cfg.fingerprint())


def version_checkpoint_async(
    repo_root: str | Path | None,
    checkpoint_path: str | Path,
    remote: str | None = None,
    executor: concurrent.futures.Executor | None = None,
) -> PendingVersion:
    """Same as :func:`version_checkpoint` on ``executor`` (a run's :class:`Versioning` thread;
    None: a thread of its own)."""
    own = executor is None
    pool = executor or concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="convoy-dvc")
    staged = threading.Event()
    future = pool.submit(version_checkpoint, repo_root, checkpoint_path, remote, True, staged)
    if own:
        pool.shutdown(wait=False)  # the submitted call still runs; the thread ends after it
    return PendingVersion(Path(checkpoint_path).name, future, staged)


def remote_label(repo: Any, name: str | None, source: str) -> str:
    """``remote 'convoy' (/mnt/shared/dvc, from params.yaml tracking.dvc_remote)``: which remote
    a pull used and why, for every error it can end in."""
    name = name or repo.config.get("core", {}).get("remote") or "?"
    url = repo.config.get("remote", {}).get(name, {}).get("url", "no URL configured")
    return f"remote {name!r} ({url}, from {source})" if source else f"remote {name!r} ({url})"


class Versioning:
    """A run's chunk-boundary versioning: one background thread (checkpoints are versioned in
    submission order) and what is still in flight.  Held by the flow's run resources; the flow
    submits each committed boundary and :meth:`collect` waits for them once, as the run closes."""

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        self.config, self.run_dir = config, Path(run_dir)
        self.pending: list[PendingVersion] = []
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def submit(self, step: int, only_if_missing: bool = False) -> PendingVersion | None:
        """Start DVC-versioning a committed chunk checkpoint, overlapping the next chunk's training.
        Safe against retention: the checkpoint is hard-linked into a private staging folder before
        ``dvc add`` (:func:`_snapshot`).  None if versioning is off (or, ``only_if_missing``, if the
        checkpoint is gone or already has its ``.dvc`` file)."""
        if not self.config.tracking.dvc:
            return None
        path = RunPaths(self.run_dir).checkpoint(step)
        if only_if_missing and (not path.is_dir() or path.with_name(path.name + ".dvc").exists()):
            return None
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="convoy-dvc")
        pending = version_checkpoint_async(None, str(path), self.config.tracking.dvc_remote or None, self._executor)
        self.pending.append(pending)
        return pending

    def collect(self) -> list[Versioned | NotVersioned]:
        """Wait for every versioning in flight and end the thread; a failure is a warning (the
        checkpoint is safe on disk)."""
        done, self.pending = [p.outcome() for p in self.pending], []
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        return done
