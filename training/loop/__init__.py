"""The worker loop's room: what one worker process does between taking a run and exiting.

What lives here: taking the run (``claim``: lease, the predecessor's last beat, the heartbeat,
the stop request), what it trains with (``runtime``: a frozen ``Runtime`` built once), the resume
(``restore``), one optimizer step and validation (``step``), the loss watch (``nonfinite``), host
memory checked before each copy of the state (``memory_watch``, the budget's rule 5), the threads
a worker may run (``hermetic``, invariant 12) and a forked worker's tie to the flow
(``lifeline``).  Their order is stated once, in the lifecycle of :mod:`training.worker`.

What it may import (enforced by ``tests/test_import_rooms.py``): this room and what stands below
it: training's top modules (the state, the task, the run directory, the heartbeat, the memory
budget ...), the data room (``training.datapipe``), the checkpoint rooms and ``tracking``.  Never
the two entry points above it, ``training.worker`` (``python -m training.worker``) and
``training.zygote`` (``python -m training.zygote``, which forks workers): they keep their names and
places because every torchrun command, the zygote's fork, ``deploy/`` and the docs start them by
those names.

Who imports it: in ``training``, only ``training.worker`` and ``training.zygote``; outside,
``tasks`` (the supervisor's stop request, ``claim.request_stop``) and ``flows`` (the reaper waits on
the lifeline).  Kept out of
this room, below it: ``training.heartbeat`` (the beat record, read by ``tracking``, the memory
sweep and the supervisors) and ``training.evaluate`` (the DVC stages' command, run after training).
"""
