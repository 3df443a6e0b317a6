"""The Kubernetes manifests ``convoy kubernetes render`` writes (flows/k8s_manifests.py), checked the
way a cluster and Prefect would read them, offline: every object against the Kubernetes OpenAPI
schema (kubernetes-validate's bundled schemas, strict: an unknown field fails), the work pool's
base job template through Prefect's server-side check and prefect-kubernetes' own rendering of a
flow run's Job, and the multi-node pods' shell script run by ``sh`` with a stand-in ``python``.

No cluster ran any of it (docs/kubernetes.md says so at its top): what is proven here is that the
manifests are what Kubernetes' schema and Prefect's code accept, and that they say what the docs
say, not how a cluster behaves under them.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import math
import os
import shlex
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import typer
import yaml
from typer.testing import CliRunner

from flows.cli.kubernetes import app as kubernetes_app
from flows.k8s_manifests import (
    TERMINATION_MARGIN_S,
    Target,
    chunk_end,
    chunk_job,
    chunk_job_name,
    render,
    torchrun_script,
    work_pool_template,
)
from tasks.supervision.multinode import Rendezvous, node_commands
from training.config import RunConfig, load_config
from training.events import EXIT_CONFIG, EXIT_PREEMPTED
from training.rundir import keyed_config, load_run_config

REPO = Path(__file__).resolve().parents[1]
PARAMS = REPO / "params.yaml"
#: Two nodes of two GPU ranks (train.hosts: the config's check wants nnodes names; the Job names its pods itself).
MULTI = ["train.device=cuda", "train.ranks=2", "train.nnodes=2", "train.hosts=[node-0,node-1]"]
SINGLE = ["train.device=cuda", "train.ranks=2"]
#: The oldest Kubernetes whose schema has everything used (podFailurePolicy is GA from 1.31), and the newest bundled.
K8S_VERSIONS = ("1.31", kubernetes_validate.utils.latest_version())
#: The committed examples under deploy/kubernetes/ and the command lines that wrote them (docs/kubernetes.md).
EXAMPLES = {
    "single-node": [*(a for o in SINGLE for a in ("-S", o))],
    "multi-node": [*(a for o in MULTI for a in ("-S", o))],
}
EXAMPLE_FLAGS = ["--image", "your-registry/convoy:0.1.0", "--namespace", "convoy"]


def cli(*args: str) -> tuple[int, str]:
    """``convoy kubernetes ...`` as flows.cli.main registers it (a typer group named kubernetes)."""
    root = typer.Typer()
    root.add_typer(kubernetes_app, name="kubernetes")
    result = CliRunner().invoke(root, ["kubernetes", *args], terminal_width=200)
    return result.exit_code, result.output


def config(overrides: list[str]) -> RunConfig:
    return load_config(PARAMS, overrides)


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any connection attempt fails the test: the schemas and Prefect's rendering must be offline."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield


def rendered(tmp_path: Path, overrides: list[str], *flags: str) -> dict[str, list[dict[str, Any]]]:
    """Render through the command into ``tmp_path``; file name -> its documents."""
    out = tmp_path / "out"
    code, text = cli("render", str(PARAMS), *(a for o in overrides for a in ("-S", o)), "--out", str(out), *flags)
    assert code == 0, text
    files = {}
    for path in sorted(out.iterdir()):
        assert f"wrote {path}" in text, text
        files[path.name] = (
            [json.loads(path.read_text())] if path.suffix == ".json" else list(yaml.safe_load_all(path.read_text()))
        )
    return files


def validate(doc: dict[str, Any], strict: bool = True) -> None:
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(doc, version, strict=strict)


# ----------------------------------------------------------------------------- schema


def test_every_rendered_object_validates_against_the_kubernetes_schema_offline(
    tmp_path: Path, no_network: None
) -> None:
    files = rendered(tmp_path, MULTI, "--image", "registry.local/convoy:1", "--namespace", "train")
    assert set(files) == {
        "work-pool-convoy-k8s.json",
        "prefect-kubernetes.yaml",
        "runs-pvc.yaml",
        "multinode-chunk-1.yaml",
    }
    kinds = []
    for name in ("runs-pvc.yaml", "multinode-chunk-1.yaml"):
        for doc in files[name]:
            validate(doc)
            kinds.append(doc["kind"])
    assert kinds == ["PersistentVolumeClaim", "Service", "Job"]


@pytest.mark.parametrize(
    ("where", "value"),
    [
        (("spec", "backoffLimit"), "zero"),  # wrong type
        (("spec", "template", "spec", "restartPolicyy"), "Never"),  # unknown field (a typo)
        (("spec", "podFailurePolicy", "rules", 0, "onPodConditions", 0, "typ"), "DisruptionTarget"),
        (("spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"), "rdzv"),
    ],
)
def test_negative_control_a_broken_job_fails_validation(where: tuple[Any, ...], value: Any) -> None:
    """The validator is no rubber stamp: one bad field in an otherwise valid Job is refused."""
    job = chunk_job(config(MULTI), Target(image="x"), 1)
    validate(job)
    broken = copy.deepcopy(job)
    node = broken
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)


# ----------------------------------------------------------------------------- the flow's pod (Prefect)


def prefect_job(template: dict[str, Any], values: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """A flow run's Job as the Kubernetes worker builds it: prefect-kubernetes'
    ``from_template_and_values`` then ``prepare_for_flow_run`` (a client that is never opened:
    any API call would fail)."""
    from prefect.client.orchestration import PrefectClient
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    async def build() -> KubernetesWorkerJobConfiguration:
        client = PrefectClient("http://127.0.0.1:9/api")
        return await KubernetesWorkerJobConfiguration.from_template_and_values(template, values, client=client)

    configuration = asyncio.run(build())
    flow_run = FlowRun(id=uuid.uuid4(), name="brave-fox", flow_id=uuid.uuid4())
    configuration.prepare_for_flow_run(flow_run)
    return configuration.job_manifest, flow_run


def test_work_pool_template_renders_through_prefect_as_the_docs_say(tmp_path: Path, no_network: None) -> None:
    from prefect.server.schemas.actions import validate_base_job_template

    cfg = config(SINGLE)
    template = rendered(tmp_path, SINGLE, "--image", "registry.local/convoy:1", "--namespace", "train")[
        "work-pool-convoy-k8s.json"
    ][0]
    assert template == work_pool_template(cfg, Target(image="registry.local/convoy:1", namespace="train"))
    validate_base_job_template(template)  # what `prefect work-pool create --base-job-template` sends is accepted
    job, flow_run = prefect_job(template, {"env": {"MLFLOW_TRACKING_URI": "http://mlflow.train:5000"}})
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    # docs/kubernetes.md, "What the flow's pod runs": these are its words.
    doc = (REPO / "docs" / "kubernetes.md").read_text()
    assert container["args"] == ["prefect", "flow-run", "execute"] and "`prefect flow-run execute`" in doc
    assert env["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "reschedule"
    assert "`PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR=reschedule`" in doc
    assert env["PREFECT__FLOW_RUN_ID"] == str(flow_run.id) and "`PREFECT__FLOW_RUN_ID`" in doc
    assert env["PYTHONUNBUFFERED"] == "1" and env["MLFLOW_TRACKING_URI"] == "http://mlflow.train:5000"
    assert container["image"] == "registry.local/convoy:1" and job["metadata"]["namespace"] == "train"
    assert container["workingDir"] == "/opt/convoy"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/opt/convoy/runs", "/dev/shm"}
    assert job["spec"]["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert pod["terminationGracePeriodSeconds"] == math.ceil(cfg.heartbeat.grace_s) + TERMINATION_MARGIN_S
    assert container["resources"] == {"requests": {"nvidia.com/gpu": 2}, "limits": {"nvidia.com/gpu": 2}}
    validate(job, strict=False)
    # Strict, less the two keys prefect-kubernetes' manifest check demands in the pod spec (Kubernetes drops them).
    strict = copy.deepcopy(job)
    assert strict["spec"]["template"]["spec"].pop("parallelism") == 1
    assert strict["spec"]["template"]["spec"].pop("completions") == 1
    validate(strict)


def test_a_deployment_overrides_the_pool_defaults(no_network: None) -> None:
    """``job_variables`` of a deployment win over the pool's defaults, as Prefect documents."""
    template = work_pool_template(config(SINGLE), Target(image="a/b:1"))
    job, _ = prefect_job(template, {"image": "a/b:2", "namespace": "other"})
    assert job["spec"]["template"]["spec"]["containers"][0]["image"] == "a/b:2"
    assert job["metadata"]["namespace"] == "other"


