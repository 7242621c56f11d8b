"""Importers: experience that other systems logged, read into the registry through the ingest path.

``ratchet ingest --from mlflow|otel|langfuse|openai`` reads MLflow Tracing (``mlflowtraces``), OTLP JSON
spans with the GenAI semantic conventions (``otlpspans``), a Langfuse trace export (``langfusetraces``) and
OpenAI stored completions (``storedcompletions``). Each turns what it reads into ``intake.Turn``s; ``intake``
validates them as ``ratchet ingest`` validates a JSONL line, stores them idempotently (the content hash) and
quarantines, per record with its reason, what it cannot read.
"""
