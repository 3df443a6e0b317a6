"""What a run reports while and after it trains: step metrics written exactly once
(``metrics``: ``metrics.jsonl`` and the logger, ``mlflow_backend``: MLflow as a backend), the
resume audit read from the run's own files (``resume_audit``) and where a run stands now
(``progress``: ``convoy status``).  Nothing here creates MLflow runs: the flow does that
(``tasks/records/mlflow_runs.py``, ``tasks/records/mlflow_audit.py``)."""
