"""kiln.shared: the contracts and plumbing every kiln service stands on.

Modules: ``contracts`` (streams, subjects, schemas), ``bus`` (nats-py client),
``config`` (pydantic settings, experiment files), ``telemetry`` (OpenTelemetry,
structured logs), ``db`` (SQLAlchemy models, migrations), ``tasks`` (task format and
the built-in suite), ``tools`` (tool schemas shown to the model), ``model`` (the
policy, needs the ``model`` extra), ``embedded`` (local nats-server and PostgreSQL),
``launcher`` and ``cli`` (``kiln``).
"""
