"""SGLang serving modes: each one the pruner accepts is exact, each one it cannot honour is refused.

One test (or group) per mode, marked ``sglang_modes``; each runs SGLang 0.5.23's own code on CPU and
failed before the change it covers.  The table in docs/sglang-modes.md points at these tests.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.sglang_helpers import apply_routing_hooks
from xshare_sglang import PrunerConfig, route_within, select_experts_mask
from xshare_sglang.sglang_plugin.metrics import MetricsReporter
from xshare_sglang.sglang_plugin.model_layers import make_layer_state, make_runtime
from xshare_sglang.sglang_plugin.runtime import ForwardScope, set_runtime
from xshare_sglang.sglang_plugin.settings import PluginSettings

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_modes]

NUM_TOKENS, NUM_VALID, NUM_EXPERTS, TOP_K = 12, 10, 64, 8


def _logits(seed: int, num_tokens: int = NUM_TOKENS, num_experts: int = NUM_EXPERTS) -> torch.Tensor:
    return torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)) * 1.5


def _softmax_config(layer_id: int = 0, **overrides):
    from sglang.srt.layers.moe.topk import TopKConfig

    fields = dict(top_k=TOP_K, renormalize=True, torch_native=True, scoring_func="softmax", layer_id=layer_id)
    fields.update(overrides)
    return TopKConfig(**fields)


def _route(config, logits, **kwargs):
    """SGLang's own ``select_experts`` (hooked when a runtime is published)."""
    from sglang.srt.layers.moe import topk

    out = topk.select_experts(
        hidden_states=torch.zeros(logits.shape[0], 16),
        router_logits=logits.clone(),
        topk_config=config,
        layer_id=config.layer_id,
        **kwargs,
    )
    return out.topk_ids.clone(), out.topk_weights.clone()


def _publish(configs, pruner: PrunerConfig, *, num_experts: int = NUM_EXPERTS, phase: str = "decode"):
    states = {
        id(config): make_layer_state(config, layer_id=config.layer_id, row=row, num_experts=num_experts, device="cpu")
        for row, config in enumerate(configs)
    }
    runtime = make_runtime(PluginSettings(pruner=pruner), states, "cpu")
    runtime.num_valid_buffer.fill_(NUM_VALID)
    runtime.enter(
        ForwardScope(phase=phase, num_valid=runtime.num_valid_buffer, cfg=runtime.config_for(phase)),
    )
    set_runtime(runtime)
    return runtime


def _as_sets(ids, weights, rows):
    return [{int(e): float(w) for e, w in zip(ids[t], weights[t], strict=True) if int(e) >= 0} for t in range(rows)]


@pytest.fixture(autouse=True)
def _hooks():
    apply_routing_hooks()
    yield
    set_runtime(None)


# ---------------------------------------------------------------------------------- coverage
@pytest.mark.parametrize("policy", [PrunerConfig(policy="xshare", k0=1, budget=3), PrunerConfig(policy="oea", k0=2)])
def test_truncation_coverage_keeps_natural_picks(policy) -> None:
    """``--moe-pruner-coverage truncation``: each token keeps its own top-k picks and weights, and only
    the picks outside the keep mask are dropped (no substitute expert, no renormalization) - exactly
    the reference's ``route_within(..., coverage="truncation")``, not substitution."""
    import dataclasses

    pruner = dataclasses.replace(policy, coverage="truncation")
    config = _softmax_config()
    _publish([config], pruner)
    logits = _logits(3)
    ids, weights = _route(config, logits)
    keep = select_experts_mask(logits, pruner, top_k=TOP_K, num_valid_tokens=NUM_VALID)
    assert keep.sum() < NUM_EXPERTS
    want_ids, want_weights = route_within(logits, keep, top_k=TOP_K, coverage="truncation", num_valid_tokens=NUM_VALID)
    mine, ref = _as_sets(ids, weights, NUM_TOKENS), _as_sets(want_ids, want_weights, NUM_TOKENS)
    for t in range(NUM_TOKENS):
        assert mine[t].keys() == ref[t].keys(), t
        for e in mine[t]:
            assert mine[t][e] == pytest.approx(ref[t][e], abs=1e-5)
    # truncation really differs from substitution here: some token lost a slot instead of a swap
    sub_ids, _ = route_within(logits, keep, top_k=TOP_K, coverage="substitution", num_valid_tokens=NUM_VALID)
    assert (ids[:NUM_VALID] < 0).sum() > (sub_ids[:NUM_VALID] < 0).sum()


