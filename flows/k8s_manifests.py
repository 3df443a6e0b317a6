"""Kubernetes manifests for a convoy run, rendered from its :class:`~training.config.RunConfig`.

Why rendered, not hand-written: what matters on a cluster is already in ``params.yaml`` and must
agree with it, or a fault is handled twice or not at all: the ranks per node are the GPUs a pod
asks for; ``heartbeat.grace_s`` (the worker's emergency-save budget after SIGTERM) sets
``terminationGracePeriodSeconds`` and torchrun's ``--shutdown-timeout``;
``orchestration.chunk_deadline_s`` is a Job's ``activeDeadlineSeconds``; the worker's run
directory is the flow's (``training.rundir.keyed_config``).  Rendered (docs/kubernetes.md): the
base job template of a Kubernetes work pool for flow ``train``, a deployment file for it, a
ReadWriteMany claim for ``runs_dir`` and, for ``train.nnodes > 1``, one chunk attempt as an Indexed
Job plus headless Service (torchrun per pod, c10d rendezvous on pod 0, ``training.worker`` as
``tasks/supervision/multinode.py`` starts it).  Kubernetes retries nothing (``backoffLimit: 0``,
``restartPolicy: Never``, a ``podFailurePolicy`` failing the Job at the first disruption):
convoy's ``orchestration.retries`` is the only retry budget.  Pure functions over plain dicts, so
the tests validate them against the Kubernetes schema and prefect-kubernetes' own rendering.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

import yaml

from training.config import RunConfig
from training.events import EXIT_CONFIG, EXIT_PREEMPTED
from training.rundir import keyed_config

#: Where the image holds the project checkout (its working directory); relative paths of the
#: config (``runs_dir``, ``data.prepared_dir``, PARAMS) are read from here.
WORKDIR = "/opt/convoy"
#: Port of the c10d rendezvous store hosted by pod 0 of a multi-node chunk.
RDZV_PORT = 29400
#: How long a pod waits for pod 0's rendezvous store (pods may start minutes apart on new nodes).
RDZV_READ_TIMEOUT_S = 600
#: Seconds the pod gets beyond ``heartbeat.grace_s``: torchrun's and Prefect's own exit, the
#: worker's last beat and event, after the emergency checkpoint is durable.
TERMINATION_MARGIN_S = 30
#: The container name prefect-kubernetes requires for the flow pod (its manifest check).
FLOW_CONTAINER = "prefect-job"
#: The container of a multi-node chunk's pods; the podFailurePolicy's exit-code rule names it.
WORKER_CONTAINER = "worker"
GPU_RESOURCE = "nvidia.com/gpu"
RUNS_VOLUME, SHM_VOLUME = "runs", "dshm"
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")


class _PlainDumper(yaml.SafeDumper):
    """YAML without anchors: a reader of a manifest should not have to resolve ``*id001``."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    """A multi-line string (the pods' shell script) as a literal block, line for line."""
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_PlainDumper.add_representer(str, _str)


class RenderError(ValueError):
    """A bad input to the render, said in one line (what is wrong, what is allowed)."""


@dataclass(frozen=True)
class Target:
    """Where and how the run goes on the cluster: what ``params.yaml`` cannot know."""

    #: The image with the project checkout at ``workdir``, convoy installed, ``python`` on PATH.
    image: str
    namespace: str = "default"
    #: The Kubernetes work pool that runs flow ``train`` (not ``convoy``: prefect.yaml's process pool).
    pool: str = "convoy-k8s"
    workdir: str = WORKDIR
    #: ``pvc``: runs_dir on a ReadWriteMany claim; ``emptydir``: pod-local, the DVC remote keeps
    #: the checkpoints (``tracking.dvc``, one node only).
    runs_volume: Literal["pvc", "emptydir"] = "pvc"
    runs_claim: str = "convoy-runs"
    storage: str = "50Gi"
    storage_class: str | None = None
    #: A Secret whose keys become environment variables of every pod (AWS_*, MLFLOW_TRACKING_URI).
    env_secret: str | None = None
    #: The chunk the multi-node Job trains (1 = the first): ``--until-step`` is its end.
    chunk: int = 1
    #: ``terminationGracePeriodSeconds``; None: ``heartbeat.grace_s`` + :data:`TERMINATION_MARGIN_S`.
    grace_period_s: int | None = None
    #: PARAMS relative to ``workdir`` and the ``-S`` overrides: the pods load the run's config as rendered.
    params: str = "params.yaml"
    overrides: tuple[str, ...] = ()


@dataclass(frozen=True)
class RenderedFile:
    """One file of the render: its name under the output folder, its documents, what it is (said when written)."""

    name: str
    documents: tuple[dict[str, Any], ...]
    what: str

    def text(self) -> str:
        """JSON for a lone ``.json`` document (what ``prefect work-pool create`` reads), else YAML."""
        if self.name.endswith(".json"):
            return json.dumps(self.documents[0], indent=2) + "\n"
        return yaml.dump_all(list(self.documents), Dumper=_PlainDumper, sort_keys=False, width=120)


def check_target(cfg: RunConfig, target: Target) -> None:
    """Refuse, in one line, what Kubernetes or the run would refuse later, before anything is written."""
    if not target.image.strip() or any(c.isspace() for c in target.image):
        raise RenderError(f"--image {target.image!r}: give the image reference (no spaces), e.g. registry/convoy:0.1.0")
    for flag, value in (("--namespace", target.namespace), ("--pool", target.pool)):
        if len(value) > 63 or not _DNS_LABEL.match(value):
            raise RenderError(f"{flag} {value!r}: must be a DNS label (lower-case letters, digits, '-', at most 63)")
    if len(target.runs_claim) > 253 or not _DNS_SUBDOMAIN.match(target.runs_claim):
        raise RenderError(f"--runs-claim {target.runs_claim!r}: must be a DNS subdomain (lower-case, digits, '-', '.')")
    if not _QUANTITY.match(target.storage):
        raise RenderError(f"--storage {target.storage!r}: must be a Kubernetes quantity, e.g. 50Gi")
    if not PurePosixPath(target.workdir).is_absolute():
        raise RenderError(f"--workdir {target.workdir!r}: must be an absolute path inside the image")
    if PurePosixPath(target.workdir).is_relative_to(in_pod(target, cfg.runs_dir)):
        raise RenderError(
            f"runs_dir = {cfg.runs_dir!r}: the claim would be mounted over the checkout; use a folder of its own"
        )
    if target.runs_volume == "emptydir" and (not cfg.tracking.dvc or cfg.train.nnodes > 1):
        raise RenderError(
            "--runs-volume emptydir needs tracking.dvc: true and train.nnodes = 1: without the DVC remote, "
            "or with several nodes, the pods must share runs_dir (use --runs-volume pvc)"
        )
    chunks = math.ceil(cfg.train.total_steps / cfg.train.chunk_steps)
    if not 1 <= target.chunk <= chunks:
        raise RenderError(f"--chunk {target.chunk}: the run has chunks 1..{chunks}")
    if target.grace_period_s is not None and target.grace_period_s <= math.ceil(cfg.heartbeat.grace_s):
        raise RenderError(
            f"--grace-period-s {target.grace_period_s} is not above heartbeat.grace_s = {cfg.heartbeat.grace_s:g}: "
            "the pod would be killed before the worker's emergency checkpoint is durable"
        )


def termination_grace_s(cfg: RunConfig, target: Target) -> int:
    """Seconds between the pod's SIGTERM and its SIGKILL: the emergency save's budget plus a margin."""
    if target.grace_period_s is not None:
        return target.grace_period_s
    return math.ceil(cfg.heartbeat.grace_s) + TERMINATION_MARGIN_S


def chunk_end(cfg: RunConfig, chunk: int) -> int:
    """The step chunk ``chunk`` (from 1) ends at: ``flows.train.plan_chunks``' rule, without
    importing the flow (Prefect, MLflow) into a command that only writes files."""
    return min(chunk * cfg.train.chunk_steps, cfg.train.total_steps)


def in_pod(target: Target, path: str) -> str:
    """A config path as the pods see it: relative paths are under the image's working directory."""
    return posixpath.normpath(posixpath.join(target.workdir, path))  # an absolute path stays itself


def run_dir_in_pod(cfg: RunConfig, target: Target) -> str:
    """The run directory the flow trains (``runs/<name>@<fingerprint[:8]>`` under ``new_run``), in the pod."""
    return in_pod(target, keyed_config(cfg).run_dir.as_posix())


def gpu_resources(cfg: RunConfig) -> dict[str, Any]:
    """One GPU per rank on the node (an extended resource: request = limit); none for ``device: cpu``
    (``auto`` asks for them: it takes a GPU when one is there)."""
    if cfg.train.device == "cpu":
        return {}
    gpus = {GPU_RESOURCE: cfg.train.ranks}
    return {"requests": dict(gpus), "limits": dict(gpus)}


def runs_pvc(target: Target) -> dict[str, Any]:
    """The ReadWriteMany claim every pod mounts at ``runs_dir``: checkpoints, heartbeats, events."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": target.storage}}}
    if target.storage_class:
        spec["storageClassName"] = target.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": target.runs_claim, "namespace": target.namespace, "labels": _labels("runs")},
        "spec": spec,
    }


def _labels(component: str, instance: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "convoy", "app.kubernetes.io/component": component}
    return {**labels, "app.kubernetes.io/instance": instance} if instance else labels


def pod_storage(cfg: RunConfig, target: Target) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts): ``runs_dir`` at the path the config names, and a RAM-backed ``/dev/shm``
    (a container's default is 64 MiB; the memory tier, DataLoader workers and NCCL live there)."""
    runs: dict[str, Any] = (
        {"persistentVolumeClaim": {"claimName": target.runs_claim}} if target.runs_volume == "pvc" else {"emptyDir": {}}
    )
    volumes = [{"name": RUNS_VOLUME, **runs}, {"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}}]
    mount_at = {RUNS_VOLUME: in_pod(target, cfg.runs_dir), SHM_VOLUME: "/dev/shm"}
    return volumes, [{"name": name, "mountPath": path} for name, path in mount_at.items()]


def _env_from(target: Target) -> dict[str, Any]:
    return {"envFrom": [{"secretRef": {"name": target.env_secret}}]} if target.env_secret else {}


# ----------------------------------------------------------------------------- flow train
_COMMAND_DOC = "Leave empty: the worker fills in `prefect flow-run execute`."
_JOB_CONFIGURATION = ("command", "env", "labels", "annotations", "name", "namespace", "pod_watch_timeout_seconds")


def _slot(variable: str) -> str:
    """A Prefect placeholder: the work pool variable's value (a deployment's job_variables win)."""
    return "{{ " + variable + " }}"


def _variable(kind: str, default: Any, description: str, **extra: Any) -> dict[str, Any]:
    return {"type": kind, "default": default, "description": description, **extra}


def _pool_variables(target: Target) -> dict[str, Any]:
    """The work pool's variables (a JSON schema; a deployment's ``job_variables`` override them).
    Only what the job configuration uses: Prefect's server refuses a template naming one it lacks."""
    env_doc = "Environment variables of the flow pod (PREFECT_API_URL comes from the worker)."
    props = {
        "image": _variable("string", target.image, "The convoy image (project checkout at the working directory)."),
        "namespace": _variable("string", target.namespace, "The namespace of the flow's Job."),
        "image_pull_policy": _variable(
            "string", "IfNotPresent", "Image pull policy.", enum=["IfNotPresent", "Always", "Never"]
        ),
        "env": _variable("object", {"PYTHONUNBUFFERED": "1"}, env_doc, additionalProperties={"type": "string"}),
        "labels": _variable("object", {}, "Labels of the Job.", additionalProperties={"type": "string"}),
        "annotations": _variable("object", {}, "Annotations of the Job.", additionalProperties={"type": "string"}),
        "name": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "description": "Job name prefix."},
        "command": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "description": _COMMAND_DOC},
        "pod_watch_timeout_seconds": _variable("integer", 300, "Seconds to wait for the pod to start (GPU nodes)."),
    }
    return {"type": "object", "properties": props}


def flow_job_manifest(cfg: RunConfig, target: Target) -> dict[str, Any]:
    """The Job of one flow run of ``train``, with Prefect's placeholders.

    ``backoffLimit: 0`` is a constant, not a variable: Kubernetes must not start the flow again on
    its own (convoy's retries, and Prefect's reschedule on SIGTERM, are the only ones), and with
    0 prefect-kubernetes sets ``PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR=reschedule``.
    ``parallelism``/``completions`` sit in the pod spec because prefect-kubernetes' manifest
    check demands them there (Kubernetes ignores them)."""
    volumes, mounts = pod_storage(cfg, target)
    container: dict[str, Any] = {
        "name": FLOW_CONTAINER,
        "image": "{{ image }}",
        "imagePullPolicy": "{{ image_pull_policy }}",
        "args": "{{ command }}",
        "env": "{{ env }}",
        **_env_from(target),
        "workingDir": target.workdir,
        "volumeMounts": mounts,
    }
    if cfg.train.nnodes == 1 and gpu_resources(cfg):  # one node: the chunks' workers run in this pod
        container["resources"] = gpu_resources(cfg)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {**{k: _slot(k) for k in ("annotations", "labels", "namespace")}, "generateName": "{{ name }}-"},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "parallelism": 1,
                    "completions": 1,
                    "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": termination_grace_s(cfg, target),
                    "containers": [container],
                    "volumes": volumes,
                }
            },
        },
    }


