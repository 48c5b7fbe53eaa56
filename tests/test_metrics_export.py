"""The plugin's Prometheus series, without a server: every family of ``METRICS`` exists from the
reporter's creation, each series at 0 for each layer, and the counters then follow the forwards.

The live counterpart (SGLang's multiprocess ``/metrics``) is ``tests/test_live_metrics.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.break_even import BucketDecision, GuardTable
from xshare_sglang.policies.rewrite import RETAINED_ONE
from xshare_sglang.sglang_plugin.metrics import GUARD_METRICS, METRICS, SPEC_METRICS, MetricsReporter
from xshare_sglang.sglang_plugin.model_layers import make_runtime
from xshare_sglang.sglang_plugin.settings import PluginSettings

prometheus_client = pytest.importorskip("prometheus_client")

LAYER_IDS = [3, 7, 11]  # model layer ids of the MoE layers, in row order


def _runtime(log_interval: int = 2):
    # the reporter reads only each layer's id and row
    states = {row: SimpleNamespace(layer_id=layer_id, row=row) for row, layer_id in enumerate(LAYER_IDS)}
    settings = PluginSettings(pruner=PrunerConfig(policy="oea", k0=1), log_interval=log_interval)
    return make_runtime(settings, states, "cpu")


def _samples(registry) -> dict[str, dict[tuple, float]]:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name.startswith("moe_pruner:"):
                out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return out


def _labels(layer: int | None = None) -> tuple:
    items = {"tp_rank": "0"} if layer is None else {"layer": str(layer), "tp_rank": "0"}
    return tuple(sorted(items.items()))


def test_every_series_exists_at_zero_from_creation() -> None:
    registry = prometheus_client.CollectorRegistry()
    MetricsReporter(_runtime(), prometheus=True, labels={"tp_rank": "0"}, registry=registry)
    samples = _samples(registry)
    for spec in METRICS:
        want = [_labels(layer) for layer in LAYER_IDS] if spec.per_layer else [_labels()]
        assert sorted(samples.get(spec.series, {})) == sorted(want), spec.series
        assert set(samples[spec.series].values()) == {0.0}, spec.series
    assert not any(spec.series in samples for spec in GUARD_METRICS)


def test_counters_follow_the_forwards_and_fallbacks_show_at_once() -> None:
    registry = prometheus_client.CollectorRegistry()
    runtime = _runtime(log_interval=2)
    reporter = MetricsReporter(runtime, prometheus=True, labels={"tp_rank": "0"}, registry=registry)
    for _ in range(3):
        runtime.metrics_of("decode")[:, 0] += 4  # activated experts
        runtime.metrics_of("decode")[:, 1] += 2  # kept
        runtime.metrics_of("decode")[:, 2] += RETAINED_ONE // 2
        runtime.metrics_of("decode")[:, 3] += 1  # one call per layer
        reporter.on_pruned_forward()
    samples = _samples(registry)
    assert samples["moe_pruner:pruned_forwards_total"] == {_labels(): 3.0}
    # the report at forward 2 added its two calls per layer; the third waits for the next report
    assert samples["moe_pruner:layer_calls_total"] == {_labels(layer): 2.0 for layer in LAYER_IDS}
    assert samples["moe_pruner:kept_experts"] == {_labels(layer): 2.0 for layer in LAYER_IDS}
    assert samples["moe_pruner:activated_experts"] == {_labels(layer): 4.0 for layer in LAYER_IDS}
    assert samples["moe_pruner:retained_score_mass"] == {_labels(layer): 0.5 for layer in LAYER_IDS}
    assert samples["moe_pruner:selection_fallbacks_total"] == {_labels(): 0.0}
    runtime.faults += 5  # failures between reports are exported by the next pruned forward
    reporter.on_pruned_forward()
    samples = _samples(registry)
    assert samples["moe_pruner:selection_fallbacks_total"] == {_labels(): 5.0}
    assert samples["moe_pruner:layer_calls_total"] == {_labels(layer): 3.0 for layer in LAYER_IDS}


def test_a_second_reporter_reuses_the_families_and_guard_gauges_appear() -> None:
    registry = prometheus_client.CollectorRegistry()
    MetricsReporter(_runtime(), prometheus=True, labels={"tp_rank": "0"}, registry=registry)
    reporter = MetricsReporter(_runtime(), prometheus=True, labels={"tp_rank": "0"}, registry=registry)
    table = GuardTable(
        (
            BucketDecision("decode", 1, 0.002, 0.003, False, "slower"),
            BucketDecision("decode", 8, 0.004, None, True, "forced"),
        ),
        seconds=1.5,
    )
    reporter.export_guard(table)
    samples = _samples(registry)
    bucket = {n: (("phase", "decode"), ("tokens", str(n)), ("tp_rank", "0")) for n in (1, 8)}
    assert samples["moe_pruner:guard_pruned"] == {bucket[1]: 0.0, bucket[8]: 1.0}
    assert samples["moe_pruner:guard_unpruned_seconds"] == {bucket[1]: 0.002, bucket[8]: 0.004}
    assert samples["moe_pruner:guard_pruned_seconds"] == {bucket[1]: 0.003}
    assert samples["moe_pruner:guard_startup_seconds"] == {_labels(): 1.5}
    with pytest.raises(ValueError, match="already exists with labels"):
        MetricsReporter(_runtime(), prometheus=True, labels={"dp_rank": "0"}, registry=registry)


def test_series_without_extra_labels() -> None:
    registry = prometheus_client.CollectorRegistry()
    runtime = _runtime()
    reporter = MetricsReporter(runtime, prometheus=True, registry=registry)
    reporter.on_pruned_forward()
    samples = _samples(registry)
    assert samples["moe_pruner:pruned_forwards_total"] == {(): 1.0}
    assert samples["moe_pruner:selection_fallbacks_total"] == {(): 0.0}
    assert sorted(samples["moe_pruner:kept_experts"]) == sorted((("layer", str(layer)),) for layer in LAYER_IDS)


def test_nothing_is_exported_without_enable_metrics() -> None:
    runtime = _runtime(log_interval=1)
    reporter = MetricsReporter(runtime, prometheus=False)
    runtime.metrics_of("decode")[:, 3] += 1
    reporter.on_pruned_forward()
    assert reporter._families is None


def _serve_metrics(monkeypatch, registry) -> None:
    """Answer the A/B tool's GET /metrics with ``registry``'s exposition text."""
    from xshare_sglang.serving.ab import ab_server

    class Page:
        status_code = 200

        @property
        def text(self) -> str:
            return prometheus_client.generate_latest(registry).decode()

    monkeypatch.setattr(ab_server.requests, "get", lambda *args, **kwargs: Page())


def test_ab_tool_ignores_gauges_not_reported_yet(monkeypatch) -> None:
    """The A/B tool averages the gauges of the layers reported so far: a server at start-up (every
    layer at 0 calls) gives None, as before the series existed from start-up."""
    from xshare_sglang.serving.ab import ab_server

    registry = prometheus_client.CollectorRegistry()
    runtime = _runtime(log_interval=1)
    MetricsReporter(runtime, prometheus=True, labels={"tp_rank": "0"}, registry=registry)
    _serve_metrics(monkeypatch, registry)
    assert ab_server.pruner_metrics("http://server") is None
    reporter = MetricsReporter(runtime, prometheus=True, labels={"tp_rank": "0"}, registry=registry)
    runtime.metrics_of("decode")[0] = torch.tensor([6, 3, RETAINED_ONE, 1])  # one call of the first layer only
    reporter.on_pruned_forward()
    assert ab_server.pruner_metrics("http://server") == {
        "activated_experts": 6.0,
        "kept_experts": 3.0,
        "retained_score_mass": 1.0,
    }


def test_phase_split_and_speculative_series() -> None:
    """A speculative server's reporter: per-phase activated experts and calls, the distinct experts
    per verify request, forwards by draft tokens, each from start-up at 0; the adaptive step gauges
    once SGLang's adaptive speculation starts; the all-phase series stay as they were."""
    registry = prometheus_client.CollectorRegistry()
    runtime = _runtime(log_interval=2)
    reporter = MetricsReporter(
        runtime, prometheus=True, labels={"tp_rank": "0"}, registry=registry, draft_tokens=[4, 1, 2]
    )
    samples = _samples(registry)

    def by_phase(phase: str, layer: int) -> tuple:
        return tuple(sorted({"layer": str(layer), "phase": phase, "tp_rank": "0"}.items()))

    def by_width(d: int) -> tuple:
        return tuple(sorted({"draft_tokens": str(d), "tp_rank": "0"}.items()))

    assert samples["moe_pruner:phase_activated_experts"] == {
        by_phase(phase, layer): 0.0 for phase in ("decode", "verify") for layer in LAYER_IDS
    }
    assert samples["moe_pruner:verify_request_experts"] == {_labels(layer): 0.0 for layer in LAYER_IDS}
    assert samples["moe_pruner:pruned_spec_forwards_total"] == {by_width(d): 0.0 for d in (1, 2, 4)}
    assert "moe_pruner:speculative_steps" not in samples
    decode, verify = runtime.metrics_of("decode"), runtime.metrics_of("verify")
    decode[:] = torch.tensor([6, 6, RETAINED_ONE, 3])  # three decode calls per layer, 2 experts each
    verify[:] = torch.tensor([40, 40, RETAINED_ONE, 4])  # four verify calls, 10 experts each
    runtime.request_metrics[:] = torch.tensor([21, 5])  # five requests, 21 distinct experts in all
    reporter.on_pruned_forward(1)
    reporter.on_pruned_forward(4)
    samples = _samples(registry)
    assert samples["moe_pruner:phase_activated_experts"] == {
        by_phase(phase, layer): want for phase, want in (("decode", 2.0), ("verify", 10.0)) for layer in LAYER_IDS
    }
    assert samples["moe_pruner:phase_layer_calls_total"] == {
        by_phase(phase, layer): want for phase, want in (("decode", 3.0), ("verify", 4.0)) for layer in LAYER_IDS
    }
    assert samples["moe_pruner:activated_experts"] == {_labels(layer): 46 / 7 for layer in LAYER_IDS}
    assert samples["moe_pruner:verify_request_experts"] == {_labels(layer): 4.2 for layer in LAYER_IDS}
    assert samples["moe_pruner:pruned_spec_forwards_total"] == {by_width(1): 1.0, by_width(2): 0.0, by_width(4): 1.0}
    reporter.export_adaptive_steps({1: 3, 8: 0})
    steps = _samples(registry)["moe_pruner:speculative_steps"]
    assert steps == {(("batch_size", "1"), ("tp_rank", "0")): 3.0, (("batch_size", "8"), ("tp_rank", "0")): 0.0}


