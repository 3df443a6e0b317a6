"""Prefect tasks: the supervised chunk (``run_chunk``), failure hooks and artifacts.

``tasks.supervisor`` is deliberately Prefect-free (pure process supervision) so it can be unit
tested and reused by the benchmark without starting an API.
"""
