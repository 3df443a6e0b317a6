"""The run directory: identity (``run.json``), resolved config and the fingerprint check.

``run.json`` pins a run to the fingerprint of the config that created it, so a config that
changes the trajectory can never silently resume an old run (docs/architecture.md, invariant 7).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from filelock import FileLock

from training.compat import as_written_before, continuation_hint, read_as_today
from training.config import ConfigError, InitFrom, RunConfig, config_from_dict
from training.events import Event, append_event
from training.fsutil import atomic_replace, atomic_write_json, read_json
from training.locks import take_lock
from training.paths import CONFIG_FILE, RunPaths
from training.run_identity import RunInfo
from training.trajectory import trajectory_changes


class RunBusy(ConfigError):
    """Another worker holds the run's lease.  A ConfigError: exit 78, never retried."""


def take_worker_lease(run_dir: Path, wait_s: float = 5.0) -> FileLock:
    """Hold ``run_dir/.worker.lock`` so exactly one worker trains a run at a time
    (docs/architecture.md, invariant 8): a second ``convoy worker`` next to a flow would write
    the same heartbeat, metrics and checkpoints, and its start-up cleanup could remove the first
    one's in-flight temp save.  A retry waits ``wait_s`` for a predecessor that is still being
    reaped.  A pipelined chunk adopts the running worker, and with it the lease; the lease lives
    as long as the worker process (no owner note is removed: the next holder replaces it)."""

    def refuse(holder: str) -> RunBusy:
        return RunBusy(
            f"{run_dir} is being trained by another worker ({holder}); stop that worker first "
            f"(a second one would overwrite its checkpoints and metrics)"
        )

    return take_lock(RunPaths(run_dir).worker_lease, wait_s, refuse)


def run_info(run_dir: str | Path) -> RunInfo | None:
    """The run's ``run.json`` (:class:`~training.run_identity.RunInfo`); None before it exists."""
    path = RunPaths(run_dir).run_file
    return RunInfo.from_json(read_json(path)) if path.exists() else None


def update_run_info(run_dir: str | Path, **fields: Any) -> RunInfo:
    """``fields`` set in ``run.json`` (by its keys; every other key, known or not, kept)."""
    path = RunPaths(run_dir).run_file
    data = read_json(path) if path.exists() else {}
    data.update(fields)
    atomic_write_json(path, data)
    return RunInfo.from_json(data)


def keyed_config(config: RunConfig) -> RunConfig:
    """The config whose ``run_dir`` is the directory that trains ``config``.

    Under ``on_config_change: new_run`` a run's identity is its name *and* its trajectory:
    ``runs/<name>@<fingerprint[:8]>``, so a param change under ``dvc repro`` trains a new run
    instead of being refused, the old run stays untouched, and changing back finds the old run.
    A run created before this (a real ``runs/<name>`` directory) is kept while its fingerprint
    matches.  Idempotent: a name that already carries a fingerprint is returned as is."""
    if config.on_config_change != "new_run" or "@" in config.run_name:
        return config
    fp = config.fingerprint()
    legacy = config.run_dir
    if legacy.is_dir() and not legacy.is_symlink() and (run_info(legacy) or RunInfo()).fingerprint == fp:
        return config
    return config.model_copy(update={"run_name": f"{config.run_name}@{fp[:8]}"})


def link_current(config: RunConfig) -> Path | None:
    """Point ``runs/<name>`` at the keyed run directory of ``config`` (a relative symbolic link,
    replaced atomically), so ``convoy status runs/<name>`` shows the run trained last.  Returns
    the link, or None when there is none to make: not keyed, or ``runs/<name>`` is a real
    directory (a run created before keyed directories; it is left alone)."""
    base, sep, _ = config.run_name.partition("@")
    if not sep:
        return None
    link = Path(config.runs_dir) / base
    if link.exists() and not link.is_symlink():
        return None
    with atomic_replace(link, durable=False) as tmp:
        tmp.symlink_to(config.run_name)
    return link


