"""Inference: ``python -m hpcpipe.infer`` (``command``), the setup, the pipelined run, the streaming stage, row
I/O and the report. ``hpcpipe.infer.run(weights, input, output, ...)`` is the Python entry point."""

from __future__ import annotations

from typing import Any


def run(weights: Any, input: Any, output: Any, **kwargs: Any) -> dict[str, Any]:
    """Infer the outputs of ``input``'s rows into ``output`` (collective); see :func:`hpcpipe.infer.pipeline.run`."""
    from hpcpipe.infer.pipeline import run as _run  # MPI starts only when asked to run
    return _run(weights, input, output, **kwargs)
