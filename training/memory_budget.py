"""Host memory, budgeted before a run starts: convoy's projected peak on this node against what the
machine offers, and what convoy gives up, in a stated order, so that a run it starts never runs
into the OOM killer because of convoy's own copies.

Why: measured at a 4 GiB state, a bare loop with ``torch.save`` peaked at 6.2 GB and ``convoy
train`` with the defaults at 18.3 GB: the memory tier's two slots in ``/dev/shm`` and the async
save's staging copy, on top of the live state.  On a 24 GB machine a bare loop trains ~12 GB of
state; convoy was OOM-killed above ~5 GB, and the kernel took the worker, which convoy then
retried into the same wall.  Published runs died the same way (a first save that stages most of a
node's RAM).  Nothing measured host memory before; now every flow's start projects it.

Rules (numbered; cited in code):

1. **What is counted, per node.**  The live state where it lives in host memory (a CPU run:
   weights, gradients, optimizer state; activations are not known before the run and are not
   counted), each rank's copies per tier (the memory tier: ``checkpoint.memory_slots`` copies of
   the rank's share, in ``/dev/shm``, which is RAM; the async save's staging: one, unless the
   tier holds it, memory tier rule 8), every rank on this node, and a warm
   standby's built model.  Replicated state is held whole by rank 0's copies and by each rank's
   live replica; an FSDP-sharded one (``train.parallel: fsdp``), a share per rank, live and in its
   tier; a DDP replica saved in the sharded format, whole live and in each rank's tier (it holds
   what the rank holds, memory tier rule 9), a share in its save's staging.
2. **Against what is offered.**  The cgroup's limit less its usage where one applies, else the
   kernel's ``MemAvailable``; ``checkpoint.host_memory_gb`` stands in for both (planning for
   another machine, tests).  ``/dev/shm``'s free space bounds the memory tier apart.
3. **Degrade before running out, in this order**, while the projected peak exceeds
   ``checkpoint.host_memory_share`` of what is offered: the memory tier down to one slot (which
   is also the async save's staging, memory tier rule 8), then that last copy: the tier off and
   saves synchronous together (either alone keeps one copy of the state; without both a kill
   loses up to the disk interval and each save holds the loop for its write).  Each is one line
   saying what was given up and what it costs.  A tier that ``/dev/shm`` cannot hold loses slots
   or goes off whatever the share, in one line too (the save then stages its own copy).
4. **Never start what is projected to run out.**  If, with everything given up, the projection
   exceeds all that is offered (not only the share: a bare loop may use it all), the run is
   refused in one line (exit 2) before any process starts.  Where a bare loop would fit, convoy,
   degraded, adds nothing to it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

from training.checkpointing.memory.memory_tier import enabled
from training.config import ConfigError, RunConfig
from training.parts import TaskParts

GB = 1e9


def size_text(n: float) -> str:
    """Bytes as a person reads them: MB below a GB, else GB."""
    return f"{n / 1e6:,.1f} MB" if n < GB else f"{n / GB:.2f} GB"


#: Per-parameter optimizer buffers of torch's built-in optimizers (before their first step their
#: state is empty, so the projection counts by class); amsgrad adds one, momentum one.
_OPTIMIZER_BUFFERS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adadelta": 2, "Rprop": 2}
#: What the flow, the Prefect server and the worker zygote hold beside training (measured: 0.7 GB).
CONVOY_PROCESSES = int(0.7 * GB)


@dataclass(frozen=True)
class StateSize:
    """One replica's checkpointed state, in bytes: the model (parameters and buffers) and the
    optimizer's state (counted by class before its first step)."""

    model: int
    optimizer: int
    #: Of the model, the parameters that train (their gradients are live too).
    trainable: int

    @property
    def state(self) -> int:
        return self.model + self.optimizer

    @classmethod
    def of(cls, parts: TaskParts) -> StateSize:
        """The sizes of ``parts`` (built on the meta device is enough: shapes and dtypes)."""
        model = parts.model
        params = list(model.parameters())
        size = sum(p.numel() * p.element_size() for p in params)
        size += sum(b.numel() * b.element_size() for b in model.buffers())
        trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        return cls(size, _optimizer_bytes(parts.optimizer, trainable), trainable)


def _optimizer_bytes(optimizer: object, trainable: int) -> int:
    """The optimizer state's bytes: what it holds, or by its class before its first step."""
    state = getattr(optimizer, "state", {})
    held = sum(t.numel() * t.element_size() for s in state.values() for t in s.values() if hasattr(t, "numel"))
    if held:
        return held
    groups = getattr(optimizer, "param_groups", [{}])
    options = groups[0] if groups else {}
    name = type(optimizer).__name__
    if name == "SGD":
        per = 1 if options.get("momentum") else 0
    elif name in ("RMSprop",):
        per = 1 + bool(options.get("momentum")) + bool(options.get("centered"))
    elif name in ("Adagrad", "ASGD"):
        per = 1
    else:  # Adam's family, and what is not known: counted as Adam (two moments), the common worst
        per = _OPTIMIZER_BUFFERS.get(name, 2) + bool(options.get("amsgrad"))
    return per * trainable