def work_pool_template(cfg: RunConfig, target: Target) -> dict[str, Any]:
    """``prefect work-pool create <pool> --type kubernetes --base-job-template <this>.json``."""
    config: dict[str, Any] = {key: _slot(key) for key in _JOB_CONFIGURATION}
    return {
        "job_configuration": {**config, "job_manifest": flow_job_manifest(cfg, target)},
        "variables": _pool_variables(target),
    }


def flow_deployment(cfg: RunConfig, target: Target) -> dict[str, Any]:
    """A prefect.yaml of one deployment, ``train/kubernetes``, on the Kubernetes pool.

    The pull step enters the image's checkout, so ``params`` (relative to it) and every relative
    path of the config mean there what they mean in the checkout the render ran in; the
    overrides are the render's own, so the flow trains the run directory the manifests name."""
    return {
        "name": "convoy",
        "prefect-version": "3.9.1",
        "pull": [{"prefect.deployments.steps.set_working_directory": {"directory": target.workdir}}],
        "deployments": [
            {
                "name": "kubernetes",
                "description": f"Train (or continue) run {cfg.run_name!r} in a pod of work pool {target.pool!r}.",
                "entrypoint": "flows/train.py:train",
                "parameters": {"params": target.params, "overrides": list(target.overrides)},
                "tags": ["convoy", "kubernetes"],
                # One parent flow at a time; the run directory's lock refuses a second one anyway.
                "concurrency_limit": 1,
                "work_pool": {"name": target.pool, "work_queue_name": "default", "job_variables": {}},
            }
        ],
    }


