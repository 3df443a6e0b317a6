"""Failure kinds, and the rules that name a worker's own exit (exit code, output tail, audit events).

Why its own module: the kinds are the contract of docs/architecture.md "Worker ⇄ supervisor contract" and the
exit rules are unit-tested without running anything.  The liveness kinds (hang, dead, timeout, a
lost rank) are decided while watching, in :mod:`tasks.supervision.supervisor`.

``config``     exit 78 — configuration/data error, never retried.
``preempted``  exit 75 — SIGTERM from outside; the worker saved an emergency checkpoint.
``oom``        best effort: killed by SIGKILL (or exit 137) *and* the cgroup ``oom_kill`` counter
               rose during the attempt, or the output tail says "out of memory"/``MemoryError``.
``killed``     ended by a signal it did not raise itself (SIGKILL, SIGTERM, SIGINT, ...).
``crash``      any other non-zero exit, a fatal signal of its own (SIGSEGV/SIGABRT/SIGBUS/SIGFPE/
               SIGILL), or exit 0 without a committed checkpoint at the chunk's end step.
``diskfull``   exited non-zero and its last lines name ENOSPC ("No space left on device", errno
               28): free space or lower ``checkpoint.keep_last`` / ``max_bytes``; retried, since
               retention or an operator may have freed space meanwhile.
``hang``       alive and beating but no step progress for ``stall_s`` in phase ``train``, or stuck
               in a phase longer than its own limit (init/load: ``init_timeout_s``; eval: ``eval_timeout_s``;
               save and the exit after ``done``: ``save_timeout_s``).
``dead``       no heartbeat for ``timeout_s`` (a frozen or wedged process), or none at all within
               ``init_timeout_s`` of the start.
``timeout``    the attempt ran past the chunk deadline.
``repeated``   decided by the chunk task (:mod:`tasks.supervision.repeated`), not by one attempt: two consecutive
               attempts crashed at the same step with the same error and nothing trained in between.
               A bug, not a fault: never retried.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from training.event_records import EventLog, Preempted, WorkerConfigError
from training.events import EXIT_CONFIG, EXIT_PREEMPTED, FailureKind, WorkerSays

FAILURE_KINDS = tuple(FailureKind)
#: Kinds Prefect must never retry: the same input fails the same way.
NOT_RETRYABLE = frozenset({FailureKind.CONFIG, FailureKind.REPEATED})
#: Signals a process raises on itself when it crashes (as opposed to being killed from outside).
_CRASH_SIGNALS = {signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL}
_OOM_MARKERS = ("out of memory", "memoryerror", "cannot allocate memory")
_DISKFULL_MARKERS = ("no space left on device", "[errno 28]", "enospc")


@dataclass(frozen=True)
class Verdict:
    """A failed attempt, named: by the watch (a limit crossed, a rank gone) or by the worker's exit."""

    kind: FailureKind
    #: The failure in words ("no step progress for 20.3 s at step 45", "signal SIGKILL").
    reason: str
    #: Seconds from the failure to its detection (for an exit: an upper bound, the gap between
    #: the last poll that saw the worker running and the one that saw it gone).
    detected_after_s: float


def oom_kills() -> int | None:
    """cgroup v2 ``oom_kill`` counter (None where unavailable, e.g. cgroup v1 or no access)."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory.events.local"):
        try:
            for line in Path(path).read_text().splitlines():
                key, _, val = line.partition(" ")
                if key == "oom_kill":
                    return int(val)
        except (OSError, ValueError):
            continue
    return None


def classify_exit(returncode: int, tail: Sequence[str], oom_before: int | None, oom_after: int | None) -> FailureKind:
    """Failure kind of a worker that exited by itself with ``returncode`` (non-zero)."""
    if returncode == EXIT_CONFIG:
        return FailureKind.CONFIG
    if returncode == EXIT_PREEMPTED:
        return FailureKind.PREEMPTED
    oom_counter = oom_before is not None and oom_after is not None and oom_after > oom_before
    text = "\n".join(tail[-20:]).lower()
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) and oom_counter:
        return FailureKind.OOM
    if any(m in text for m in _OOM_MARKERS):
        return FailureKind.OOM
    if returncode > 0 and any(m in text for m in _DISKFULL_MARKERS):
        return FailureKind.DISKFULL
    if returncode < 0:
        return FailureKind.CRASH if -returncode in _CRASH_SIGNALS else FailureKind.KILLED
    if returncode > 128 and returncode - 128 in {int(s) for s in signal.Signals}:
        # A shell or launcher reporting its child's signal as 128+n.
        return FailureKind.CRASH if returncode - 128 in _CRASH_SIGNALS else FailureKind.KILLED
    return FailureKind.CRASH


def launcher_exit(run_dir: Path, returncode: int, tail: Sequence[str], since: float) -> int:
    """The exit that matters when torchrun stands between us and the ranks.

    torchrun exits 1 whatever its ranks did, so the ranks' own audit events decide first (a
    config error, an emergency checkpoint), then the "Root Cause" exit code in its failure report.
    """
    if returncode in (0, EXIT_CONFIG, EXIT_PREEMPTED):
        return returncode
    recent = [e for e in EventLog.read(run_dir).of(WorkerConfigError, Preempted) if e.time >= since]
    if any(isinstance(e, WorkerConfigError) for e in recent):
        return EXIT_CONFIG
    if any(isinstance(e, Preempted) for e in recent):
        return EXIT_PREEMPTED
    return _root_exitcode("\n".join(tail), returncode)


def _root_exitcode(report: str, returncode: int) -> int:
    """The exit code of the rank that failed first, from torchrun's failure report.

    torchrun names its "Root Cause" by a timestamp of one-second resolution, so a rank that was
    SIGKILLed and the survivors torchrun itself then SIGTERMed can tie, and the tie goes to the
    lowest rank: a survivor's SIGTERM. Where no rank was preempted (checked before this), a
    SIGTERM is torchrun's own doing, so any other failing exit in the report is the cause.
    """
    root = report[report.find("Root Cause") :] if "Root Cause" in report else report
    m = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    first = int(m.group(1)) if m else returncode
    if first != -signal.SIGTERM:
        return first
    others = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", report)]
    return next((c for c in others if c not in (0, -signal.SIGTERM)), first)


def config_message(tail: Sequence[str]) -> str:
    """The worker's one-line config message (it prints ``config error: ...`` last, on stderr)."""
    for line in reversed(tail):
        if line.startswith(WorkerSays.CONFIG_ERROR):
            return line
    return next((line for line in reversed(tail) if line.strip()), "configuration error (exit 78)")


