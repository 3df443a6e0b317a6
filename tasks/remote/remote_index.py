"""A run's place in the DVC remote: the index of its uploaded checkpoints, beside DVC's objects.

Why: DVC stores a checkpoint content-addressed (``files/md5/…``; a directory is a ``.dir``
object listing its files), so the data is findable only through its hash, which lives in a
``.dvc`` file that someone would have to commit and push with git before another machine could
pull it.  The index is the missing link: a machine that has only the git repository (the params
and the code, as committed before training started) computes the run's name and fingerprint,
reads the index and finds the newest uploaded checkpoint, with no git commit in between.

Layout, under the remote's URL (a directory or ``s3://bucket/prefix``), next to DVC's ``files/``::

    convoy/runs/<run name>/<fingerprint>/index.json
        {"format": 1, "run": <run name>, "fingerprint": <16 hex>,
         "checkpoints": [{"step", "digest", "dvc_md5" (<md5>.dir), "bytes", "nfiles",
                          "fingerprint" (of the manifest), "node", "uploaded" (unix time)}, ...],
         "metrics": [{"from", "through", "object": "metrics/<through:09d>.jsonl"}, ...]}
    convoy/runs/<run name>/<fingerprint>/metrics/<through:09d>.jsonl
        the run's ``metrics.jsonl`` rows of steps (previous through, through]

Consistency: the index is written last, after every object of the checkpoint (its files and
its ``.dir`` listing) and the metric rows are in the remote, and it is replaced whole: a local
directory through a temporary file and a rename, an object store with one PUT (atomic there).
So a reader sees the previous index or the next one, and an upload killed half-way leaves
objects no index names: never a half-uploaded checkpoint that looks valid.  One writer per run at
a time (the node training it); entries are only ever added.

The metric rows travel with the checkpoints so that the node that resumes a run has the
history up to its checkpoint: its metric shipper sends the points the failed node had not sent
(``tasks/records/metric_shipping.py``), keeping exactly one point per (metric, step).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from training.fsutil import atomic_write_bytes

INDEX_FORMAT = 1
INDEX_NAME = "index.json"
#: Where convoy's files live in a DVC remote (DVC's own objects are under ``files/``).
REMOTE_DIR = "convoy/runs"


class RemoteCopyRefused(Exception):
    """A remote copy of a checkpoint that must not be installed (an unsafe listing, a digest that is
    not the one the index recorded).  Its own type so that only this, a rejection by the store and
    missing objects make a fetch try the next older copy; a bug is not mistaken for a bad copy."""


def node_name() -> str:
    """This machine as the index and the events name it: ``$CONVOY_NODE``, else the host name."""
    return os.environ.get("CONVOY_NODE") or os.uname().nodename


@dataclass(frozen=True)
class IndexEntry:
    """One uploaded checkpoint in the index (the JSON keys above)."""

    step: int
    digest: str
    #: DVC's hash of the checkpoint's directory (``<md5>.dir``): how its files are found.
    dvc_md5: str
    bytes: int = 0
    nfiles: int = 0
    #: The fingerprint its manifest records.
    fingerprint: str | None = None
    node: str | None = None
    uploaded: float = 0.0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> IndexEntry:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class MetricSegment:
    """The metric rows of steps ``first``..``through`` (JSON ``from``/``through``), in ``object``."""

    first: int
    through: int
    object: str

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MetricSegment:
        return cls(int(data["from"]), int(data["through"]), str(data["object"]))

    def to_json(self) -> dict[str, Any]:
        return {"from": self.first, "through": self.through, "object": self.object}


@dataclass(frozen=True)
class RemoteIndex:
    """A run's ``index.json`` (layout above): its uploaded checkpoints in step order and the
    segments of its metric rows.  Read and written whole (keys as on disk)."""

    run: str
    fingerprint: str
    checkpoints: tuple[IndexEntry, ...] = ()
    metrics: tuple[MetricSegment, ...] = ()
    updated: float | None = None
    format: int = INDEX_FORMAT

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RemoteIndex:
        if not isinstance(data.get("checkpoints"), list):
            raise ValueError("no 'checkpoints' list")
        return cls(
            str(data.get("run", "")),
            str(data.get("fingerprint", "")),
            tuple(IndexEntry.from_json(e) for e in data["checkpoints"]),
            tuple(MetricSegment.from_json(m) for m in data.get("metrics") or []),
            data.get("updated"),
            int(data.get("format", INDEX_FORMAT)),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": self.format, "run": self.run, "fingerprint": self.fingerprint}
        out["checkpoints"] = [e.to_json() for e in self.checkpoints]
        out["metrics"] = [m.to_json() for m in self.metrics]
        if self.updated is not None:
            out["updated"] = self.updated
        return out

    def newest(self) -> IndexEntry | None:
        return max(self.checkpoints, key=lambda e: e.step, default=None)


@dataclass
class RemoteRun:
    """One run's files in one DVC remote: ``fs`` is the remote's file system (DVC's, so a local
    directory, S3 or any DVC remote), ``odb`` its content-addressed object store, ``root`` the
    run's folder (:data:`REMOTE_DIR`), ``label`` how messages name the remote."""

    fs: Any
    odb: Any
    root: str
    label: str
    run_name: str
    fingerprint: str

    @classmethod
    def of(cls, remote: Any, label: str, run_name: str, fingerprint: str) -> RemoteRun:
        """From DVC's ``Remote`` (``repo.cloud.get_remote(name)``)."""
        root = remote.fs.join(remote.path, *REMOTE_DIR.split("/"), run_name, fingerprint)
        return cls(remote.fs, remote.odb, root, label, run_name, fingerprint)

    def path(self, rel: str) -> str:
        return self.fs.join(self.root, *rel.split("/"))

    def read_index(self) -> RemoteIndex:
        """The run's index (an empty one if nothing was uploaded yet).  A damaged index is an
        error naming it: guessing the newest checkpoint from the objects would be exactly what
        the index exists to avoid."""
        path = self.path(INDEX_NAME)
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            return RemoteIndex(self.run_name, self.fingerprint)
        try:
            return RemoteIndex.from_json(json.loads(raw))
        except (ValueError, AttributeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path} in {self.label} is not a convoy index ({exc})") from None

    def put(self, rel: str, data: bytes) -> None:
        """Write one file of the run's folder whole: a reader sees all of it or the old one."""
        path = self.path(rel)
        if self.fs.protocol == "local":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(Path(path), data)  # temp file + fsync + rename
            return
        self.fs.makedirs(self.fs.parent(path), exist_ok=True)
        self.fs.pipe_file(path, data)  # one PUT: atomic on an object store

    def get(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def write_index(self, index: RemoteIndex) -> None:
        self.put(INDEX_NAME, (json.dumps(index.to_json(), indent=1, sort_keys=True) + "\n").encode())

    def download(self, dvc_md5: str, dest: Path) -> int:
        """Copy the files of the checkpoint whose DVC directory hash is ``dvc_md5`` into
        ``dest`` (created), straight from the remote's objects (no DVC cache, so a corrupt object
        never settles in one); returns the bytes copied.  A missing object is FileNotFoundError."""
        from dvc_data.hashfile.hash_info import HashInfo
        from dvc_data.hashfile.tree import Tree

        tree = Tree.load(self.odb, HashInfo("md5", dvc_md5))
        sources, targets = [], []
        for key, _meta, hash_info in tree:
            if any(part in ("", ".", "..") or "/" in part for part in key):
                raise RemoteCopyRefused(f"{dvc_md5} lists {'/'.join(key)!r}: not a plain path (refused)")
            target = dest.joinpath(*key)
            target.parent.mkdir(parents=True, exist_ok=True)
            sources.append(self.odb.oid_to_path(hash_info.value))
            targets.append(str(target))
        dest.mkdir(parents=True, exist_ok=True)
        if self.fs.protocol == "local":  # a kernel copy: DVC's own goes through Python in 64 MiB reads
            for source, target in zip(sources, targets, strict=True):
                shutil.copyfile(source, target)
        elif sources:
            self.fs.get(sources, targets)
        return sum(Path(t).stat().st_size for t in targets)


def entry_for(step: int, digest: str, out: Any, manifest: dict[str, Any]) -> IndexEntry:
    """The index entry of a checkpoint DVC just pushed (``out``: the ``.dvc`` file's output)."""
    meta = getattr(out, "meta", None)
    return IndexEntry(
        step=step,
        digest=digest,
        dvc_md5=out.hash_info.value,
        bytes=int(getattr(meta, "size", 0) or 0),
        nfiles=int(getattr(meta, "nfiles", 0) or 0),
        fingerprint=manifest.get("fingerprint"),
        node=node_name(),
        uploaded=round(time.time(), 3),
    )


def publish(run: RemoteRun, entry: IndexEntry, metric_rows: list[tuple[int, dict[str, float]]]) -> bool:
    """Add ``entry`` to the run's index, after the metric rows not uploaded yet; False (nothing
    written) when the index already lists that step with that digest."""
    index = run.read_index()
    if any(e.step == entry.step and e.digest == entry.digest for e in index.checkpoints):
        return False
    through = max((m.through for m in index.metrics), default=0)
    rows = [(s, m) for s, m in metric_rows if through < s <= entry.step]
    segments = index.metrics
    if rows:
        rel = f"metrics/{entry.step:09d}.jsonl"
        run.put(rel, "".join(json.dumps({"step": s, "metrics": m}, sort_keys=True) + "\n" for s, m in rows).encode())
        segments = (*segments, MetricSegment(rows[0][0], entry.step, rel))
    others = [e for e in index.checkpoints if e.step != entry.step]
    checkpoints = tuple(sorted([*others, entry], key=lambda e: e.step))
    run.write_index(replace(index, checkpoints=checkpoints, metrics=segments, updated=entry.uploaded))  # last
    return True


def metric_rows_through(run: RemoteRun, index: RemoteIndex, step: int) -> list[tuple[int, dict[str, float]]]:
    """The uploaded metric rows of steps up to ``step``, in step order (first value of a step wins)."""
    rows: dict[int, dict[str, float]] = {}
    for segment in sorted(index.metrics, key=lambda m: m.first):
        if segment.first > step:
            continue
        for line in run.get(segment.object).decode().splitlines():
            rec = json.loads(line)
            if int(rec["step"]) <= step:
                rows.setdefault(int(rec["step"]), {k: float(v) for k, v in rec["metrics"].items()})
    return sorted(rows.items())
