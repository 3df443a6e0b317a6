"""Prefect flows (``train``), deployments and the ``convoy`` CLI."""
