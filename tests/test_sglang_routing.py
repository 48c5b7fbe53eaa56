"""SGLang's own ``select_experts`` (torch-native router, CPU) with the plugin's routing hooks applied.

The module fixture first records SGLang's unhooked outputs for every scenario, then applies the
routing hooks through SGLang's ``HookRegistry`` and publishes a runtime whose layers are real
``TopKConfig`` objects.  Hooks are process-global: this module leaves them applied, and every other
test module is unaffected because the hooks pass through when no runtime is published.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tests.sglang_helpers import deepseek_topk_config, publish_runtime, sglang_select_experts
from xshare_sglang import PrunerConfig, route_within, select_experts_mask
from xshare_sglang.policies.rewrite import RETAINED_ONE
from xshare_sglang.sglang_plugin.runtime import get_runtime, set_runtime

pytestmark = pytest.mark.sglang

NUM_TOKENS, NUM_VALID, NUM_EXPERTS, TOP_K = 12, 10, 64, 8


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=torch.Generator().manual_seed(seed)) * 1.5


def _configs():
    from sglang.srt.layers.moe.topk import TopKConfig

    bias = torch.randn(NUM_EXPERTS, generator=torch.Generator().manual_seed(99)) * 0.1
    return {
        "qwen3": TopKConfig(top_k=TOP_K, renormalize=True, torch_native=True, scoring_func="softmax", layer_id=0),
        "qwen3_raw": TopKConfig(top_k=TOP_K, renormalize=False, torch_native=True, scoring_func="softmax", layer_id=1),
        "deepseek": deepseek_topk_config(top_k=TOP_K, layer_id=2, correction_bias=bias, torch_native=True),
        "draft": TopKConfig(top_k=TOP_K, renormalize=True, torch_native=True, scoring_func="softmax", layer_id=0),
    }


@pytest.fixture(scope="module")
def sglang_env():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from xshare_sglang.sglang_plugin import hooks, liveness

    configs = _configs()
    baselines = {
        (name, seed): sglang_select_experts(config, _logits(seed))
        for name, config in configs.items()
        for seed in (0, 1)
    }
    for module in hooks.ROUTING_HOOKS:
        HookRegistry.register(module.TARGET, module.hook, HookType(module.KIND))
    HookRegistry.apply_hooks()
    assert liveness.unhooked(hooks.ROUTING_HOOKS) == []
    yield SimpleNamespace(configs=configs, baselines=baselines)
    set_runtime(None)


def _publish(configs, pruner: PrunerConfig, *, names=("qwen3", "qwen3_raw", "deepseek"), phase="decode", d=1):
    return publish_runtime(configs, names, pruner, num_experts=NUM_EXPERTS, num_valid=NUM_VALID, phase=phase, d=d)


def test_hooks_wrap_every_target(sglang_env) -> None:
    from xshare_sglang.sglang_plugin import hooks, liveness

    for module in hooks.ROUTING_HOOKS:
        assert liveness.is_hooked(module.TARGET, module.hook), module.TARGET
    # and a function that is not ours is not reported as hooked
    assert not liveness.is_hooked(hooks.ROUTING_HOOKS[0].TARGET, lambda: None)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_raw"])
@pytest.mark.parametrize(
    "pruner",
    [
        PrunerConfig(policy="xshare", k0=1, budget=4),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=2, budget=1),
        PrunerConfig(policy="moe-spec", max_experts=12),
        PrunerConfig(policy="lynx", alpha=1.0, beta=2),
    ],
    ids=lambda c: c.policy,
)
def test_softmax_routing_stays_in_the_mask(sglang_env, name, pruner) -> None:
    """Qwen3-like softmax routing: every pick is a kept expert, and each real token routes exactly as
    the reference routes inside the reference's mask (same experts, same weights)."""
    config = sglang_env.configs[name]
    runtime = _publish(sglang_env.configs, pruner, d=4)
    logits = _logits(0)
    ids, weights = sglang_select_experts(config, logits)
    keep = select_experts_mask(logits, pruner, top_k=TOP_K, tokens_per_request=4, num_valid_tokens=NUM_VALID)
    state = runtime.layers[id(config)]
    assert torch.equal(state.keep, keep)
    assert keep.sum() < NUM_EXPERTS  # the policy really pruned
    picked = ids[:NUM_VALID]
    assert keep[picked[picked >= 0].long()].all()
    assert (ids[NUM_VALID:] == -1).all() and (weights[NUM_VALID:] == 0).all()
    assert torch.isfinite(weights).all()
    want_ids, want_weights = route_within(logits, keep, top_k=TOP_K, renormalize=config.renormalize)
    for t in range(NUM_VALID):
        mine = {int(e): float(w) for e, w in zip(ids[t], weights[t], strict=True) if e >= 0}
        ref = {int(e): float(w) for e, w in zip(want_ids[t], want_weights[t], strict=True) if e >= 0}
        assert mine.keys() == ref.keys(), t
        for e in mine:
            assert mine[e] == pytest.approx(ref[e], abs=1e-5)


