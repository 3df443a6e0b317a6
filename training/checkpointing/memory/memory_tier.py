"""The memory tier: the newest training state kept in RAM, in front of the durable checkpoints.

Why: a worker killed ``every_steps`` after its last durable checkpoint loses up to that many
steps (50 on the demo), because disk and the remote are the only tiers.  Gemini (SOSP'23), NVRx's
local checkpointing and multi-tier checkpointing put a fast tier in front of them.  Here each rank
snapshots its state every ``checkpoint.memory_every_steps`` into memory-mapped files on a RAM file
system (``/dev/shm``).  They survive the worker's death — tmpfs belongs to the machine, not to a
process — and a resume restores from them when they are newer than every disk checkpoint that
verifies: what is lost is the steps since the last snapshot (one interval at most, and the step
in flight; ``auto`` sets the interval, :class:`~training.checkpointing.schedule.MemorySchedule`).

Why not a checkpoint directory on tmpfs: written by the store's background thread (files, fsyncs,
manifest, rename, retention: mostly Python), every-step snapshots slowed the demo's loop by 30 %,
the thread fighting the loop for the interpreter lock.  A snapshot here is a few C-level copies
with no system call once the slots are mapped — split the state, copy its tensors into a mapped
slot, hash the slot with the checkpoints' hash (xxh3-128), commit a small header — and, where a
CPU is free, all but the capture run beside the next step's backward, which holds no interpreter
lock, and the commit just before its optimizer step (rule 7).  The
split walks only the small part of the state: the model's and optimizer's tensors are found once
by a plan (:mod:`training.checkpointing.memory.snapshot_plan`), checked at every snapshot and copied.

Layout, per rank ``r``: one or two slots (``checkpoint.memory_slots``; rule 8),
``rank-<r>.slot-<k>.bin`` (every tensor's bytes, one after the other, then the JSON skeletons of
the state) and ``rank-<r>.slot-<k>.head`` (its header: step,
fingerprint, world size, the tensors' places, the hash; as JSON after its length and its own
xxh64, :func:`encode_header`).  A snapshot writes the slot not written last: it zeroes that
slot's header length first and writes the new header's length and checksum last, both in the
mapped file, so a worker killed in the middle of a snapshot leaves that slot without a header (a
torn header fails its checksum) and the other slot, one snapshot older, intact (with one slot:
no snapshot, and the disk tier decides).

Rules (numbered; cited in code):

1. **Never the last verified checkpoint.**  Retention and "the newest verified checkpoint" of the
   run (``convoy verify``, the chunk's artifact, DVC, the remote) are the disk tier's; the memory
   tier is never counted as durable.
2. **Only when newer.**  A disk checkpoint at the same or a later step wins; the memory snapshot is
   a candidate only ahead of the first disk checkpoint older than it (:func:`merged`).
3. **Only this run, this trajectory, this layout.**  The directory is keyed by the run directory
   *and* its creation time (``run.json``: a run directory deleted and created again is another
   run), and a snapshot of another fingerprint or another world size is ignored, never an error.
4. **Verified like any checkpoint.**  Every rank's slot of the chosen step is hashed on every rank
   (all ranks decide alike); one that does not verify (bit flips, a slot half written) is passed
   over, said in the log and recorded (``memory_snapshot_refused``), and the disk tier decides.
5. **The machine is the limit.**  When the machine goes (reboot, a node lost), so does the tier;
   the disk and remote tiers decide, as without it.  Multi-node runs do not use it, nor do
   machines without ``/dev/shm``.
6. **Never past a missing chunk boundary.**  A chunk's artifact is the disk checkpoint at its end
   step; a worker resumed from a snapshot at or past that step would never write it (its save
   failed, e.g. disk full, or was cut short by the kill), and every retry of the chunk would find
   no artifact.  Such a snapshot is passed over (recorded, rule 4) and the disk tier decides: the
   retry trains to the boundary again and commits it (:func:`missing_boundary`).  A boundary whose
   chunk was committed (its ``chunk_done`` records the artifact's digest) and was removed later
   (by hand, by a fault drill) is not missing: its chunk has its artifact, and passing the
   snapshot over would send the retry back to an older checkpoint, or to step 0, for nothing
   (``convoy chaos``: a corrupt and a deleted checkpoint left no other).
7. **Copied beside the loop, committed before the next update.**  The worker's tier
   (``overlap``), for a snapshot through a plan of a state in host memory, takes on the loop's
   thread the plan's check, the walked rest (step, RNG states, scheduler, scaler, cursor) as new
   objects and copies of the model's buffers (a forward may update them), and hands the rest to
   its writer thread (``convoy-memory``, :mod:`~training.checkpointing.memory.beside`): lay the walked
   rest out, serialise the skeletons, zero the slot's header length, copy the parameters and the
   optimizer's state, hash, write the header's body.  The job is handed over when the loop's
   next backward begins (``train_step``'s ``before_backward``): autograd holds no interpreter
   lock, so the writer's Python does not slow the loop as it did beside the fetch and forward,
   and neither changes those tensors.  A stream's position (which the next fetch may move) is
   laid out on the loop's thread.  Before the optimizer step the loop calls
   :meth:`MemoryTier.settle`, which waits for the writer and commits, as torchtitan's async
   checkpointing waits for its staging before the optimizer step.
   A parameter changed in place between the snapshot and the commit (a hook that edits weights
   in the forward) moves its version counter (only the optimizer's step changes its state); that snapshot is not
   committed (``changed_before_commit``), the other slot stays.  A kill before the commit
   leaves the slot without a header and the other slot, one snapshot older, is restored: the
   step lost is the one the snapshot held, one at most, as before.  The wait in ``settle``
   counts as the snapshot's stall.  A state on a GPU is copied on the loop's thread, as
   without ``overlap`` (a device-to-host copy beside the loop would wait for the queued
   forward).
8. **One copy for both tiers.**  A durable save persisted in the background is staged in this
   tier's slot, not in a copy of its own (:meth:`MemoryTier.stage`): the loop copies the state
   into the slot the next snapshot would take, the store's persist thread hashes and commits it
   (the tier's snapshot of that step) and then writes the checkpoint's files from it, and the
   slot is held until the persist ends.  With ``checkpoint.memory_slots: 1`` (the default) the
   state is held once beside the live one; snapshots wait while the slot is held (a kill then
   loses the steps since that save, which the slot holds), and a kill while the slot is being
   written finds no snapshot: the disk tier decides.  ``memory_slots: 2`` keeps the other slot
   committed meanwhile, at a second copy of the state.
9. **A sharded state: each rank its own pieces.**  With ``checkpoint.format: sharded`` each rank's
   slot holds the pieces of the model and optimizer that rank holds (each DTensor's local shard,
   :func:`~training.checkpointing.sharded.held_pieces`) and the tree's skeleton; rank 0's the rest
   of the state, as on disk.  A resume reads and hashes its own slot whole, and of the others'
   only their small parts (RNG, step, cursor), each hashed where it lies (rule 4): a rank holds its
   share, never every rank's.  A slot of the other ``checkpoint.format`` is refused.  The pieces
   go back into the same rank's local tensors, which rule 3's world size guarantees are the same
   shards (another world size restores from disk, where DCP re-shards); pieces that do not fit the
   model are refused on every rank alike.  No plan (it knows a replicated state only): the walk at
   every snapshot, and none before the optimizer's first update (DCP's walk would initialise an
   empty optimizer state with a step of its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from training.checkpointing import sharded
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.memory.beside import BesideCopy
from training.checkpointing.memory.slot_files import (
    SLOTS,
    SlotFiles,
    copy_and_hash,
    data_path,
    header_body,
    header_path,
)
from training.checkpointing.memory.slot_format import Header, slot_hash, slot_manifest, slot_parts, tensor_views
from training.checkpointing.memory.slot_layout import Layout, Layouts, copy_into
from training.checkpointing.memory.slot_read import read_parts_but, read_whole
from training.checkpointing.memory.snapshot_plan import (
    MAX_REBUILDS,
    PLAN_ERRORS,
    SlotContent,
    SnapshotPlan,
    split_parts,
)
from training.checkpointing.staged import Staged
from training.checkpointing.store import Candidate, CheckpointStore
from training.checkpointing.verify import Checkpoint, Validator
from training.config import RunConfig
from training.paths import checkpoint_name

if TYPE_CHECKING:  # the loop's types: the tier is built before them
    import mmap

    from training.checkpointing.memory.source import SnapshotSource
    from training.checkpointing.schedule import MemorySchedule

#: Where the tier lives: a RAM file system on Linux.
SHM = Path("/dev/shm")
#: Another place for it (a tmpfs of your own; the tests keep theirs in a temporary directory).
DIR_ENV = "CONVOY_MEMORY_DIR"
#: A stream's position in a rank's checkpoint part (``SnapshotSource.checkpoint_parts``): a snapshot
#: that holds one is laid out on the loop's thread (the next fetch may move it; rule 7).
STREAM = "stream"


def tier_dir(run_dir: str | Path, created: str) -> Path | None:
    """The memory tier directory of the run at ``run_dir`` created at ``created`` (its
    ``run.json``; rule 3), or None where there is no RAM file system."""
    base = tier_base()
    if not base.parent.is_dir() or not os.access(base.parent, os.W_OK):
        return None
    run_dir = Path(run_dir).resolve()
    key = hashlib.blake2b(f"{run_dir}\0{created}".encode(), digest_size=8).hexdigest()
    return base / f"{run_dir.name}-{key}"


def tier_base() -> Path:
    """The folder that holds every run's tier on this machine, for this user."""
    return Path(os.environ[DIR_ENV]) if os.environ.get(DIR_ENV) else SHM / f"convoy-{os.getuid()}"


