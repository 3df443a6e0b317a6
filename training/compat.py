"""Runs written by earlier releases: what a trajectory setting they did not have means.

A run outlives releases.  When a release adds a trajectory setting whose value is not omitted at
its default (``Trajectory(omit_at=...)`` covers most), every older run's recorded trajectory lacks
the key, and a plain comparison would refuse the run although nothing it trained with changed.
Each such setting is declared here, as data: the value that reproduces what releases before it
did (``before``), and whether this release still behaves that way for a given config.

Invariants (docs/compatibility.md states the policy for users):

1. A key an older run's trajectory lacks, and that is declared here, reads as ``before``.
2. Where this release still behaves as ``before`` for the config (the setting has no effect on
   it), the key reads as today's value: the run continues, and nothing about it is refused.
3. Where it does not, the key stays ``before``, so the comparison names the change
   (``data.generator 1 → 2``) and :func:`continuation_hint` says what continues the run.
4. A key that is not declared here is never read as anything: a run lacking it is refused as a
   change of settings, as before this module existed.
5. A run whose ``run.json`` recorded no trajectories predates every setting declared here, so its
   trajectory re-derived from ``config.json`` drops these keys (:func:`as_written_before`).

Imports only ``training.config`` and ``training.trajectory``: no torch, used on the CLI path.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from training.config import RunConfig

#: The tasks that read convoy's synthetic corpus (``training.datapipe.corpus.load_corpus``); for any other
#: task the corpus generator has no effect.  tests/test_release_gate.py checks the list against
#: every example that calls ``load_corpus``.
CORPUS_READERS = (
    "training.examples.char_gpt:build",
    "training.examples.hf_causal_lm:build",
    "training.examples.hf_stream:build",
)


@dataclass(frozen=True)
class LaterSetting:
    """A trajectory key added by a release, and what its absence means in an older run."""

    #: ``section.name`` as the user writes it.
    key: str
    #: The release that added it, as a user can check it out.
    since: str
    #: The value that reproduces what the releases before it did.
    before: Any
    #: Whether this release still behaves as ``before`` for ``config`` (the key has no effect).
    honoured: Callable[[RunConfig], bool]
    #: What continues an older run where it is not honoured (one clause).
    continue_with: str


LATER_SETTINGS = (
    LaterSetting(
        key="data.generator",
        since="2026-12-02 (25f4ad6)",
        before=1,
        honoured=lambda config: config.data.source != "synthetic" or config.task not in CORPUS_READERS,
        continue_with=(
            "this release no longer generates corpus 1; continue the run with a release before "
            "2026-12-02 (git checkout e96280b), or train a new run (`-S run_name=<new name>`)"
        ),
    ),
)


_ABSENT = object()


def _get(tree: dict[str, Any], key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def _set(tree: dict[str, Any], key: str, value: Any) -> None:
    *sections, name = key.split(".")
    node = tree
    for part in sections:
        node = node.setdefault(part, {})
    node[name] = value


def _drop(tree: dict[str, Any], key: str) -> None:
    *sections, name = key.split(".")
    node: Any = tree
    for part in sections:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(name, None)


def read_as_today(old: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """``old`` (a recorded trajectory) with every declared later key it lacks filled in: today's
    value where this release still behaves as ``before`` for ``config`` (invariant 2), else
    ``before`` (invariant 3)."""
    today = config.trajectory()
    read = copy.deepcopy(old)
    for setting in LATER_SETTINGS:
        if _get(old, setting.key) is not _ABSENT or _get(today, setting.key) is _ABSENT:
            continue
        _set(read, setting.key, _get(today, setting.key) if setting.honoured(config) else setting.before)
    return read


def continuation_hint(old: dict[str, Any], config: RunConfig) -> str | None:
    """What continues a run of trajectory ``old`` that a declared later key stops (invariant 3)."""
    today = config.trajectory()
    for setting in LATER_SETTINGS:
        lacked = _get(old, setting.key) is _ABSENT and _get(today, setting.key) is not _ABSENT
        if lacked and not setting.honoured(config):
            return f"{setting.key} was added in {setting.since}; {setting.continue_with}"
    return None


def as_written_before(trajectory: dict[str, Any]) -> dict[str, Any]:
    """A trajectory re-derived by this release from an old run's ``config.json``, minus the keys
    the release that wrote it did not have (invariant 5)."""
    out = copy.deepcopy(trajectory)
    for setting in LATER_SETTINGS:
        _drop(out, setting.key)
    return out
