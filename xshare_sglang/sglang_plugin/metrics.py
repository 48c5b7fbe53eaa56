"""Periodic read-out of the per-layer pruning metrics: one log line and Prometheus gauges.

The routing hooks accumulate, per MoE layer and on the device, the sums of activated experts, kept
experts and retained score mass, and the number of calls (``PrunerRuntime.metrics``).  Every
``log_interval`` pruned forwards this reads them with one device-to-host copy (the only host sync
the plugin does), logs the means, exports them when SGLang runs with ``--enable-metrics``, and
zeroes the accumulators in place (CUDA graphs keep writing into the same tensor).
"""

from __future__ import annotations

import logging
from typing import Any

from .runtime import PrunerRuntime

logger = logging.getLogger(__name__)


class MetricsReporter:
    """Turns the device accumulators into a log line and Prometheus gauges.

    Parameters
    ----------
    runtime : PrunerRuntime
    prometheus : bool
        Export gauges (SGLang started with ``--enable-metrics``).
    labels : dict
        Extra labels for every series (e.g. the TP rank).
    """

    def __init__(self, runtime: PrunerRuntime, *, prometheus: bool, labels: dict[str, str] | None = None) -> None:
        self.runtime = runtime
        self.prometheus = prometheus
        self.labels = dict(labels or {})
        self._gauges: dict[str, Any] | None = None
        self._reported_faults = 0
        self._layer_ids = [state.layer_id for state in sorted(runtime.layers.values(), key=lambda s: s.row)]

    def on_pruned_forward(self) -> None:
        """Count one pruned forward; report when the interval is reached."""
        runtime = self.runtime
        runtime.pruned_forwards += 1
        interval = runtime.settings.log_interval
        if interval and runtime.pruned_forwards % interval == 0:
            self.report()

    def report(self) -> dict[str, float] | None:
        """Read, log, export and reset the accumulators; returns the means logged (None if no call)."""
        sums = self.runtime.metrics.to("cpu", copy=True)
        self.runtime.metrics.zero_()
        calls = sums[:, 3]
        seen = calls > 0
        if self.prometheus:
            self._export(sums)  # also when every call fell back: the fallbacks must still be counted
        if not bool(seen.any()):
            return None
        per_layer = sums[seen, :3] / calls[seen, None]
        means = per_layer.mean(dim=0).tolist()
        summary = {
            "activated_experts": means[0],
            "kept_experts": means[1],
            "retained_score_mass": means[2],
            "layer_calls": float(calls.sum()),
            "fallbacks": float(self.runtime.faults),
        }
        logger.info(
            "moe-pruner: %d pruned forwards, %d layer calls: activated experts %.1f, kept %.1f, "
            "retained score mass %.1f%%, selection fallbacks %d",
            self.runtime.pruned_forwards,
            int(summary["layer_calls"]),
            means[0],
            means[1],
            100.0 * means[2],
            self.runtime.faults,
        )
        return summary

    def _export(self, sums) -> None:
        if self._gauges is None:
            self._gauges = self._make_gauges()
        labelnames = dict(self.labels)
        for row, layer_id in enumerate(self._layer_ids):
            calls = float(sums[row, 3])
            if calls == 0:
                continue
            labels = {**labelnames, "layer": str(layer_id)}
            self._gauges["activated"].labels(**labels).set(float(sums[row, 0]) / calls)
            self._gauges["kept"].labels(**labels).set(float(sums[row, 1]) / calls)
            self._gauges["retained"].labels(**labels).set(float(sums[row, 2]) / calls)
        new_faults = self.runtime.faults - self._reported_faults
        if new_faults:
            self._gauges["fallbacks"].labels(**labelnames).inc(new_faults)
            self._reported_faults = self.runtime.faults

    def _make_gauges(self) -> dict[str, Any]:
        # imported here: prometheus_client must be loaded after SGLang set PROMETHEUS_MULTIPROC_DIR
        from prometheus_client import Counter, Gauge

        names = [*self.labels, "layer"]
        return {
            "activated": Gauge(
                "moe_pruner:activated_experts",
                "Mean distinct experts the routed tokens use per layer call, since the last report.",
                labelnames=names,
                multiprocess_mode="mostrecent",
            ),
            "kept": Gauge(
                "moe_pruner:kept_experts",
                "Mean experts in the keep mask per layer call, since the last report.",
                labelnames=names,
                multiprocess_mode="mostrecent",
            ),
            "retained": Gauge(
                "moe_pruner:retained_score_mass",
                "Mean share of the batch's aggregate router score held by kept experts, since the last report.",
                labelnames=names,
                multiprocess_mode="mostrecent",
            ),
            "fallbacks": Counter(
                "moe_pruner:selection_fallbacks",
                "Layer calls left unpruned because selection failed.",
                labelnames=list(self.labels),
            ),
        }
