"""The memory tier's room: the newest training state kept in RAM (``/dev/shm``) in front of the
durable checkpoints, and everything a snapshot is made of.

What lives here: the tier itself and its rules (``memory_tier``), the slot files and their
three writing steps (``slot_files``), a slot's header and what it holds (``slot_format``), its
verified reading (``slot_read``), where each tensor lies in a slot (``slot_layout``), the plan
that finds the state's tensors once and checks them at every snapshot (``snapshot_plan``), the
copy beside the loop's backward (``beside``), and the protocol a state must meet to be snapshotted (``source``).

What it may import (enforced by ``tests/test_import_rooms.py``): the rest of
``training.checkpointing`` (the store it stands in front of, verification, the codec) and
training's base modules (``training.config``, ``paths``, ``events``, ``fsutil``, ``parts`` ...).
Never the run around it (``training.state``, ``task``, ``rundir``, the worker): a state reaches
the tier through :class:`~training.checkpointing.memory.source.SnapshotSource`, and what the run
directory says (its creation time, its config) is read by ``training.run_memory``.  The rest of
``training.checkpointing`` does not import this room: the durable store stands without it.
"""
