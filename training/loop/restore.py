"""The resume: the newest checkpoint that verifies, belongs to this trajectory and restores.

Three outcomes for each checkpoint the store offers, newest first
(:meth:`~training.checkpointing.store.CheckpointStore.candidates`):

* **rejected** (:class:`~training.checkpointing.errors.CheckpointRejected`, by the store while
  loading it, or by the shard reader while restoring it): recorded as ``checkpoint_skipped``, and
  the next older one is tried on a fresh runtime (a partial restore must not leak into it);
* **another trajectory** (its fingerprint is neither this config's nor one ``run.json``
  accepted): a :class:`~training.config.ConfigError` naming each changed key — never a fallback;
* **restored**: the train state now holds it.

Anything else raised on the way is a bug: it propagates, the worker crashes with the traceback
in its log (and the supervisor's ``failure`` event), and the checkpoint is neither recorded as
refused nor, when the run reaches its step again, quarantined.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from training import distributed, faults
from training.checkpointing import sharded
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.memory.memory_tier import merged
from training.checkpointing.store import Candidate, Checkpoint
from training.config import ConfigError
from training.datapipe.data import mix_seed
from training.datapipe.stream_position import SavedLayout, check_resume, is_global
from training.datapipe.streams import is_main_positioned
from training.events import Event, append_event, read_events
from training.loop.runtime import Runtime
from training.parts import TaskParts
from training.paths import RunPaths
from training.run_identity import RunInfo
from training.rundir import continues, describe_change, recorded_trajectories, run_info
from training.state import seed_everything


@dataclass(frozen=True)
class Restored:
    """What the restore left: the runtime that holds the state to train on (a rebuilt one when an
    earlier checkpoint was refused) and the checkpoint it came from (None: step 0)."""

    runtime: Runtime
    checkpoint: Checkpoint | None
    #: The world size differs from the checkpoint's (the metric logger then compares replayed
    #: steps loosely: another all-reduce order).
    world_changed: bool
    #: Seconds from the first candidate to the restored state.
    load_s: float
    #: Restored from the memory tier's snapshot, not from a disk checkpoint.
    from_memory: bool = False


def restore_newest(runtime: Runtime, run_dir: Path, log: Callable[[str], None]) -> Restored:
    """Walk the candidates newest first — the memory tier's snapshot among the disk checkpoints
    where its step puts it (:func:`~training.checkpointing.memory.memory_tier.merged`); see the module
    docstring for what happens to each."""
    t0 = time.perf_counter()
    skipped: list[str] = []  # "<checkpoint>: <why>", newest first: the refusal below quotes them
    for candidate, in_memory in merged(runtime.memory, runtime.store):
        candidate = agreed(candidate, runtime) if in_memory else candidate
        if candidate.loaded is None:
            refuse(runtime, run_dir, candidate.path, candidate.reason, in_memory, log, recorded=not in_memory)
            skipped.append(f"{candidate.path.name}: {candidate.reason}")
            continue
        checkpoint, parts = candidate.loaded
        if not in_memory:  # a snapshot of another trajectory never reaches here (memory tier rule 3)
            check_fingerprint(runtime, run_dir, checkpoint)
        try:
            world_changed = apply(runtime, checkpoint, parts, run_dir, log)
        except CheckpointRejected as exc:
            if runtime.world_size > 1:
                raise  # every rank must fall back together; a crash makes the retry do it
            refuse(runtime, run_dir, checkpoint.path, f"restore failed: {exc}", in_memory, log)
            skipped.append(f"{checkpoint.path.name}: {exc}")
            runtime = runtime.rebuilt()
            continue
        if checkpoint.manifest.get("forked_from"):
            adopt_child_settings(runtime, checkpoint.manifest["forked_from"], log)
        return Restored(runtime, checkpoint, world_changed, time.perf_counter() - t0, in_memory)
    parent = (run_info(run_dir) or RunInfo()).parent
    if parent:  # a child trained from scratch would be another run under the child's name
        why = (skipped or ["none was found"])[0] + (f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else "")
        raise ConfigError(
            f"run {runtime.config.run_name} starts from {parent.run} step {parent.step}, but no "
            f"checkpoint here restores: {why}; fork it again"
        )
    refuse_fresh_start(runtime, run_dir, skipped)
    return Restored(runtime, None, False, time.perf_counter() - t0)


def refuse_fresh_start(runtime: Runtime, run_dir: Path, skipped: list[str]) -> None:
    """Never a silent fresh start: a run past its first chunk (a checkpoint committed at or after
    ``chunk_steps``) that finds none that restores (disk and memory tier; the chunk task fetched
    the remote's first) fails, recorded with what was looked at, rather than train its whole
    history again and call it a resume (torchtitan#3732: a resume silently started fresh).  Inside
    the first chunk, step 0 is as near as the lost checkpoints were: it starts there, as said."""
    committed = [int(e["step"]) for e in read_events(run_dir, Event.CHECKPOINT_COMMITTED) if "step" in e]
    if max(committed, default=0) < runtime.config.train.chunk_steps:
        return  # a new run, or one still in its first chunk
    looked = skipped or ["no checkpoint on disk and no memory snapshot"]
    if runtime.rank == 0:
        append_event(run_dir, Event.NO_RESTORABLE_CHECKPOINT, newest_committed=max(committed), looked_at=looked)
    more = f" (and {len(looked) - 1} more)" if len(looked) > 1 else ""
    raise ConfigError(
        f"run {runtime.config.run_name} committed checkpoints up to step {max(committed)}, but none here "
        f"restores: {looked[0]}{more}; refusing to train it again from step 0: bring its checkpoints back "
        f"(`convoy pull`, or {RunPaths(run_dir).checkpoints} from a backup) or train a new run "
        f"(`convoy train -S run_name=<new name>`)"
    )


def agreed(snapshot: Candidate, runtime: Runtime) -> Candidate:
    """A memory snapshot every rank loaded (and whose sharded pieces fit this rank's model), or
    refused on every rank (memory tier rules 4 and 9): ranks that restored different steps could
    not train on together, and a rank that failed alone would crash every retry."""
    if snapshot.loaded is not None:
        misfit = sharded.snapshot_misfit(snapshot.loaded[1], runtime.parts.model, runtime.parts.optimizer)
        snapshot = snapshot if misfit is None else replace(snapshot, reason=misfit, loaded=None)
    (refused_somewhere,) = distributed.agree_any(snapshot.loaded is None)
    if refused_somewhere and snapshot.loaded is not None:
        return replace(snapshot, reason="refused by another rank", loaded=None)
    return snapshot


def refuse(
    runtime: Runtime,
    run_dir: Path,
    path: Path,
    reason: str,
    in_memory: bool,
    log: Callable[[str], None],
    recorded: bool = False,
) -> None:
    """Pass a candidate over: said in the log, and recorded — a disk checkpoint as
    ``checkpoint_skipped`` (unless the store already did), the memory snapshot as
    ``memory_snapshot_refused`` (memory tier rule 4)."""
    if in_memory:
        log(f"skipping the memory snapshot of step {path.name}: {reason}")
        append_event(run_dir, Event.MEMORY_SNAPSHOT_REFUSED, rank=runtime.rank, checkpoint=path.name, reason=reason)
        return
    log(f"skipping checkpoint {path.name}: {reason}")
    if not recorded:
        runtime.store.refuse(path, reason)


def check_fingerprint(runtime: Runtime, run_dir: Path, checkpoint: Checkpoint) -> None:
    """Refuse a checkpoint of another trajectory, naming the keys that differ (old → new)
    from what ``run.json`` recorded for the checkpoint's fingerprint."""
    config = runtime.config
    info = run_info(run_dir) or RunInfo()
    saved = checkpoint.manifest.get("fingerprint")
    if saved in (config.fingerprint(), *info.accepted_fingerprints):
        return
    old = recorded_trajectories(run_dir, info).get(saved)
    if continues(old, config):  # an earlier release's checkpoint, trained as this one would train it
        return
    raise ConfigError(
        f"checkpoint {checkpoint.path.name} was saved with other trajectory settings: "
        f"{describe_change(old, config)}; refusing to resume it under this config; resume with the "
        f"config that saved it, train a new run (`convoy train -S run_name=<new name>`), or accept the "
        f"change (`convoy train --allow-config-change`)"
    )


def apply(
    runtime: Runtime, checkpoint: Checkpoint, parts: dict[str, Any], run_dir: Path, log: Callable[[str], None]
) -> bool:
    """Restore the train state from a loaded checkpoint (every rank, same step); True when the
    world size changed since it was saved."""
    rank, world = runtime.rank, runtime.world_size
    saved_world = int(checkpoint.manifest.get("world_size", 1))
    has_rng = f"rank-{rank}" in parts
    withheld = faults.withheld()
    if withheld:
        log(f"NEGATIVE CONTROL: this restore withholds {', '.join(sorted(withheld))} (CONVOY_FAULTS)")
    runtime.state.restore(
        parts, rank, restore_rng_state=has_rng, load_weights=sharded_weights(checkpoint, parts), withheld=withheld
    )
    if has_rng and runtime.device.type == "cuda":
        log(runtime.state.rng_note)
    if not has_rng:  # more ranks than when saved: a fresh, deterministic stream for this rank
        seed_everything(mix_seed(runtime.config.train.seed, rank, checkpoint.step))
    resume_stream(runtime, checkpoint.step, saved_world, parts)
    distributed.check_same_step(runtime.state.step)
    world_changed = saved_world != world
    if world_changed and rank == 0:
        log(f"world size changed {saved_world} -> {world}: same global batch and sample position")
        append_event(run_dir, Event.WORLD_SIZE_CHANGED, step=checkpoint.step, old=saved_world, new=world)
    return world_changed


def sharded_weights(checkpoint: Checkpoint, parts: dict[str, Any]) -> Callable[[TaskParts], None] | None:
    """How a sharded checkpoint's model and optimizer are loaded (collectively, from its
    directory: every rank calls it), or None: they are in ``parts`` (the replicated format)."""
    if sharded.LAYOUT not in parts:
        return None
    skeleton = parts[sharded.LAYOUT]
    if sharded.PIECES in parts:  # a memory snapshot: this rank's pieces, from its own slot (tier rule 9)
        pieces = parts[sharded.PIECES]
        return lambda p: sharded.load_pieces(pieces, skeleton, p.model, p.optimizer)
    return lambda p: sharded.load_shards(checkpoint.path, skeleton, p.model, p.optimizer)


def resume_stream(runtime: Runtime, step: int, saved_world: int, parts: dict[str, Any]) -> None:
    """Refuse a stream position that another layout would misread (:func:`check_resume`, which
    ``convoy train`` runs before a run is touched; repeated here for every other way in), and
    give every rank a global-order position: it is rank 0's, the same on every rank, also for a
    rank the checkpoint has no part for."""
    saved = (parts.get("rank-0") or {}).get("stream")
    if saved is None:
        return
    data = runtime.parts.train_data
    layout = SavedLayout.of(step, saved_world, saved)
    restripes = is_main_positioned(data) and bool(data.restripes)
    check_resume(layout, runtime.world_size, runtime.config.data.num_workers, is_global(data), restripes)
    if layout.is_global:
        runtime.state.stream_saved = saved


def adopt_child_settings(runtime: Runtime, parent: dict[str, Any], log: Callable[[str], None]) -> None:
    """Restoring the parent checkpoint a child run was forked from (``--from``) brought the
    parent's optimisation settings with its state: take the child's instead (optimizer
    hyper-parameters, and for a LambdaLR the base LR, then the LR at the restored step from
    the child's schedule).  Model, optimizer moments, RNG, data cursor and step stay the
    parent's.  Deterministic, so a resumed child (restoring its own checkpoints, which
    already hold these settings) stays bitwise equal to an uninterrupted one."""
    opt, sched = runtime.parts.optimizer, runtime.parts.scheduler
    for group, fresh in zip(opt.param_groups, runtime.fresh.groups, strict=True):
        group.update(fresh)
    if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        sched.base_lrs = list(runtime.fresh.base_lrs)
        lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas, strict=True)]
        for group, lr in zip(opt.param_groups, lrs, strict=True):
            group["lr"] = lr
        sched._last_lr = lrs  # what get_last_lr() reports
    elif sched is not None:
        log(f"scheduler {type(sched).__name__}: the parent's schedule state continues unchanged")
    log(f"forked from {parent.get('run')} step {parent.get('step')}: this run's optimizer settings apply")
