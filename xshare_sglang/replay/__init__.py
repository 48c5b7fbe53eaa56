"""Offline evaluation from routing traces: the trace format, batch builders, replay through the
policies, the bandwidth cost model and Pareto plots.  Runs no model (the tiny models' own tools are
in :mod:`xshare_sglang.tiny`) and imports no SGLang.
"""

from .batches import SCENARIOS, BatchShape, build_batches, mixed_load_batches, segment_batches, single_load_batches
from .configs import DEFAULT_SHAPES, VERIFY_SHAPES, default_configs, sweep_configs, verify_configs
from .cost import DEVICES, Device, modeled_speedup, moe_read_seconds
from .engine import ReplayRow, replay_table
from .route_csv import RouteTrace, bundled_trace_path, load_route_csv
from .tokens import TokenTable, token_table
from .trace import LayerCall, Trace, TraceMeta, load_trace, trace_from_route_csv

__all__ = [
    "DEFAULT_SHAPES",
    "DEVICES",
    "SCENARIOS",
    "VERIFY_SHAPES",
    "BatchShape",
    "Device",
    "LayerCall",
    "ReplayRow",
    "RouteTrace",
    "TokenTable",
    "Trace",
    "TraceMeta",
    "build_batches",
    "bundled_trace_path",
    "default_configs",
    "load_route_csv",
    "load_trace",
    "mixed_load_batches",
    "modeled_speedup",
    "moe_read_seconds",
    "replay_table",
    "segment_batches",
    "single_load_batches",
    "sweep_configs",
    "token_table",
    "trace_from_route_csv",
    "verify_configs",
]
