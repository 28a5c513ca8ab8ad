"""kiln's operator side: the ``kiln`` command and what it starts on one machine.

``kiln run`` (``local_run``: every installed service as a supervised process, over the
embedded servers of ``embedded``), ``kiln eval`` (``posthoc_eval``), ``kiln chaos``
(``chaos``), the dashboard (``dashboard``) and ``kiln tasks synth|validate``
(``tasks_synth``, ``tasks_validate``, which drive env-pool's environment builder).

Invariant: this package may import every service; ``kiln.shared`` (the library every
service imports) never imports this package or any service, so a service image needs
only ``kiln-shared``, its own package and, for ``kiln health`` / ``kiln db upgrade``,
this one without its optional dependencies.
"""