def signame(returncode: int) -> str:
    try:
        return f"signal {signal.Signals(-returncode).name}" if returncode < 0 else f"exit code {returncode}"
    except ValueError:
        return f"signal {-returncode}"


def diskfull_message(tail: Sequence[str]) -> str:
    """One line for a full disk: the worker's own line naming ENOSPC, not its traceback."""
    line = next((x for x in reversed(tail) if any(m in x.lower() for m in _DISKFULL_MARKERS)), "")
    return f"disk full: {plain_error(line)[:300] or 'No space left on device'}"


#: ``training.checkpointing.store.CheckpointError: `` at the start of a traceback's last line.
_CLASS_PATH = re.compile(r"^\s*(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)(?=: )")
#: Lines a worker prints about its own progress (``[worker rank 0] ...``): never a failure's cause.
_CHATTER = re.compile(r"^\[(worker )?rank \d+\]")


#: Exceptions whose message says it all: their class name is dropped from a failure's text (any
#: other class, e.g. ``OutOfMemoryError: 2 GiB``, is the information and stays).
_SELF_EXPLAINING = re.compile(
    r"^(?:OSError|IOError|PermissionError|FileNotFoundError|CheckpointError|CheckpointRejected|ConfigError"
    r"|VersioningError): "
)
#: ``[Errno 28] `` in an OSError's text: the words after it say the same to a person.
_ERRNO = re.compile(r"\[Errno \d+\] ")


def plain_error(line: str) -> str:
    """A traceback's last line as a person reads it: no module path, no class name where the
    message says it all, no errno number —
    ``training.checkpointing.store.CheckpointError: save failed: [Errno 28] No space left``
    → ``save failed: No space left``."""
    text = _CLASS_PATH.sub(r"\1", line.strip())
    return _ERRNO.sub("", _SELF_EXPLAINING.sub("", text))


#: Where torchrun's failure report names the rank that failed first (its banner follows).
_ROOT_CAUSE = "Root Cause (first observed failure):"
_FIELD = re.compile(r"^\s*(rank|exitcode|traceback)\s*:\s*(.*)$")


def launcher_error(tail: Sequence[str]) -> str | None:
    """``rank 1: ValueError: bad shape``: torchrun's "Root Cause" report, read as a person would
    (the rank that failed first and its exception's last line, from the traceback the worker's
    ``@record`` left; its exit or signal where it left none); None without such a report."""
    lines = list(tail)
    starts = [i for i, line in enumerate(lines) if _ROOT_CAUSE in line]
    if not starts:
        return None
    section = lines[starts[-1] + 1 :]
    end = next((i for i, line in enumerate(section) if line.strip().startswith("====")), len(section))
    fields: dict[str, str] = {}
    last = ""
    for line in section[:end]:
        if m := _FIELD.match(line):
            fields.setdefault(m.group(1), m.group(2).strip())
        if line.strip():
            last = line.strip()
    rank = fields.get("rank", "?").split(" ")[0]
    traceback = fields.get("traceback", "")
    if traceback and not traceback.startswith("To enable traceback"):
        return f"rank {rank}: {plain_error(last.removeprefix('traceback :').strip())}"
    try:
        return f"rank {rank}: {signame(int(fields.get('exitcode', '').split(' ')[0]))}"
    except ValueError:
        return f"rank {rank}: failed (the launcher's report names no exit code)"


def error_line(tail: Sequence[str]) -> str | None:
    """The line in a crashed worker's last output that says why it ended (a traceback's last
    line, a fatal message), without module paths; under torchrun, the first failed rank's
    (:func:`launcher_error`), never the launcher's banner; None when its last words are only its
    own progress lines, which would name something unrelated."""
    if (from_launcher := launcher_error(tail)) is not None:
        return from_launcher
    for line in reversed(tail):
        text = line.strip()
        if not text or text.startswith("# convoy"):
            continue
        return None if _CHATTER.match(text) else plain_error(text)
    return None
