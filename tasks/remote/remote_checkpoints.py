"""Checkpoints that travel by themselves (docs/architecture.md, invariant 10).

With ``tracking.dvc`` on, a run needs no shared disk and no manual step to continue on another
machine:

* **Upload** (:class:`Uploader`, one per run, held by the run's resources in the process that
  supervises its workers): a thread follows the run's ``LATEST`` and uploads the newest committed
  checkpoint whenever it is free, through :func:`tasks.remote.dvc_version.version_checkpoint`
  (hard-linked stage, the store's own verification, ``dvc add`` + ``dvc push``: content-addressed,
  so unchanged files cost nothing; then the remote index, :mod:`tasks.remote.remote_index`).
  Policy: the newest wins; checkpoints committed while an upload runs are passed over, except the
  newest, so the lag stays about one upload and the remote never falls further behind.  It runs
  beside the worker, never in it: a step is never held up beyond the snapshot the worker already
  takes.  The stage is a set of hard links, so retention deletes the checkpoint as usual
  (invariant 3 is untouched).
* **Fetch** (:func:`fetch_newest`, before a worker restores: the flow's start, every chunk
  attempt, so also a standby's hand-over and a pool chunk on a new node): when the remote's
  newest uploaded checkpoint is newer than anything that verifies here, it is downloaded straight
  from the remote's objects into ``checkpoints/.fetch-step-N``, verified by the store (sizes,
  hashes, structure and, where the task can be built, shapes) and against the digest the index
  recorded, and only then renamed into place; the metric rows uploaded with it fill in this
  machine's ``metrics.jsonl``.  A copy that does not verify (or whose objects are missing) is
  refused, the refusal is recorded naming the step, and the next older one is tried.  The fetch
  is timed (``fetch_s``: T_fetch, a part of the time to recover) in the ``checkpoint_fetched``
  event, which the resume audit attaches to the resume that follows it.

Never imported by ``training/`` (the worker knows nothing of DVC: it restores whatever verifies).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.remote.dvc_version import (
    Versioned,
    VersioningError,
    _with_repo,
    remote_run,
    resolve_remote,
    version_checkpoint,
)
from tasks.remote.remote_index import (
    IndexEntry,
    RemoteCopyRefused,
    RemoteIndex,
    RemoteRun,
    metric_rows_through,
    node_name,
)
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.install import install
from training.config import ConfigError, RunConfig
from training.events import Event, append_event
from training.paths import RunPaths, checkpoint_name

log = logging.getLogger("convoy.remote")

#: Prefix of a checkpoint being downloaded (not a checkpoint name: the store ignores it).
FETCH_PREFIX = ".fetch-"


def open_remote(config: RunConfig, run_dir: Path) -> RemoteRun:
    """The run's folder in the remote its uploads go to (``tracking.dvc_remote``, else the
    repository's default remote, else the local fallback: :func:`tasks.remote.dvc_version.resolve_remote`).
    Raises :class:`VersioningError` with one line when there is no DVC repository or remote."""

    def work(repo: Any) -> RemoteRun:
        return remote_run(repo, resolve_remote(repo, config.tracking.dvc_remote or None), run_dir)

    try:
        return _with_repo(None, run_dir, work)
    except VersioningError:
        raise
    except Exception as exc:  # DVC raises many types; one line for the caller
        raise VersioningError(f"the DVC remote of {run_dir.name}: {type(exc).__name__}: {exc}") from exc


def newest_uploaded(config: RunConfig, run_dir: Path) -> IndexEntry | None:
    """The newest entry of the run's remote index (None: nothing uploaded yet)."""
    return open_remote(config, run_dir).read_index().newest()


# ---------------------------------------------------------------------------------- fetch
def _resume_store(config: RunConfig, run_dir: Path) -> Any:
    """The store with the resume's validation: structure always, the model's tensor names,
    shapes and dtypes too when the task can be built here (on the meta device)."""
    from training.checkpointing.state_check import ExpectedState, checkpoint_validator
    from training.checkpointing.store import CheckpointStore
    from training.task import check_task

    try:
        parts = check_task(config)
    except ConfigError:
        parts = None
    expected = ExpectedState.of(parts) if parts is not None else None
    return CheckpointStore(run_dir, validator=checkpoint_validator(expected))


