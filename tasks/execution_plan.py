"""How a run's chunks execute, decided once from its config, and the span of one chunk.

Why: the chunk task and the flow each re-derived the run's execution from its settings, in
inline checks (``mode == "local"``, ``pipeline and mode == "local"``, ``standby and ... and
world_size == 1``) scattered over the flow, the chunk task and the run's resources, and a
chunk's steps crossed module boundaries as a ``(chunk, start, end)`` tuple.  Now
:class:`ExecutionPlan` is computed once, held by :class:`tasks.run_resources.RunResources`,
and every decision reads its named fields; :class:`ChunkSpan` names a chunk's steps.

Rules:
1. Pool mode (``orchestration.mode: pool``) runs each chunk as its own flow run on a work pool:
   no pipelining, standby or zygote there (they live in one flow process across chunks).
2. A standby worker and the zygote serve one rank on one node: a multi-rank worker is torchrun's
   (its ranks are not forked and not kept warm).
"""

from __future__ import annotations

from dataclasses import dataclass

from training.config import RunConfig


@dataclass(frozen=True)
class ChunkSpan:
    """One chunk of a run: its number and its steps ``[start, end)``."""

    chunk: int
    start: int
    end: int

    def following(self, chunk_steps: int, total_steps: int) -> ChunkSpan:
        """The next chunk's span (a worker parked at this one's end trains it)."""
        return ChunkSpan(self.chunk + 1, self.end, min(self.end + chunk_steps, total_steps))


@dataclass(frozen=True)
class ExecutionPlan:
    """How the run's chunks execute (the rules above)."""

    #: Each chunk its own flow run on a work pool (rule 1); else local, in the flow's process.
    pool: bool
    #: A worker trains on through chunk boundaries, handed from one chunk task to the next.
    pipelined: bool
    #: A warm standby worker takes a failed worker's place (rule 2).
    standby: bool
    #: Workers are forked from the run's zygote, with torch imported (rule 2).
    zygote: bool

    @classmethod
    def of(cls, config: RunConfig) -> ExecutionPlan:
        o, t = config.orchestration, config.train
        local = o.mode == "local"
        one_rank = t.world_size == 1 and t.nnodes == 1
        return cls(
            pool=not local,
            pipelined=local and o.pipeline,
            standby=local and o.standby and t.world_size == 1,
            zygote=local and o.zygote and one_rank,
        )

    @property
    def local(self) -> bool:
        return not self.pool