def test_a_server_that_does_not_speculate_has_no_speculative_series() -> None:
    registry = prometheus_client.CollectorRegistry()
    reporter = MetricsReporter(_runtime(), prometheus=True, labels={"tp_rank": "0"}, registry=registry)
    reporter.on_pruned_forward()
    reporter.export_adaptive_steps({1: 3})
    samples = _samples(registry)
    assert not any(spec.series in samples for spec in SPEC_METRICS)
    assert {labels for labels in samples["moe_pruner:phase_activated_experts"]} == {
        tuple(sorted({"layer": str(layer), "phase": phase, "tp_rank": "0"}.items()))
        for phase in ("decode", "verify")
        for layer in LAYER_IDS
    }


def test_ab_tool_reads_the_verify_phase_experts(monkeypatch) -> None:
    """The A/B tool's reading of /metrics adds the activated experts of verify calls alone, averaged over
    the layers the verify phase reported (its own layer-call counter), next to the all-phase means."""
    from xshare_sglang.serving.ab import ab_server

    registry = prometheus_client.CollectorRegistry()
    runtime = _runtime(log_interval=1)
    reporter = MetricsReporter(runtime, prometheus=True, labels={"tp_rank": "0"}, registry=registry, draft_tokens=[4])
    _serve_metrics(monkeypatch, registry)
    runtime.metrics_of("decode")[:] = torch.tensor([2, 2, RETAINED_ONE, 1])
    runtime.metrics_of("verify")[0] = torch.tensor([12, 12, RETAINED_ONE, 1])  # the first layer's verify call only
    reporter.on_pruned_forward(4)
    got = ab_server.pruner_metrics("http://server")
    assert got["verify_activated_experts"] == 12.0
    assert got["activated_experts"] == pytest.approx((14 / 2 + 2 + 2) / 3)


