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

With ``--enable-metrics`` every family of :data:`METRICS` is created when the reporter is (in the
scheduler process, once the target model is loaded, so before the server answers its first health
check), each series with its known labels (every MoE layer, the TP rank) at 0: a server that never
fell back shows ``moe_pruner:selection_fallbacks_total 0`` rather than nothing.  The start-up guard's
gauges (:data:`GUARD_METRICS`) exist only with ``--moe-pruner-guard auto``, set to its decisions.
SGLang collects every process's series through prometheus_client's multiprocess mode, so the gauges
use its ``mostrecent`` mode (which drops a series never set: they are set to 0 explicitly).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..break_even import GuardTable
from ..policies.rewrite import RETAINED_ONE
from .runtime import PrunerRuntime

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MetricSpec:
    """One Prometheus family of the plugin.

    Attributes
    ----------
    key : str
        The reporter's name for it.
    name : str
        The family's name (a counter's samples carry ``_total`` after it).
    kind : str
        ``gauge`` or ``counter``.
    help : str
        The ``# HELP`` text.
    per_layer : bool
        Labelled by MoE layer (``layer``) besides the reporter's own labels.
    """

    key: str
    name: str
    kind: str
    help: str
    per_layer: bool = False

    @property
    def series(self) -> str:
        """The sample name ``/metrics`` shows."""
        return f"{self.name}_total" if self.kind == "counter" else self.name


#: The families of a pruning server with ``--enable-metrics``, every series present from start-up.
METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "activated",
        "moe_pruner:activated_experts",
        "gauge",
        "Mean distinct experts the routed tokens use per layer call, since the last report (0 before the first).",
        per_layer=True,
    ),
    MetricSpec(
        "kept",
        "moe_pruner:kept_experts",
        "gauge",
        "Mean experts in the keep mask per layer call, since the last report (0 before the first).",
        per_layer=True,
    ),
    MetricSpec(
        "retained",
        "moe_pruner:retained_score_mass",
        "gauge",
        "Mean share of the batch's aggregate router score held by kept experts, since the last report "
        "(0 before the first).",
        per_layer=True,
    ),
    MetricSpec(
        "layer_calls",
        "moe_pruner:layer_calls",
        "counter",
        "Pruned calls of this MoE layer that added their metrics (every call, or those of the forwards "
        "--moe-pruner-metrics-every samples), added at each report.",
        per_layer=True,
    ),
    MetricSpec(
        "forwards",
        "moe_pruner:pruned_forwards",
        "counter",
        "Forwards of the target model that ran pruned routing.",
    ),
    MetricSpec(
        "fallbacks",
        "moe_pruner:selection_fallbacks",
        "counter",
        "Layer calls left unpruned because selection failed.",
    ),
)

#: The start-up guard's families (``--moe-pruner-guard auto`` only), labelled by phase and bucket
#: except the start-up time.
GUARD_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "pruned",
        "moe_pruner:guard_pruned",
        "gauge",
        "1 where the start-up guard kept pruning for this bucket of real tokens, 0 where it turned it off.",
    ),
    MetricSpec(
        "unpruned_s",
        "moe_pruner:guard_unpruned_seconds",
        "gauge",
        "Median start-up time of the timed MoE layers for this bucket, unpruned.",
    ),
    MetricSpec(
        "pruned_s",
        "moe_pruner:guard_pruned_seconds",
        "gauge",
        "Median start-up time of the timed MoE layers for this bucket, pruned (selection included).",
    ),
    MetricSpec(
        "startup",
        "moe_pruner:guard_startup_seconds",
        "gauge",
        "Seconds the start-up guard added to the server's start.",
    ),
)

#: Families already made in this process, by (registry, name): a second reporter reuses them
#: (prometheus_client refuses to register a name twice).
# (id(registry), name) -> (registry, label names, family); holding the registry keeps its id from being
# reused by a later registry after this one is garbage-collected
_FAMILIES: dict[tuple[int, str], tuple[Any, tuple[str, ...], Any]] = {}


def _family(spec: MetricSpec, labelnames: list[str], registry: Any = None) -> Any:
    """The prometheus_client object of ``spec``, made on first use in this process.

    Imported here, not at module level: prometheus_client must be loaded after SGLang has set
    ``PROMETHEUS_MULTIPROC_DIR``.
    """
    from prometheus_client import REGISTRY, Counter, Gauge

    registry = REGISTRY if registry is None else registry
    key = (id(registry), spec.name)
    names = tuple(labelnames)
    if key in _FAMILIES and _FAMILIES[key][0] is registry:
        _, known, family = _FAMILIES[key]
        if known != names:
            raise ValueError(f"{spec.name} already exists with labels {list(known)}, not {list(names)}")
        return family
    if spec.kind == "counter":
        family = Counter(spec.name, spec.help, labelnames=names, registry=registry)
    else:
        family = Gauge(spec.name, spec.help, labelnames=names, multiprocess_mode="mostrecent", registry=registry)
    _FAMILIES[key] = (registry, names, family)
    return family


