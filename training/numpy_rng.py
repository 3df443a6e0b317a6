"""numpy's global generator's state, as ``np.random.get_state()`` gives it, read in microseconds.

Why: a checkpoint holds every RNG (invariant 2), and the memory tier captures them after every
step.  ``np.random.get_state()`` costs 70-100 µs (its Mersenne Twister getter copies the 624
words of the key one Python call at a time), a third of the Python a snapshot spends on the
loop's thread.  The same words are read here through the bit generator's documented ctypes
interface (``MT19937.ctypes.state_address``: numpy's ``mt19937_state``, the key then ``pos``),
and the legacy generator's cached normal (``has_gauss``, ``gauss``), which numpy exposes only
through ``get_state``, from the generator object's own memory at offsets found by a probe.

Rules (numbered; cited in code and tests):

1. **The same values or the slow path.**  The probe sets two known states on a private
   ``RandomState`` and finds the one place each field is; it then reads back three more states
   and compares them with ``get_state``'s.  A probe that finds nothing, or more than one place,
   or reads one value wrong, turns the fast read off for the process: :func:`legacy_state` calls
   ``np.random.get_state()``, as does a global generator that is not numpy's own
   ``RandomState`` over ``MT19937`` (replaced by a test or a library).
2. **Read, never written.**  The fast path copies the words out; restoring goes through
   ``np.random.set_state`` as before.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from typing import Any

import numpy as np

#: numpy's ``mt19937_state``: ``uint32_t key[624]; int pos``.
_KEY_WORDS = 624
_POS_OFFSET = _KEY_WORDS * 4
#: A cached normal no state of a run will hold by chance (rule 1's probe looks for its bytes).
_MARK = -0.7071067811865476 * 3.141592653589793


@functools.cache
def _offsets() -> tuple[int, struct.Struct] | None:
    """Where a ``RandomState`` keeps ``has_gauss`` (a C int) and, after it, ``gauss`` (a double),
    from the object's address: (offset, how to unpack both); None where the probe cannot tell
    (rule 1)."""
    probe = np.random.RandomState(0)
    size = type(probe).__basicsize__
    key = np.arange(_KEY_WORDS, dtype=np.uint32)

    def image(has_gauss: int, gauss: float) -> bytes:
        probe.set_state(("MT19937", key, 3, has_gauss, gauss))
        return ctypes.string_at(id(probe), size)

    on, off = image(1, _MARK), image(0, 0.0)
    flags = [i for i in range(0, size - 3) if on[i : i + 4] == (1).to_bytes(4, "little") and off[i : i + 4] == bytes(4)]
    marks = [i for i in range(size - 7) if on[i : i + 8] == struct.pack("d", _MARK)]
    if len(flags) != 1 or len(marks) != 1 or marks[0] < flags[0] + 4:
        return None
    found = (flags[0], struct.Struct(f"=i{marks[0] - flags[0] - 4}xd"))
    for has_gauss, gauss in ((1, -2.5), (0, 7.75), (1, 1e-300)):
        probe.set_state(("MT19937", key, 5, has_gauss, gauss))
        if not same(_read(probe, found), probe.get_state()):
            return None
    return found


def same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Whether two legacy states are equal, field by field (the key as an array)."""
    return (
        len(a) == len(b) == 5
        and a[0] == b[0]
        and np.array_equal(a[1], b[1])
        and a[2:4] == b[2:4]
        and struct.pack("d", a[4]) == struct.pack("d", b[4])
    )


def legacy_state() -> tuple[str, np.ndarray, int, int, float]:
    """``np.random.get_state()`` of the global generator (rule 1)."""
    generator = np.random.mtrand._rand
    offsets = _offsets() if type(generator) is np.random.RandomState else None
    if offsets is None or type(generator._bit_generator) is not np.random.MT19937:
        return np.random.get_state()
    return _read(generator, offsets)


def _read(generator: Any, offsets: tuple[int, struct.Struct]) -> tuple[str, np.ndarray, int, int, float]:
    """``generator``'s state, copied out of its memory (rule 2): two copies of bytes, few calls
    (a snapshot runs right after a step, whose working set has pushed these code paths out of
    the caches: each call costs there several times what it costs in a loop of its own)."""
    words = ctypes.string_at(generator._bit_generator.ctypes.state_address, _POS_OFFSET + 4)
    start, aug = offsets
    has_gauss, gauss = aug.unpack(ctypes.string_at(id(generator) + start, aug.size))
    key = np.frombuffer(words, dtype=np.uint32, count=_KEY_WORDS)  # over its own bytes: read-only
    return "MT19937", key, int.from_bytes(words[_POS_OFFSET:], "little", signed=True), has_gauss, gauss
