"""Injected faults for chaos testing, switched on only by the ``CONVOY_FAULTS`` variable.

``CONVOY_FAULTS="persist_delay=0.5,diskfull_from_step=120,slow_step=40:3,step_delay=0.03"``
(also ``diskfull_flag=PATH`` and ``slow_flag=PATH:SECONDS``) — each entry is read where the
fault belongs: a slow background persist (to land a kill inside it), a save that fails with
ENOSPC from a given step on, or once when PATH exists (an injected writer error, not a real full
disk), one stalled training step (``step:seconds``, or the next one once PATH exists), a
pause before every step, and ``micro_stall=S:K:SECONDS:PATH``: before micro-batch K (1-based)
of optimizer step S, create PATH and stall, once (not again once PATH exists), so a test can
kill the worker provably inside a gradient-accumulation window; ``upload_stall=S:SECONDS:PATH``
stalls the checkpoint uploader between the data and the index of step S; ``handoff_hold=K:PATH``
holds chunk K's task, before it adopts the worker the chunk before parked, until PATH exists (a
slow Prefect: a test's kill then lands provably between the two chunk tasks, and the test says
when the task may go on); ``slot_stall=N:SECONDS:PATH`` stalls the N-th memory-tier slot write
with its header uncommitted.  Unset in normal runs: every check is one dict
lookup.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable
from functools import cache
from typing import Any


@cache
def _faults() -> dict[str, str]:
    spec = os.environ.get("CONVOY_FAULTS", "")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, value = item.partition("=")
        out[key] = value
    return out


def reset() -> None:
    """Read ``CONVOY_FAULTS`` afresh: a worker forked by the zygote has another environment."""
    _faults.cache_clear()


def persist_delay() -> None:
    if "persist_delay" in _faults():
        time.sleep(float(_faults()["persist_delay"]))


def check_disk_full(step: int) -> None:
    """``diskfull_from_step=N``: every save from step N fails.  ``diskfull_flag=PATH``: the next
    save fails once if PATH exists (``convoy chaos`` creates it to inject a transient ENOSPC)."""
    start = _faults().get("diskfull_from_step")
    if start is not None and step >= int(start):
        raise OSError(errno.ENOSPC, f"No space left on device (injected by CONVOY_FAULTS at step {step})")
    flag = _faults().get("diskfull_flag")
    if flag and os.path.exists(flag):
        os.unlink(flag)
        raise OSError(errno.ENOSPC, f"No space left on device (injected once by CONVOY_FAULTS at step {step})")


def slow_step(step: int, stopping: Callable[[], bool] = lambda: False) -> None:
    """``slow_step=S:SECONDS`` stalls step S once per process, cut short once ``stopping()`` turns
        true (a preempted worker saves at once, so a test may give the stall a wide margin without
        waiting it out); ``slow_flag=PATH:SECONDS`` stalls
        the next step once PATH exists (``convoy chaos`` creates it, so the stall lands exactly when
        the runner says, whatever a resume replayed before); ``hold_flag=PATH:STEP`` holds every step
    from STEP on while PATH exists, cut short by ``stopping()`` (a test lets an outside event, e.g. a
    scheduler's signal, land mid-chunk); ``step_delay=SECONDS`` pauses before
        every step (tests use it so short chunks last several heartbeats)."""
    delay = _faults().get("step_delay")
    if delay:
        time.sleep(float(delay))
    spec = _faults().get("slow_step")
    if spec:
        at, _, seconds = spec.partition(":")
        if step == int(at):
            until = time.monotonic() + float(seconds or 5)
            while time.monotonic() < until and not stopping():
                time.sleep(min(0.1, max(0.0, until - time.monotonic())))
    hold = _faults().get("hold_flag")
    if hold:  # hold_flag=PATH:STEP: from STEP on, wait while PATH exists (or until stopped)
        path, _, at = hold.rpartition(":")
        while step >= int(at) and os.path.exists(path) and not stopping():
            time.sleep(0.1)
    flag_spec = _faults().get("slow_flag")
    if flag_spec:
        flag, _, seconds = flag_spec.rpartition(":")
        if os.path.exists(flag):
            os.unlink(flag)  # consumed: once per flag
            t0 = time.monotonic()
            time.sleep(float(seconds or 5))
            # Tells the chaos runner which step stalled, how long; renamed in whole, since the runner
            # reads it as soon as it exists (it once read the file between its creation and write).
            with open(f"{flag}.done.tmp", "w") as fh:
                fh.write(f'{{"step": {step}, "seconds": {time.monotonic() - t0:.3f}}}\n')
            os.replace(f"{flag}.done.tmp", f"{flag}.done")


_slot_writes = 0


def slot_stall() -> None:
    """``slot_stall=N:SECONDS:PATH``: the N-th memory-tier slot write of this process, its header
    just uncommitted, creates PATH and stalls SECONDS, once (not again once PATH exists), so a
    test can kill a worker provably in the middle of writing a slot."""
    global _slot_writes
    spec = _faults().get("slot_stall")
    if not spec:
        return
    _slot_writes += 1
    at, seconds, path = spec.split(":", 2)
    if _slot_writes == int(at) and not os.path.exists(path):
        with open(path, "w") as fh:
            fh.write(f'{{"write": {_slot_writes}}}\n')
        time.sleep(float(seconds))


def micro_stall(step: int, micro: int) -> None:
    """``micro_stall=S:K:SECONDS:PATH``: before micro-batch K of step S, if PATH does not exist
    yet, create it and sleep SECONDS (micro-batches 1..K-1 of S are then done, the optimizer step
    is not).  A resumed worker replaying step S finds PATH and does not stall again."""
    spec = _faults().get("micro_stall")
    if not spec:
        return
    at, k, seconds, path = spec.split(":", 3)
    if step == int(at) and micro == int(k) and not os.path.exists(path):
        with open(path, "w") as fh:
            fh.write(f'{{"step": {step}, "micro": {micro}}}\n')
        time.sleep(float(seconds))


def upload_stall(step: int) -> None:
    """``upload_stall=S:SECONDS:PATH``: once every object of checkpoint S is in the DVC remote but
    before the remote index names it, create PATH and stall, once (not again once PATH exists), so
    a test can kill the uploader provably half-way through an upload."""
    spec = _faults().get("upload_stall")
    if not spec:
        return
    at, seconds, path = spec.split(":", 2)
    if step == int(at) and not os.path.exists(path):
        with open(path, "w") as fh:
            fh.write(f'{{"step": {step}}}\n')
        time.sleep(float(seconds))


def handoff_hold(chunk: int, timeout_s: float = 120.0) -> None:
    """``handoff_hold=K:PATH``: chunk K's task waits until PATH exists before it adopts its worker."""
    spec = _faults().get("handoff_hold")
    if spec:
        at, _, path = spec.partition(":")
        deadline = time.monotonic() + timeout_s
        while chunk == int(at) and not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)


def withheld() -> frozenset[str]:
    """``withhold=<component>+<component>``: components of the train state a restore leaves as
    the fresh task has them (``training.state.COMPONENTS``, ``optimizer.<buffer>``,
    ``extra.<name>``).  The suite's negative controls: a resume that withholds any one of them
    must fail the bitwise comparison (tests/test_negative_controls.py)."""
    return frozenset(filter(None, _faults().get("withhold", "").split("+")))


def poison_weights(step: int, model: Any) -> None:
    """``nan_weights_at=STEP``: after the update of optimizer step STEP, every floating weight is
    NaN (its loss was finite): a save of that step holds NaN weights under valid hashes, and the
    next step's loss is NaN (``training.loop.nonfinite``)."""
    if str(step) != _faults().get("nan_weights_at"):
        return
    import torch

    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.fill_(float("nan"))