@pytest.mark.sglang_modes
def test_biased_grouped_sigmoid_routing(sglang_env) -> None:
    """DeepSeek-V3-like routing (sigmoid, correction bias, 8 groups, top-4 groups): the bias is masked
    with the logits, so no pick lands on a pruned expert; weights stay finite; padding rows are -1."""
    config = sglang_env.configs["deepseek"]
    pruner = PrunerConfig(policy="xshare", k0=2, budget=20)
    runtime = _publish(sglang_env.configs, pruner)
    for seed in (0, 1):
        logits = _logits(seed)
        ids, weights = sglang_select_experts(config, logits)
        keep = select_experts_mask(logits, pruner, top_k=TOP_K, num_valid_tokens=NUM_VALID, scoring="sigmoid")
        assert torch.equal(runtime.layers[id(config)].keep, keep)
        live = ids[:NUM_VALID]
        assert keep[live[live >= 0].long()].all()
        assert (live >= 0).sum(dim=1).min() >= 2  # every token keeps at least its warm-up experts
        assert (ids[NUM_VALID:] == -1).all()
        assert torch.isfinite(weights).all() and (weights[ids < 0] == 0).all()
    # the unmasked bias parameter itself was never modified
    assert torch.equal(config.correction_bias, _configs()["deepseek"].correction_bias)


@pytest.mark.sglang_modes
def test_bias_is_masked_with_the_logits(sglang_env) -> None:
    """The hooked call (the fused kernels in place of SGLang's router) equals SGLang's own biased
    grouped routing run on masked logits *and* masked bias, followed by the drop of leftover picks
    and padding rows, up to the order of a row's slots (SGLang's grouped top-k leaves them unsorted;
    the MoE sums over slots): masking the bias is what lets a token reach kept experts instead of
    losing its slots."""
    import dataclasses

    from xshare_sglang.policies.apply import mask_router_inputs
    from xshare_sglang.policies.rewrite import rewrite_routing

    config = sglang_env.configs["deepseek"]
    pruner = PrunerConfig(policy="xshare", k0=1, budget=3)
    _publish(sglang_env.configs, pruner)
    logits = _logits(1)
    ids, weights = sglang_select_experts(config, logits)
    keep = select_experts_mask(logits, pruner, top_k=TOP_K, num_valid_tokens=NUM_VALID, scoring="sigmoid")
    masked_logits, masked_bias = mask_router_inputs(logits, keep, bias=config.correction_bias)
    set_runtime(None)  # hooks pass through: plain SGLang routing on the masked inputs
    expected_ids, expected_weights = sglang_select_experts(
        dataclasses.replace(config, correction_bias=masked_bias), masked_logits
    )
    rewrite_routing(expected_ids, expected_weights, keep, num_valid_tokens=NUM_VALID)
    order, expected_order = ids.sort(dim=1).indices, expected_ids.sort(dim=1).indices
    assert torch.equal(ids.gather(1, order), expected_ids.gather(1, expected_order))
    torch.testing.assert_close(weights.gather(1, order), expected_weights.gather(1, expected_order))
    # with the bias left unmasked SGLang would keep picking pruned experts (all then dropped)
    unmasked_ids, _ = sglang_select_experts(config, masked_logits)
    assert (~keep[unmasked_ids[:NUM_VALID].long()]).sum() > (ids[:NUM_VALID] < 0).sum()