# ----------------------------------------------------------------------------- multi-node chunk
def chunk_job_name(cfg: RunConfig, chunk: int) -> str:
    """``convoy-<run>-<fingerprint>-c<chunk>``: a DNS label short enough that each pod's host name
    (``<name>-<index>``) is one too; the same name for the Job, its Service and the rendezvous id."""
    slug = re.sub(r"[^a-z0-9]+", "-", keyed_config(cfg).run_name.lower()).strip("-")
    suffix = f"-c{chunk}"
    room = 63 - len("convoy-") - len(suffix) - len(f"-{cfg.train.nnodes - 1}")
    return f"convoy-{slug[:room].rstrip('-')}{suffix}"


def torchrun_argv(cfg: RunConfig, target: Target, chunk: int) -> list[str]:
    """The agent each pod runs, as ``tasks/supervision/multinode.py``'s ``node_commands`` builds it,
    with the node's rank and the rendezvous host flag left to the shell (``$NODE_RANK``,
    ``$IS_HOST``: from ``JOB_COMPLETION_INDEX``).  ``--max-restarts=0``: torchrun does not restart
    ranks either; ``--shutdown-timeout``: it gives its ranks ``heartbeat.grace_s`` after SIGTERM."""
    name = chunk_job_name(cfg, chunk)
    return [
        "python",
        "-m",
        "torch.distributed.run",
        f"--nnodes={cfg.train.nnodes}",
        f"--nproc-per-node={cfg.train.ranks}",
        "--node-rank=$NODE_RANK",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={name}-0.{name}:{RDZV_PORT}",  # pod 0 through the headless Service
        f"--rdzv-id={name}",
        f"--rdzv-conf=is_host=$IS_HOST,read_timeout={RDZV_READ_TIMEOUT_S}",
        "--max-restarts=0",
        f"--shutdown-timeout={math.ceil(cfg.heartbeat.grace_s)}",
        "-m",
        "training.worker",
        "--run-dir",
        run_dir_in_pod(cfg, target),
        "--until-step",
        str(chunk_end(cfg, chunk)),
    ]


