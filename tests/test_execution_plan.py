"""The run's execution plan, decided once from its config (tasks/execution_plan.py, its rules)."""

from __future__ import annotations

import pytest

from tasks.execution_plan import ChunkSpan, ExecutionPlan
from training.config import load_config


@pytest.mark.parametrize(
    ("settings", "expected"),
    [
        ([], ExecutionPlan(pool=False, pipelined=True, standby=False, zygote=True)),
        (["orchestration.standby=true"], ExecutionPlan(pool=False, pipelined=True, standby=True, zygote=True)),
        (  # rule 1: a pool runs each chunk as its own flow run: nothing lives across chunks
            ["orchestration.mode=pool", "orchestration.standby=true"],
            ExecutionPlan(pool=True, pipelined=False, standby=False, zygote=False),
        ),
        (  # rule 2: torchrun's ranks are neither forked nor kept warm
            ["train.ranks=2", "orchestration.standby=true"],
            ExecutionPlan(pool=False, pipelined=True, standby=False, zygote=False),
        ),
        (["orchestration.pipeline=false", "orchestration.zygote=false"], ExecutionPlan(False, False, False, False)),
    ],
)
def test_the_plan_follows_the_settings(settings: list[str], expected: ExecutionPlan) -> None:
    assert ExecutionPlan.of(load_config(None, ["tracking.mlflow=false", *settings])) == expected


def test_a_span_knows_the_next_chunk() -> None:
    assert ChunkSpan(1, 0, 20).following(20, 50) == ChunkSpan(2, 20, 40)
    assert ChunkSpan(2, 40, 50).following(20, 50) == ChunkSpan(3, 50, 50)