def _tied_logits(seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Router logits on a coarse grid, so many rows hold ties among and around their top-k."""
    logits = torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=torch.Generator().manual_seed(seed))
    return (torch.round(logits * 4) / 4).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_keep_all_routes_bit_for_bit_as_sglang(sglang_env, dtype, seed) -> None:
    """A mask that keeps every expert the tokens pick (xshare with k0 = top_k and no budget) serves
    SGLang's own routing exactly: same ids in the same slot order (ties included), same weight bits."""
    config = sglang_env.configs["qwen3"]
    pruner = PrunerConfig(policy="xshare", k0=TOP_K, budget=0)
    for logits in (_logits(seed).to(dtype), _tied_logits(seed, dtype)):
        set_runtime(None)
        want_ids, want_weights = sglang_select_experts(config, logits)
        runtime = _publish(sglang_env.configs, pruner)
        ids, weights = sglang_select_experts(config, logits)
        keep = runtime.layers[id(config)].keep
        assert keep.sum() < NUM_EXPERTS  # a real mask: the experts no token picks are pruned
        assert torch.equal(ids[:NUM_VALID], want_ids[:NUM_VALID].to(ids.dtype))
        assert torch.equal(weights[:NUM_VALID], want_weights[:NUM_VALID])
        assert (ids[NUM_VALID:] == -1).all()


def test_model_routing_is_adopted_only_where_exact(sglang_env) -> None:
    """Rows that lose one of their own experts route inside the mask as the reference does; rows that
    keep all of theirs take SGLang's routing, except under softmax without renormalization, where the
    weights are shares of every kept expert and only a mask keeping every expert qualifies."""
    pruner = PrunerConfig(policy="xshare", k0=2, budget=20)
    logits = _tied_logits(5, torch.bfloat16)
    for name in ("qwen3", "qwen3_raw"):
        config = sglang_env.configs[name]
        set_runtime(None)
        own_ids, own_weights = sglang_select_experts(config, logits)
        runtime = _publish(sglang_env.configs, pruner)
        ids, weights = sglang_select_experts(config, logits)
        keep = runtime.layers[id(config)].keep
        ref_ids, ref_weights = route_within(logits, keep, top_k=TOP_K, renormalize=config.renormalize)
        inside = keep[own_ids[:NUM_VALID].long()].all(dim=1)
        assert inside.any() and not inside.all()  # both kinds of rows occur
        for t in range(NUM_VALID):
            if inside[t] and config.renormalize:
                assert torch.equal(ids[t], own_ids[t].to(ids.dtype)) and torch.equal(weights[t], own_weights[t])
            else:
                # the same experts up to ties (equal logits): the reference takes the lower index
                chosen, ref_chosen = logits[t, ids[t].long()], logits[t, ref_ids[t].long()]
                assert torch.equal(chosen.sort().values, ref_chosen.sort().values), t
                torch.testing.assert_close(weights[t].sort().values, ref_weights[t].sort().values)
                if not config.renormalize:  # shares of the kept experts: more than SGLang's unpruned weights
                    assert weights[t].sum() > own_weights[t].sum()


def test_unpruned_calls_are_bit_identical(sglang_env) -> None:
    """Draft layers, phases outside the config, and no runtime at all: SGLang's outputs exactly."""
    pruner = PrunerConfig(policy="xshare", k0=1, budget=2)
    # 1. the draft model's TopKConfig is not one of the runtime's layers
    _publish(sglang_env.configs, pruner)
    for seed in (0, 1):
        got = sglang_select_experts(sglang_env.configs["draft"], _logits(seed))
        assert all(torch.equal(a, b) for a, b in zip(got, sglang_env.baselines[("draft", seed)], strict=True))
    # 2. an extend (prefill) forward with the default phases
    _publish(sglang_env.configs, pruner, phase="extend")
    for name in ("qwen3", "deepseek"):
        got = sglang_select_experts(sglang_env.configs[name], _logits(0))
        assert all(torch.equal(a, b) for a, b in zip(got, sglang_env.baselines[(name, 0)], strict=True))
    # 3. no runtime (pruner off, or a process that is not a scheduler)
    set_runtime(None)
    for name in ("qwen3", "qwen3_raw", "deepseek"):
        got = sglang_select_experts(sglang_env.configs[name], _logits(1))
        assert all(torch.equal(a, b) for a, b in zip(got, sglang_env.baselines[(name, 1)], strict=True))


def test_fault_falls_back_to_unpruned_routing(sglang_env, caplog) -> None:
    """A selection failure leaves that call's routing exactly as SGLang computes it; counted, logged."""
    pruner = PrunerConfig(policy="xshare", k0=1, budget=2)
    runtime = _publish(sglang_env.configs, pruner)
    runtime.layers[id(sglang_env.configs["qwen3"])].num_experts = 32  # logits will not match: a fault
    with caplog.at_level(logging.ERROR, logger="xshare_sglang.sglang_plugin.runtime"):
        first = sglang_select_experts(sglang_env.configs["qwen3"], _logits(0))
        second = sglang_select_experts(sglang_env.configs["qwen3"], _logits(1))
    baseline_ids, baseline_weights = sglang_env.baselines[("qwen3", 0)]
    assert torch.equal(first[0][:NUM_VALID], baseline_ids[:NUM_VALID])
    assert torch.equal(first[1][:NUM_VALID], baseline_weights[:NUM_VALID])
    assert torch.equal(second[0][:NUM_VALID], sglang_env.baselines[("qwen3", 1)][0][:NUM_VALID])
    assert runtime.faults == 2
    errors = [r.getMessage() for r in caplog.records if "selection failed" in r.getMessage()]
    assert len(errors) == 1  # rate-limited
    assert "layer 0" in errors[0] and "expected [T, 32]" in errors[0]


def test_metrics_accumulate_on_the_device(sglang_env) -> None:
    pruner = PrunerConfig(policy="oea", k0=1)
    runtime = _publish(sglang_env.configs, pruner)
    config = sglang_env.configs["qwen3"]
    activated = []
    for seed in (0, 1):
        ids, _ = sglang_select_experts(config, _logits(seed))
        live = ids[:NUM_VALID]
        activated.append(len(set(live[live >= 0].tolist())))
    row = runtime.metrics_of("decode")[runtime.layers[id(config)].row]
    keeps = [
        int(select_experts_mask(_logits(s), pruner, top_k=TOP_K, num_valid_tokens=NUM_VALID).sum()) for s in (0, 1)
    ]
    assert row[3] == 2  # two calls
    assert row[0] == sum(activated) and row[1] == sum(keeps)
    assert 0 < row[2] <= 2 * RETAINED_ONE  # two retained-mass ratios, each in (0, 1], in units of 2**-24
    untouched = runtime.metrics_of("decode")[runtime.layers[id(sglang_env.configs["deepseek"])].row]
    assert untouched.tolist() == [0.0, 0.0, 0.0, 0.0]


def test_metrics_report_and_reset(sglang_env, caplog) -> None:
    from xshare_sglang.sglang_plugin.metrics import MetricsReporter

    runtime = _publish(sglang_env.configs, PrunerConfig(policy="oea", k0=1))
    reporter = MetricsReporter(runtime, prometheus=False)
    sglang_select_experts(sglang_env.configs["qwen3"], _logits(0))
    with caplog.at_level(logging.INFO, logger="xshare_sglang.sglang_plugin.metrics"):
        summary = reporter.report()
    assert summary["layer_calls"] == 1 and 0 < summary["kept_experts"] < NUM_EXPERTS
    assert any("moe-pruner:" in r.getMessage() and "kept" in r.getMessage() for r in caplog.records)
    assert runtime.metrics.abs().sum() == 0  # zeroed in place
    assert reporter.report() is None
    assert get_runtime() is runtime
