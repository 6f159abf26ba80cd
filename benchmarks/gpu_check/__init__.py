"""The parts of ``benchmarks/gpu.py``: one module per section, the carry preparation, the plan, the runner and
the report."""
