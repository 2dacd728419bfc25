"""A run: the stage loop (:mod:`~asyncrl.run.loop`), the builders training and eval share, eval,
SFT data, metrics sinks, the run directory, the signal guard, the compilation cache, provenance
and export. The public entry point is :func:`asyncrl.train`."""
