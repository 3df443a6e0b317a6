"""Run records: the MLflow run of a training run and its attempt runs, the resume audit, the
logged model, the metric shipper that follows ``metrics.jsonl``, and the flow's chunk row.
Callers ask :mod:`tasks.records.run_records`, which hands each record to the run's tracker
(:mod:`tasks.records.tracker`; MLflow's: :mod:`tasks.records.mlflow_tracker`).

May import: ``training`` and this package.  Never Prefect, ``tasks.supervision``,
``tasks.remote`` or ``flows``.  MLflow is imported here and nowhere in ``training``.
"""
