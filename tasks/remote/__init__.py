"""Checkpoints that travel: DVC versioning of committed checkpoints (``dvc_version``), the run's
index in the DVC remote (``remote_index``), the background uploader and the verified fetch on
another machine (``remote_checkpoints``).

May import: ``training``, ``tasks.records`` (an upload's lag is recorded in MLflow) and this
package.  Never Prefect, ``tasks.supervision`` or ``flows``.
"""
