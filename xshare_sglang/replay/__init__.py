"""Offline replay of routing traces through the policies (the demo and, later, the replay tool)."""

from .batches import BatchShape, segment_batches
from .demo import VERIFY_SHAPES, ReplayRow, default_configs, replay_trace, verify_configs
from .route_csv import RouteTrace, bundled_trace_path, load_route_csv

__all__ = [
    "VERIFY_SHAPES",
    "BatchShape",
    "ReplayRow",
    "RouteTrace",
    "bundled_trace_path",
    "default_configs",
    "load_route_csv",
    "replay_trace",
    "segment_batches",
    "verify_configs",
]