# ---------------------------------------------------------------------------------- metrics
class _PendingEvent:
    """Stands in for ``torch.cuda.Event``: the copy completes when the test says so."""

    done = False

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return _PendingEvent.done

    def synchronize(self) -> None:
        raise AssertionError("the forward path waited for the device")


class _DeviceReads(torch.overrides.TorchFunctionMode):
    """Records every op that reads ``watched`` back to the host (what would block on a GPU)."""

    BLOCKING = frozenset({"to", "cpu", "item", "tolist", "numpy", "__bool__", "__float__", "__int__", "clone"})

    def __init__(self, watched: torch.Tensor) -> None:
        super().__init__()
        self.watched, self.reads, self.copies = watched, [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        touches = any(a is self.watched for a in args)
        if touches and name in self.BLOCKING:
            self.reads.append(name)
        if name == "copy_" and len(args) > 1 and args[1] is self.watched:
            self.copies.append(bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)))
        return func(*args, **kwargs)


def test_metrics_never_wait_for_the_device(monkeypatch, caplog) -> None:
    """The periodic metrics report takes a non-blocking copy into a host buffer and reads it on a
    later forward once the copy's event completed: no device-to-host read on the forward path, and
    the layer calls made while the copy is in flight are kept for the next report."""
    config = _softmax_config()
    runtime = _publish([config], PrunerConfig(policy="oea", k0=1))
    runtime.settings = PluginSettings(pruner=runtime.settings.pruner, log_interval=2)
    reporter = MetricsReporter(runtime, prometheus=False)
    reporter.asynchronous = True  # as with a CUDA device: copies complete later, signalled by an event
    monkeypatch.setattr(torch.cuda, "Event", _PendingEvent)
    _PendingEvent.done = False
    row = runtime.metrics[0]

    def forward(seed):
        _route(config, _logits(seed))
        with _DeviceReads(runtime.metrics) as watch:
            reporter.on_pruned_forward()
        return watch

    with caplog.at_level(logging.INFO, logger="xshare_sglang.sglang_plugin.metrics"):
        assert forward(0).reads == []
        watch = forward(1)  # the interval: snapshot taken, nothing read yet
        assert watch.reads == [] and watch.copies == [True]
        assert row.tolist() == [0.0, 0.0, 0.0, 0.0]  # zeroed in place after the copy
        assert not [r for r in caplog.records if "pruned forwards" in r.getMessage()]
        forward(2)  # copy still in flight: not read, and this call is kept in the accumulators
        assert row[3] == 1
        _PendingEvent.done = True
        watch = forward(3)  # copy complete: published; and this forward is the next interval
        assert watch.reads == [] and watch.copies == [True]
    lines = [r.getMessage() for r in caplog.records if "pruned forwards" in r.getMessage()]
    # the calls of forwards 2 and 3, made while the first copy was in flight, are in the second report
    assert len(lines) == 2 and all("2 layer calls" in line for line in lines)
    assert row[3] == 0


@pytest.mark.gpu
def test_metrics_report_runs_without_host_sync_on_cuda() -> None:
    """On a GPU: CUDA's sync debug mode raises on any synchronizing call during the forward path."""
    config = _softmax_config()
    runtime = _publish([config], PrunerConfig(policy="oea", k0=1))
    runtime.metrics = runtime.metrics.cuda()
    runtime.settings = PluginSettings(pruner=runtime.settings.pruner, log_interval=1)
    reporter = MetricsReporter(runtime, prometheus=False)
    published = []
    publish = reporter._publish
    reporter._publish = lambda sums: published.append(sums) or publish(sums)
    runtime.metrics[0, 3] = 5
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            reporter.on_pruned_forward()
            torch.cuda._sleep(1_000_000)  # device work after the copy: still nothing waits for it
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    reporter.report()
    assert sum(float(sums[0, 3]) for sums in published) == 5
