"""The data room: which samples a step trains on, in which order, and how that order resumes.

What lives here: the deterministic resumable data order and its loaders (``data``: the cursor
of the global batch, the sampler, ``LoaderSpec``), each sample seeded by its place in the run
(``sample_rng``), resumable streams (``streams``; positioned by global sample index:
``stream_position``) and third-party ones made exactly resumable (``stream_adapters/``), the tree
map that moves a batch of any structure to the device (``batch``), the demo corpus with its exact
entropy floor (``corpus``) and the first-batch fetch and stream-layout check run before a run
exists (``preflight``).

What it may import (enforced by ``tests/test_import_rooms.py``): this room and training's base
modules (``training.config``, ``paths``, ``fsutil`` ...), and the checkpoint rooms (``preflight``
reads a checkpoint's saved stream layout through ``training.checkpointing.verify``).  Never the
rest of ``training``: not the state, the task, the run directory, the worker loop's room
(``training.loop``) or ``tracking``; they stand on the data order, not the other way round.
``sample_rng`` is itself one of training's base modules (``training.parts`` names its generators)
and imports nothing of ``training``.

Who imports it: the rest of ``training`` (the state, the task, the worker loop, ``tracking``,
``examples``), ``tasks`` and ``flows``.
"""
