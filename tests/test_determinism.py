"""CPU determinism flags: a worker pins its thread count and turns MKL's dynamic threading off.

MKL (torch's CPU BLAS) starts with dynamic threading on and may run a GEMM on fewer threads
than asked, which changes the last bits; a resumed run on a busy machine could then leave the
uninterrupted trajectory.  Checked in a fresh interpreter: the MKL setting is process-global.
"""

from __future__ import annotations

import os
import subprocess
import sys

PROBE = """
import ctypes, os, sys, torch
from training.state import configure_determinism
mkl = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
threads = torch.get_num_threads()
before = mkl.mkl_serv_get_dynamic()
configure_determinism(sys.argv[1] == "on", torch.device("cpu"))
print(before, mkl.mkl_serv_get_dynamic(), threads, torch.get_num_threads())
"""


def _probe(mode: str) -> list[int]:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # several threads: where MKL's dynamic mode matters
    cmd = [sys.executable, "-c", PROBE, mode]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True, env=env)
    return [int(x) for x in out.stdout.split()]


def test_deterministic_runs_turn_mkl_dynamic_threading_off_and_keep_the_thread_count() -> None:
    before, after, threads, threads_after = _probe("on")
    assert before == 1, "MKL's default changed: this test no longer shows the fix"
    assert after == 0 and threads_after == threads


def test_non_deterministic_runs_leave_mkl_alone() -> None:
    before, after, threads, threads_after = _probe("off")
    assert before == after == 1 and threads_after == threads
