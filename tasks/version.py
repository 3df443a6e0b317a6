"""Checkpoint versioning with DVC: a committed checkpoint goes to DVC's cache and the remote.

After a chunk commits, :func:`version_checkpoint` runs ``dvc add`` on the checkpoint directory
(``runs/<name>/checkpoints/step-N`` → ``step-N.dvc`` next to it; content-addressed, so unchanged
files cost nothing) and ``dvc push``es it to the remote, through the ``dvc.repo.Repo`` API.  A
committed checkpoint directory is immutable, so this can run on a background thread while the next
chunk trains (:func:`version_checkpoint_async`, or ``version_chunk.submit(...)`` in a flow).
:func:`pull_run` restores a run's checkpoints on another machine (``dvc pull`` of the run's
``.dvc`` files), after which the worker resumes from the newest one that verifies.

Remote selection: ``tracking.dvc_remote`` may be the *name* of a configured DVC remote, or a URL
/ directory path (``/mnt/shared/dvc``, ``s3://bucket/prefix``, ...) which is configured as the remote
``convoy`` in the repository's local config.  Empty: the repository's default remote
(``dvc remote add -d``), or if there is none a local directory remote (``$CONVOY_DVC_REMOTE``,
default ``~/.cache/convoy/dvc-remote``).  Git must not ignore ``checkpoints/step-N.dvc`` files
(DVC refuses to create them); ignore ``runs/**`` but re-include ``runs/**/`` and the ``.dvc`` files.
The run directory must not be a declared output of a running
``dvc repro`` stage (DVC refuses to ``add`` a path inside a stage's outs).

DVC calls in one process are serialised (one lock) and retried when another DVC process holds the
repository lock.  ``dvc`` is imported lazily (on first use).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from pathlib import Path
from typing import Any

from prefect import task

from training.checkpoint import CheckpointStore, parse_step
from training.events import append_event

#: Name given to a remote configured from a URL or path in ``tracking.dvc_remote``.
URL_REMOTE_NAME = "convoy"

_dvc_lock = threading.Lock()
_executor: concurrent.futures.ThreadPoolExecutor | None = None


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

    ``remote`` empty: the repository's default remote, else a local directory remote
    (:func:`default_remote_dir`) configured as ``convoy``.  A name: that remote.  A URL or path:
    configured as the remote ``convoy`` (in ``.dvc/config.local``, never committed).
    """
    remotes = repo.config.get("remote", {})
    if not remote:
        if repo.config.get("core", {}).get("remote"):
            return None  # DVC uses the default
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


def version_checkpoint(
    repo_root: str | Path | None, checkpoint_path: str | Path, remote: str | None = None, push: bool = True
) -> dict[str, Any]:
    """``dvc add`` a committed checkpoint directory and ``dvc push`` it; returns what was done.

    The checkpoint is verified first (manifest + hashes): an invalid or half-written directory is
    never versioned.  Raises :class:`VersioningError` with a one-line reason.
    """
    ckpt = Path(checkpoint_path).resolve()
    step = parse_step(ckpt.name)
    if step is None or not ckpt.is_dir():
        raise VersioningError(f"{ckpt}: not a checkpoint directory (expected checkpoints/step-NNNNNNNNN)")
    run_dir = ckpt.parent.parent
    try:
        manifest = CheckpointStore(run_dir).verify(ckpt).manifest
    except (ValueError, OSError) as exc:
        raise VersioningError(f"{ckpt.name} does not verify, not versioning it: {exc}") from None

    def work(repo: Any) -> dict[str, Any]:
        remote_name = resolve_remote(repo, remote) if push else None
        t0 = time.perf_counter()
        stages = repo.add([str(ckpt)])
        add_s = time.perf_counter() - t0
        out = stages[0].outs[0]
        md5 = out.hash_info.value if out.hash_info else None
        pushed, push_s = 0, 0.0
        if push:
            t1 = time.perf_counter()
            pushed = repo.push(targets=[str(stages[0].path)], remote=remote_name)
            push_s = time.perf_counter() - t1
        return {
            "checkpoint": ckpt.name,
            "step": step,
            "digest": manifest["digest"],
            "dvc_md5": md5,
            "dvcfile": str(stages[0].path),
            "remote": (remote_name or "(default)") if push else None,
            "files_pushed": pushed,
            "add_s": round(add_s, 3),
            "push_s": round(push_s, 3),
        }

    try:
        result = _with_repo(repo_root, ckpt, work)
    except VersioningError:
        raise
    except Exception as exc:  # DVC raises many types; the caller needs one line
        if type(exc).__name__ == "FileIsGitIgnored":
            raise VersioningError(
                f"git ignores {ckpt.name}.dvc, so DVC refuses to track {ckpt.name}: in .gitignore replace a "
                f"blanket 'runs/' with 'runs/**', '!runs/**/', '!runs/*/checkpoints/*.dvc', "
                f"'!runs/*/checkpoints/.gitignore'"
            ) from None
        if not ckpt.exists():
            raise VersioningError(f"{ckpt.name} was retired (deleted by retention) while versioning it") from None
        raise VersioningError(f"dvc add/push of {ckpt.name} failed: {type(exc).__name__}: {exc}") from exc
    append_event(run_dir, "checkpoint_versioned", **result)
    return result


