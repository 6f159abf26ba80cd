"""Judging models by running them: output comparison, latency, precision checks and baselines regression.

Submodules are imported on demand (``nmdeploy.evaluation.compare``, ``.bench``, ``.precision``, ``.regress``).
"""
