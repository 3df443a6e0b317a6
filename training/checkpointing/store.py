"""Checkpoint store: atomic commit, verified restore, retention, async two-phase save.

What a checkpoint directory holds and how one is judged is :mod:`training.checkpointing.verify`;
this module walks a run's checkpoints, writes new ones and retires old ones.

Commit protocol (docs/architecture.md, invariant 1; after torch.distributed.checkpoint: the metadata
written last commits): write into ``.tmp-step-…`` → fsync every file → write + fsync ``manifest.json``
→ fsync the dir → rename into place → fsync ``checkpoints/`` → move ``LATEST`` → retention.
Restore (invariant 2) walks checkpoints newest first and takes the first whose manifest and
hashes verify; every one rejected (:class:`CheckpointRejected`, and only that: any other error is
a bug and propagates) is recorded in ``events.jsonl`` and left on disk untouched.  Retention
(invariant 3) never deletes the newest verified checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training import faults
from training.checkpointing import safetensors_io as safetensors
from training.checkpointing import sharded
from training.checkpointing.codec import split_tree
from training.checkpointing.errors import CheckpointError, CheckpointRejected
from training.checkpointing.install import install, point_latest
from training.checkpointing.retention import kept
from training.checkpointing.staged import Staged
from training.checkpointing.verified import Candidate, PassedOver, ResumePoint, Verdicts, with_missing
from training.checkpointing.verify import (
    FORMAT_VERSION,
    MANIFEST,
    Checkpoint,
    Validator,
    dir_bytes,
    load_checkpoint,
    member_path,
    parse_step,
    read_manifest,
    state_digest,
    writer_versions,
)
from training.config import CheckpointConfig
from training.events import Event, append_event, read_events
from training.fsutil import atomic_write_bytes, atomic_write_json, read_json
from training.paths import RunPaths, checkpoint_name

if TYPE_CHECKING:  # torch is imported where a snapshot is taken: finding the resume point needs none
    import torch

#: Names other modules import from the store (it was the one module before ``verify`` split off).
__all__ = [
    "MANIFEST",
    "Candidate",
    "Checkpoint",
    "PassedOver",
    "ResumePoint",
    "CheckpointError",
    "CheckpointRejected",
    "CheckpointStore",
    "WriterGroup",
    "checkpoint_name",
    "member_path",
    "newest_verified_step",
    "parse_step",
    "state_digest",
]


@dataclass
class _Snapshot:
    step: int
    skeletons: dict[str, Any]
    tensors: dict[str, dict[str, torch.Tensor]]
    extra_manifest: dict[str, Any] = field(default_factory=dict)
    cuda_event: Any = None
    #: This rank's pieces of a sharded model and optimizer (sharded mode), copied like the parts.
    shard: sharded.LocalShard | None = None
    #: The holder of the staged copy this snapshot's tensors are views of (the memory tier's slot).
    staged: Staged | None = None


@dataclass(frozen=True)
class WriterGroup:
    """The ranks that write one checkpoint together: this process's ``rank`` of ``world_size``;
    rank 0 commits once every rank's files are written, or gives up after ``gather_timeout_s``."""

    world_size: int = 1
    rank: int = 0
    gather_timeout_s: float = 300


