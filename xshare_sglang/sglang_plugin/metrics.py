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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..break_even import GuardTable
from ..config import PHASES
from ..policies.rewrite import RETAINED_ONE
from .runtime import PHASE_INDEX, PrunerRuntime

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

#: Families split by the forward's phase (``phase``: each phase the server prunes), per MoE layer.
PHASE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "phase_activated",
        "moe_pruner:phase_activated_experts",
        "gauge",
        "Mean distinct experts the routed tokens use per layer call of this phase (decode, verify, extend, "
        "mixed), since the last report that saw the phase (0 before).",
        per_layer=True,
    ),
    MetricSpec(
        "phase_calls",
        "moe_pruner:phase_layer_calls",
        "counter",
        "Pruned calls of this MoE layer in this phase that added their metrics, added at each report.",
        per_layer=True,
    ),
)

#: Families of a speculative server (EAGLE verify pruned, or ``--speculative-adaptive``).
SPEC_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "request_experts",
        "moe_pruner:verify_request_experts",
        "gauge",
        "Mean distinct experts one request's draft tokens use together per pruned verify layer call (the "
        "experts a verify step adds per request), since the last report that saw a verify call (0 before).",
        per_layer=True,
    ),
    MetricSpec(
        "spec_forwards",
        "moe_pruner:pruned_spec_forwards",
        "counter",
        "Pruned forwards of a speculative server's target model by draft tokens per request (draft_tokens: "
        "steps + 1; 1 is a step of --speculative-adaptive at 0 steps, pruned as decode).",
    ),
    MetricSpec(
        "spec_steps",
        "moe_pruner:speculative_steps",
        "gauge",
        "Draft steps --speculative-adaptive has in force for batches of this size bucket (batch_size: a key "
        "of its adaptive config; 0 = no drafting).",
    ),
    MetricSpec(
        "tier_allowed",
        "moe_pruner:spec_tier_allowed",
        "gauge",
        "1 where the expert-aware tiers (--moe-pruner-guard auto with --speculative-adaptive) let this batch "
        "bucket run this step count, 0 where they took it out of SGLang's candidates.",
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
    draft_tokens : sequence of int
        A speculative server's D values (steps + 1 of every step count it may run): each gets its
        :data:`SPEC_METRICS` forward counter at 0.  Empty for a server that does not speculate.
    """

    def __init__(
        self,
        runtime: PrunerRuntime,
        *,
        prometheus: bool,
        labels: dict[str, str] | None = None,
        registry: Any = None,
        draft_tokens: Sequence[int] = (),
    ) -> None:
        self.runtime = runtime
        self.prometheus = prometheus
        self.labels = dict(labels or {})
        self.registry = registry
        self.draft_tokens = tuple(sorted(set(draft_tokens)))
        self._families: dict[str, Any] | None = None
        self._reported_faults = 0
        self._layer_ids = [state.layer_id for state in sorted(runtime.layers.values(), key=lambda s: s.row)]
        self._phases = [phase for phase in PHASES if runtime.settings.config_for(phase) is not None]
        metrics = runtime.metrics
        #: copies from a CUDA device are asynchronous; from host memory there is nothing to wait for
        self.asynchronous = metrics.device.type == "cuda"
        self._host = torch.empty(metrics.shape, dtype=metrics.dtype, pin_memory=self.asynchronous)
        requests = runtime.request_metrics
        self._host_requests = None
        if requests is not None:
            self._host_requests = torch.empty(requests.shape, dtype=requests.dtype, pin_memory=self.asynchronous)
        self._ready: Any = None  # event recorded after the copy in flight
        self._pending = False
        self._warned_unpruned = False
        if prometheus:
            self._start_series()

    def on_pruned_forward(self, tokens_per_request: int = 1) -> None:
        """Count one pruned forward (of ``tokens_per_request`` rows per request: D of a verify, 1
        otherwise): read a snapshot whose copy completed, take one at the interval."""
        runtime = self.runtime
        runtime.pruned_forwards += 1
        if self._families is not None:
            # host-side counters only: nothing here reads the device
            _series(self._families["forwards"], self.labels).inc()
            if self.draft_tokens:
                labels = {**self.labels, "draft_tokens": str(tokens_per_request)}
                self._families["spec_forwards"].labels(**labels).inc()
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
        sources = [(self.runtime.metrics, self._host)]
        if self._host_requests is not None:
            sources.append((self.runtime.request_metrics, self._host_requests))
        for device, host in sources:
            host.copy_(device, non_blocking=self.asynchronous)
        if self.asynchronous:
            self._ready = torch.cuda.Event()
            self._ready.record()
        for device, _ in sources:
            device.zero_()
        self._pending = True
        return True

    def collect(self) -> dict[str, float] | None:
        """Log and export the snapshot if its copy completed (never waits); the means logged, or None
        (no snapshot ready, or no layer call in it)."""
        if not self._pending or (self._ready is not None and not self._ready.query()):
            return None
        self._pending, self._ready = False, None
        requests = None if self._host_requests is None else self._host_requests.clone()
        return self._publish(self._host.clone(), requests)

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

    def _publish(self, phase_sums: torch.Tensor, requests: torch.Tensor | None = None) -> dict[str, float] | None:
        sums = phase_sums.sum(dim=0)
        calls = sums[:, 3]
        seen = calls > 0
        if self.prometheus:
            # also when every call fell back: the fallbacks must still be counted
            self._export(sums, phase_sums, requests)
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
        by_phase = []
        for phase in self._phases:
            rows = phase_sums[PHASE_INDEX[phase]]
            phase_seen = rows[:, 3] > 0
            if bool(phase_seen.any()):
                activated = float((rows[phase_seen, 0] / rows[phase_seen, 3]).mean())
                summary[f"{phase}_activated_experts"] = activated
                by_phase.append(f"{phase} {activated:.1f}")
        if requests is not None and int(requests[:, 1].sum()) > 0:
            per_request = requests[:, 1] > 0
            summary["verify_request_experts"] = float((requests[per_request, 0] / requests[per_request, 1]).mean())
            by_phase.append(f"per verify request {summary['verify_request_experts']:.1f}")
        # the phases only where they tell something: several of them ran, or a verify ran
        detail = ""
        if len(by_phase) > 1 or "verify_request_experts" in summary:
            detail = "; activated experts by phase: " + ", ".join(by_phase)
        every = self.runtime.settings.metrics_every
        logger.info(
            "moe-pruner: %d pruned forwards, %d layer calls%s: activated experts %.1f, kept %.1f, "
            "retained score mass %.1f%%, selection fallbacks %d%s",
            self.runtime.pruned_forwards,
            int(summary["layer_calls"]),
            f" sampled (1 forward in {every})" if every > 1 else "",
            means[0],
            means[1],
            100.0 * means[2],
            self.runtime.faults,
            detail,
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

    def _export(self, sums, phase_sums, requests) -> None:
        if self._families is None:
            self._start_series()
        families = self._families
        for row, layer_id in enumerate(self._layer_ids):
            labels = {**self.labels, "layer": str(layer_id)}
            for phase in self._phases:
                phase_row = phase_sums[PHASE_INDEX[phase], row]
                phase_calls = float(phase_row[3])
                if phase_calls:
                    phase_labels = {**labels, "phase": phase}
                    families["phase_activated"].labels(**phase_labels).set(float(phase_row[0]) / phase_calls)
                    families["phase_calls"].labels(**phase_labels).inc(phase_calls)
            if requests is not None and "request_experts" in families and int(requests[row, 1]) > 0:
                families["request_experts"].labels(**labels).set(float(requests[row, 0]) / float(requests[row, 1]))
            calls = float(sums[row, 3])
            if calls == 0:
                continue
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

    def export_adaptive_steps(self, steps_by_batch_size: dict[int, int]) -> None:
        """Publish the step count ``--speculative-adaptive`` has in force per batch-size bucket."""
        if self._families is None or "spec_steps" not in self._families:
            return
        for batch_size, steps in steps_by_batch_size.items():
            labels = {**self.labels, "batch_size": str(batch_size)}
            self._families["spec_steps"].labels(**labels).set(float(steps))

    def export_tiers(self, decisions) -> None:
        """Publish the expert-aware tiers: 1 for each (bucket, step count) they allow, 0 for the
        candidates they took out (``decisions``: batch size -> ``spec_tiers.TierDecision``)."""
        if self._families is None or "tier_allowed" not in self._families:
            return
        for decision in decisions.values():
            for steps in decision.candidates:
                labels = {**self.labels, "batch_size": str(decision.batch_size), "steps": str(steps)}
                self._families["tier_allowed"].labels(**labels).set(1.0 if steps in decision.allowed else 0.0)

    def _label_sets(self, spec: MetricSpec) -> list[dict[str, str]]:
        """The series of ``spec`` that exist from start-up."""
        layers = [{**self.labels, "layer": str(layer_id)} for layer_id in self._layer_ids]
        if spec in PHASE_METRICS:
            return [{**labels, "phase": phase} for phase in self._phases for labels in layers]
        if spec.key == "request_experts":
            return layers if self.runtime.request_metrics is not None else []
        if spec.key == "spec_forwards":
            return [{**self.labels, "draft_tokens": str(d)} for d in self.draft_tokens]
        if spec.key in ("spec_steps", "tier_allowed"):
            return []  # created when SGLang's adaptive speculation starts (export_adaptive_steps, export_tiers)
        return layers if spec.per_layer else [self.labels]

    def _start_series(self) -> None:
        """Create every family of :data:`METRICS`, :data:`PHASE_METRICS` and (on a speculative server)
        :data:`SPEC_METRICS`, and each series known at start-up, at 0."""
        names = list(self.labels)
        specs = [*METRICS, *PHASE_METRICS, *(SPEC_METRICS if self.draft_tokens else ())]
        extra = {"phase_activated": ["phase"], "phase_calls": ["phase"], "spec_forwards": ["draft_tokens"]}
        extra["spec_steps"] = ["batch_size"]
        extra["tier_allowed"] = ["batch_size", "steps"]
        self._families = {
            spec.key: _family(
                spec, [*names, *(["layer"] if spec.per_layer else []), *extra.get(spec.key, [])], self.registry
            )
            for spec in specs
        }
        for spec in specs:
            family = self._families[spec.key]
            for labels in self._label_sets(spec):
                series = _series(family, labels)
                if spec.kind == "counter":
                    series.inc(0)  # creates the series; a counter never goes back
                else:
                    series.set(0.0)  # mostrecent gauges need a set to be collected
