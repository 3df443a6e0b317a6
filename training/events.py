"""Append-only audit log ``runs/<name>/events.jsonl`` (failures, detections, resumes, skips).

One JSON object per line, appended with O_APPEND in a single write so concurrent writers
(worker, supervisor, hooks) never interleave inside a line.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from training.paths import EVENTS_FILE, RunPaths  # noqa: F401 - EVENTS_FILE re-exported


def append_event(run_dir: str | Path, kind: str, **fields: Any) -> dict[str, Any]:
    record = {"time": round(time.time(), 3), "kind": kind, **fields}
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    path = RunPaths(run_dir).events
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return record


def read_events(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    path = RunPaths(run_dir).events
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line after a crash; the rest of the log stays readable
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out
