"""The checkpoint codec (training/checkpointing/codec.py): a state tree split into JSON and
tensors and joined back, every leaf kind the walk meets, through its fast path for plain leaves."""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import orjson
import pytest
import torch

from training.checkpointing.codec import join_tree, split_tree


def test_every_leaf_kind_round_trips_with_its_marker() -> None:
    tree = {
        "floats": {"finite": 0.25, "inf": math.inf, "ninf": -math.inf, "nan": math.nan},
        "list": [1, 2.5, math.inf, None, True, "s", [3, -math.inf]],
        "tuple": (0.9, 0.95),
        "ints": list(range(625)),
        "by_index": {0: {"step": torch.tensor(3.0)}, 1: {}},
        "module": OrderedDict(weight=torch.ones(2, 3)),
        "array": np.arange(4, dtype=np.int64),
        "np_scalar": np.int64(7),
    }
    skeleton, tensors = split_tree(tree)
    assert skeleton["floats"] == {
        "finite": 0.25,
        "inf": {"__float__": "inf"},
        "ninf": {"__float__": "-inf"},
        "nan": {"__float__": "nan"},
    }
    assert skeleton["list"] == [1, 2.5, {"__float__": "inf"}, None, True, "s", [3, {"__float__": "-inf"}]]
    assert skeleton["tuple"] == {"__tuple__": [0.9, 0.95]} and skeleton["np_scalar"] == 7
    assert sorted(tensors) == ["array", "by_index.0.step", "module.weight"]
    orjson.dumps(skeleton)  # plain JSON throughout
    back = join_tree(orjson.loads(orjson.dumps(skeleton)), tensors)
    assert back["floats"]["inf"] == math.inf and math.isnan(back["floats"]["nan"])
    assert back["list"][2] == math.inf and back["list"][6][1] == -math.inf
    assert back["tuple"] == (0.9, 0.95) and back["ints"] == list(range(625))
    assert torch.equal(back["by_index"][0]["step"], torch.tensor(3.0))
    assert np.array_equal(back["array"], np.arange(4))


def test_what_is_not_json_is_refused_at_save_time() -> None:
    with pytest.raises(TypeError, match=r"cannot checkpoint object at a\.b"):
        split_tree({"a": {"b": object()}})
