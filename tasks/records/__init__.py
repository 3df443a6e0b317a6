"""Run records: the MLflow run of a training run and its attempt runs, the resume audit, the
logged model, the metric shipper that follows ``metrics.jsonl``, and the flow's chunk row.

May import: ``training`` and this package.  Never Prefect, ``tasks.supervision``,
``tasks.remote`` or ``flows``.  MLflow is imported here and nowhere in ``training``.
"""