def torchrun_script(cfg: RunConfig, target: Target, chunk: int) -> str:
    """``sh -c`` text: the node rank is the pod's completion index, pod 0 hosts the rendezvous, and
    ``exec`` makes torchrun the container's first process, so the kubelet's SIGTERM reaches it
    (it forwards it to its ranks, which save an emergency checkpoint and exit 75)."""
    quoted = " ".join(a if "$" in a else shlex.quote(a) for a in torchrun_argv(cfg, target, chunk))
    return "\n".join(
        [
            'NODE_RANK="${JOB_COMPLETION_INDEX:?not an Indexed Job pod}"',
            'IS_HOST=0; [ "$NODE_RANK" = 0 ] && IS_HOST=1',
            f"exec {quoted}",
        ]
    )


def pod_failure_policy() -> dict[str, Any]:
    """Fail the Job at once, naming why: a disruption (preemption, eviction, node drain or
    shutdown: the pod's ``DisruptionTarget`` condition) is convoy's ``preempted``; the worker's
    own 75 (preempted after an emergency checkpoint) and 78 (configuration: never retried) are
    named by exit code.  Anything else fails it through ``backoffLimit: 0``."""
    return {
        "rules": [
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": WORKER_CONTAINER,
                    "operator": "In",
                    "values": [EXIT_PREEMPTED, EXIT_CONFIG],
                },
            },
        ]
    }


