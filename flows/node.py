"""Where a pool node runs a chunk: a Prefect pull step that enters the node's own checkout.

Why: ``prefect deploy`` resolves ``{{ $PWD }}`` in ``prefect.yaml`` once, on the machine that
deploys, so every node would be sent to the deployer's directory — which exists only there when
the nodes share no disk.  This step runs on the node, when a flow run starts: it enters
``$CONVOY_NODE_DIR`` (set in the environment of the node's ``prefect worker``: the node's clone of
the project, where ``runs/`` and ``data/`` live) or, without it, ``directory`` (the deploy-time
directory: every node sees the same path, as on shared storage).

Kept free of convoy's heavy imports: it runs before the flow is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

NODE_DIR_ENV = "CONVOY_NODE_DIR"


def enter_node_directory(directory: str) -> dict[str, str]:
    """Prefect pull step: ``chdir`` into the node's checkout; returns ``{"directory": ...}``."""
    target = Path(os.environ.get(NODE_DIR_ENV) or directory).expanduser()
    if not target.is_dir():
        raise FileNotFoundError(
            f"{target}: no such directory on this node; set {NODE_DIR_ENV} in the environment of its "
            "`prefect worker` to the node's checkout of the project"
        )
    os.chdir(target)
    return {"directory": str(target)}
