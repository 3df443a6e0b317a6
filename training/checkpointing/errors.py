"""The two ways a checkpoint goes wrong, kept apart so neither is mistaken for a bug.

:class:`CheckpointRejected` — *this checkpoint is bad*: unreadable, a size or hash that does not
match its manifest, a manifest that is wrong, files convoy does not write, a state that does not
fit the task.  Only the store (:mod:`training.checkpointing.verify`, ``sharded``,
``safetensors_io``) and the train-state validator (:func:`training.checkpointing.state_check.checkpoint_validator`)
raise it, and every place that means "pass over this checkpoint" catches exactly it.  Any other
exception while a checkpoint is verified or restored is a bug: it crashes the worker with its
traceback, and the checkpoint is never recorded as refused nor quarantined.

It is a ``ValueError`` so that code outside convoy written against the store's earlier
``ValueError`` still sees a rejection; convoy's own code never catches ``ValueError`` to mean it.

:class:`CheckpointError` — a *save* failed (e.g. ENOSPC): raised in the training loop, never
swallowed.
"""

from __future__ import annotations


class CheckpointRejected(ValueError):
    """This checkpoint is bad (the message says why, naming the file): pass over it."""


class CheckpointError(RuntimeError):
    """A save failed (e.g. ENOSPC); raised in the training loop, never swallowed."""