def _install(stage: Path, final: Path, run_dir: Path) -> None:
    """Rename a verified download into place and point ``LATEST`` at it.  A directory already
    there does not verify (it would have been the resume point otherwise): it is moved aside, as
    the store does with an invalid checkpoint it meets again, never deleted."""
    if final.exists():
        aside = final.with_name(f"{final.name}.invalid-{int(time.time() * 1000)}")
        os.rename(final, aside)
        append_event(
            run_dir,
            Event.CHECKPOINT_INVALID,
            checkpoint=final.name,
            moved_to=aside.name,
            reason="did not verify; replaced by the remote copy",
        )
    install(stage, final, files_synced=False)  # DVC's download does not fsync what it wrote


def _download_verified(remote: RemoteRun, entry: IndexEntry, store: Any) -> dict[str, Any]:
    """Download one indexed checkpoint, verify it, install it; returns its bytes and the seconds
    of each part.  CheckpointRejected (does not verify), RemoteCopyRefused (unsafe listing, not
    the indexed digest) or FileNotFoundError (objects missing) when the remote copy is unusable."""
    step = entry.step
    root = store.root
    stage = root / f"{FETCH_PREFIX}{checkpoint_name(step)}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        t0 = time.perf_counter()
        nbytes = remote.download(entry.dvc_md5, stage)
        t1 = time.perf_counter()
        ck = store.verify(stage, step=step)  # the resume's own validation
        if ck.digest != entry.digest:
            raise RemoteCopyRefused(f"its digest {ck.digest} is not the {entry.digest} the index recorded")
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    _install(stage, root / checkpoint_name(step), store.run_dir)
    return {"bytes": nbytes, "download_s": round(t1 - t0, 4), "verify_s": round(time.perf_counter() - t1, 4)}


def _fill_metrics(remote: RemoteRun, index: RemoteIndex, run_dir: Path, step: int) -> int:
    """Append the uploaded metric rows up to ``step`` that this machine's ``metrics.jsonl`` lacks."""
    from training.tracking.metrics import JsonlBackend, read_metric_lines

    path = RunPaths(run_dir).metrics
    backend = JsonlBackend(path)  # cuts a torn last line first
    have = {s for s, _ in read_metric_lines(path)}
    rows = [(s, m) for s, m in metric_rows_through(remote, index, step) if s not in have]
    if rows:
        backend.write(rows)
    return len(rows)


def _newer_entries(remote: RemoteRun, run_dir: Path) -> tuple[RemoteIndex, list[IndexEntry]]:
    """The index and its entries newer than anything here, newest first.  Cheap first (manifests
    only); the local files are hashed only when the remote has something newer."""
    from training.checkpointing.store import CheckpointStore

    try:
        index = remote.read_index()
    except (ValueError, OSError) as exc:
        raise VersioningError(str(exc)) from None
    store = CheckpointStore(run_dir)
    readable = [s for s, p in store.step_dirs() if _manifest_reads(store, p)]
    if not any(e.step > max(readable, default=0) for e in index.checkpoints):
        return index, []
    local = store.latest_valid(record=False)
    newer = [e for e in index.checkpoints if e.step > (local.step if local else 0)]
    return index, sorted(newer, key=lambda e: -e.step)


def _manifest_reads(store: Any, path: Path) -> bool:
    try:
        store.read_manifest(path)
    except CheckpointRejected:
        return False
    return True


