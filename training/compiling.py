"""Compiled models (``torch.compile``): as a setting (``train.compile``) or as the task's own choice,
with the same state names as the plain model, a first step that is not called a hang, and a
compile cache that a killed compile cannot poison (issue 44, item 1).

Why each part:

* **Names.** ``torch.compile(module)`` wraps the module: its state dict gains ``_orig_mod.``, so a
  compiled run's checkpoints did not load into the plain class (nor a ``--from`` fork across the
  setting, nor the registered model).  ``nn.Module.compile()`` compiles the same call in place,
  without the wrapper: convoy uses it, and unwraps a factory's wrapper into it (rule 1).
* **Phase.**  The first step of a compiled model compiles it (26.5 s cold for a 2-layer Llama
  here, minutes for real models): longer than ``heartbeat.stall_s``, so the supervisor killed it
  as a hang.  That step runs in phase ``compile``, limited by ``heartbeat.compile_timeout_s``: a
  real hang while compiling is still caught, later.
* **Cache.**  A worker killed during the C++ build left a 0-byte ``.so`` in torch's shared
  inductor cache, and every retry died importing it.  Each worker compiles into a private cache
  directory of its own (seeded from the run's last published one), and publishes it once its
  compile step is done (rule 3): a killed compile's files are never read by another worker.

Rules:
1. A compiled module's state dict has the plain module's names: no ``_orig_mod.`` in checkpoints,
   exports or the registered model; compiling changes no saved state.
2. Compiling is a trajectory setting (``train.compile`` is hashed): inductor's kernels may sum in
   another order than eager, so a compiled run is bitwise equal to itself (resumed or not) but not
   to the eager run of the same config.
3. A published cache is complete (copied whole, then renamed into place); a private one is read
   by no other worker, and removed when its worker starts again or the next one publishes.
4. Inductor's probe of the CPU's vector instruction sets (a C++ build and a new interpreter that
   loads it, per set: most of a warm start's first step here) runs once per run and machine: its
   verdict travels with the cache (``vec-isa.json``), and where every set the CPU reports passed,
   each worker tells inductor so (``cpp.vec_isa_ok``) instead of probing again.  The setting is
   part of inductor's cache key, so the compiling worker sets it too: all pick the same set.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from training.events import Phase

#: Run-directory folder of the published compile caches and the workers' private ones.
CACHE_DIR = "compile-cache"
#: Published caches kept (the newest is seeded from; one older in case it is being copied).
KEEP = 2


def unwrap_compiled(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with every ``torch.compile`` wrapper (``OptimizedModule``) in it, itself included,
    replaced by the module it wraps, compiled in place with the same options (rule 1)."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(module, OptimizedModule):
        inner = module._orig_mod
        # What nn.Module.compile() does, with the wrapper's own compile context (its options).
        inner._compiled_call_impl = module.dynamo_ctx(inner._call_impl)
        return unwrap_compiled(inner)
    for name, child in list(module.named_children()):
        plain = unwrap_compiled(child)
        if plain is not child:
            setattr(module, name, plain)
    return module


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether any part of ``module`` is compiled (in place or wrapped)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return any(
        isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None for m in module.modules()
    )


def compile_model(model: torch.nn.Module, how: str, units: list[torch.nn.Module]) -> None:
    """``train.compile``: ``model`` compiles the whole model's call, ``units`` each of ``units``
    (e.g. the decoder layers: smaller graphs, one compile shared by identical layers)."""
    if how == "model":
        model.compile()
    elif how == "units":
        for unit in units:
            unit.compile()


class CompileCache:
    """This worker's private inductor cache under ``run_dir/compile-cache`` (rule 3)."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.root = run_dir / CACHE_DIR
        self.private = self.root / f"worker-{rank}-{os.getpid()}"  # a standby beside a worker has its own
        self.rank = rank

    def open(self, cpu: bool = True) -> Path:
        """Point torch's caches here (``TORCHINDUCTOR_CACHE_DIR``; Triton's lives under it), seeded
        from the newest published cache.  Called before anything compiles; removes the private
        caches of workers that are gone (a killed compile's files: never read, rule 3)."""
        for other in self.root.glob("worker-*") if self.root.is_dir() else []:
            if not _alive(int(other.name.rsplit("-", 1)[1])):
                shutil.rmtree(other, ignore_errors=True)
        newest = self._published()
        if newest:
            shutil.copytree(newest[-1], self.private, symlinks=True)
        self.private.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.private)
        if cpu:  # C++ kernels: inductor probes the CPU's vector sets (rule 4)
            settle_vec_isa(self.private / ISA_FILE)
        return self.private

    def publish(self) -> Path | None:
        """Rank 0's private cache, copied whole, renamed into place (rule 3); older ones pruned."""
        if self.rank != 0 or not self.private.is_dir():
            return None
        final = self.root / f"published-{time.time_ns():020d}"
        staging = self.root / f".staging-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(self.private, staging, symlinks=True)
        staging.rename(final)
        for old in self._published()[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _published(self) -> list[Path]:
        return sorted(self.root.glob("published-*")) if self.root.is_dir() else []


#: Inductor's vector-ISA verdict, beside the cache it compiled (rule 4).
ISA_FILE = "vec-isa.json"


def settle_vec_isa(path: Path) -> bool:
    """Rule 4: the verdict recorded at ``path`` for this torch and CPU, probed (and recorded) where
    there is none; True when inductor was told every vector set the CPU reports works."""
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa as isa

    if platform.machine() not in ("x86_64", "AMD64") or inductor_config.cpp.vec_isa_ok is not None:
        return False  # elsewhere inductor's own list has no probe to spare; a user's setting wins
    flags = isa.x86_isa_checker()
    # What inductor lists with the probe skipped: every set whose flags the CPU reports.
    plain = [str(s) for s in isa.supported_vec_isa_list if all(f in flags for f in str(s).split())]
    machine = {"torch": torch.__version__, "flags": flags, "plain": plain}
    try:
        recorded = json.loads(path.read_text())
    except (OSError, ValueError):
        recorded = {}
    if {k: recorded.get(k) for k in machine} != machine:
        recorded = {**machine, "probed": [str(s) for s in isa.valid_vec_isa_list()]}  # inductor's own probe
        path.write_text(json.dumps(recorded))
    if recorded["probed"] != plain:
        return False  # a set failed its probe here: inductor probes each time, as without convoy
    inductor_config.cpp.vec_isa_ok = True
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FirstStep:
    """A compiled model's first step in this worker: run in phase ``compile`` (its own heartbeat
    limit), the private cache published after it (rule 3).  Later steps pass straight through."""

    def __init__(self, cache: CompileCache) -> None:
        self.cache = cache
        self.pending = True

    @classmethod
    def for_model(cls, model: torch.nn.Module, run_dir: Path, rank: int) -> FirstStep | None:
        """None for an eager model; else the cache opened before anything compiles."""
        if not is_compiled(model):
            return None
        cache = CompileCache(run_dir, rank)
        cache.open(cpu=next(model.parameters(), torch.empty(0)).device.type == "cpu")
        return cls(cache)

    @contextlib.contextmanager
    def phase(self, set_phase: Callable[..., object]) -> Iterator[None]:
        """Around a step: the first one under ``compile`` (``set_phase(phase=...)``), then published."""
        if not self.pending:
            yield
            return
        set_phase(phase=Phase.COMPILE)
        try:
            yield
        finally:
            set_phase(phase=Phase.TRAIN)
        self.pending = False
        self.cache.publish()