def version_checkpoint_async(
    repo_root: str | Path | None, checkpoint_path: str | Path, remote: str | None = None
) -> concurrent.futures.Future[dict[str, Any]]:
    """Same as :func:`version_checkpoint` on one background thread (in submission order)."""
    global _executor
    if _executor is None:
        _executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="convoy-dvc")
    return _executor.submit(version_checkpoint, repo_root, checkpoint_path, remote)


def checkpoint_dvcfiles(run_dir: str | Path) -> list[Path]:
    """The run's ``checkpoints/step-N.dvc`` files, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    files = [p for p in root.glob("step-*.dvc") if parse_step(p.name.removesuffix(".dvc")) is not None]
    return sorted(files, key=lambda p: parse_step(p.name.removesuffix(".dvc")) or 0)


def pull_run(
    repo_root: str | Path | None, run_dir: str | Path, remote: str | None = None, latest_only: bool = False
) -> dict[str, Any]:
    """Restore a run's versioned checkpoints from the DVC remote (``convoy pull RUN``).

    Pulls every ``checkpoints/step-N.dvc`` of the run (only the newest with ``latest_only``) and
    verifies what arrived.  The next worker then resumes from the newest valid checkpoint.
    """
    run_dir = Path(run_dir).resolve()
    dvcfiles = checkpoint_dvcfiles(run_dir)
    if not dvcfiles:
        raise VersioningError(
            f"{run_dir}: no checkpoints/step-*.dvc files; nothing was versioned for this run "
            f"(or the .dvc files were not copied/committed)"
        )
    if latest_only:
        dvcfiles = dvcfiles[-1:]

    def work(repo: Any) -> Any:
        remote_name = resolve_remote(repo, remote)
        return repo.pull(targets=[str(p) for p in dvcfiles], remote=remote_name)

    t0 = time.perf_counter()
    try:
        stats = _with_repo(repo_root, run_dir, work)
    except VersioningError:
        raise
    except Exception as exc:
        raise VersioningError(f"dvc pull of {run_dir.name} failed: {type(exc).__name__}: {exc}") from exc
    store = CheckpointStore(run_dir)
    verified = []
    for p in dvcfiles:
        path = p.with_suffix("")
        try:
            verified.append({"checkpoint": path.name, "digest": store.verify(path).digest})
        except (ValueError, OSError) as exc:
            raise VersioningError(f"pulled {path.name} does not verify: {exc}") from None
    result = {
        "run_dir": str(run_dir),
        "checkpoints": verified,
        "pull_s": round(time.perf_counter() - t0, 3),
        "fetched": (stats or {}).get("fetched") if isinstance(stats, dict) else None,
    }
    append_event(run_dir, "checkpoints_pulled", checkpoints=[v["checkpoint"] for v in verified])
    return result


# ---------------------------------------------------------------------------------- Prefect task
@task(name="version-chunk", retries=2, retry_delay_seconds=2, log_prints=True)
def version_chunk(repo_root: str | None, checkpoint_path: str, remote: str | None = None) -> dict[str, Any]:
    """Version one committed checkpoint; ``version_chunk.submit(...)`` overlaps it with the next chunk."""
    result = version_checkpoint(repo_root, checkpoint_path, remote)
    print(
        f"versioned {result['checkpoint']} (dvc md5 {result['dvc_md5']}): add {result['add_s']} s, "
        f"push {result['push_s']} s to {result['remote']}"
    )
    return result
