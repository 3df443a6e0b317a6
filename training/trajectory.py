"""Which settings change the training trajectory: the ``Trajectory`` marker and what it selects.

The fingerprint of a config (``RunConfig.fingerprint``) hashes the settings marked
``Annotated[<type>, Trajectory(...)]`` where they are declared, and nothing else.  Opt-in on
purpose: a setting added later (logging, cadence, limits) is never hashed unless someone marks
it, so adding one cannot silently change the fingerprint of every existing run, which would fork
each of them into a new, empty run or refuse to resume it.

A marker also carries the rule under which its setting is left out, as data beside the
declaration: ``omit_at`` (the value the setting had before it existed, so fingerprints computed
before it stay valid) and ``only_with`` (a sibling switch without which the setting has no
effect).  A section whose trajectory includes a value that is no setting (the synthetic
corpus's generator version) returns it from ``derived_trajectory()``.

This module imports nothing of convoy: ``training.config`` declares the settings with it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo


class _Never:
    """``omit_at``'s default: a value no setting has, so the setting is always hashed."""

    def __repr__(self) -> str:
        return "never"


NEVER = _Never()


@dataclass(frozen=True)
class Trajectory:
    """Marks a setting as part of the trajectory (hashed into the fingerprint, kept in ``run.json``).

    A marked field whose value is a model (a section) contributes that model's own marked fields."""

    #: Left out while the setting has this value: the value it had before it existed.
    omit_at: Any = NEVER
    #: Left out while this sibling setting (of the same section) is off: it has no effect then.
    only_with: str | None = None
    #: What is hashed instead of the value (e.g. only a path's last part, which stays the same
    #: when the parent directory moves).
    hashed_as: Callable[[Any], Any] | None = None

    def omitted(self, value: Any, section: BaseModel) -> bool:
        if self.only_with is not None and not getattr(section, self.only_with):
            return True
        return self.omit_at is not NEVER and value == self.omit_at


def marker(field: FieldInfo) -> Trajectory | None:
    """The field's ``Trajectory`` marker, or None for a setting that is never hashed."""
    return next((m for m in field.metadata if isinstance(m, Trajectory)), None)


def trajectory_of(section: BaseModel) -> dict[str, Any]:
    """The marked settings of ``section`` (sections nested), each as JSON, minus those a rule omits.

    The keys are the settings' names, so ``trajectory_changes`` can name a changed one as the user
    writes it (``train.lr``)."""
    selected: dict[str, Any] = {}
    for name, field in type(section).model_fields.items():
        mark = marker(field)
        value = getattr(section, name)
        if mark is None or mark.omitted(value, section):
            continue
        if mark.hashed_as is not None:
            value = mark.hashed_as(value)
        selected[name] = trajectory_of(value) if isinstance(value, BaseModel) else value
    derived = getattr(section, "derived_trajectory", None)
    if derived is not None:
        selected.update(derived())
    # Through JSON once, keys sorted: what run.json records is exactly what the fingerprint hashes.
    return json.loads(json.dumps(selected, sort_keys=True, default=str))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"lr": 1}}`` → ``{"train.lr": 1}`` (lists and scalars are leaves)."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):  # an empty section has no keys to name
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


_UNSET = object()


def _shown(value: Any) -> str:
    """A value as a user would type it in ``-S``: ``0.003``, ``'file'``, ``[a, b]``; ``(unset)``
    for a key one side does not have."""
    if value is _UNSET:
        return "(unset)"
    return repr(value) if isinstance(value, str) else json.dumps(value)


def trajectory_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``["train.lr 0.003 → 0.002", ...]``: each trajectory key whose value differs, sorted.

    Why: a refusal that names fingerprints tells the user nothing they can act on; the keys and
    both values say at once whether the change was meant (and what to undo otherwise)."""
    a, b = _flatten(old), _flatten(new)
    return [
        f"{key} {_shown(a.get(key, _UNSET))} → {_shown(b.get(key, _UNSET))}"
        for key in sorted(a.keys() | b.keys())
        if a.get(key, _UNSET) != b.get(key, _UNSET)
    ]
