"""The GPU benchmarks' library: timing in CUDA graphs, token alignment, the MoE-layer benchmark.
``scripts/bench_moe_layer.py`` and ``scripts/bench_selection.py`` are thin command lines over it."""
