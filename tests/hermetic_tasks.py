"""A task that draws from all three host generators in the training process every step.

``build_host_draws`` is the example char model whose loss is scaled by a number drawn from
python's ``random``, numpy's global generator and torch's global generator at each step (what a
task's own regularisation noise or a sampled auxiliary loss does): the trajectory depends on
those generators, so anything else in the process that draws from them changes the run.  Each
step also sleeps ``task_args.step_sleep_s`` (default 0.25 s, no effect on the numbers) so a test
can disturb the services around a run while it trains."""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

import numpy as np
import torch

from training.config import RunConfig
from training.examples import char_gpt
from training.task import TaskParts


def build_host_draws(config: RunConfig, device: torch.device) -> TaskParts:
    args = dict(config.task_args)
    pause = float(args.pop("step_sleep_s", 0.25))
    parts = char_gpt.build(config.model_copy(update={"task_args": args}), device)
    base = parts.loss_fn

    def loss_fn(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        time.sleep(pause)
        draw = random.random() + float(np.random.random()) + float(torch.rand(()))
        return base(model, batch) * (1.0 + 1e-2 * draw)

    return dataclasses.replace(parts, loss_fn=loss_fn)


def build_with_a_thread(config: RunConfig, device: torch.device) -> TaskParts:
    """The example task, plus a library-style thread that draws from ``random`` every 10 ms (what
    urllib3's retry backoff does while a server is down): the worker must name it.  The thread
    ends with the model, as a library's ends with its client: a process that only builds the
    task to check it (the test's own, through the config's check) must not keep a thread that
    draws from ``random`` for good, moving every later test's python RNG (CI saw
    tests/test_snapshot_plan.py's tiers capture different states for it)."""
    import threading
    import weakref

    stop = threading.Event()

    def jitter() -> None:
        while not stop.wait(0.01):
            random.random()

    threading.Thread(target=jitter, name="jitter-thread", daemon=True).start()
    parts = char_gpt.build(config, device)
    weakref.finalize(parts.model, stop.set)
    return parts
