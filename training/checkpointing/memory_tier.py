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
on the loop's own thread — split the state, copy its tensors into a mapped slot, hash the slot
with the checkpoints' hash (xxh3-128), commit a small header — with no system call once the slots
are mapped.  The split walks only the small part of the state: the model's and optimizer's
tensors are found once by a plan (:mod:`training.checkpointing.snapshot_plan`), checked at every
snapshot and copied.

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
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from training.checkpointing.codec import join_tree
from training.checkpointing.errors import CheckpointRejected
from training.checkpointing.slot_layout import Layouts, copy_into
from training.checkpointing.snapshot_plan import MAX_REBUILDS, SlotContent, SnapshotPlan, skeleton_bytes, split_parts
from training.checkpointing.store import Candidate, CheckpointStore
from training.checkpointing.verify import Checkpoint, Validator, parse_step
from training.config import RunConfig
from training.paths import RunPaths, checkpoint_name
from training.rundir import run_info

if TYPE_CHECKING:  # the loop's types: the tier is built before them
    from training.checkpointing.schedule import MemorySchedule
    from training.state import TrainState

#: What a plan's check or making may raise on a model or optimizer it did not foresee (a custom
#: ``state_dict``, a replaced ``param_groups``; torch's out-of-memory is a RuntimeError): the
#: full walk decides, the snapshot is still taken.
_PLAN_ERRORS = (AttributeError, IndexError, KeyError, RuntimeError, TypeError, ValueError)
#: Where the tier lives: a RAM file system on Linux.
SHM = Path("/dev/shm")
#: Another place for it (a tmpfs of your own; the tests keep theirs in a temporary directory).
DIR_ENV = "CONVOY_MEMORY_DIR"
FORMAT = 2  # 2: headers written in place (.head); 1 was renamed in (.json)
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


def _hash(*buffers: Any) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    for b in buffers:
        h.update(b)
    return h.hexdigest()


@dataclass(frozen=True)
class Header:
    """A slot's header (``rank-<r>.slot-<k>.head``): what the slot holds and its hash."""

    step: int
    fingerprint: str
    world_size: int
    rank: int
    #: (part, key, dtype name, shape, offset, bytes) of each tensor, in the slot's order.
    tensors: Any  # a list of those; written as the layout's serialised places (an orjson Fragment)
    #: Where in the slot the JSON skeletons of the parts are (:mod:`training.checkpointing.codec`):
    #: [start, end), after the tensors' bytes.
    skeletons: list[int]
    size: int
    digest: str

    def as_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **self.__dict__}

    @classmethod
    def read(cls, path: Path) -> Header | None:
        """The header committed in ``path``, or None: none committed, being written, torn or of
        another format (see :func:`encode_header`)."""
        try:
            d = json.loads(decode_header(path.read_bytes()) or b"null")
            fields = {k: d[k] for k in cls.__dataclass_fields__}
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return cls(**fields) if d.get("format") == FORMAT else None


#: A header file: the body's length (8 bytes, 0 = no header), the body's xxh64 (8), the body (JSON).
_HEAD = 16


def encode_header(body: bytes) -> tuple[bytes, bytes]:
    """(length and checksum, body) as a header file holds them; the first part is written last:
    the commit."""
    import xxhash

    return len(body).to_bytes(8, "little") + xxhash.xxh64_digest(body), body


def decode_header(data: bytes) -> bytes | None:
    """The committed body of a header file, or None where there is none or it does not check out
    (a kill in the middle of its write)."""
    import xxhash

    n = int.from_bytes(data[:8], "little")
    body = data[_HEAD : _HEAD + n]
    if not n or len(body) != n or xxhash.xxh64_digest(body) != data[8:_HEAD]:
        return None
    return body


