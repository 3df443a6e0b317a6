"""The seeds' reliability formulas, and ``convoy plan`` built from them.

* Reliability of N independent GPUs with failure rate λ each over time t: R(t) = exp(-N·λ·t).
* Cluster MTBF = 1 / (N·λ).
* Checkpoint size S ≈ (P + O)·bytes, P parameters, O optimizer values (Adam: 2·P).
* Overhead of checkpointing every T with save time T_save: η(T) = T_save/T + T/(2·MTBF)
  (first term: time spent saving; second: expected work lost per failure, half an interval).
  Minimised at the Young/Daly interval T* = √(2·T_save·MTBF).
* Availability A = MTBF / (MTBF + MTTR); resume beats rerun when rerun time > recover + 5 min.

All times here are in hours unless a name says otherwise.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

RESUME_MARGIN_H = 5 / 60


def reliability(n_gpus: int, rate_per_gpu_h: float, hours: float) -> float:
    return math.exp(-n_gpus * rate_per_gpu_h * hours)


def cluster_mtbf_h(n_gpus: int, rate_per_gpu_h: float) -> float:
    return math.inf if rate_per_gpu_h == 0 else 1.0 / (n_gpus * rate_per_gpu_h)


def overhead(interval_h: float, save_h: float, mtbf_h: float) -> float:
    return save_h / interval_h + interval_h / (2 * mtbf_h)


def young_daly_h(save_h: float, mtbf_h: float) -> float:
    return math.sqrt(2 * save_h * mtbf_h)


def checkpoint_bytes(params: float, optimizer_values_per_param: float = 2, bytes_per_value: float = 4) -> float:
    return params * (1 + optimizer_values_per_param) * bytes_per_value


def availability(mtbf_h: float, mttr_h: float) -> float:
    return 1.0 if math.isinf(mtbf_h) else mtbf_h / (mtbf_h + mttr_h)


class PlanInput(BaseModel):
    """Inputs of ``convoy plan``; impossible values are rejected with one line."""

    model_config = ConfigDict(extra="forbid")
    gpus: int = Field(8, gt=0, description="number of GPUs (N)")
    failure_rate_per_day: float = Field(0.001, ge=0, description="failures per GPU per day (λ)")
    job_hours: float = Field(24.0, gt=0)
    save_hours: float | None = Field(None, gt=0, description="checkpoint save time; else from size / bandwidth")
    params: float | None = Field(None, gt=0, description="model parameters (P), to estimate the checkpoint size")
    optimizer_values_per_param: float = Field(2, ge=0)
    bytes_per_value: float = Field(4, gt=0)
    bandwidth_gb_s: float = Field(1.0, gt=0, description="storage write bandwidth")
    restart_minutes: float = Field(5.0, ge=0, description="detect + reload + rebuild time (MTTR)")
    interval_hours: float | None = Field(None, gt=0, description="your checkpoint interval, to compare")
    keep_last: int = Field(3, ge=1)
    gpus_per_node: int = Field(8, gt=0, description="GPUs (ranks) per node, for the host memory per node")

    @model_validator(mode="after")
    def _needs_save_time(self) -> PlanInput:
        if self.save_hours is None and self.params is None:
            raise ValueError("give --save-hours, or --params (with --bandwidth-gb-s) to estimate the save time")
        return self


def plan(p: PlanInput) -> dict[str, Any]:
    rate_h = p.failure_rate_per_day / 24
    mtbf = cluster_mtbf_h(p.gpus, rate_h)
    size = checkpoint_bytes(p.params, p.optimizer_values_per_param, p.bytes_per_value) if p.params else None
    save_h = p.save_hours if p.save_hours is not None else size / (p.bandwidth_gb_s * 1e9) / 3600  # type: ignore[operator]
    mttr_h = p.restart_minutes / 60
    optimum = young_daly_h(save_h, mtbf) if math.isfinite(mtbf) else p.job_hours
    chosen = p.interval_hours or optimum
    failures = p.job_hours / mtbf if math.isfinite(mtbf) else 0.0
    rerun_h = p.job_hours / 2  # expected progress lost by restarting from scratch at a random failure
    return {
        "reliability_over_job": reliability(p.gpus, rate_h, p.job_hours),
        "cluster_mtbf_hours": mtbf,
        "expected_failures": failures,
        "checkpoint_bytes": size,
        "save_hours": save_h,
        "optimal_interval_hours": optimum,
        "overhead_at_optimal": overhead(optimum, save_h, mtbf) if math.isfinite(mtbf) else save_h / optimum,
        "chosen_interval_hours": chosen,
        "overhead_at_chosen": overhead(chosen, save_h, mtbf) if math.isfinite(mtbf) else save_h / chosen,
        "expected_lost_hours": failures * (chosen / 2 + mttr_h),
        "availability": availability(mtbf, mttr_h),
        "storage_bytes": size * p.keep_last if size else None,
        # convoy's host memory per node beside training (training.memory_budget, memory tier rule 8):
        # one copy, the tier's slot that the async save persists from; rank 0's whole state when
        # replicated, each rank's share when sharded (the tier is off there: the save's staging).
        "host_copy_replicated_bytes": size,
        "host_copy_sharded_bytes": size * min(p.gpus_per_node, p.gpus) / p.gpus if size else None,
        "resume_beats_rerun": rerun_h > mttr_h + RESUME_MARGIN_H,
    }
