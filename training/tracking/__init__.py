"""What a run reports while and after it trains: step metrics written exactly once
(``metrics``: the worker's ``metrics.jsonl`` journal and its logger), the attempts read back from
the events (``attempts``), a failed attempt's facts as one typed record (``failure_record``: what
the supervisor finds, the ``failure`` event holds, MLflow and the report show), the resume audit
read from the run's own files (``resume_audit``) and where a run stands now (``progress``:
``convoy status``).  Nothing here imports MLflow: the chunk task ships the journal
(``tasks/records/metric_shipping.py``) and the flow creates the MLflow runs
(``tasks/records/mlflow_runs.py``, ``tasks/records/mlflow_audit.py``)."""
