"""numpy's global generator read fast (training/numpy_rng.py): ``np.random.get_state()``'s values
in every state a run can leave it in, or ``get_state`` itself (rule 1)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from training import numpy_rng
from training.state import capture_rng, restore_rng


def _set(has_gauss: int, gauss: float) -> Callable[[], Any]:
    return lambda: np.random.set_state(("MT19937", np.arange(624, dtype=np.uint32), 17, has_gauss, gauss))


MOVES: list[tuple[str, Callable[[], Any]]] = [
    ("seeded", lambda: np.random.seed(1234)),
    ("uniform draws", lambda: np.random.rand(1000)),
    ("one normal: a second one cached", np.random.standard_normal),
    ("the cached normal taken", np.random.standard_normal),
    ("the key wrapped round (pos 624)", lambda: np.random.randint(0, 2**31, size=623)),
    ("set with a cached normal", _set(1, -3.25)),
    ("set without one, a stale value kept", _set(0, 0.5)),
    ("integers, shuffles", lambda: np.random.permutation(257)),
]


def test_the_fast_read_is_get_state_in_every_state_a_run_leaves() -> None:
    saved = np.random.get_state()
    try:
        assert numpy_rng._offsets() is not None  # this numpy: the probe found both fields
        for what, move in MOVES:
            move()
            fast, slow = numpy_rng.legacy_state(), np.random.get_state()
            assert numpy_rng.same(fast, slow), what
            assert not fast[1].flags.writeable  # a copy of the words, not a window onto them
            assert isinstance(fast[2], int) and isinstance(fast[3], int) and isinstance(fast[4], float)
    finally:
        np.random.set_state(saved)


def test_a_captured_state_restores_the_same_stream() -> None:
    saved = np.random.get_state()
    try:
        np.random.seed(7)
        np.random.standard_normal()  # a normal cached: the next draw takes it, no key words
        rng = capture_rng()
        expected = np.random.standard_normal(5)
        np.random.seed(99)
        restore_rng(rng)
        assert np.array_equal(np.random.standard_normal(5), expected)
    finally:
        np.random.set_state(saved)


@pytest.mark.parametrize("how", ["another bit generator", "the probe found nothing"])
@pytest.mark.filterwarnings("ignore:get_state and legacy can only be used")
def test_what_the_fast_read_cannot_vouch_for_takes_get_state(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if how == "another bit generator":
        generator = np.random.RandomState(np.random.PCG64(5))
        monkeypatch.setattr(np.random.mtrand, "_rand", generator)
        monkeypatch.setattr(np.random, "get_state", generator.get_state)
    else:
        monkeypatch.setattr(numpy_rng, "_offsets", lambda: None)
    calls: list[bool] = []
    real = np.random.get_state

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(np.random, "get_state", counted)
    got = numpy_rng.legacy_state()
    assert calls == [True]  # numpy's own answer, whatever it is (a dict, and a warning, for PCG64)
    if how == "the probe found nothing":
        assert numpy_rng.same(got, real())