class MemoryTier:
    """One rank's memory tier (see the module docstring)."""

    def __init__(self, root: Path, fingerprint: str, rank: int = 0, world_size: int = 1, plans: bool = True) -> None:
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
        steps = {k: h.step for k in SLOTS if (h := Header.read(self._header(rank, k))) is not None}
        self.next_slot = min(SLOTS, key=lambda k: steps.get(k, -1))  # overwrite the older one first

    def _header(self, rank: int, slot: int) -> Path:
        return self.root / f"rank-{rank}.slot-{slot}.head"

    def _data(self, rank: int, slot: int) -> Path:
        return self.root / f"rank-{rank}.slot-{slot}.bin"

    # ------------------------------------------------------------------ writing
    def snapshot(self, state: TrainState, schedule: MemorySchedule) -> None:
        """This rank's state at its step into the next slot, on the calling thread; the schedule
        learns what it cost."""
        t0 = time.perf_counter()
        self.write_content(state.step, self._content(state))
        self.last_stall_s = time.perf_counter() - t0
        schedule.saved(state.step, self.last_stall_s)

    def _content(self, state: TrainState) -> SlotContent:
        """The state laid out for a slot: through the plan while it holds, else by the full walk,
        which makes the next plan (:mod:`training.checkpointing.snapshot_plan`)."""
        if self._plan is not None:
            try:
                fast = self._plan.content(state, self.rank)
            except _PLAN_ERRORS:  # a plan that cannot tell does not hold: the full walk decides
                fast = None
            if fast is not None:
                return fast
            self._plan, self._plans_failed = None, self._plans_failed + 1
        include = self.rank == 0
        full = split_parts(state.checkpoint_parts(self.rank, include_replicated=include, sharded=False))
        if include and self.plans and self._plans_failed < MAX_REBUILDS:
            try:  # a model the plan's walk trips on (a custom state_dict) gets no plan, not a crash
                self._plan = SnapshotPlan.build(state, full)
            except _PLAN_ERRORS:
                self._plan = None
            self._plans_failed += self._plan is None
        return SlotContent.of(full, self._layouts)

    def write(self, step: int, parts: dict[str, Any]) -> None:
        """``parts`` (``TrainState.checkpoint_parts``) of ``step`` into the next slot."""
        self.write_content(step, SlotContent.of(split_parts(parts), self._layouts))

    def write_content(self, step: int, content: SlotContent) -> None:
        slot = self.next_slot
        head = self._map(self._heads, self._header(self.rank, slot), _HEAD)
        head[:8] = bytes(8)  # uncommitted: a kill from here on leaves this slot without a header
        offset = content.layout.end
        skeleton = skeleton_bytes(content.skeletons)
        size = offset + len(skeleton)
        buf = self._map(self._maps, self._data(self.rank, slot), size)
        copy_into(buf, content.groups)
        buf[offset:size] = skeleton
        digest = _hash(memoryview(buf)[:size])
        places = content.layout.places_json  # serialised once per layout: the same at every snapshot
        header = Header(step, self.fingerprint, self.world_size, self.rank, places, [offset, size], size, digest)
        commit, body = encode_header(orjson.dumps(header.as_dict()))
        head = self._map(self._heads, self._header(self.rank, slot), _HEAD + len(body))
        head[_HEAD : _HEAD + len(body)] = body
        head[:_HEAD] = commit  # the commit, last; no fsync: the tier does not outlive the machine
        self.next_slot = 1 - slot

    def _map(self, maps: dict[int, mmap.mmap], path: Path, size: int) -> mmap.mmap:
        """``path`` (one of the next slot's files) mapped, at least ``size`` bytes (grown when
        the state grows)."""
        slot = self.next_slot
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
                parts.update(_parts(headers[r], data[r]))
            manifest = _manifest(step, headers)
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
        digest = _hash(memoryview(data))
        if len(data) != header.size or digest != header.digest:
            said = f"content hash {digest[:12]}… != header {header.digest[:12]}…"
            raise CheckpointRejected(f"memory slot of rank {header.rank}: {said} (corrupt)")
        return data

    # ------------------------------------------------------------------ end
    def release_when_done(self, step: int, total_steps: int) -> None:
        """At a worker's end: unmap; once the run's last step is trained (on disk), free the RAM."""
        for m in (*self._maps.values(), *self._heads.values()):
            with contextlib.suppress(BufferError):
                m.close()
        self._maps.clear()
        self._heads.clear()
        if self.rank == 0 and step >= total_steps:
            shutil.rmtree(self.root, ignore_errors=True)


def _parts(header: Header, data: bytearray) -> dict[str, Any]:
    """The state parts a verified slot holds (tensors over a private copy of its bytes)."""
    import torch

    start, end = header.skeletons
    skeletons = json.loads(bytes(data[start:end]))
    tensors: dict[str, dict[str, Any]] = {part: {} for part in skeletons}
    for part, key, dtype, shape, offset, nbytes in header.tensors:
        flat = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset) if nbytes else None
        dt = getattr(torch, dtype)
        tensors[part][key] = flat.view(dt).reshape(shape) if flat is not None else torch.empty(shape, dtype=dt)
    return {part: join_tree(skel, tensors[part]) for part, skel in skeletons.items()}


def _manifest(step: int, headers: dict[int, Header]) -> dict[str, Any]:
    """What a restore reads of a checkpoint's manifest, for a snapshot."""
    h0 = headers[0]
    return {
        "step": step,
        "fingerprint": h0.fingerprint,
        "world_size": h0.world_size,
        "digest": _hash(*(h.digest.encode() for _, h in sorted(headers.items()))),
        "files": {f"rank-{r}.slot": {"size": h.size} for r, h in headers.items()},
        "tier": "memory",
    }


def open_tier(run_dir: str | Path, config: RunConfig, rank: int = 0, world_size: int = 1) -> MemoryTier | None:
    """The run's memory tier for one rank of a worker, or None when the run keeps none here."""
    root = tier_root(run_dir)
    if root is None or not enabled(config):
        return None
    return MemoryTier(root, config.fingerprint(), rank, world_size)


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