class CheckpointStore:
    """One run's checkpoints.  Exactly one writer process per run (the flow holds a file lock)."""

    def __init__(
        self,
        run_dir: str | Path,
        policy: CheckpointConfig | None = None,
        fingerprint: str = "",
        *,
        writers: WriterGroup | None = None,
        boundary_every: int = 0,
        validator: Validator | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.root = RunPaths(self.run_dir).checkpoints
        self.root.mkdir(parents=True, exist_ok=True)
        self.policy = policy or CheckpointConfig()
        self.fingerprint = fingerprint
        writers = writers or WriterGroup()
        self.world_size, self.rank, self.gather_timeout_s = writers.world_size, writers.rank, writers.gather_timeout_s
        #: Chunk length: retention keeps the newest chunk boundary (the chunk's artifact, verified and
        #: versioned while the worker trains on; rule 4 of :mod:`training.chunk_boundary`).
        self.boundary_every = boundary_every
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._saved_step: int | None = None  # the newest snapshot's step
        self._error: BaseException | None = None
        self.last_stall_s = self.last_persist_s = 0.0
        self.last_committed: Checkpoint | None = None
        #: Semantic check of loaded parts (the worker and the CLI set it; see ``load``).
        self.validator = validator
        #: Checkpoint name -> why it was refused (by this process), see :meth:`refuse`.
        self.refused: dict[str, str] = {}
        #: Each unchanged checkpoint verified once by this store (see :meth:`verify`).
        self.verdicts = Verdicts()

    # ------------------------------------------------------------------ listing / verifying
    def step_dirs(self) -> list[tuple[int, Path]]:
        """Committed-looking checkpoint directories, newest first (validity not checked)."""
        steps = ((parse_step(p.name), p) for p in self.root.iterdir())
        return sorted(((step, p) for step, p in steps if step is not None and p.is_dir()), reverse=True)

    def read_manifest(self, path: Path, step: int | None = None) -> dict[str, Any]:
        """``path``'s manifest, checked against its file list and the step in the directory name
        (or ``step``, for a copy under another name, e.g. a DVC stage).  CheckpointRejected if not."""
        return read_manifest(path, step)

    def verify(self, path: Path, step: int | None = None) -> Checkpoint:
        """The one validation (``convoy verify``/``inspect``, the flow, versioning, the resume):
        :meth:`load`'s checks on the safetensors headers instead of tensors (no ``import torch``,
        no tensor built), once per unchanged directory for this store
        (:class:`~training.checkpointing.verified.Verdicts`).  Raises CheckpointRejected with the reason."""
        return self.verdicts.verify(path, step, lambda p, s: load_checkpoint(p, s, self.validator, tensors=False)[0])

    def resume_point(self) -> ResumePoint:
        """THE newest usable checkpoint: the first, newest first, that verifies, and the newer ones
        passed over with their reasons.  Nothing recorded; every caller in the flow process asks
        the run's one store, so an unchanged checkpoint is hashed once."""
        passed: list[PassedOver] = []
        for step, path in self.step_dirs():
            try:
                return ResumePoint(self.verify(path), with_missing(passed, self.run_dir, step))
            except CheckpointRejected as exc:
                passed.append(PassedOver(path.name, step, str(exc)))
        return ResumePoint(None, with_missing(passed, self.run_dir, 0))

    def refuse(self, path: Path, reason: str) -> None:
        """Record that ``path`` was not restored (events.jsonl) and remember why: if the run
        reaches that step again, the directory is quarantined as invalid, not mistaken for
        evidence of a non-deterministic replay."""
        self.refused[path.name] = reason
        append_event(self.run_dir, Event.CHECKPOINT_SKIPPED, checkpoint=path.name, reason=reason)

    def latest_valid(self, record: bool = True) -> Checkpoint | None:
        """:meth:`resume_point`'s checkpoint; with ``record`` the passed-over ones are recorded
        (``checkpoint_skipped``) and left alone."""
        point = self.resume_point()
        if record:
            for passed in point.passed_over:
                self.refuse(self.root / passed.checkpoint, passed.reason)
        return point.checkpoint

    def inspect(self) -> list[dict[str, Any]]:
        """Every checkpoint directory with its verification result (for ``convoy inspect``),
        then the quarantined copies (``step-….invalid-<ms>``/``….replaced-<ms>``) with the reason
        recorded when they were moved aside."""
        rows = []
        for step, path in self.step_dirs():
            row: dict[str, Any] = {"step": step, "name": path.name, "quarantined": False}
            try:
                checkpoint = self.verify(path)
                row.update(valid=True, bytes=checkpoint.bytes, digest=checkpoint.digest, reason="")
            except CheckpointRejected as exc:
                row.update(valid=False, bytes=dir_bytes(path), digest=None, reason=str(exc))
            rows.append(row)
        moved = {e.get("moved_to"): e for e in read_events(self.run_dir) if e.get("moved_to")}
        for path in sorted(self.root.glob("step-*.*-*")):
            step = parse_step(path.name.split(".", 1)[0])
            if step is None or not path.is_dir():
                continue
            event = moved.get(path.name, {})
            reason = (
                f"quarantined ({event.get('kind', 'moved aside').removeprefix('checkpoint_')}): "
                f"{event.get('reason', 'no event recorded')}"
            )
            rows.append(
                {
                    "step": step,
                    "name": path.name,
                    "quarantined": True,
                    "valid": False,
                    "bytes": dir_bytes(path),
                    "digest": event.get("old_digest"),
                    "reason": reason,
                }
            )
        return rows

    # ------------------------------------------------------------------ loading
    def load(self, path: Path, step: int | None = None) -> tuple[Checkpoint, dict[str, Any]]:
        """Verify and load every part (:func:`training.checkpointing.verify.load_checkpoint`, with
        this store's validator).  Never unpickles; CheckpointRejected with the reason."""
        return load_checkpoint(path, step, self.validator)

    def load_latest(
        self, on_skip: Callable[[Path, str], None] | None = None
    ) -> tuple[Checkpoint, dict[str, Any]] | None:
        """Newest checkpoint that verifies *and* parses; skipped ones are recorded (and reported
        to ``on_skip(path, reason)``)."""
        for candidate in self.candidates():
            if candidate.loaded is not None:
                return candidate.loaded
            if on_skip is not None:
                on_skip(candidate.path, candidate.reason)
        return None

    def candidates(self) -> Iterator[Candidate]:
        """Every checkpoint newest first; a rejected one comes with its reason (already recorded).
        The resume walks this so a checkpoint that loads but cannot be restored still falls back
        to an older one.  Only a rejection is passed over: any other error propagates."""
        for step, path in self.step_dirs():
            yield self.candidate(step, path)

    def candidate(self, step: int, path: Path) -> Candidate:
        """One checkpoint as the resume meets it: loaded, or rejected (recorded) with the reason."""
        try:
            loaded = self.load(path)
        except CheckpointRejected as exc:
            self.refuse(path, str(exc))
            return Candidate(step, path, str(exc), None)
        return Candidate(step, path, "", loaded)

    # ------------------------------------------------------------------ saving
    def check(self) -> None:
        """Raise a background save error at the next step boundary (never swallowed)."""
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"checkpoint save failed: {err}") from err

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _snapshot_tensor(self, key: str, t: torch.Tensor, blocking: bool) -> torch.Tensor:
        if blocking and not t.is_cuda:
            return t  # the caller waits for the write: no copy needed (CUDA still needs host memory)
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = sys.modules["torch"].empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)  # a plain host tensor
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf

    def save(
        self,
        step: int,
        parts: dict[str, Any],
        blocking: bool = False,
        extra_manifest: dict[str, Any] | None = None,
        shard: sharded.LocalShard | None = None,
        staged: Staged | None = None,
    ) -> float:
        """Snapshot ``parts`` into reused CPU buffers, then persist (in the background unless
        ``blocking``).  Returns the stall in seconds: the time the caller was held up.
        ``staged``: the state was copied already (the tier's slot, its rule 8): ``parts`` unread,
        ``shard``'s pieces the slot's.
        ``shard`` (sharded mode): this rank's pieces of the model and optimizer, copied and
        written the same way (:mod:`training.checkpointing.sharded`)."""
        t0 = time.perf_counter()
        self.wait()  # the buffers are reused: the previous persist must be done
        if self._saved_step == step:  # a final save just after this step's (agreed) periodic one: done
            return time.perf_counter() - t0
        self._saved_step = step
        copy_now = blocking or not self.policy.async_save
        any_cuda = False
        if shard is not None and staged is None:  # staged: the pieces are the slot's copies already
            any_cuda = any(t.is_cuda for t in shard.tensors.values())  # copied non-blocking: an event below
            pieces = {k: self._snapshot_tensor(f"shard/{k}", t, copy_now) for k, t in shard.tensors.items()}
            shard = dataclasses.replace(shard, tensors=pieces)
        skeletons: dict[str, Any] = {} if staged is None else staged.skeletons
        tensors: dict[str, dict[str, torch.Tensor]] = {} if staged is None else staged.tensors
        for part, tree in parts.items() if staged is None else ():
            skel, flat = split_tree(tree)
            skeletons[part] = skel
            tensors[part] = {}
            for key, t in flat.items():
                any_cuda |= t.is_cuda
                tensors[part][key] = self._snapshot_tensor(f"{part}/{key}", t, copy_now)
        extra = {**(extra_manifest or {}), **({"layout": sharded.LAYOUT} if shard is not None else {})}
        snap = _Snapshot(step, skeletons, tensors, extra, shard=shard, staged=staged)
        if any_cuda:
            snap.cuda_event = sys.modules["torch"].cuda.Event()  # tensors exist: torch is imported
            snap.cuda_event.record()
        if blocking or not self.policy.async_save:
            self._persist(snap)
            self.check()
        else:
            self._thread = threading.Thread(target=self._persist, args=(snap,), name="convoy-ckpt", daemon=True)
            self._thread.start()
        self.last_stall_s = time.perf_counter() - t0
        return self.last_stall_s

    def _persist(self, snap: _Snapshot) -> None:
        """Write this process's parts; rank 0 then gathers every rank's file list and commits.

        Ranks meet through files, not collectives: this runs on a background thread while the
        main thread may be inside a DDP all-reduce, and mixing the two on one process group is
        unsafe.  Each rank fsyncs its files, then publishes ``.rank-<r>.files.json``; rank 0
        waits for all of them before writing the manifest (the commit record)."""
        t0 = time.perf_counter()
        tmp = self.root / f".tmp-{checkpoint_name(snap.step)}"
        try:
            if snap.staged is not None:
                snap.staged.before_write()
            if snap.cuda_event is not None:
                snap.cuda_event.synchronize()
            if self.world_size == 1 and tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(exist_ok=True)
            faults.check_disk_full(snap.step)
            files = _write_parts(snap, tmp)
            if self.world_size > 1:
                atomic_write_json(tmp / f".rank-{self.rank}.files.json", files)
                if self.rank != 0:
                    self.last_persist_s = time.perf_counter() - t0
                    return
                files = self._gather_rank_files(tmp, snap.step)
            manifest = {
                "format": FORMAT_VERSION,
                "step": snap.step,
                "created": time.time(),
                "fingerprint": self.fingerprint,
                "world_size": self.world_size,
                "files": files,
                "digest": state_digest(files),
                "versions": writer_versions(),
                **snap.extra_manifest,
            }
            atomic_write_bytes(tmp / MANIFEST, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
            faults.persist_delay()
            final = self.root / checkpoint_name(snap.step)
            if final.exists() and self._keep_existing(final, manifest["digest"]):
                shutil.rmtree(tmp)
                point_latest(final)
            else:
                install(tmp, final, files_synced=True)  # each file was fsynced as it was written
            committed = Checkpoint(snap.step, final, self.read_manifest(final))
            append_event(self.run_dir, Event.CHECKPOINT_COMMITTED, step=snap.step, checkpoint=final.name)
            self.last_committed = committed
            self.last_persist_s = time.perf_counter() - t0
            self.apply_retention(protect=committed)
        except BaseException as exc:  # noqa: BLE001 - surfaced via check()
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)  # uncommitted, ours: safe to remove
            self._error = exc
        finally:
            if snap.staged is not None:
                snap.staged.release()

    def _gather_rank_files(self, tmp: Path, step: int) -> dict[str, dict[str, Any]]:
        deadline = time.time() + self.gather_timeout_s
        markers = [tmp / f".rank-{r}.files.json" for r in range(self.world_size)]
        while not all(m.exists() for m in markers):
            if time.time() > deadline:
                missing = [m.name for m in markers if not m.exists()]
                raise TimeoutError(f"step {step}: ranks did not finish writing in {self.gather_timeout_s} s: {missing}")
            time.sleep(0.01)
        files: dict[str, dict[str, Any]] = {}
        for m in markers:
            files.update(read_json(m))
            m.unlink()
        return files

    def _keep_existing(self, final: Path, new_digest: str) -> bool:
        """A directory already holds this step (a resumed run re-reaching it).

        Valid with the same digest: keep it, the new copy is redundant.  Otherwise move it aside
        (never delete): an invalid one, or one this process refused to restore, is quarantined; a
        valid one with another digest is kept as evidence of a non-deterministic replay."""
        old: str | None = None
        try:
            existing = self.verify(final)
        except CheckpointRejected as exc:
            event, reason = Event.CHECKPOINT_INVALID, str(exc)
        else:
            if final.name in self.refused:  # it loads, but the resume could not use it
                event, reason = Event.CHECKPOINT_INVALID, self.refused[final.name]
            elif existing.digest == new_digest:
                return True
            else:
                event, old = Event.CHECKPOINT_REPLACED, existing.digest
                reason = "same step, different state digest (non-deterministic replay)"
        self.quarantine(final, reason, event, old_digest=old, new_digest=new_digest)
        return False

    def quarantine(
        self, path: Path, reason: str, event: Event = Event.CHECKPOINT_INVALID, **digests: str | None
    ) -> None:
        """Move a committed checkpoint aside (``step-….invalid-<ms>``, never deleted, recorded), so
        nothing takes its directory for a commit: a pipelined chunk task judges its boundary by
        the directory's manifest alone."""
        aside = path.with_name(f"{path.name}.{event.removeprefix('checkpoint_')}-{int(time.time() * 1000)}")
        os.rename(path, aside)
        append_event(self.run_dir, event, checkpoint=path.name, moved_to=aside.name, reason=reason, **digests)

    # ------------------------------------------------------------------ retention
    def apply_retention(self, protect: Checkpoint) -> list[str]:
        """Delete committed checkpoints outside the policy; never ``protect`` (newest verified),
        never a directory that does not verify at manifest level, or that a resume passed over
        (left for inspection, :mod:`training.checkpointing.retention`)."""
        pol = self.policy
        candidates: list[tuple[int, Path, int]] = []
        for step, path in self.step_dirs():
            if path == protect.path or step > protect.step:
                continue
            try:
                manifest = self.read_manifest(path)
            except CheckpointRejected:
                continue
            candidates.append((step, path, sum(f["size"] for f in manifest["files"].values())))
        keep_recent, boundary = kept(self.run_dir, protect.step, candidates, pol.keep_last, self.boundary_every)
        deleted: list[str] = []
        survivors = []
        for step, path, size in candidates:
            if path in keep_recent or (pol.keep_every and step % pol.keep_every == 0):
                survivors.append((step, path, size))
                continue
            self._delete(path, "keep_last")
            deleted.append(path.name)
        if pol.max_bytes:
            total = protect.bytes + sum(s for _, _, s in survivors)
            for _step, path, size in sorted(survivors):  # oldest first
                if total <= pol.max_bytes:
                    break
                if _step == boundary:
                    continue
                self._delete(path, "max_bytes")
                deleted.append(path.name)
                total -= size
        return deleted

    def _delete(self, path: Path, reason: str) -> None:
        # Rename first so a crash mid-delete never leaves a half-deleted dir named like a checkpoint.
        doomed = path.with_name(f".deleting-{path.name}")
        os.rename(path, doomed)
        shutil.rmtree(doomed)
        append_event(self.run_dir, Event.CHECKPOINT_RETIRED, checkpoint=path.name, reason=reason)

    def cleanup_stale_temp(self) -> None:
        """Remove ``.tmp-*``/``.deleting-*`` left by a killed writer (never committed).  Only the
        holder of the run's worker lease calls it, so no other live writer's temp dir exists."""
        for p in self.root.iterdir():
            if p.name.startswith((".tmp-", ".deleting-")):
                shutil.rmtree(p, ignore_errors=True)


def _write_parts(snap: _Snapshot, tmp: Path) -> dict[str, dict[str, Any]]:
    """This rank's parts (and pieces of a sharded state) into ``tmp``, fsynced: their manifest entries."""
    files: dict[str, dict[str, Any]] = sharded.write_shard(snap.shard, tmp) if snap.shard is not None else {}
    for part in sorted(snap.skeletons):
        skel = (json.dumps(snap.skeletons[part], sort_keys=True, indent=1) + "\n").encode()
        skel_path = tmp / f"{part}.json"
        atomic_write_bytes(skel_path, skel, durable=True)
        files[skel_path.name] = {"size": len(skel), "xxh3_128": safetensors.hash_bytes(skel)}
        size, digest = safetensors.write_file(tmp / f"{part}.safetensors", snap.tensors[part])
        files[f"{part}.safetensors"] = {"size": size, "xxh3_128": digest}
    return files


def newest_verified_step(run_dir: str | Path) -> int | None:
    """Step of the newest checkpoint that verifies (nothing recorded): the one a resume takes.
    A fresh store, so a fresh walk: a caller that holds the run's store asks it instead."""
    return CheckpointStore(run_dir).resume_point().step