def adopt_pulled_run(config: RunConfig | None, run_dir: Path) -> Path | None:
    """After ``convoy pull`` into the run directory of ``config`` (its fingerprint-named one):
    write its identity (``run.json``, ``config.json``: git holds only the ``.dvc`` files) and
    point ``runs/<name>`` at it, so ``convoy inspect``, ``status`` and ``train`` work on
    ``runs/<name>`` in a fresh clone.  Returns the link (None: not these params' run, or no link
    to make)."""
    if config is None:
        return None
    keyed = keyed_config(config)
    if keyed.run_dir.resolve() != Path(run_dir).resolve():
        return None
    open_run(keyed)
    return link_current(keyed)


def _split_from(spec: str) -> tuple[Path, int | None]:
    """``runs/demo`` or ``runs/demo@600`` (also ``runs/demo@1a2b3c4d@600``: a keyed directory's
    name holds an ``@`` too, so ``@step`` is split off only when the whole path is no directory)."""
    path = Path(spec)
    head, sep, tail = spec.rpartition("@")
    if path.is_dir() or not sep or not tail.isdigit():
        return path, None
    return Path(head), int(tail)


def resolve_parent(spec: str) -> InitFrom:
    """``--from runs/<parent>[@step]`` → the exact parent checkpoint: its run directory (links
    resolved: the child must name the run, not whatever ``runs/<name>`` points at later), the
    step (default: the newest verified one) and its digest.  A ConfigError says what is wrong."""
    from training.checkpointing.errors import CheckpointRejected
    from training.checkpointing.store import CheckpointStore

    path, step = _split_from(spec)
    if not RunPaths(path).checkpoints.is_dir():
        raise ConfigError(f"--from {spec}: {path} is not a convoy run directory (no checkpoints/)")
    store = CheckpointStore(path.resolve())
    try:
        ck = store.latest_valid(record=False) if step is None else store.verify(RunPaths(path).checkpoint(step))
    except CheckpointRejected as exc:
        steps = ", ".join(str(s) for s, _ in store.step_dirs()) or "none"
        raise ConfigError(
            f"--from {spec}: checkpoint of step {step} not usable ({exc}); steps there: {steps}"
        ) from None
    if ck is None:
        raise ConfigError(f"--from {spec}: {path} has no verified checkpoint")
    return InitFrom(run=os.path.relpath(path.resolve()), step=ck.step, digest=ck.digest)


def child_config(config: RunConfig, spec: str) -> RunConfig:
    """``config`` as a run that starts from ``--from spec``, in its own fingerprint-named
    directory (the fingerprint covers the parent checkpoint).

    The same command again must resume the child it made, although ``runs/<name>`` then links
    to that child: when ``spec`` (without ``@step``) is a child whose recorded parent gives these
    params its very fingerprint, that child is resumed instead of being forked again.  A parent
    already at ``train.total_steps`` is refused: the child would train nothing."""
    path, step = _split_from(spec)
    info = run_info(path) if step is None and RunPaths(path).run_file.exists() else None
    if info and info.parent and RunPaths(path).config_file.exists():
        same = config.model_copy(update={"init_from": load_run_config(path).init_from, "on_config_change": "new_run"})
        if same.init_from is not None and same.fingerprint() == info.fingerprint:
            return same
    parent = resolve_parent(spec)
    if parent.step >= config.train.total_steps:
        raise ConfigError(
            f"--from {spec}: that checkpoint ({parent.run} step {parent.step}) is already at "
            f"train.total_steps = {config.train.total_steps}; set a larger -S train.total_steps, or "
            f"name an earlier checkpoint (`{parent.run}@<step>`)"
        )
    return config.model_copy(update={"init_from": parent, "on_config_change": "new_run"})


def _parent_dvc_md5(ckpt: Path) -> str | None:
    """The DVC hash of the parent checkpoint (its ``step-N.dvc``), when it was versioned."""
    dvcfile = ckpt.with_name(ckpt.name + ".dvc")
    if not dvcfile.exists():
        return None
    import yaml

    outs = (yaml.safe_load(dvcfile.read_text()) or {}).get("outs") or [{}]
    return outs[0].get("md5")