@dataclass(frozen=True)
class HostMemory:
    """What this node offers (rule 2), in bytes."""

    available: int
    #: Free space where the memory tier lives (``/dev/shm``); None: no RAM file system there.
    shm_free: int | None
    #: Where ``available`` comes from, as a person reads it.
    source: str

    @classmethod
    def of_machine(cls, config: RunConfig, tier_base: Path) -> HostMemory:
        shm = _free_bytes(tier_base)
        if config.checkpoint.host_memory_gb is not None:
            return cls(int(config.checkpoint.host_memory_gb * GB), shm, "checkpoint.host_memory_gb")
        limit = cgroup_room()
        available = mem_available()
        if limit is not None and limit < available:
            return cls(limit, shm, "the cgroup's memory limit less its usage")
        return cls(available, shm, "MemAvailable")


def _free_bytes(base: Path) -> int | None:
    """Free bytes of the file system that holds (or would hold) ``base``."""
    for p in (base, *base.parents):
        if p.is_dir():
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
    return None


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def cgroup_room() -> int | None:
    """The cgroup's limit less its usage (v2, else v1), or None where no limit applies."""
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        with contextlib.suppress(OSError, ValueError):
            limit = Path(limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:  # v1 says "no limit" with a huge number
                return None
            return max(0, int(limit) - int(Path(usage_file).read_text()))
    return None


@dataclass(frozen=True)
class Projection:
    """convoy's projected peak host memory on one node (rule 1), by what holds it."""

    size: StateSize
    ranks: int
    live: int
    tier: int
    staging: int
    standby: int

    @property
    def peak(self) -> int:
        return self.live + self.tier + self.staging + self.standby + CONVOY_PROCESSES

    def line(self, host: HostMemory, share: float) -> str:
        parts = [f"live {size_text(self.live)}" if self.live else "live state on the GPU"]
        if self.tier:
            parts.append(f"memory tier {size_text(self.tier)} (/dev/shm)")
        if self.staging:
            parts.append(f"save staging {size_text(self.staging)}")
        if self.standby:
            parts.append(f"standby {size_text(self.standby)}")
        parts.append(f"convoy's processes {CONVOY_PROCESSES / GB:.1f} GB")
        return (
            f"host memory: state {size_text(self.size.state)}, {self.ranks} rank(s) on this node; projected peak "
            f"{size_text(self.peak)} = {' + '.join(parts)}; budget {share:.0%} of {size_text(host.available)} "
            f"({host.source}) = {size_text(share * host.available)}"
        )


def project(config: RunConfig, size: StateSize, on_cpu: bool) -> Projection:
    """The peak of ``config`` on one node (rule 1); ``on_cpu``: the state trains in host memory."""
    t, c = config.train, config.checkpoint
    ranks = t.ranks  # this node's
    sharded, fsdp = c.format == "sharded", t.parallel == "fsdp"  # fsdp: the live state sharded too
    share = size.state // t.world_size if fsdp else size.state  # what one rank holds live
    copies = size.state // t.world_size if sharded else size.state  # what one rank's save writes
    live = ranks * (share + (size.trainable // (t.world_size if fsdp else 1))) if on_cpu else 0
    holders = ranks if sharded else 1  # replicated: rank 0's copies hold the state whole
    # The tier holds what a rank holds (tier rule 9): its share of an FSDP state, a DDP replica whole.
    tier = c.memory_slots * (share if sharded else copies) * holders if enabled(config) else 0
    # An async save stages its own copy, unless the tier holds it (memory tier rule 8).
    staging = copies * holders if c.async_save and c.every_steps is not None and not tier else 0
    standby = size.model if config.orchestration.standby and ranks == 1 else 0
    return Projection(size, ranks, live, tier, staging, standby)


@dataclass(frozen=True)
class Fitted:
    """``config`` as it will run: what it gave up (one line each) and the projection it keeps."""

    config: RunConfig
    gave_up: list[str]
    projection: Projection
    host: HostMemory

    @property
    def line(self) -> str:
        """The projection kept, in one line (``convoy validate``, a flow's log)."""
        return self.projection.line(self.host, self.config.checkpoint.host_memory_share)


def fit(config: RunConfig, size: StateSize, host: HostMemory, on_cpu: bool) -> Fitted:
    """Degrade ``config`` until its projection fits the budget (rule 3), or refuse (rule 4)."""
    c = config.checkpoint
    budget = c.host_memory_share * host.available
    gave_up: list[str] = []
    p = project(config, size, on_cpu)
    while p.tier and host.shm_free is not None and p.tier > host.shm_free:
        slots = config.checkpoint.memory_slots
        config, cost = _fewer_slots(config)
        gave_up.append(
            f"host memory: /dev/shm has {size_text(host.shm_free)} free, the memory tier's {slots} slot(s) need "
            f"{size_text(p.tier)}: {cost}"
        )
        p = project(config, size, on_cpu)
    while p.peak > budget and p.tier and config.checkpoint.memory_slots > 1:
        config, cost = _fewer_slots(config)
        gave_up.append(f"{_over(p, budget, host)}: {cost}")
        p = project(config, size, on_cpu)
    if p.peak > budget and (p.tier or p.staging):  # the one copy left serves both tiers: both go
        config, cost = no_copy(config, size)
        gave_up.append(f"{_over(p, budget, host)}: {cost}")
        p = project(config, size, on_cpu)
    if p.peak > host.available:
        raise ConfigError(
            f"host memory: projected peak {size_text(p.peak)} (live state {size_text(p.live)}) exceeds the "
            f"{size_text(host.available)} available ({host.source}) even with the memory tier and asynchronous "
            "saves off: train on a machine with more memory, shard the state over more ranks "
            "(train.parallel: fsdp), or set checkpoint.host_memory_gb if this is not the machine that trains"
        )
    return Fitted(config, gave_up, p, host)


def _with_checkpoint(config: RunConfig, **changes: object) -> RunConfig:
    return config.model_copy(update={"checkpoint": config.checkpoint.model_copy(update=changes)})


def _tier_off(config: RunConfig) -> RunConfig:
    return _with_checkpoint(config, memory_every_steps=None)


def _fewer_slots(config: RunConfig) -> tuple[RunConfig, str]:
    """The memory tier one slot smaller, or off, and what that costs."""
    if config.checkpoint.memory_slots > 1:
        cost = (
            "memory tier down to one slot (checkpoint.memory_slots: 1); a kill while a snapshot is written, "
            "or while a save persists from the slot, falls back to the newest disk checkpoint"
        )
        return _with_checkpoint(config, memory_slots=1), cost
    return _tier_off(config), _TIER_OFF.format(interval=_interval(config))


def no_copy(config: RunConfig, size: StateSize) -> tuple[RunConfig, str]:
    """Rule 3's last step: no copy of the state beside the live one (tier off, saves synchronous)."""
    said = []
    if enabled(config):
        said.append(_TIER_OFF.format(interval=_interval(config)))
    if config.checkpoint.async_save:
        said.append(
            "asynchronous saves off (checkpoint.async_save: false): no staging copy of the state; each save holds "
            f"the loop while it writes {size_text(size.state)} (~{size.state / GB / 0.7:.2g} s at 0.7 GB/s)"
        )
    return _with_checkpoint(_tier_off(config), async_save=False), "; ".join(said)


_TIER_OFF = (
    "memory tier off (checkpoint.memory_every_steps: null); a kill now loses up to the steps since the last "
    "disk checkpoint ({interval}) instead of those since the last snapshot"
)


def _interval(config: RunConfig) -> str:
    every = config.checkpoint.every_steps
    return f"checkpoint.every_steps = {every}" if every is not None else "the disk interval"


def _over(p: Projection, budget: float, host: HostMemory) -> str:
    return f"host memory: projected peak {size_text(p.peak)} > budget {size_text(budget)} ({host.source})"


def fitted(config: RunConfig, parts: TaskParts | None = None) -> Fitted | None:
    """``config`` fitted to this machine's host memory (rules 1-4); ``parts`` sizes the state (by
    default the task built on the meta device); None where it cannot be built here (its data is
    not on this machine: the worker's machine decides then)."""
    from training.checkpointing.memory.memory_tier import tier_base

    size = StateSize.of(parts) if parts is not None else _sized(config.model_dump_json())
    if size is None:
        return None
    host = HostMemory.of_machine(config, tier_base())
    return fit(config, size, host, on_cpu=trains_on_cpu(config))


@functools.cache
def _sized(config_json: str) -> StateSize | None:
    """The state's size for a config, the task built once per process (a flow's start sizes it
    before and inside the flow run: a task built on the CPU, where meta fails, is not cheap)."""
    from training.config import config_from_dict
    from training.task import check_task

    parts = check_task(config_from_dict(json.loads(config_json), "memory budget", check_task=False))
    return StateSize.of(parts) if parts is not None else None


def trains_on_cpu(config: RunConfig) -> bool:
    """Whether the state lives in host memory (``device: auto`` as this machine would pick)."""
    if config.train.device != "auto":
        return config.train.device == "cpu"
    import torch

    return not torch.cuda.is_available()
