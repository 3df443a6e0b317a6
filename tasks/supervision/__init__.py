"""Supervision of one worker attempt, Prefect-free: start the worker (or take the parked one),
watch its heartbeat and process tree, classify how it failed, stop it, and hand a live worker to
the next chunk.

May import: ``training`` and this package.  Never Prefect, MLflow, DVC, ``tasks`` above it or
``flows``: the supervisor is unit tested and benchmarked without an API.
"""
