"""One MoE layer at decode and verify shapes, baseline against pruned, inside CUDA graphs: the model
shapes, routing from the shipped traces, SGLang's fused-MoE kernel (or ``torch._grouped_mm``), the
checks every row passes before it is timed, and the report.  ``scripts/bench_moe_layer.py`` is its
command line (its docstring says what is measured); ``scripts/bench_selection.py`` reuses the layer
timing.

The modules, each importing only those above it:

- :mod:`.shapes`: the shape table (:data:`MODELS`, :data:`SMOKE_MODELS`) and the policy grid;
- :mod:`.trace_routing`: :class:`TraceRouting`, router logits built from a shipped trace;
- :mod:`.reference`: the float32 reference MoE, the model's top-k and the check tolerances;
- :mod:`.grouped_mm`, :mod:`.sglang_fused`: the two timed MoE backends;
- :mod:`.backends`: which backends a run uses, and their checks against the reference;
- :mod:`.probes`: copy bandwidth, bf16 matmul rate and the roofline;
- :mod:`.case`: one (model, phase, T)'s inputs and the pruned routing over them;
- :mod:`.report`: Markdown / CSV / JSON outputs and the start-up guard's decision table;
- :mod:`.model_bench`: :class:`ModelBench`, which times one shape and builds its rows, and the flags.

This package re-exports their public names.
"""

from .backends import check_alignment, check_backend, resolve_backends
from .case import Case, PrunedLayer, build_case
from .grouped_mm import GroupedMMMoE
from .model_bench import (
    ROOFLINE_TARGET,
    ROOFLINE_TARGET_MIN_T,
    SELECTION_TARGET,
    SELECTION_TARGET_MAX_T,
    SPEEDUP_TARGET,
    SPEEDUP_TARGET_MIN_T,
    ModelBench,
    add_layer_bench_arguments,
)
from .probes import measure_bandwidth, measure_matmul_tflops, roofline_us
from .reference import (
    MOE_TOLERANCE,
    WEIGHT_TOLERANCE,
    activated_experts,
    reference_moe,
    rel_err,
    route_topk,
    routed_slots,
)
from .report import guard_markdown, guard_rows, md_tables, write_outputs
from .sglang_fused import CONFIG_DIR, KERNEL_FILE, REPO_ROOT, SglangFusedMoE, find_sglang_root, sglang_version
from .shapes import MODELS, SMOKE_MODELS, Shape, policy_grid, policy_label
from .trace_routing import TraceRouting

__all__ = [
    "CONFIG_DIR",
    "KERNEL_FILE",
    "MODELS",
    "MOE_TOLERANCE",
    "REPO_ROOT",
    "ROOFLINE_TARGET",
    "ROOFLINE_TARGET_MIN_T",
    "SELECTION_TARGET",
    "SELECTION_TARGET_MAX_T",
    "SMOKE_MODELS",
    "SPEEDUP_TARGET",
    "SPEEDUP_TARGET_MIN_T",
    "WEIGHT_TOLERANCE",
    "Case",
    "GroupedMMMoE",
    "ModelBench",
    "PrunedLayer",
    "SglangFusedMoE",
    "Shape",
    "TraceRouting",
    "activated_experts",
    "add_layer_bench_arguments",
    "build_case",
    "check_alignment",
    "check_backend",
    "find_sglang_root",
    "guard_markdown",
    "guard_rows",
    "md_tables",
    "measure_bandwidth",
    "measure_matmul_tflops",
    "policy_grid",
    "policy_label",
    "reference_moe",
    "rel_err",
    "resolve_backends",
    "roofline_us",
    "route_topk",
    "routed_slots",
    "sglang_version",
    "write_outputs",
]