def fork_checkpoint(config: RunConfig, run_dir: Path) -> dict[str, Any]:
    """Make the parent checkpoint the child's first one and return the lineage for ``run.json``.

    The files are hard-linked (a committed checkpoint is immutable: no bytes copied); the
    manifest is a new file naming the child's fingerprint and ``forked_from``, without the
    parent's MLflow run id (the child logs to its own run).  Built in a temporary sibling and
    renamed, then ``LATEST`` (invariant 1).  The worker restores it like any checkpoint and then
    takes the optimisation settings of the child's config (:mod:`training.loop.restore`)."""
    from training.checkpointing.errors import CheckpointRejected
    from training.checkpointing.install import install
    from training.checkpointing.store import MANIFEST, CheckpointStore

    src = config.init_from
    assert src is not None
    parent = Path(src.run)
    ckpt = RunPaths(parent).checkpoint(src.step)
    try:
        ck = CheckpointStore(parent).verify(ckpt)
    except CheckpointRejected as exc:
        raise ConfigError(f"--from {src.run}@{src.step}: the parent checkpoint does not verify ({exc})") from None
    if ck.digest != src.digest:
        raise ConfigError(f"--from {src.run}@{src.step}: that checkpoint's digest is {ck.digest}, not {src.digest}")
    final = RunPaths(run_dir).checkpoints / ckpt.name
    lineage = {
        "run": str(parent),
        "run_name": parent.name,
        "step": ck.step,
        "digest": ck.digest,
        "fingerprint": ck.manifest.get("fingerprint"),
        "mlflow_run_id": (run_info(parent) or RunInfo()).mlflow_run_id,
        "dvc_md5": _parent_dvc_md5(ckpt),
    }
    if final.is_dir():  # forked before, killed before run.json was written
        return lineage
    tmp = RunPaths(run_dir).checkpoints / f".tmp-fork-{ckpt.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt, tmp, copy_function=_link_or_copy)
    manifest = {**ck.manifest, "fingerprint": config.fingerprint(), "forked_from": lineage}
    manifest.pop("mlflow_run_id", None)
    (tmp / MANIFEST).unlink()  # a hard link to the parent's: never written through
    atomic_write_json(tmp / MANIFEST, manifest)
    install(tmp, final, files_synced=True)  # the parent's files are durable; the manifest was fsynced
    append_event(run_dir, Event.FORKED, **lineage)
    return lineage


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # no hard links here (another filesystem): copy
        shutil.copy2(src, dst)


def recorded_trajectories(run_dir: Path, info: RunInfo) -> dict[str, dict[str, Any]]:
    """``{fingerprint: trajectory settings}`` of every config this run was opened with.

    Runs created before ``run.json`` kept them: the trajectory is re-derived from ``config.json``,
    which still holds the config the run was last opened with."""
    known = dict(info.trajectories)
    if not known and RunPaths(run_dir).config_file.exists():
        try:
            previous = load_run_config(run_dir)
        except ConfigError:
            return known
        # Keyed by the fingerprint the writing release recorded (its checkpoints carry that one),
        # read as that release had it (training.compat, invariant 5).
        known[info.fingerprint or previous.fingerprint()] = as_written_before(previous.trajectory())
    return known


def continues(old: dict[str, Any] | None, config: RunConfig) -> bool:
    """Whether a run (or checkpoint) of recorded trajectory ``old`` continues under ``config``
    unchanged: equal once the keys later releases added are read as an older run means them."""
    return old is not None and not trajectory_changes(read_as_today(old, config), config.trajectory())


def describe_change(old: dict[str, Any] | None, config: RunConfig) -> str:
    """``train.lr 0.003 → 0.002, train.seed 1 → 2``, or why the keys are unknown."""
    if old is None:
        return "changed keys unknown (the run never recorded that config)"
    changes = ", ".join(trajectory_changes(read_as_today(old, config), config.trajectory()))
    hint = continuation_hint(old, config)
    return f"{changes} ({hint})" if hint else changes or "no key differs (another code version?)"


def mismatch_message(config: RunConfig, info: RunInfo, old: dict[str, Any] | None) -> str:
    """One line: which run, which keys changed (old → new), and the commands that do what the
    user may have meant (docs/architecture.md, invariant 7)."""
    return (
        f"run {config.run_name!r} was trained with other trajectory settings: {describe_change(old, config)}; "
        f"to train these settings as a new run: `convoy train -S run_name=<new name>` (or set "
        f"on_config_change: new_run); "
        f"to go on training this run under them: `--allow-config-change`"
    )


