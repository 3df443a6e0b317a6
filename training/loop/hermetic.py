"""What may run inside the training process besides training (docs/architecture.md, invariant 12).

The generators convoy saves as training state — python's ``random``, numpy's global generator,
torch's CPU and CUDA generators — are process-wide: any code in the worker that draws from them
moves the saved state and the trajectory after it.  A library thread is the silent case: an HTTP
client's retry loop draws its backoff jitter from ``random`` while training runs (urllib3), so a
tracking server that is down for a few seconds changed a run's final checkpoint with every loss
still right.  So the worker runs no network client at all (metrics leave through
``metrics.jsonl``, shipped by the chunk task) and only the threads named here, none of which
draws a random number.

:func:`foreign_threads` is the check: the worker records the threads it ran at its end
(``worker_done``) and warns, once, when a thread of no known purpose is alive at a save — a
library a task imported that started one may be drawing from the generators."""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from training.events import Event, append_event

#: Thread names of the worker process and what each may touch.  None draws random numbers.
KNOWN_THREADS: dict[str, str] = {
    "MainThread": "training: the step, the data cursor, the generators (the only one that draws)",
    "convoy-heartbeat": "writes heartbeat/rank-<r>.json (atomic rename); reads the clock",
    "convoy-ckpt": "persists a snapshot taken by the main thread: writes checkpoints/, fsyncs, renames",
    "convoy-hash": "hashes the tensor bytes of a checkpoint being written",
    "convoy-memory": "copies a memory-tier snapshot the main thread took into its slot and hashes it",
    "convoy-lifeline": "a forked worker's wait for the flow's death (training.loop.lifeline): one poll, then SIGTERM",
    "QueueFeederThread": "multiprocessing queues of DataLoader workers: pickles and sends batches",
}
#: Threads started without a name, as Python names them (``Thread-7 (<target>)``), by target.
KNOWN_TARGETS: dict[str, str] = {
    "_pin_memory_loop": "torch DataLoader with pin_memory (CUDA): copies batches into pinned memory",
}
#: Thread-name prefixes torch.compile leaves in a process once inductor has compiled there: its
#: pool that runs the C++ builds and loads the kernels, and tqdm's monitor of its progress bars.
#: Neither draws a random number; known only once inductor compiled (``async_compile`` imported).
COMPILE_THREADS = ("ThreadPoolExecutor-", "tqdm_monitor")
#: Network clients whose retry loops draw from ``random``; none of them may be loaded in a worker.
NETWORK_CLIENTS = ("mlflow", "urllib3", "requests", "botocore", "httpx")
_UNNAMED = re.compile(r"Thread-\d+ \((?P<target>[^)]*)\)")


def thread_names() -> list[str]:
    """The names of the Python threads alive now, sorted."""
    return sorted(t.name for t in threading.enumerate())


def is_known(name: str, declared: tuple[str, ...] = ()) -> bool:
    """A thread of the worker's own (:data:`KNOWN_THREADS`, :data:`KNOWN_TARGETS`), or one whose
    name starts with a prefix the task's data declared (``convoy_threads`` of a stream adapter
    whose library's threads were audited, e.g. MosaicML's download pool)."""
    unnamed = _UNNAMED.fullmatch(name)
    return (
        name in KNOWN_THREADS
        or (unnamed is not None and unnamed["target"] in KNOWN_TARGETS)
        or name.startswith(declared)
    )


def declared_threads(train_data: object) -> tuple[str, ...]:
    """The thread-name prefixes a stream adapter declares its library runs (``convoy_threads``)."""
    return tuple(getattr(train_data, "convoy_threads", ()))


def foreign_threads(declared: tuple[str, ...] = ()) -> list[str]:
    """Threads alive now that are none of the worker's own: a library started them."""
    return [n for n in thread_names() if not is_known(n, declared)]


def loaded_network_clients() -> list[str]:
    """The network client libraries imported in this process (a worker must have none)."""
    return [name for name in NETWORK_CLIENTS if name in sys.modules]


class ThreadWatch:
    """Once per worker: warn (log line and ``foreign_threads`` event) when a thread of no known
    purpose runs beside training at a save (:func:`foreign_threads`): a library the task imported
    started it, and it may draw from the generators the checkpoint saves."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.warned = False

    def check(self, train_data: object, log: Callable[[str], None]) -> None:
        compiled = COMPILE_THREADS if "torch._inductor.async_compile" in sys.modules else ()
        foreign = foreign_threads(declared_threads(train_data) + compiled)
        if foreign and not self.warned:
            self.warned = True
            log(
                f"WARNING: thread(s) {', '.join(foreign)} run beside training; if they draw from random, "
                "numpy or torch generators the saved state differs from an uninterrupted run's"
            )
            append_event(self.run_dir, Event.FOREIGN_THREADS, rank=self.rank, threads=foreign)
