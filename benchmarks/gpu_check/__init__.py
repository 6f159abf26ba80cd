"""The parts of ``benchmarks/gpu.py``: one module per section (environment, gemm, convert, training), the carry
preparation, the plan, the runner, the timing helpers and the report."""
