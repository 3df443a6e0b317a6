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

import sys
import threading

#: Thread names of the worker process and what each may touch.  None draws random numbers.
KNOWN_THREADS: dict[str, str] = {
    "MainThread": "training: the step, the data cursor, the generators (the only one that draws)",
    "convoy-heartbeat": "writes heartbeat/rank-<r>.json (atomic rename); reads the clock",
    "convoy-ckpt": "persists a snapshot taken by the main thread: writes checkpoints/, fsyncs, renames",
    "convoy-hash": "hashes the tensor bytes of a checkpoint being written",
    "pin_memory": "torch DataLoader (pin_memory on CUDA): copies batches to pinned memory",
    "QueueFeederThread": "multiprocessing queues of DataLoader workers: pickles and sends batches",
}
#: Prefixes of names that threads of the Python runtime and torch get (numbered by the runtime).
_KNOWN_PREFIXES = ("Thread-", "pt_", "ThreadPoolExecutor-")
#: Network clients whose retry loops draw from ``random``; none of them may be loaded in a worker.
NETWORK_CLIENTS = ("mlflow", "urllib3", "requests", "botocore", "httpx")


def thread_names() -> list[str]:
    """The names of the Python threads alive now, sorted."""
    return sorted(t.name for t in threading.enumerate())


def foreign_threads() -> list[str]:
    """Threads alive now that are not the worker's own: none of :data:`KNOWN_THREADS`, nor a
    runtime-numbered one (``Thread-3 (target)``: checked by the caller that started it)."""
    return [n for n in thread_names() if n not in KNOWN_THREADS and not n.startswith(_KNOWN_PREFIXES)]


def loaded_network_clients() -> list[str]:
    """The network client libraries imported in this process (a worker must have none)."""
    return [name for name in NETWORK_CLIENTS if name in sys.modules]