def _series(family: Any, labels: dict[str, str]) -> Any:
    """The series of ``family`` with ``labels`` (the family itself when it has no labels)."""
    return family.labels(**labels) if labels else family


class MetricsReporter:
    """Turns the device accumulators into a log line and Prometheus series.

    Parameters
    ----------
    runtime : PrunerRuntime
    prometheus : bool
        Export :data:`METRICS` (SGLang started with ``--enable-metrics``): every series is created
        here, at 0, for each MoE layer of ``runtime``.
    labels : dict
        Extra labels for every series (e.g. the TP rank).
    registry : prometheus_client.CollectorRegistry, optional
        Where the families are registered (default: prometheus_client's process-wide registry,
        the one SGLang's ``/metrics`` reads through the multiprocess files).
    """

    def __init__(
        self,
        runtime: PrunerRuntime,
        *,
        prometheus: bool,
        labels: dict[str, str] | None = None,
        registry: Any = None,
    ) -> None:
        self.runtime = runtime
        self.prometheus = prometheus
        self.labels = dict(labels or {})
        self.registry = registry
        self._families: dict[str, Any] | None = None
        self._reported_faults = 0
        self._layer_ids = [state.layer_id for state in sorted(runtime.layers.values(), key=lambda s: s.row)]
        metrics = runtime.metrics
        #: copies from a CUDA device are asynchronous; from host memory there is nothing to wait for
        self.asynchronous = metrics.device.type == "cuda"
        self._host = torch.empty(metrics.shape, dtype=metrics.dtype, pin_memory=self.asynchronous)
        self._ready: Any = None  # event recorded after the copy in flight
        self._pending = False
        self._warned_unpruned = False
        if prometheus:
            self._start_series()

    def on_pruned_forward(self) -> None:
        """Count one pruned forward: read a snapshot whose copy completed, take one at the interval."""
        runtime = self.runtime
        runtime.pruned_forwards += 1
        if self._families is not None:
            # host-side counters only: nothing here reads the device
            _series(self._families["forwards"], self.labels).inc()
            self._export_faults()
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
        every = self.runtime.settings.metrics_every
        logger.info(
            "moe-pruner: %d pruned forwards, %d layer calls%s: activated experts %.1f, kept %.1f, "
            "retained score mass %.1f%%, selection fallbacks %d",
            self.runtime.pruned_forwards,
            int(summary["layer_calls"]),
            f" sampled (1 forward in {every})" if every > 1 else "",
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
        if self._families is None:
            self._start_series()
        families = self._families
        for row, layer_id in enumerate(self._layer_ids):
            calls = float(sums[row, 3])
            if calls == 0:
                continue
            labels = {**self.labels, "layer": str(layer_id)}
            families["activated"].labels(**labels).set(float(sums[row, 0]) / calls)
            families["kept"].labels(**labels).set(float(sums[row, 1]) / calls)
            families["retained"].labels(**labels).set(float(sums[row, 2]) / RETAINED_ONE / calls)
            families["layer_calls"].labels(**labels).inc(calls)
        self._export_faults()

    def _export_faults(self) -> None:
        new_faults = self.runtime.faults - self._reported_faults
        if new_faults:
            _series(self._families["fallbacks"], self.labels).inc(new_faults)
            self._reported_faults = self.runtime.faults

    def export_guard(self, table: GuardTable) -> None:
        """Publish the start-up guard's decisions: one gauge per (phase, bucket), and its start-up time."""
        if not self.prometheus:
            return
        names = [*self.labels, "phase", "tokens"]
        gauges = {
            spec.key: _family(spec, list(self.labels) if spec.key == "startup" else names, self.registry)
            for spec in GUARD_METRICS
        }
        for decision in table.decisions:
            labels = {**self.labels, "phase": decision.phase, "tokens": str(decision.num_tokens)}
            gauges["pruned"].labels(**labels).set(1.0 if decision.prune else 0.0)
            for key, value in (("unpruned_s", decision.unpruned_s), ("pruned_s", decision.pruned_s)):
                if value is not None:
                    gauges[key].labels(**labels).set(value)
        _series(gauges["startup"], self.labels).set(table.seconds)

    def _start_series(self) -> None:
        """Create every family of :data:`METRICS` and each of its series, at 0."""
        names = list(self.labels)
        self._families = {
            spec.key: _family(spec, [*names, "layer"] if spec.per_layer else names, self.registry) for spec in METRICS
        }
        for spec in METRICS:
            family = self._families[spec.key]
            label_sets = (
                [{**self.labels, "layer": str(layer_id)} for layer_id in self._layer_ids]
                if spec.per_layer
                else [self.labels]
            )
            for labels in label_sets:
                series = _series(family, labels)
                if spec.kind == "counter":
                    series.inc(0)  # creates the series; a counter never goes back
                else:
                    series.set(0.0)  # mostrecent gauges need a set to be collected