def enabled(config: RunConfig) -> bool:
    """Whether this run keeps a memory tier (rule 5)."""
    return bool(config.checkpoint.memory_every_steps) and config.train.nnodes == 1


class MemoryTier:
    """One rank's memory tier (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        fingerprint: str,
        rank: int = 0,
        world_size: int = 1,
        plans: bool = True,
        overlap: bool = False,
        slots: int = 2,
        sharded: bool = False,
    ) -> None:
        self.root, self.fingerprint, self.rank, self.world_size = root, fingerprint, rank, world_size
        #: The state is sharded (``checkpoint.format: sharded``, rule 9): each rank's slot holds its
        #: own pieces, and a resume reads only its own of them.
        self.sharded = sharded
        #: How many slots this rank keeps (rule 8): 1 holds the state once, 2 keep the older too.
        self.slots = slots
        #: The slot a durable save is persisting from (rule 8), or None.
        self._held: int | None = None
        #: Whether snapshots may take a plan's fast path (off: the full walk every time, as the
        #: tests compare).
        self.plans = plans
        self._plan: SnapshotPlan | None = None
        self._plans_failed = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self.validator: Validator | None = None
        #: This rank's slot files, mapped once (:mod:`training.checkpointing.memory.slot_files`).
        self._files = SlotFiles(root, rank, slots)
        #: The slot layout, the same at every snapshot of a run.
        self._layouts = Layouts()
        self.last_stall_s = 0.0
        #: Rule 7: the writer thread that lays out, copies and hashes a snapshot while the loop
        #: goes on (:mod:`training.checkpointing.memory.beside`).  Built here, in the worker, never in a
        #: process that forks workers (the zygote builds no tier).
        self._beside = BesideCopy(self._files, self._header_body) if overlap else None
        #: Whether the next snapshot may be copied beside the loop (off once one was refused).
        self.beside = overlap
        #: Snapshots left uncommitted (rule 7): a parameter changed before the commit, the plan
        #: found broken by the writer thread.
        self.changed_before_commit = self.broken_before_commit = 0
        self._unbilled_s = 0.0  # commit waits not yet told to the schedule
        steps = {k: h.step for k in range(slots) if (h := Header.read(header_path(root, rank, k))) is not None}
        self.next_slot = min(range(slots), key=lambda k: steps.get(k, -1))  # overwrite the older one first
        for k in SLOTS[slots:]:  # a slot a run kept before it kept fewer: its RAM freed
            header_path(root, rank, k).unlink(missing_ok=True)
            data_path(root, rank, k).unlink(missing_ok=True)

    # ------------------------------------------------------------------ writing
    def snapshot(self, state: SnapshotSource, schedule: MemorySchedule) -> None:
        """This rank's state at its step into the next slot; the schedule learns what it cost.

        With ``overlap`` (the worker's tier) a snapshot through a plan of a model in host memory
        is laid out, copied and hashed on the tier's writer thread while the loop goes on, and
        committed by :meth:`settle`, which the loop calls before its next optimizer step (rule 7)."""
        self.settle()  # the loop settled it before its optimizer step already (rule 7)
        self.last_stall_s = 0.0
        if self._held is not None and self.slots == 1:
            return  # rule 8: the only slot is being persisted from; a later step snapshots
        if self.sharded and not state.parts.optimizer.state:
            return  # rule 9: no update yet (fp16 steps skipped); DCP's walk would take a fake one
        t0 = time.perf_counter()
        plan = self._plan
        light = self._planned(state)  # the plan checked here, on the loop's thread (rule 7)
        beside = self._beside if light is not None and self.beside and plan is not None and plan.on_cpu else None
        if beside is not None and plan is not None and STREAM not in light[f"rank-{self.rank}"]:
            beside.submit(plan, self._take_slot(), state.step, light=light)
        else:
            content = self._laid_out(light)
            if content is None:
                content, beside = self._walked(state), None
            if beside is not None and plan is not None:  # a stream's position: laid out here
                beside.submit(plan, self._take_slot(), state.step, content=plan.detached(content))
            else:
                slot, buf, size = self._open_slot(content)
                self._commit(slot, state.step, content.layout, size, copy_and_hash(buf, content.groups, size))
        self.last_stall_s = time.perf_counter() - t0
        # The schedule's cost: this stall and the last commit's wait (a snapshot's whole cost).
        schedule.saved(state.step, self.last_stall_s + self._unbilled_s)
        self._unbilled_s = 0.0

    def backward_begins(self) -> None:
        """The loop's backward begins: a snapshot waiting for it is written from now (rule 7)."""
        if self._beside is not None:
            self._beside.backward_begins()

    def settle(self) -> float:
        """Commit the snapshot the writer thread wrote, once it has (its error is raised here),
        unless a parameter has changed in place since it was taken or the plan no longer laid
        the state out: that snapshot is left without a header (the other slot, one older,
        stays).  Returns how long this took.  The loop calls it before its optimizer step changes
        what was taken."""
        job = self._beside.take() if self._beside is not None else None
        if job is None:
            return 0.0
        t0 = time.perf_counter()
        assert job.done is not None  # handed over by take()
        commit = job.done.result()
        if commit is not None and job.plan.versions() == job.versions:
            self._files.write_commit(job.slot, commit)
            self._unbilled_s += (took := time.perf_counter() - t0)
            return took
        # Not committed; the next snapshot takes this slot again: the other is the newest one.
        self.next_slot = job.slot
        if commit is None:  # the plan no longer held: the next snapshot walks and makes a new one
            self._drop_plan()
            self.broken_before_commit += 1
        else:  # a model that edits its weights between two steps: copied on this thread from now
            self.changed_before_commit += 1
            self.beside = False
        return time.perf_counter() - t0

    def _planned(self, state: SnapshotSource) -> dict[str, Any] | None:
        """The walked rest of ``state`` through the plan (checked), or None: no plan, or one that
        no longer holds (dropped: the full walk decides and makes the next)."""
        if self._plan is None:
            return None
        try:
            light = self._plan.light_parts(state, self.rank)
        except PLAN_ERRORS:  # a plan that cannot tell does not hold
            light = None
        if light is None:
            self._drop_plan()
        return light

    def _laid_out(self, light: dict[str, Any] | None) -> SlotContent | None:
        """``light`` laid out by the plan, or None (the plan dropped when it cannot)."""
        if light is None or self._plan is None:
            return None
        try:
            content = self._plan.lay_out(light)
        except PLAN_ERRORS:
            content = None
        if content is None:
            self._drop_plan()
        return content

    def _drop_plan(self) -> None:
        """The plan no longer holds: the next snapshot takes the full walk, which makes another
        (until :data:`MAX_REBUILDS` of them broke)."""
        self._plan, self._plans_failed = None, self._plans_failed + 1

    def _walked(self, state: SnapshotSource) -> SlotContent:
        """The state laid out by the full walk (:mod:`training.checkpointing.memory.snapshot_plan`),
        which makes the next plan."""
        include = self.rank == 0
        parts = state.checkpoint_parts(self.rank, include_replicated=include, sharded=self.sharded)
        if self.sharded:  # rule 9: this rank's pieces; no plan (it knows only a replicated state)
            parts.update(sharded.snapshot_parts(sharded.flattened(state.parts.model, state.parts.optimizer)))
        full = split_parts(parts)
        if include and self.plans and not self.sharded and self._plans_failed < MAX_REBUILDS:
            try:  # a model the plan's walk trips on (a custom state_dict) gets no plan, not a crash
                self._plan = SnapshotPlan.build(state, full)
            except PLAN_ERRORS:
                self._plan = None
            self._plans_failed += self._plan is None
        return SlotContent.of(full, self._layouts)

    def write(self, step: int, parts: dict[str, Any]) -> None:
        """``parts`` (``SnapshotSource.checkpoint_parts``) of ``step`` into the next slot, on this thread."""
        self.settle()
        content = SlotContent.of(split_parts(parts), self._layouts)
        slot, buf, size = self._open_slot(content)
        self._commit(slot, step, content.layout, size, copy_and_hash(buf, content.groups, size))

    def _take_slot(self) -> int:
        """The slot the next snapshot writes: the older one, never one a save persists from."""
        slot = self.next_slot if self.next_slot != self._held else (self.next_slot + 1) % self.slots
        self.next_slot = (slot + 1) % self.slots
        return slot

    def stage(self, step: int, parts: dict[str, Any]) -> Staged:
        """Rule 8: ``parts`` (``checkpoint_parts`` of ``step``) copied on this thread into the slot
        the next snapshot would take, for the store to persist from; the slot's hash and commit
        run on the persist thread before its files are written, and the slot is held until the
        store releases it.  Call once the store's previous persist ended (it may read the only
        slot).  ``/dev/shm`` full raises OSError here; the slot is then left uncommitted."""
        self.settle()
        split = split_parts(parts)
        content = SlotContent.of(split, self._layouts)
        slot, buf, size = self._open_slot(content)
        copy_into(buf, content.groups)
        self._held = slot

        def commit() -> None:
            digest = slot_hash(memoryview(buf)[:size])
            self._files.commit(slot, self._header_body(step, content.layout, size, digest))

        tensors: dict[str, dict[str, Any]] = {part: {} for part in split.skeletons}
        tensors.update(tensor_views(buf, content.layout.places))
        return Staged(split.skeletons, tensors, commit, self._release)

    def _release(self) -> None:
        """The store persisted from the held slot (or gave up): snapshots may take it again."""
        self._held = None

    def _open_slot(self, content: SlotContent) -> tuple[int, mmap.mmap, int]:
        """The next slot, its header uncommitted, its data mapped for ``content`` and its
        skeletons written (:mod:`~training.checkpointing.memory.slot_files`' step 1): (slot, the mapping,
        the slot's size)."""
        slot = self._take_slot()
        return slot, *self._files.open_for(slot, content)

    def _commit(self, slot: int, step: int, layout: Layout, size: int, digest: str) -> None:
        self._files.commit(slot, self._header_body(step, layout, size, digest))

    def _header_body(self, step: int, layout: Layout, size: int, digest: str) -> bytes:
        return header_body(step, self.fingerprint, self.world_size, self.rank, layout, size, digest)

    # ------------------------------------------------------------------ reading
    def headers(self) -> dict[int, dict[int, tuple[int, Header]]]:
        """Step -> rank -> (slot, header), of the slots of this run's trajectory and layout (rule 3)."""
        self.settle()  # a snapshot of this tier in flight is read committed
        found: dict[int, dict[int, tuple[int, Header]]] = {}
        for r in range(self.world_size):
            for k in SLOTS:
                h = Header.read(header_path(self.root, r, k))
                if h is not None and h.fingerprint == self.fingerprint and h.world_size == self.world_size:
                    found.setdefault(h.step, {})[r] = (k, h)
        return found

    def newest_step(self) -> int | None:
        """The newest step every rank holds a slot of (by the headers alone, no hashing)."""
        return max(self.complete_steps(), default=None)

    def complete_steps(self) -> list[int]:
        """The steps every rank holds a slot of, newest first."""
        return sorted((s for s, ranks in self.headers().items() if len(ranks) == self.world_size), reverse=True)

    def candidate(self, step: int) -> Candidate:
        """The snapshot of ``step`` (one of :meth:`complete_steps`), verified on every rank alike
        and loaded for this one, or refused with the reason (rule 4)."""
        slots = self.headers().get(step, {})
        headers = {r: h for r, (_k, h) in slots.items()}
        path = self.root / checkpoint_name(step)
        try:
            if len(slots) != self.world_size:
                raise CheckpointRejected(f"memory snapshot of step {step}: overwritten before it was read")
            parts = {}
            for r, (k, h) in sorted(slots.items()):  # every rank's parts, as a disk checkpoint holds them
                if self.sharded and r != self.rank:  # rule 9: another rank's pieces stay in its slot
                    parts.update(read_parts_but(data_path(self.root, r, k), h, (sharded.PIECES, sharded.LAYOUT)))
                else:
                    parts.update(slot_parts(h, read_whole(data_path(self.root, r, k), h)))
            if (sharded.PIECES in parts) != self.sharded:  # checkpoint.format changed since (rule 3)
                raise CheckpointRejected(f"memory snapshot of step {step}: of the other checkpoint.format")
            if self.sharded:
                parts[sharded.LAYOUT] = json.loads(parts[sharded.LAYOUT])
            manifest = slot_manifest(step, headers)
            if self.validator is not None:
                self.validator(manifest, parts)
        except CheckpointRejected as exc:
            return Candidate(step, path, str(exc), None)
        return Candidate(step, path, "", (Checkpoint(step, path, manifest), parts))

    # ------------------------------------------------------------------ end
    def release_when_done(self, step: int, total_steps: int) -> None:
        """At a worker's end: the snapshot in flight committed, unmap; once the run's last step is
        trained (on disk), free the RAM."""
        with contextlib.suppress(OSError):  # a tier that failed is only unmapped
            self.settle()
        if self._beside is not None:
            self._beside.shutdown()
        self._files.close()
        if self.rank == 0 and step >= total_steps:
            shutil.rmtree(self.root, ignore_errors=True)


def spare_cpu(ranks: int = 1) -> bool:
    """Whether this process may run on a CPU that the torch threads of the ``ranks`` processes
    training beside each other leave free: a copy beside the loop (rule 7) on a CPU the step uses
    too only moves the cost into the step (with the demo's two threads on two CPUs: a 6.6 % stall
    and a 7 % slower step, against 7.3 % on the loop's thread, bench/snapshot_cost.py)."""
    import torch

    return len(os.sched_getaffinity(0)) > torch.get_num_threads() * ranks


def merged(memory: MemoryTier | None, disk: CheckpointStore) -> Iterator[tuple[Candidate, bool]]:
    """The resume's candidates newest first, each with whether it is a memory snapshot: each of
    the tier's snapshots (at most two, its slots) goes just before the first disk checkpoint older
    than it (rule 2), or is passed over when it lies past a chunk boundary the disk lacks (rule 6).
    Each is verified and loaded only when it is reached, so a disk checkpoint older than a
    snapshot that restores costs nothing."""
    if memory is None:
        yield from ((disk.candidate(step, path), False) for step, path in disk.step_dirs())
        return
    pending = memory.complete_steps()
    dirs = disk.step_dirs()
    on_disk = {step for step, _ in dirs} | committed_boundaries(disk.run_dir)

    def snapshot(step: int) -> Candidate:
        boundary = missing_boundary(step, disk.boundary_every, on_disk)
        if boundary is None:
            return memory.candidate(step)
        reason = (
            f"the chunk boundary {checkpoint_name(boundary)} is not on disk; resuming here would never "
            "write it (rule 6), so the retry trains to it again"
        )
        return Candidate(step, memory.root / checkpoint_name(step), reason, None)

    for step, path in dirs:
        while pending and pending[0] > step:
            yield snapshot(pending.pop(0)), True
        yield disk.candidate(step, path), False
    for step in pending:
        yield snapshot(step), True


def committed_boundaries(run_dir: str | Path) -> set[int]:
    """End steps of the run's committed chunks (``chunk_done``): their artifacts were written and
    verified, so a later loss of the file does not make them missing (rule 6)."""
    from training.events import Event, read_events

    return {int(e["end_step"]) for e in read_events(run_dir, Event.CHUNK_DONE) if e.get("end_step") is not None}


def missing_boundary(step: int, boundary_every: int, on_disk: set[int]) -> int | None:
    """The chunk boundary at or before ``step`` that a resume from ``step`` would skip although no
    disk checkpoint holds it (rule 6); None when there is none (or the run has no chunks)."""
    if boundary_every <= 0:
        return None
    boundary = step // boundary_every * boundary_every
    return boundary if boundary > 0 and boundary not in on_disk else None
