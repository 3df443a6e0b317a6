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
CPU is free, the copy and the hash run beside the next step's fetch, forward and backward, none of
them holding the interpreter lock, and the commit just before its optimizer step (rule 7).  The
split walks only the small part of the state: the model's and optimizer's tensors are found once
by a plan (:mod:`training.checkpointing.snapshot_plan`), checked at every snapshot and copied.

Layout, per rank ``r``: two slots, ``rank-<r>.slot-<k>.bin`` (every tensor's bytes, one after the
other, then the JSON skeletons of the state) and ``rank-<r>.slot-<k>.head`` (its header: step,
fingerprint, world size, the tensors' places, the hash; as JSON after its length and its own
xxh64, :func:`encode_header`).  A snapshot writes the slot not written last: it zeroes that
slot's header length first and writes the new header's length and checksum last, both in the
mapped file, so a worker killed in the middle of a snapshot leaves that slot without a header (a
torn header fails its checksum) and the other slot, one snapshot older, intact.

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
   the disk and remote tiers decide, as without it.  Multi-node runs and sharded checkpoints do
   not use it, nor do machines without ``/dev/shm``.
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
   thread the plan's check, the walked rest (step, RNG states, scheduler, scaler, cursor, stream
   position) and copies of the model's buffers (a forward may update them), zeroes the slot's
   header length, and hands the copy of the parameters and the optimizer's state, the hash and
   the header's body to its writer thread (``convoy-memory``,
   :mod:`~training.checkpointing.writer_thread`): they run while the loop fetches its next
   batch and runs its forward and backward, which change none of those tensors.  Before the
   optimizer step the loop calls :meth:`MemoryTier.settle`, which waits for the writer and
   commits, as torchtitan's async checkpointing waits for its staging before the optimizer step.
   A parameter changed in place between the snapshot and the commit (a hook that edits weights
   in the forward) moves its version counter (only the optimizer's step changes its state); that snapshot is not
   committed (``changed_before_commit``), the other slot stays.  A kill before the commit
   leaves the slot without a header and the other slot, one snapshot older, is restored: the
   step lost is the one the snapshot held, one at most, as before.  The wait in ``settle``
   counts as the snapshot's stall.  A state on a GPU is copied on the loop's thread, as
   without ``overlap`` (a device-to-host copy beside the loop would wait for the queued
   forward).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.slot_format import (
    HEAD,
    Header,
    encode_header,
    slot_hash,
    slot_manifest,
    slot_parts,
)
from training.checkpointing.slot_layout import Layouts, copy_into
from training.checkpointing.snapshot_plan import (
    MAX_REBUILDS,
    PLAN_ERRORS,
    SlotContent,
    SnapshotPlan,
    skeleton_bytes,
    split_parts,
)
from training.checkpointing.store import Candidate, CheckpointStore
from training.checkpointing.verify import Checkpoint, Validator, parse_step
from training.checkpointing.writer_thread import WriterThread
from training.config import RunConfig
from training.paths import RunPaths, checkpoint_name
from training.rundir import run_info

if TYPE_CHECKING:  # the loop's types: the tier is built before them
    from training.checkpointing.schedule import MemorySchedule
    from training.state import TrainState

#: Where the tier lives: a RAM file system on Linux.
SHM = Path("/dev/shm")
#: Another place for it (a tmpfs of your own; the tests keep theirs in a temporary directory).
DIR_ENV = "CONVOY_MEMORY_DIR"
SLOTS = (0, 1)


def tier_root(run_dir: str | Path) -> Path | None:
    """The run's memory tier directory (rule 3), or None where there is no RAM file system."""
    base = Path(os.environ[DIR_ENV]) if os.environ.get(DIR_ENV) else SHM / f"convoy-{os.getuid()}"
    if not base.parent.is_dir() or not os.access(base.parent, os.W_OK):
        return None
    run_dir = Path(run_dir).resolve()
    created = (run_info(run_dir) or {}).get("created", "")
    key = hashlib.blake2b(f"{run_dir}\0{created}".encode(), digest_size=8).hexdigest()
    return base / f"{run_dir.name}-{key}"


def enabled(config: RunConfig) -> bool:
    """Whether this run keeps a memory tier (rule 5)."""
    c = config.checkpoint
    return bool(c.memory_every_steps) and config.train.nnodes == 1 and c.format != "sharded"


@dataclass(frozen=True)
class _Pending:
    """A snapshot the writer thread is making ready (rule 7)."""

    ready: Future[bytes | None]  # its header's commit, once the slot is written and hashed
    plan: SnapshotPlan  # whose tensors' versions...
    versions: tuple[int, ...]  # ...were these when it was taken
    slot: int


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
    ) -> None:
        self.root, self.fingerprint, self.rank, self.world_size = root, fingerprint, rank, world_size
        #: Whether snapshots may take a plan's fast path (off: the full walk every time, as the
        #: tests compare).
        self.plans = plans
        self._plan: SnapshotPlan | None = None
        self._plans_failed = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self.validator: Validator | None = None
        self._maps: dict[int, mmap.mmap] = {}
        #: The slot layout, the same at every snapshot of a run.
        self._layouts = Layouts()
        self.last_stall_s = 0.0
        #: Each slot's header, mapped: written in place (a snapshot every step should not pay for
        #: an unlink, a file written and a rename).
        self._heads: dict[int, mmap.mmap] = {}
        #: Rule 7: the thread that copies, hashes and commits a snapshot while the loop goes on
        #: (one job at a time), and the job in flight.  Started here, in the worker, never in a
        #: process that forks workers (the zygote builds no tier).
        self._writer = WriterThread() if overlap else None
        #: Whether the next snapshot may be copied beside the loop (off once one was refused).
        self.beside = overlap
        self._pending: _Pending | None = None
        #: Snapshots left uncommitted (rule 7): a parameter changed before the commit, the plan
        #: found broken by the writer thread.
        self.changed_before_commit = self.broken_before_commit = 0
        self._unbilled_s = 0.0  # commit waits not yet told to the schedule
        steps = {k: h.step for k in SLOTS if (h := Header.read(self._header(rank, k))) is not None}
        self.next_slot = min(SLOTS, key=lambda k: steps.get(k, -1))  # overwrite the older one first

    def _header(self, rank: int, slot: int) -> Path:
        return self.root / f"rank-{rank}.slot-{slot}.head"

    def _data(self, rank: int, slot: int) -> Path:
        return self.root / f"rank-{rank}.slot-{slot}.bin"

    # ------------------------------------------------------------------ writing
    def snapshot(self, state: TrainState, schedule: MemorySchedule) -> None:
        """This rank's state at its step into the next slot; the schedule learns what it cost.

        With ``overlap`` (the worker's tier) a snapshot through a plan of a model in host memory
        is copied, hashed and made ready on the tier's writer thread while the loop goes on, and
        committed by :meth:`settle`, which the loop calls before its next optimizer step (rule 7)."""
        self.settle()  # the loop settled it before its optimizer step already (rule 7)
        t0 = time.perf_counter()
        beside = self.beside and self._plan is not None and self._plan.on_cpu
        content, plan = self._content(state, checked=not beside)
        slot, skeleton, buf = self._open_slot(content)
        if beside and plan is not None and self._writer is not None:
            detached = plan.detached(content)
            ready = self._writer.submit(self._fill_checked, plan, state.step, slot, detached, skeleton, buf)
            self._pending = _Pending(ready, plan, plan.versions(), slot)
        else:
            self._heads[slot][:HEAD] = self._fill(state.step, slot, content, skeleton, buf)
        self.last_stall_s = time.perf_counter() - t0
        # The schedule's cost: this stall and the last commit's wait (a snapshot's whole cost).
        schedule.saved(state.step, self.last_stall_s + self._unbilled_s)
        self._unbilled_s = 0.0

    def settle(self) -> float:
        """Commit the snapshot the writer thread made ready, once it is (its error is raised
        here), unless a tensor an optimizer step changes has changed since it was taken: that
        snapshot is left without a header (the other slot, one older, stays).  Returns how long
        this waited.  The loop calls it before its optimizer step changes what was taken."""
        pending, self._pending = self._pending, None
        if pending is None:
            return 0.0
        t0 = time.perf_counter()
        commit = pending.ready.result()
        if commit is not None and pending.plan.versions() == pending.versions:
            self._heads[pending.slot][:HEAD] = commit  # (the body may have grown its mapping)
            self._unbilled_s += (waited := time.perf_counter() - t0)
            return waited
        # Not committed; the next snapshot takes this slot again: the other is the newest one.
        self.next_slot = pending.slot
        if commit is None:  # the plan no longer held: the next snapshot walks and makes a new one
            self._plan, self._plans_failed = None, self._plans_failed + 1
            self.broken_before_commit += 1
        else:  # a model that edits its weights between two steps: copied on this thread from now
            self.changed_before_commit += 1
            self.beside = False
        return time.perf_counter() - t0

    def _content(self, state: TrainState, checked: bool = True) -> tuple[SlotContent, SnapshotPlan | None]:
        """The state laid out for a slot, and the plan that did it: through the plan while it
        holds, else by the full walk (no plan), which makes the next plan
        (:mod:`training.checkpointing.snapshot_plan`).  ``checked=False``: the plan's watch is
        left to the writer thread (:meth:`_fill_checked`)."""
        if self._plan is not None:
            try:
                fast = self._plan.content(state, self.rank, check=checked)
            except PLAN_ERRORS:  # a plan that cannot tell does not hold: the full walk decides
                fast = None
            if fast is not None:
                return fast, self._plan
            self._plan, self._plans_failed = None, self._plans_failed + 1
        include = self.rank == 0
        full = split_parts(state.checkpoint_parts(self.rank, include_replicated=include, sharded=False))
        if include and self.plans and self._plans_failed < MAX_REBUILDS:
            try:  # a model the plan's walk trips on (a custom state_dict) gets no plan, not a crash
                self._plan = SnapshotPlan.build(state, full)
            except PLAN_ERRORS:
                self._plan = None
            self._plans_failed += self._plan is None
        return SlotContent.of(full, self._layouts), None

    def write(self, step: int, parts: dict[str, Any]) -> None:
        """``parts`` (``TrainState.checkpoint_parts``) of ``step`` into the next slot, on this thread."""
        self.settle()
        content = SlotContent.of(split_parts(parts), self._layouts)
        slot, skeleton, buf = self._open_slot(content)
        self._heads[slot][:HEAD] = self._fill(step, slot, content, skeleton, buf)

    def _open_slot(self, content: SlotContent) -> tuple[int, bytes, mmap.mmap]:
        """The next slot, its header uncommitted, its data mapped for ``content``: (slot, the
        skeleton bytes, the mapping).  ``/dev/shm`` full raises OSError here, on the caller's
        thread."""
        slot, self.next_slot = self.next_slot, 1 - self.next_slot
        head = self._map(self._heads, self._header(self.rank, slot), HEAD, slot)
        head[:8] = bytes(8)  # uncommitted: a kill from here on leaves this slot without a header
        skeleton = skeleton_bytes(content.skeletons)
        buf = self._map(self._maps, self._data(self.rank, slot), content.layout.end + len(skeleton), slot)
        return slot, skeleton, buf

    def _fill_checked(
        self, plan: SnapshotPlan, step: int, slot: int, content: SlotContent, skeleton: bytes, buf: mmap.mmap
    ) -> bytes | None:
        """:meth:`_fill`, on the writer thread, if the plan still holds (no commit if not)."""
        return self._fill(step, slot, content, skeleton, buf) if plan.holds() else None

    def _fill(self, step: int, slot: int, content: SlotContent, skeleton: bytes, buf: mmap.mmap) -> bytes:
        """The slot's bytes, their hash and its header's body (its length was zeroed before);
        returns the header's commit: its length and checksum, written last."""
        offset = content.layout.end
        size = offset + len(skeleton)
        copy_into(buf, content.groups)
        for start, end in content.layout.gaps:
            buf[start:end] = bytes(end - start)
        buf[offset:size] = skeleton
        digest = slot_hash(memoryview(buf)[:size])
        places = content.layout.places_json  # serialised once per layout: the same at every snapshot
        header = Header(step, self.fingerprint, self.world_size, self.rank, places, [offset, size], size, digest)
        commit, body = encode_header(orjson.dumps(header.as_dict()))
        head = self._map(self._heads, self._header(self.rank, slot), HEAD + len(body), slot)
        head[HEAD : HEAD + len(body)] = body
        return commit  # no fsync once written: the tier does not outlive the machine

    def _map(self, maps: dict[int, mmap.mmap], path: Path, size: int, slot: int) -> mmap.mmap:
        """``path`` (one of ``slot``'s files) mapped, at least ``size`` bytes (grown when the
        state grows)."""
        current = maps.get(slot)
        if current is not None and len(current) >= size:
            return current
        if current is not None:
            current.close()
        with open(path, "a+b") as f:
            # Allocated now, not on first touch: a full tmpfs is an OSError here, where a write
            # into a mapped hole would be a SIGBUS that kills the worker.
            os.posix_fallocate(f.fileno(), 0, max(size, 1))
            maps[slot] = mmap.mmap(f.fileno(), max(size, 1))
        return maps[slot]

    # ------------------------------------------------------------------ reading
    def headers(self) -> dict[int, dict[int, tuple[int, Header]]]:
        """Step -> rank -> (slot, header), of the slots of this run's trajectory and layout (rule 3)."""
        self.settle()  # a snapshot of this tier in flight is read committed
        found: dict[int, dict[int, tuple[int, Header]]] = {}
        for r in range(self.world_size):
            for k in SLOTS:
                h = Header.read(self._header(r, k))
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
            data = {r: self._read_verified(k, headers[r]) for r, (k, _h) in sorted(slots.items())}
            parts = {}
            for r in sorted(headers):  # every rank's parts, as a disk checkpoint holds them: all judge alike
                parts.update(slot_parts(headers[r], data[r]))
            manifest = slot_manifest(step, headers)
            if self.validator is not None:
                self.validator(manifest, parts)
        except CheckpointRejected as exc:
            return Candidate(step, path, str(exc), None)
        return Candidate(step, path, "", (Checkpoint(step, path, manifest), parts))

    def _read_verified(self, slot: int, header: Header) -> bytearray:
        try:
            data = bytearray(self._data(header.rank, slot).read_bytes()[: header.size])
        except OSError as exc:
            raise CheckpointRejected(f"memory slot of rank {header.rank}: unreadable ({exc})") from exc
        digest = slot_hash(memoryview(data))
        if len(data) != header.size or digest != header.digest:
            said = f"content hash {digest[:12]}… != header {header.digest[:12]}…"
            raise CheckpointRejected(f"memory slot of rank {header.rank}: {said} (corrupt)")
        return data

    # ------------------------------------------------------------------ end
    def release_when_done(self, step: int, total_steps: int) -> None:
        """At a worker's end: the snapshot in flight committed, unmap; once the run's last step is
        trained (on disk), free the RAM."""
        with contextlib.suppress(OSError):  # a tier that failed is only unmapped
            self.settle()
        if self._writer is not None:
            self._writer.shutdown()
        for m in (*self._maps.values(), *self._heads.values()):
            with contextlib.suppress(BufferError):
                m.close()
        self._maps.clear()
        self._heads.clear()
        if self.rank == 0 and step >= total_steps:
            shutil.rmtree(self.root, ignore_errors=True)