def fetch_newest(config: RunConfig, run_dir: Path, say: Callable[[str], None] = print) -> dict[str, Any] | None:
    """Download the remote's newest uploaded checkpoint when it is newer than the newest one that
    verifies here (falling back to older uploaded ones that verify); None when there was nothing
    newer.  The result (also the ``checkpoint_fetched`` event) says which step, its bytes, the
    time it took (``fetch_s``) and which newer remote copies were refused.  Raises
    :class:`VersioningError` when the remote cannot be read."""
    t0 = time.perf_counter()
    remote = open_remote(config, run_dir)
    index, newer = _newer_entries(remote, run_dir)
    if not newer:
        return None
    store = _resume_store(config, run_dir)
    for stale in store.root.glob(f"{FETCH_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)  # a download killed half-way (never installed)
    refused: list[dict[str, Any]] = []
    for entry in newer:
        try:
            got = _download_verified(remote, entry, store)
        except (CheckpointRejected, RemoteCopyRefused, FileNotFoundError) as exc:
            refused.append(_refuse(run_dir, remote, entry.step, str(exc) or type(exc).__name__, say))
            continue
        result = {
            "step": entry.step,
            "digest": entry.digest,
            **got,
            "fetch_s": round(time.perf_counter() - t0, 4),
            "metric_rows": _fill_metrics(remote, index, run_dir, entry.step),
            "from_node": entry.node,
            "node": node_name(),
            "remote": remote.label,
            "refused": refused,
        }
        append_event(run_dir, Event.CHECKPOINT_FETCHED, **result)
        say(f"fetched checkpoint of step {entry.step} ({got['bytes']:,} bytes) in {result['fetch_s']:.2f} s")
        return result
    return {"step": None, "refused": refused, "fetch_s": round(time.perf_counter() - t0, 4)}


def _refuse(run_dir: Path, remote: RemoteRun, step: int, reason: str, say: Callable[[str], None]) -> dict[str, Any]:
    """Record (event, one line) that the remote copy of ``step`` is not used, and why."""
    append_event(run_dir, Event.REMOTE_CHECKPOINT_REFUSED, step=step, reason=reason, remote=remote.label)
    say(f"remote checkpoint of step {step} refused ({reason}); trying the next older one")
    return {"step": step, "reason": reason}


def fetch_before_resume(config: RunConfig, run_dir: Path, say: Callable[[str], None]) -> dict[str, Any] | None:
    """:func:`fetch_newest` when versioning is on; an unreachable remote is a warning (the worker
    then resumes from what verifies here: nothing is lost, at worst steps are trained again)."""
    if not config.tracking.dvc:
        return None
    try:
        return fetch_newest(config, run_dir, say)
    except VersioningError as exc:
        say(f"WARNING: could not read the remote's checkpoints ({exc}); resuming from this machine's")
        return None


# ---------------------------------------------------------------------------------- upload
class Uploader:
    """Uploads a run's newest committed checkpoint whenever it is free (see the module docstring).

    :meth:`upload_newest` is the one step, run by the thread every ``poll_s`` and by
    :meth:`drain` (a pool chunk about to report: its newest checkpoint must be in the remote
    before another node is asked to go on)."""

    def __init__(self, config: RunConfig, run_dir: Path, poll_s: float = 0.5) -> None:
        self.config, self.run_dir, self.poll_s = config, Path(run_dir), poll_s
        self.done: int | None = None  # newest committed step handled: uploaded, passed over, or in the index
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._follow, name="convoy-upload", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.upload_newest()

    def _committed_step(self) -> int | None:
        from training.checkpointing.store import parse_step

        try:
            return parse_step(RunPaths(self.run_dir).latest.read_text().strip())
        except OSError:
            return None

    def _already_uploaded(self) -> int:
        """The newest step the remote index lists (a fetched checkpoint is not uploaded again)."""
        try:
            entry = newest_uploaded(self.config, self.run_dir)
        except (VersioningError, ValueError, OSError) as exc:
            log.warning("uploader of %s: cannot read the remote index yet: %s", self.run_dir.name, exc)
            return 0
        return entry.step if entry else 0

    def upload_newest(self) -> Versioned | None:
        """Upload the newest committed checkpoint if it is newer than the last one handled."""
        with self._lock:
            step = self._committed_step()
            if step is None or (self.done is not None and step <= self.done):
                return None
            self.done = step
            if self._already_uploaded() >= step:
                return None  # in the index already (fetched here, or versioned at its chunk boundary)
            path = RunPaths(self.run_dir).checkpoint(step)
            try:
                return version_checkpoint(None, path, self.config.tracking.dvc_remote or None)
            except VersioningError as exc:  # retired meanwhile, or does not verify: the next one goes
                log.warning("uploader: %s", exc)
            except Exception as exc:  # noqa: BLE001 - a remote hiccup must not stop the uploads
                log.warning("uploader: upload of %s failed: %s: %s", path.name, type(exc).__name__, exc)
            return None

    def drain(self) -> Versioned | None:
        return self.upload_newest()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=300)

    def close(self, drain: bool = False) -> Versioned | None:
        """Stop following; ``drain``: upload the newest committed checkpoint first."""
        self.stop()
        return self.drain() if drain else None