def chunk_service(cfg: RunConfig, target: Target, chunk: int) -> dict[str, Any]:
    """Headless Service: gives each pod of the Job a DNS name, pod 0's being the rendezvous endpoint.
    ``publishNotReadyAddresses``: the names exist from the pods' start, before any readiness."""
    name = chunk_job_name(cfg, chunk)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": target.namespace, "labels": _labels("multinode-chunk", name)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"app.kubernetes.io/instance": name},
            "ports": [{"name": "rdzv", "port": RDZV_PORT, "targetPort": RDZV_PORT, "protocol": "TCP"}],
        },
    }


def _open_run_container(target: Target, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    """Pod 0 creates (or reopens, checking the fingerprint) the run directory before any worker
    reads its ``config.json``: the other pods' ranks wait in the rendezvous until pod 0 joins."""
    argv = ["python", "-m", "flows.cli.kubernetes", "open-run", target.params]
    argv += [a for o in target.overrides for a in ("-S", o)]
    script = f'[ "$JOB_COMPLETION_INDEX" = 0 ] || exit 0\nexec {shlex.join(argv)}'
    return {
        "name": "open-run",
        "image": target.image,
        "workingDir": target.workdir,
        "command": ["/bin/sh", "-c", script],
        **_env_from(target),
        "volumeMounts": mounts,
    }


def _worker_container(cfg: RunConfig, target: Target, chunk: int, mounts: list[dict[str, Any]]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": WORKER_CONTAINER,
        "image": target.image,
        "workingDir": target.workdir,
        "command": ["/bin/sh", "-c", torchrun_script(cfg, target, chunk)],
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],
        **_env_from(target),
        "ports": [{"name": "rdzv", "containerPort": RDZV_PORT, "protocol": "TCP"}],
        "volumeMounts": mounts,
    }
    if gpu_resources(cfg):
        container["resources"] = gpu_resources(cfg)
    return container


def chunk_job(cfg: RunConfig, target: Target, chunk: int) -> dict[str, Any]:
    """One attempt of one multi-node chunk: ``nnodes`` pods (completion index = node rank), all
    needed (``completions`` = ``parallelism`` = ``nnodes``), none restarted by Kubernetes."""
    name = chunk_job_name(cfg, chunk)
    labels = _labels("multinode-chunk", name)
    volumes, mounts = pod_storage(cfg, target)
    spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": cfg.train.nnodes,
        "parallelism": cfg.train.nnodes,
        "backoffLimit": 0,
        "podFailurePolicy": pod_failure_policy(),
    }
    if cfg.orchestration.chunk_deadline_s > 0:
        spec["activeDeadlineSeconds"] = math.ceil(cfg.orchestration.chunk_deadline_s)
    spec["template"] = {
        "metadata": {"labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "subdomain": name,
            "terminationGracePeriodSeconds": termination_grace_s(cfg, target),
            "initContainers": [_open_run_container(target, mounts)],
            "containers": [_worker_container(cfg, target, chunk, mounts)],
            "volumes": volumes,
        },
    }
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": target.namespace, "labels": labels},
        "spec": spec,
    }


# ----------------------------------------------------------------------------- all of it
def render(cfg: RunConfig, target: Target) -> list[RenderedFile]:
    """Every file for ``cfg`` on ``target``, checked first: nothing is returned for a bad input."""
    check_target(cfg, target)
    pool, k = target.pool, target.chunk
    files = [
        RenderedFile(f"work-pool-{pool}.json", (work_pool_template(cfg, target),), f"template of work pool {pool!r}"),
        RenderedFile(
            "prefect-kubernetes.yaml",
            (flow_deployment(cfg, target),),
            f"deployment train/kubernetes on pool {pool!r}",
        ),
    ]
    if target.runs_volume == "pvc":
        files.append(RenderedFile("runs-pvc.yaml", (runs_pvc(target),), f"claim {target.runs_claim!r} for runs_dir"))
    if cfg.train.nnodes > 1:
        what = f"job {chunk_job_name(cfg, k)}: chunk {k} to step {chunk_end(cfg, k)}, {cfg.train.nnodes} pods"
        docs = (chunk_service(cfg, target, k), chunk_job(cfg, target, k))
        files.append(RenderedFile(f"multinode-chunk-{k}.yaml", docs, what))
    return files
