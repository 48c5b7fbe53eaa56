"""Periodic read-out of the per-layer pruning metrics: one log line and Prometheus gauges.

The routing hooks accumulate, per MoE layer and on the device, the sums of activated experts, kept
experts and retained score mass, and the number of calls (``PrunerRuntime.metrics``).  Every
``log_interval`` pruned forwards the reporter takes a snapshot without stalling the host: the
accumulators are copied into a pinned host buffer with a non-blocking copy on the current stream,
followed by an event and by zeroing them in place (CUDA graphs keep writing into the same tensor).
The snapshot is read on a later forward, once its event has completed (``Event.query``, which never
waits): it is logged, and exported when SGLang runs with ``--enable-metrics``.  Nothing on the
forward path waits for the device.  While a snapshot is still in flight the next interval is
skipped, and the accumulators keep summing, so no layer call is lost.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..break_even import GuardTable
from ..policies.rewrite import RETAINED_ONE
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
        metrics = runtime.metrics
        #: copies from a CUDA device are asynchronous; from host memory there is nothing to wait for
        self.asynchronous = metrics.device.type == "cuda"
        self._host = torch.empty(metrics.shape, dtype=metrics.dtype, pin_memory=self.asynchronous)
        self._ready: Any = None  # event recorded after the copy in flight
        self._pending = False
        self._warned_unpruned = False

    def on_pruned_forward(self) -> None:
        """Count one pruned forward: read a snapshot whose copy completed, take one at the interval."""
        runtime = self.runtime
        runtime.pruned_forwards += 1
        if self._pending:
            self.collect()
        interval = runtime.settings.log_interval
        if interval and runtime.pruned_forwards % interval == 0 and not self._pending:
            self.snapshot()
            self.collect()

    def snapshot(self) -> bool:
        """Copy the accumulators to the host buffer without waiting and zero them; False while the
        previous snapshot has not been read yet (the accumulators then keep summing)."""
        if self._pending:
            return False
        metrics = self.runtime.metrics
        if self.asynchronous:
            self._host.copy_(metrics, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host.copy_(metrics)
        metrics.zero_()
        self._pending = True
        return True

    def collect(self) -> dict[str, float] | None:
        """Log and export the snapshot if its copy completed (never waits); the means logged, or None
        (no snapshot ready, or no layer call in it)."""
        if not self._pending or (self._ready is not None and not self._ready.query()):
            return None
        self._pending, self._ready = False, None
        return self._publish(self._host.clone())

    def report(self) -> dict[str, float] | None:
        """Snapshot, wait for the copy and publish: for shutdown and tests, never on the forward path."""
        if self._pending and self._ready is not None:
            self._ready.synchronize()
        summary = self.collect()
        if summary is not None or not self.snapshot():
            return summary
        if self._ready is not None:
            self._ready.synchronize()
        return self.collect()

    def _publish(self, sums: torch.Tensor) -> dict[str, float] | None:
        calls = sums[:, 3]
        seen = calls > 0
        if self.prometheus:
            self._export(sums)  # also when every call fell back: the fallbacks must still be counted
        if not bool(seen.any()):
            return None
        self._warn_unpruned_layers(seen)
        per_layer = sums[seen, :3] / calls[seen, None]
        per_layer[:, 2] /= RETAINED_ONE
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

    def _warn_unpruned_layers(self, seen: torch.Tensor) -> None:
        """Once: layers that ran no pruned call while others did (a router that bypasses SGLang's
        ``select_experts``, or a selection that fails on every call) run unpruned; say which."""
        missing = [layer_id for layer_id, ok in zip(self._layer_ids, seen.tolist(), strict=True) if not ok]
        if missing and not self._warned_unpruned:
            self._warned_unpruned = True
            logger.warning(
                "moe-pruner: MoE layers %s ran no pruned call in the last %d pruned forwards (other layers did): "
                "they serve unpruned",
                missing,
                self.runtime.settings.log_interval,
            )

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
            self._gauges["retained"].labels(**labels).set(float(sums[row, 2]) / RETAINED_ONE / calls)
        new_faults = self.runtime.faults - self._reported_faults
        if new_faults:
            self._gauges["fallbacks"].labels(**labelnames).inc(new_faults)
            self._reported_faults = self.runtime.faults

    def export_guard(self, table: GuardTable) -> None:
        """Publish the start-up guard's decisions: one gauge per (phase, bucket), and its start-up time."""
        if not self.prometheus:
            return
        from prometheus_client import Gauge

        names = [*self.labels, "phase", "tokens"]
        gauges = {
            "pruned": Gauge(
                "moe_pruner:guard_pruned",
                "1 where the start-up guard kept pruning for this bucket of real tokens, 0 where it turned it off.",
                labelnames=names,
                multiprocess_mode="mostrecent",
            ),
            "unpruned_s": Gauge(
                "moe_pruner:guard_unpruned_seconds",
                "Median start-up time of the timed MoE layers for this bucket, unpruned.",
                labelnames=names,
                multiprocess_mode="mostrecent",
            ),
            "pruned_s": Gauge(
                "moe_pruner:guard_pruned_seconds",
                "Median start-up time of the timed MoE layers for this bucket, pruned (selection included).",
                labelnames=names,
                multiprocess_mode="mostrecent",
            ),
        }
        for decision in table.decisions:
            labels = {**self.labels, "phase": decision.phase, "tokens": str(decision.num_tokens)}
            gauges["pruned"].labels(**labels).set(1.0 if decision.prune else 0.0)
            for key, value in (("unpruned_s", decision.unpruned_s), ("pruned_s", decision.pruned_s)):
                if value is not None:
                    gauges[key].labels(**labels).set(value)
        startup = Gauge(
            "moe_pruner:guard_startup_seconds",
            "Seconds the start-up guard added to the server's start.",
            labelnames=list(self.labels),
            multiprocess_mode="mostrecent",
        )
        startup.labels(**self.labels).set(table.seconds)

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