def _refuse_finished(config: RunConfig, run_dir: Path, changes: str) -> None:
    """``--allow-config-change`` on a run whose newest checkpoint is already at the new
    ``total_steps`` would train nothing and exit 0 as if the new settings had been applied."""
    from training.checkpointing.store import CheckpointStore  # imports torch: only on this path

    newest = CheckpointStore(run_dir).latest_valid(record=False)
    if newest is not None and newest.step >= config.train.total_steps:
        raise ConfigError(
            f"--allow-config-change: run {config.run_name!r} is already at step {newest.step} >= "
            f"train.total_steps = {config.train.total_steps}, so nothing would be trained with the new "
            f"settings ({changes}); train them as a new run: `convoy train -S run_name=<new name>`"
        )


def _accept_change(config: RunConfig, run_dir: Path, info: RunInfo, old: dict[str, Any] | None, allowed: bool) -> None:
    """Reopen a run under another fingerprint: silently where only a later release's reading of
    its settings differs (``training.compat``), recorded as ``release_upgraded``; where the
    settings changed, only with ``--allow-config-change``, recorded as ``config_changed``."""
    fp = config.fingerprint()
    if continues(old, config):  # written by an earlier release; trained as this one would train it
        append_event(run_dir, Event.RELEASE_UPGRADED, old=info.fingerprint, new=fp)
        return
    if not allowed:
        raise ConfigError(mismatch_message(config, info, old))
    _refuse_finished(config, run_dir, describe_change(old, config))
    append_event(
        run_dir,
        Event.CONFIG_CHANGED,
        old=info.fingerprint,
        new=fp,
        changes=trajectory_changes(old, config.trajectory()) if old else None,
    )


def open_run(config: RunConfig, allow_config_change: bool = False) -> Path:
    """Create the run directory, or reopen it after checking the fingerprint.

    Non-trajectory settings (chunking, checkpoint cadence, limits) are updated in place.
    """
    run_dir = config.run_dir
    fp = config.fingerprint()
    info = run_info(run_dir)
    if info is None:
        from training.task import check_task  # imports torch: only when a run is created

        check_task(config)  # bad task_args fail here, before the run is pinned to their fingerprint
    known = recorded_trajectories(run_dir, info) if info is not None else {}
    if info is not None and info.fingerprint != fp:
        _accept_change(config, run_dir, info, known.get(info.fingerprint or ""), allow_config_change)
    RunPaths(run_dir).checkpoints.mkdir(parents=True, exist_ok=True)
    RunPaths(run_dir).heartbeats.mkdir(exist_ok=True)
    known[fp] = config.trajectory()
    if info is None:
        parent = fork_checkpoint(config, run_dir) if config.init_from is not None else None
        update_run_info(
            run_dir,
            name=config.run_name,
            fingerprint=fp,
            created=time.time(),
            mlflow_run_id=None,
            trajectories=known,
            **({"parent": parent} if parent else {}),
        )
    elif info.fingerprint != fp:
        # The user explicitly accepted the change: checkpoints of the old config may be resumed.
        accepted = sorted({*info.accepted_fingerprints, info.fingerprint} - {None})
        update_run_info(run_dir, fingerprint=fp, accepted_fingerprints=accepted, trajectories=known)
    elif dict(info.trajectories) != known:
        update_run_info(run_dir, trajectories=known)
    atomic_write_json(RunPaths(run_dir).config_file, config.model_dump(mode="json"))
    return run_dir


def load_run_config(run_dir: str | Path) -> RunConfig:
    path = RunPaths(run_dir).config_file
    if not path.exists():
        raise ConfigError(f"{run_dir}: not a convoy run directory (no {CONFIG_FILE}); create it with `convoy train`")
    # Checked when the run was created; whoever builds the task imports its module then, so a
    # read-only command (convoy status, verify) does not pay ``import torch`` for it.
    return config_from_dict(read_json(path), str(path), check_task=False)