def test_cpu_runs_ask_for_no_gpu_and_multi_node_flow_pods_hold_no_ranks() -> None:
    for overrides in ([], MULTI):
        pod = work_pool_template(config(overrides), Target(image="x"))["job_configuration"]["job_manifest"]
        assert "resources" not in pod["spec"]["template"]["spec"]["containers"][0]


def test_deployment_file_is_a_prefect_yaml_for_flow_train(tmp_path: Path) -> None:
    from prefect.cli.deploy._models import PrefectYamlModel

    from flows.train import train

    (doc,) = rendered(tmp_path, SINGLE, "--image", "x")["prefect-kubernetes.yaml"]
    model = PrefectYamlModel.model_validate(doc)
    (deployment,) = model.deployments
    assert deployment.entrypoint == "flows/train.py:train" and deployment.work_pool.name == "convoy-k8s"
    assert deployment.parameters == {"params": "params.yaml", "overrides": SINGLE}
    assert set(deployment.parameters) <= set(inspect.signature(train.fn).parameters)
    assert doc["pull"] == [{"prefect.deployments.steps.set_working_directory": {"directory": "/opt/convoy"}}]


# ----------------------------------------------------------------------------- the multi-node chunk


def run_script(script: str, index: str | None, tmp_path: Path) -> tuple[int, list[str]]:
    """Run a pod's ``sh -c`` text with a stand-in ``python`` that prints its argv, one per line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "python"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" python "$@"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    if index is not None:
        env["JOB_COMPLETION_INDEX"] = index
    done = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    return done.returncode, done.stdout.splitlines()


def test_each_pod_runs_torchrun_with_its_completion_index_as_node_rank(tmp_path: Path) -> None:
    cfg = config(MULTI)
    name = chunk_job_name(cfg, 2)
    run_dir = f"/opt/convoy/{keyed_config(cfg).run_dir.as_posix()}"
    script = torchrun_script(cfg, Target(image="x", chunk=2), 2)
    for index, is_host in (("0", "1"), ("1", "0")):
        code, argv = run_script(script, index, tmp_path)
        assert code == 0 and argv[:3] == ["python", "-m", "torch.distributed.run"]
        assert f"--node-rank={index}" in argv and f"--rdzv-conf=is_host={is_host},read_timeout=600" in argv
        assert {"--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", "--max-restarts=0"} <= set(argv)
        assert f"--rdzv-endpoint={name}-0.{name}:29400" in argv and f"--rdzv-id={name}" in argv
        assert f"--shutdown-timeout={math.ceil(cfg.heartbeat.grace_s)}" in argv
        assert argv[argv.index("-m", 3) :] == ["-m", "training.worker", "--run-dir", run_dir, "--until-step", "400"]
    code, argv = run_script(script, None, tmp_path)
    assert code != 0 and argv == []  # not an Indexed Job pod: refuses, starts nothing


def test_pods_start_the_agent_multinode_py_starts() -> None:
    """Every flag of the launcher's own torchrun command is in the Job's (values that depend on
    where it runs aside): one contract with the worker, whoever starts it."""
    tail = ["-m", "training.worker", "--run-dir", "R", "--until-step", "1"]
    (ours, theirs) = (
        shlex.split(torchrun_script(config(MULTI), Target(image="x"), 1).splitlines()[-1])[1:],
        node_commands(["localhost", "localhost"], 2, Rendezvous("h:1", "id"), "", tail, "/")[0],
    )

    def flags(argv: list[str]) -> set[str]:
        return {a.split("=")[0] for a in argv if a.startswith("--")}

    assert flags(theirs) - {"--shutdown-timeout"} <= flags(ours)
    assert theirs[theirs.index("torch.distributed.run") - 1 :][:2] == ours[1:3]


def test_indexed_job_leaves_retries_to_convoy_and_maps_disruption_to_preempted() -> None:
    cfg = config([*MULTI, "orchestration.chunk_deadline_s=3600"])
    service, job = render(cfg, Target(image="x", namespace="train"))[-1].documents
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert spec["backoffLimit"] == 0 and pod["restartPolicy"] == "Never"
    assert spec["activeDeadlineSeconds"] == 3600
    disruption, exits = spec["podFailurePolicy"]["rules"]
    assert disruption == {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    assert exits["action"] == "FailJob" and exits["onExitCodes"]["values"] == [EXIT_PREEMPTED, EXIT_CONFIG] == [75, 78]
    (worker,) = pod["containers"]
    assert exits["onExitCodes"]["containerName"] == worker["name"]
    assert pod["terminationGracePeriodSeconds"] == math.ceil(cfg.heartbeat.grace_s) + TERMINATION_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] > cfg.heartbeat.grace_s
    assert worker["resources"]["requests"] == worker["resources"]["limits"] == {"nvidia.com/gpu": cfg.train.ranks}
    # The headless Service names the pods: pod 0 is <job>-0.<service>.
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= job["spec"]["template"]["metadata"]["labels"].items()
    assert all(len(f"{job['metadata']['name']}-{i}") <= 63 for i in range(cfg.train.nnodes))
    mounts = {m["name"]: m["mountPath"] for m in worker["volumeMounts"]}
    assert mounts == {"runs": "/opt/convoy/runs", "dshm": "/dev/shm"}
    assert {"name": "runs", "persistentVolumeClaim": {"claimName": "convoy-runs"}} in pod["volumes"]


def test_pod_zero_opens_the_run_before_the_workers_read_it(tmp_path: Path) -> None:
    target = Target(image="x", overrides=tuple(MULTI))
    (init,) = chunk_job(config(MULTI), target, 1)["spec"]["template"]["spec"]["initContainers"]
    script = init["command"][2]
    assert run_script(script, "1", tmp_path) == (0, [])  # the other pods do nothing
    code, argv = run_script(script, "0", tmp_path)
    assert code == 0 and argv == [
        "python",
        "-m",
        "flows.cli.kubernetes",
        "open-run",
        "params.yaml",
        *EXAMPLES["multi-node"],
    ]


def test_open_run_creates_the_run_directory_a_worker_reads(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    code, out = cli("open-run", str(PARAMS), "-S", f"runs_dir={runs}", *EXAMPLES["multi-node"])
    assert code == 0, out
    run_dir = keyed_config(config([f"runs_dir={runs}", *MULTI])).run_dir
    assert f"run directory {run_dir}" in out
    assert load_run_config(run_dir).train.nnodes == 2  # what training.worker loads
    assert cli("open-run", str(PARAMS), "-S", f"runs_dir={runs}", "-S", "train.nnodes=2")[0] == 2


def test_chunk_end_is_the_flows_chunk_plan() -> None:
    from flows.train import plan_chunks

    for total, chunk in ((600, 200), (601, 200), (7, 3), (5, 5)):
        cfg = config([f"train.total_steps={total}", f"train.chunk_steps={chunk}"])
        assert [chunk_end(cfg, k) for k, _, _ in plan_chunks(total, chunk)] == [
            e for _, _, e in plan_chunks(total, chunk)
        ]


# ----------------------------------------------------------------------------- the command


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "--image ''"),
        (["--image", "x", "--grace-period-s", "10"], "--grace-period-s 10 is not above heartbeat.grace_s = 10"),
        (["--image", "x", "--runs-volume", "emptydir"], "--runs-volume emptydir needs tracking.dvc: true"),
        (["--image", "x", "--chunk", "4"], "--chunk 4: the run has chunks 1..3"),
        (["--image", "x", "--namespace", "Train_1"], "--namespace 'Train_1': must be a DNS label"),
        (["--image", "x", "--storage", "lots"], "--storage 'lots': must be a Kubernetes quantity"),
        (["--image", "x", "-S", "train.nnodes=2"], "train.nnodes = 2 needs exactly 2 host names"),
        (["--image", "x", "-S", "runs_dir=."], "runs_dir = '.': the claim would be mounted over the checkout"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path: Path, args: list[str], says: str) -> None:
    out = tmp_path / "out"
    code, text = cli("render", str(PARAMS), "--out", str(out), *args)
    assert code == 2 and text.startswith("error: ") and says in text, text
    assert len(text.strip().splitlines()) == 1, text
    assert not out.exists()


def test_params_outside_the_checkout_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "params.yaml"
    outside.write_text(PARAMS.read_text())
    code, text = cli("render", str(outside), "--image", "x", "--out", str(tmp_path / "out"))
    assert code == 2 and "PARAMS must be inside this checkout" in text, text


def test_runs_on_the_dvc_remote_need_no_claim(tmp_path: Path) -> None:
    files = rendered(tmp_path, ["tracking.dvc=true"], "--image", "x", "--runs-volume", "emptydir")
    assert "runs-pvc.yaml" not in files
    pod = files["work-pool-convoy-k8s.json"][0]["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert {"name": "runs", "emptyDir": {}} in pod["volumes"]


def test_env_secret_reaches_every_container(tmp_path: Path) -> None:
    files = rendered(tmp_path, MULTI, "--image", "x", "--env-secret", "convoy-env")
    job = files["multinode-chunk-1.yaml"][1]
    flow = files["work-pool-convoy-k8s.json"][0]["job_configuration"]["job_manifest"]
    containers = [*job["spec"]["template"]["spec"]["initContainers"], *job["spec"]["template"]["spec"]["containers"]]
    containers += flow["spec"]["template"]["spec"]["containers"]
    assert all(c["envFrom"] == [{"secretRef": {"name": "convoy-env"}}] for c in containers)


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_committed_examples_are_what_the_command_writes(tmp_path: Path, example: str) -> None:
    """deploy/kubernetes/<example>/ is rendered from the repo's params.yaml; a change to either
    is re-rendered with the command docs/kubernetes.md gives (the same as here)."""
    committed = REPO / "deploy" / "kubernetes" / example
    args = [*EXAMPLES[example], *EXAMPLE_FLAGS]
    code, text = cli("render", "params.yaml", *args, "--out", str(tmp_path))
    assert code == 0, text
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir()}
    stale = {p.name: p.read_text() for p in committed.iterdir()} if committed.is_dir() else {}
    command = f"convoy kubernetes render params.yaml {shlex.join(args)} --out deploy/kubernetes/{example}"
    assert fresh == stale, f"stale example; re-render: {command}"
    assert command in (REPO / "docs" / "kubernetes.md").read_text()


def test_docs_say_first_that_no_cluster_ran_it_and_link_nothing_outside() -> None:
    doc = (REPO / "docs" / "kubernetes.md").read_text()
    assert "has NOT run on a cluster" in doc[:800]
    assert "](http" not in doc and "https://" not in doc


@pytest.fixture(autouse=True)
def _at_the_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    """PARAMS and runs_dir resolve as for a user at the project root (the deployment names PARAMS relative to it)."""
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert os.getcwd() == str(REPO)
