"""Split a nested state tree into (flat tensors, pure-JSON skeleton) and join it back.

This is how convoy avoids pickle entirely: tensors go to safetensors, everything else must be
plain JSON (str/int/float/bool/None, lists, tuples, dicts).  Anything else raises at *save*
time, so an unsupported object is caught while the run is healthy rather than at restore.

Markers in the skeleton: ``{"__t__": key}`` a tensor, ``{"__nd__": key}`` a numpy array,
``{"__tuple__": [...]}`` a tuple, ``{"__map__": [[k, v], ...]}`` a dict with non-str keys
(optimizer state is keyed by int), ``{"__float__": "nan"}`` non-finite floats.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # imported by split_tree, which meets tensors: joining a tree needs none
    import torch

_MARKERS = ("__t__", "__nd__", "__tuple__", "__map__", "__float__")
_MARKER_SET = frozenset(_MARKERS)
_INT = frozenset((int,))
_PLAIN = frozenset((int, str, bool, type(None)))


def split_tree(tree: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    import torch

    tensors: dict[str, torch.Tensor] = {}

    def sub(path: str, key: object) -> str:
        return f"{path}.{key}" if path else str(key)

    def walk(node: Any, path: str) -> Any:
        kind = type(node)  # exact types first: the memory tier splits the state at every snapshot
        if (kind is dict or kind is OrderedDict) and all(type(k) is str for k in node) and _MARKER_SET.isdisjoint(node):
            # A module's state_dict is an OrderedDict.  Plain leaves are kept without a call (and
            # without the path a call would build): most of a scheduler's or a param group's.
            return {k: v if _plain(v) else walk(v, sub(path, k)) for k, v in node.items()}
        if kind is dict and all(type(k) is int for k in node):  # optimizer state, keyed by parameter index
            return {"__map__": [[k, walk(v, sub(path, k))] for k, v in node.items()]}
        if kind is int or kind is str or kind is bool or node is None:
            return node
        if isinstance(node, torch.Tensor):
            tensors[path] = node.detach() if node.requires_grad else node  # state_dict()'s are detached
            return {"__t__": path}
        if isinstance(node, np.ndarray):
            tensors[path] = torch.from_numpy(np.ascontiguousarray(node))
            return {"__nd__": path}
        if isinstance(node, bool | int | str):
            return node
        if isinstance(node, float):
            return node if math.isfinite(node) else {"__float__": repr(node)}
        if isinstance(node, np.integer | np.floating):
            return walk(node.item(), path)
        if isinstance(node, tuple | list) and set(map(type, node)) <= _INT:
            # Python's RNG state is 625 ints: the same skeleton as walking each, ~20x faster.
            return {"__tuple__": list(node)} if isinstance(node, tuple) else list(node)
        if isinstance(node, tuple):
            return {"__tuple__": [walk(v, sub(path, i)) for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [v if _plain(v) else walk(v, sub(path, i)) for i, v in enumerate(node)]
        if isinstance(node, dict):
            if all(isinstance(k, str) and k not in _MARKERS for k in node):
                return {k: walk(v, sub(path, k)) for k, v in node.items()}
            if all(isinstance(k, int | str) for k in node):
                return {"__map__": [[k, walk(v, sub(path, k))] for k, v in node.items()]}
        raise TypeError(
            f"cannot checkpoint {type(node).__name__} at {path or '<root>'}: only tensors, numpy "
            "arrays and JSON values are saved (no pickle)"
        )

    return walk(tree, prefix), tensors


def _plain(value: Any) -> bool:
    """Whether ``value`` is its own skeleton: an exact int, str, bool or None, or a finite float
    (``x - x`` is nan for an infinity and for nan).  A subclass (a numpy scalar, an IntEnum) is
    not: :func:`split_tree`'s walk decides for it."""
    kind = type(value)
    return kind in _PLAIN or (kind is float and value - value == 0)


def join_tree(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if "__t__" in node:
                return tensors[node["__t__"]]
            if "__nd__" in node:
                return tensors[node["__nd__"]].numpy()
            if "__tuple__" in node:
                return tuple(walk(v) for v in node["__tuple__"])
            if "__map__" in node:
                return {k: walk(v) for k, v in node["__map__"]}
            if "__float__" in node:
                return float(node["__float__"])
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(skeleton)


def tensor_refs(skeleton: Any) -> set[str]:
    """Tensor keys a JSON skeleton refers to (``__t__``/``__nd__`` markers)."""
    keys: set[str] = set()
    stack = [skeleton]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for marker in ("__t__", "__nd__"):
                if marker in node:
                    if not isinstance(node[marker], str):
                        raise ValueError(f"skeleton: bad tensor reference {node[marker]!r}")
                    keys.add(node[marker])
                    break
            else:
                stack.extend(node.values())
    return keys