def open_tier(run_dir: str | Path, config: RunConfig, rank: int = 0, world_size: int = 1) -> MemoryTier | None:
    """The run's memory tier for one rank of a worker, or None when the run keeps none here."""
    root = tier_root(run_dir)
    if root is None or not enabled(config):
        return None
    beside = config.checkpoint.memory_beside and spare_cpu(world_size)  # one node: every rank is here
    return MemoryTier(root, config.fingerprint(), rank, world_size, overlap=beside)


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


def newest_step(run_dir: str | Path, fingerprint: str, world_size: int = 1) -> int | None:
    """Step of the tier's newest snapshot by its headers alone (no hashing): what the flow reports
    a worker will resume from; the worker verifies it before it restores."""
    root = tier_root(run_dir)
    if root is None or not root.is_dir():
        return None
    return MemoryTier(root, fingerprint, 0, world_size).newest_step()


def resume_step(run_dir: str | Path, disk_step: int | None) -> int | None:
    """The step the next worker of the run resumes from, as the flow reports it: the memory
    snapshot's when the run keeps the tier and it is newer than ``disk_step`` (rule 2), else
    ``disk_step``.  The worker's own restore, which verifies, has the last word."""
    from training.rundir import load_run_config

    try:
        config = load_run_config(run_dir)
    except (OSError, ValueError):
        return disk_step
    if not enabled(config):
        return disk_step
    memory = newest_step(run_dir, config.fingerprint(), config.train.world_size)
    if memory is None or memory <= (disk_step or 0):
        return disk_step
    on_disk = {step for step in (parse_step(p.name) for p in RunPaths(run_dir).checkpoints.glob("step-*")) if step}
    on_disk |= committed_boundaries(run_dir)
    return disk_step if missing_boundary(memory, config.train.chunk_steps, on_disk) is not None else memory


def remove(run_dir: str | Path) -> bool:
    """Drop the run's memory tier (the run finished: nothing will resume from it)."""
    root = tier_root(run_dir)
    if root is None or not root.exists():
        return False
    shutil.rmtree(root, ignore_errors=True)
    return True
