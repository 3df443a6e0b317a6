"""Flow-level liveness: if the machine running flow ``train`` dies, crash the run and start it again.

The chunk supervisor covers a dying *worker*; nothing inside a dead flow process can report its
own death (hooks never run on SIGKILL or power loss) and its flow run would stay ``Running``
forever.  Prefect's answer is flow-run heartbeats (``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``, at least
30 s, emitted by flow runs started from deployments) plus two automations, created here as code:

1. *convoy: crash silent flow runs* — a proactive trigger: after a ``prefect.flow-run.heartbeat``
   of a ``train`` flow run, expect another heartbeat or a terminal event within ``within_s``;
   otherwise set the run ``Crashed``.  Measured on the open-source server: marked ~76 s after the
   last beat with ``within=75``.
2. *convoy: restart crashed training* — on ``prefect.flow-run.Crashed`` of the deployment, run
   the deployment again with the crashed run's parameters (a Jinja template of the triggering
   flow run's ``params`` and ``overrides``: a run started with ``--params other.yaml`` must not
   come back as the deployment's default run).  The new flow run takes the run lock
   (the dead one's lock died with it), stops any orphaned worker and continues from the newest
   verified checkpoint.

Run :func:`ensure_liveness_automations` once per deployment (e.g. from ``convoy prefect-setup``).
The window must exceed the heartbeat period (default 180 s, so 450 s by default); set
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY=30`` on flow machines (and here) for a ~75 s detection.
There is no restart budget in an automation: a run that crashes every time is restarted every
time, so watch the Crashed count in the UI.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

CRASH_NAME = "convoy: crash silent flow runs"
RESTART_NAME = "convoy: restart crashed training"
_TERMINAL = ("Completed", "Failed", "Cancelled", "Crashed")
#: The restarted run's parameters: the crashed run's own (Prefect renders each single-expression
#: template with ``tojson``, so ``overrides`` stays a list).
SAME_PARAMETERS = {
    "params": "{{ flow_run.parameters.get('params', 'params.yaml') }}",
    "overrides": "{{ flow_run.parameters.get('overrides') or [] }}",
}


def default_within_s() -> float:
    """2.5 heartbeat periods of *this* process's ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` (default 180 s).

    Flow machines must use the same frequency (or a shorter one) as the machine that creates the
    automation; a window shorter than the period crashes healthy runs between two beats.
    """
    from prefect.settings import get_current_settings

    return 2.5 * float(get_current_settings().flows.heartbeat_frequency or 180)


def liveness_automations(deployment_id: Any, within_s: float | None = None) -> list[Any]:
    """The two automations (not yet created) for one deployment of flow ``train``."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState, RunDeployment
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification
    from prefect.settings import get_current_settings

    period = float(get_current_settings().flows.heartbeat_frequency or 180)
    within_s = within_s if within_s is not None else default_within_s()
    if within_s <= period:
        raise ValueError(
            f"liveness window {within_s:g} s must exceed the flow heartbeat period {period:g} s "
            f"(PREFECT_FLOWS_HEARTBEAT_FREQUENCY), or healthy runs are crashed between two beats"
        )
    dep = f"prefect.deployment.{deployment_id}"
    crash = Automation(
        name=CRASH_NAME,
        description="Mark a convoy flow run Crashed when its heartbeats stop (its machine died).",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in _TERMINAL)},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.id": dep}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=within_s),
        ),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=f"convoy: no heartbeat for {within_s:g} s")],
    )
    restart = Automation(
        name=RESTART_NAME,
        description="Start the training deployment again after a crash; it resumes from the newest checkpoint.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.id": dep}),
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[RunDeployment(source="selected", deployment_id=deployment_id, parameters=SAME_PARAMETERS)],
    )
    return [crash, restart]


def ensure_liveness_automations(deployment: str = "train/nightly", within_s: float | None = None) -> list[str]:
    """Create (or replace, matched by name + deployment) the automations; return their ids."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name(deployment)
        ids = []
        for auto in liveness_automations(dep.id, within_s):
            auto.name = f"{auto.name} ({deployment})"
            for old in client.read_automations_by_name(name=auto.name):
                client.delete_automation(old.id)
            ids.append(str(auto.create().id))
    return ids


def marked_while_alive(flow_run_id: str | None) -> tuple[str, str] | None:
    """``(state, message)`` when Prefect's server holds this *live* flow run in a final state other
    than Completed — what the crash automation above sets when heartbeats stop reaching it (a
    network partition, a paused machine), not only when the machine died.  None otherwise, or when
    the server cannot be asked (the flow never depends on the answer: see ``TrainingRun.note_marks``)."""
    if flow_run_id is None:
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
    except Exception:  # noqa: BLE001 - an unreachable server changes nothing here
        return None
    if state is None or not state.is_final() or state.is_completed():
        return None
    return state.type.value, state.message or ""
