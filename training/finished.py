"""Whether a run has nothing left to do: ``convoy train`` of a finished run answers at once.

Starting the flow for it (Prefect's temporary API, the flow engine, the task's build) took ~12 s
to say that nothing was to be trained.  A run is finished for these settings when all of:

1. its directory's recorded fingerprint is this config's (any change goes through the flow,
   which checks and names it);
2. its last flow ended (``flow_done`` after every ``flow_started``) at ``train.total_steps``:
   the flow's closing work (versioning, the logged model, the audit) is done;
3. its newest checkpoint that verifies (hashes read, as a resume would) is that step, with the
   digest the flow reported.

Anything else (a flow that died, a corrupt or missing final checkpoint) goes through the flow,
which repairs what it can and says what it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

from training.config import RunConfig
from training.event_records import EventLog, FlowDone, FlowStarted
from training.rundir import run_info


@dataclass(frozen=True)
class Finished:
    """A finished run: its final step and digest, and its last flow run (which ended it)."""

    step: int
    digest: str
    ended_at: float
    flow_run_id: str | None


def finished_run(config: RunConfig) -> Finished | None:
    """The run ``config`` trains, if it has nothing left to do (the module's rules), else None."""
    run_dir = config.run_dir
    info = run_info(run_dir)
    if info is None or info.fingerprint != config.fingerprint():
        return None
    flows = EventLog.read(run_dir).of(FlowStarted, FlowDone)
    done = flows[-1] if flows else None
    if not isinstance(done, FlowDone) or done.final_step != config.train.total_steps or not done.digest:
        return None
    from training.checkpointing.store import CheckpointStore  # imports torch: only for a candidate

    newest = CheckpointStore(run_dir).latest_valid(record=False)
    if newest is None or newest.step != done.final_step or newest.digest != done.digest:
        return None
    return Finished(newest.step, newest.digest, done.time, done.flow_run_id)