def test_the_report_line_keeps_its_format_and_ends_with_the_phases(caplog) -> None:
    """The line operators and tests parse ('activated experts A, kept K, retained score mass R%,
    selection fallbacks F') is unchanged; the split by phase comes after it, only when it tells
    something (two phases in the interval, or a verify call)."""
    import logging
    import re

    line = re.compile(
        r"activated experts ([0-9.]+), kept ([0-9.]+), retained score mass [0-9.]+%, selection fallbacks 0"
    )
    runtime = _runtime(log_interval=1)
    reporter = MetricsReporter(runtime, prometheus=False)
    with caplog.at_level(logging.INFO, logger="xshare_sglang.sglang_plugin.metrics"):
        runtime.metrics_of("decode")[:] = torch.tensor([3, 4, RETAINED_ONE, 1])
        reporter.on_pruned_forward()
        runtime.metrics_of("decode")[:] = torch.tensor([2, 4, RETAINED_ONE, 1])
        runtime.metrics_of("verify")[:] = torch.tensor([10, 12, RETAINED_ONE, 1])
        runtime.request_metrics[:] = torch.tensor([14, 2])
        reporter.on_pruned_forward(4)
    first, second = [r.getMessage() for r in caplog.records if "pruned forwards" in r.getMessage()]
    assert line.search(first).groups() == ("3.0", "4.0") and first.endswith("selection fallbacks 0")
    assert line.search(second).groups() == ("6.0", "8.0")
    assert second.endswith("; activated experts by phase: decode 2.0, verify 10.0, per verify request 7.0")
