"""Pruning where SGLang routes inside the MoE kernel: SGLang's own ``TopK.forward_cuda`` with the
``TRITON_KERNEL`` and ``BYPASSED`` top-k output formats forced, on CPU, with the plugin's routing hooks.

``TRITON_KERNEL`` runs ``triton_kernels``' routing (its top-k kernel in Triton's interpreter,
``TRITON_INTERPRET=1`` from ``tests/conftest.py``); ``BYPASSED`` hands the logits to the fused MoE
kernel, so the test reads what would be handed on (the ``BypassedTopKOutput``) and materializes it as
the kernels that need explicit ids do (``to_standard``).  The layer shapes are GPT-OSS-20B's router
(32 experts, top-4, softmax renormalized over the picks) and a DeepSeek-V3-style grouped, biased
router for the bias masking.  SGLang's expert placement is stubbed to "none" (a server without EPLB),
the one published config ``TopK`` reads here.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.sglang_helpers import apply_routing_hooks, deepseek_topk_config, publish_runtime, stand_in_topk
from xshare_sglang import PrunerConfig, route_within, select_experts_mask
from xshare_sglang.policies.apply import mask_router_inputs
from xshare_sglang.policies.rewrite import RETAINED_ONE
from xshare_sglang.sglang_plugin.runtime import set_runtime

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_modes]

NUM_TOKENS, NUM_VALID, NUM_EXPERTS, TOP_K = 12, 10, 32, 4
PRUNER = PrunerConfig(policy="xshare", k0=1, budget=4)
#: |weight - reference| bound of ``triton_kernels``' routing weights against the float32 reference
#: router (:func:`route_within`): float32 softmax rounding, a few ulps of weights <= 1.
WEIGHT_ATOL = 1e-6


def _logits(seed: int) -> torch.Tensor:
    return torch.randn(NUM_TOKENS, NUM_EXPERTS, generator=torch.Generator().manual_seed(seed)) * 1.5


def _configs() -> dict:
    from sglang.srt.layers.moe.topk import TopKConfig, TopKOutputFormat

    kernel, bypassed = TopKOutputFormat.TRITON_KERNEL, TopKOutputFormat.BYPASSED
    bias = torch.randn(NUM_EXPERTS, generator=torch.Generator().manual_seed(7)) * 0.1
    return {
        "gptoss": TopKConfig(top_k=TOP_K, renormalize=True, layer_id=0, output_format=kernel),
        "gptoss_raw": TopKConfig(top_k=TOP_K, renormalize=False, layer_id=1, output_format=kernel),
        # torch_native: a materialized BYPASSED output routes with SGLang's CPU-capable top-k here
        "bypassed": TopKConfig(top_k=TOP_K, renormalize=True, layer_id=2, output_format=bypassed, torch_native=True),
        "bypassed_biased": deepseek_topk_config(
            top_k=TOP_K, layer_id=3, correction_bias=bias, topk_group=2, output_format=bypassed, torch_native=True
        ),
        "draft": TopKConfig(top_k=TOP_K, renormalize=True, layer_id=0, output_format=kernel),
    }


@pytest.fixture(scope="module")
def kernel_env():
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            ExpertLocationDispatchInfo, "init_new", classmethod(lambda cls, layer_id, *, is_draft=False: None)
        )
        configs = _configs()
        modules = {name: stand_in_topk(config, layer_id=config.layer_id) for name, config in configs.items()}
        set_runtime(None)
        baselines = {(name, seed): _forward(modules[name], _logits(seed)) for name in configs for seed in (0, 1)}
        apply_routing_hooks()
        yield SimpleNamespace(configs=configs, modules=modules, baselines=baselines)
        set_runtime(None)


def _num_valid() -> torch.Tensor:
    return torch.tensor([NUM_VALID], dtype=torch.int32)


def _forward(module, logits: torch.Tensor):
    """SGLang's ``TopK.forward_cuda`` on ``logits`` (hooked where a runtime is published), as a CUDA
    graph calls it: the real-token count on the device."""
    return module.forward_cuda(torch.zeros(NUM_TOKENS, 16), logits, num_token_non_padded=_num_valid())


def _publish(configs, pruner: PrunerConfig = PRUNER, *, phase: str = "decode", names=None):
    names = names or ("gptoss", "gptoss_raw", "bypassed", "bypassed_biased")
    return publish_runtime(configs, names, pruner, num_experts=NUM_EXPERTS, num_valid=NUM_VALID, phase=phase)


def _kernel_parts(output) -> dict[str, torch.Tensor]:
    """The defined parts of a ``TritonKernelTopKOutput`` (its gate scales past the routed slots are
    read from unwritten scratch memory)."""
    metadata = output.a_ragged_metadata
    total = int(metadata.slice_sizes.sum())
    return {
        "slice_sizes": metadata.slice_sizes,
        "slice_offs": metadata.slice_offs,
        "gather_indx": output.gather_indx,
        "scatter_indx": output.scatter_indx,
        "gate_scal": output.gate_scal[:total],
    }


def _assert_same_kernel_routing(got, want) -> None:
    mine, theirs = _kernel_parts(got), _kernel_parts(want)
    for name, tensor in mine.items():
        assert torch.equal(tensor, theirs[name]), name
    assert got.n_expts_act == want.n_expts_act


def _dense(output) -> torch.Tensor:
    """Weights [T, E] of a ``TritonKernelTopKOutput``: its slots are sorted by expert (the ragged
    metadata's slice sizes), each slot names its ``token * k + j`` in ``scatter_indx``."""
    sizes = output.a_ragged_metadata.slice_sizes.long()
    total = int(sizes.sum())
    experts = torch.repeat_interleave(torch.arange(NUM_EXPERTS), sizes)
    slots = output.scatter_indx[:total].long()
    dense = torch.zeros(NUM_TOKENS, NUM_EXPERTS)
    dense[slots // output.n_expts_act, experts] = output.gate_scal[:total].float()
    return dense


def _dense_reference(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    dense = torch.zeros(NUM_TOKENS + 1, NUM_EXPERTS)
    rows = torch.where(ids >= 0, torch.arange(NUM_TOKENS)[:, None], NUM_TOKENS)
    dense[rows, ids.long().clamp(min=0)] = weights
    return dense[:NUM_TOKENS]


@pytest.mark.parametrize("name", ["gptoss", "gptoss_raw"])
def test_triton_kernel_routing_equals_routing_the_masked_logits(kernel_env, name) -> None:
    """GPT-OSS on ``--moe-runner-backend triton_kernel``: the pruned call is ``triton_kernels``' routing
    of the masked logits bit for bit, every routed expert is kept, and the weights are the reference
    router's inside the mask (within :data:`WEIGHT_ATOL`)."""
    config, module = kernel_env.configs[name], kernel_env.modules[name]
    runtime = _publish(kernel_env.configs)
    logits = _logits(0)
    output = _forward(module, logits.clone())
    keep = runtime.layers[id(config)].keep
    want_keep = select_experts_mask(logits, PRUNER, top_k=TOP_K, num_valid_tokens=NUM_VALID)
    assert torch.equal(keep, want_keep)
    assert TOP_K <= int(keep.sum()) < NUM_EXPERTS  # pruned, with enough experts for every token
    assert runtime.faults == 0
    sizes = output.a_ragged_metadata.slice_sizes
    assert int(sizes.sum()) == NUM_VALID * TOP_K  # padding rows are not routed
    assert (sizes[~keep] == 0).all()  # no pruned expert receives a token
    set_runtime(None)
    _assert_same_kernel_routing(output, _forward(module, mask_router_inputs(logits, keep)[0]))
    ids, weights = route_within(logits, keep, top_k=TOP_K, renormalize=config.renormalize)
    dense, reference = _dense(output), _dense_reference(ids, weights)
    assert torch.equal(dense[:NUM_VALID] > 0, reference[:NUM_VALID] > 0)  # the same experts per token
    torch.testing.assert_close(dense[:NUM_VALID], reference[:NUM_VALID], rtol=0, atol=WEIGHT_ATOL)


def test_triton_kernel_metrics_come_from_the_routing(kernel_env) -> None:
    """Activated experts from the routing's expert histogram, kept experts from the mask, the retained
    mass from the selection, one call per layer call: all added on the device."""
    configs = kernel_env.configs
    runtime = _publish(configs)
    activated, kept = 0, 0
    for seed in (0, 1):
        output = _forward(kernel_env.modules["gptoss"], _logits(seed))
        activated += int((output.a_ragged_metadata.slice_sizes > 0).sum())
        kept += int(runtime.layers[id(configs["gptoss"])].keep.sum())
    row = runtime.metrics_of("decode")[runtime.layers[id(configs["gptoss"])].row]
    assert row[0] == activated and row[1] == kept and row[3] == 2
    assert 0 < row[2] <= 2 * RETAINED_ONE
    assert activated <= kept < 2 * NUM_EXPERTS  # each mask holds >= top-k experts: only kept ones route
    assert runtime.metrics_of("decode")[runtime.layers[id(configs["gptoss_raw"])].row].tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("name", ["bypassed", "bypassed_biased"])
def test_bypassed_routing_hands_on_the_masked_inputs(kernel_env, name) -> None:
    """``flashinfer_trtllm`` / ``flashinfer_mxfp4`` (``BYPASSED``): the fused kernel is handed the masked
    logits and a config carrying the masked bias; materialized, they route exactly as SGLang's
    ``select_experts`` routes those inputs, once (not pruned a second time), with every weighted pick
    kept.  The layer's own config and bias are untouched."""
    from sglang.srt.layers.moe.topk import BypassedTopKOutput

    config, module = kernel_env.configs[name], kernel_env.modules[name]
    bias_before = None if config.correction_bias is None else config.correction_bias.clone()
    runtime = _publish(kernel_env.configs)
    logits = _logits(1)
    output = _forward(module, logits.clone())
    assert isinstance(output, BypassedTopKOutput)
    state = runtime.layers[id(config)]
    keep = state.keep.clone()
    assert int(keep.sum()) < NUM_EXPERTS
    masked_logits, masked_bias = mask_router_inputs(logits, keep, bias=config.correction_bias)
    assert torch.equal(output.raw_router_logits, masked_logits)
    assert output.topk_config is not config and id(output.topk_config) not in runtime.layers
    assert dataclasses.replace(output.topk_config, correction_bias=config.correction_bias) == config
    if masked_bias is None:
        assert output.topk_config.correction_bias is None
    else:
        assert torch.equal(output.topk_config.correction_bias, masked_bias)
        assert torch.equal(config.correction_bias, bias_before)
    row = state.row
    assert runtime.metrics_of("decode")[row, 3] == 1
    standard = output.to_standard()
    assert runtime.metrics_of("decode")[row, 3] == 1 and torch.equal(state.keep, keep)  # no second pruned call
    weighted = standard.topk_ids[:NUM_VALID][standard.topk_weights[:NUM_VALID] > 0]
    assert keep[weighted.long()].all()
    set_runtime(None)
    shadow = dataclasses.replace(config, correction_bias=masked_bias)
    want = BypassedTopKOutput(
        torch.zeros(NUM_TOKENS, 16), masked_logits.clone(), shadow, num_token_non_padded=_num_valid()
    ).to_standard()
    assert torch.equal(standard.topk_ids, want.topk_ids)
    assert torch.equal(standard.topk_weights, want.topk_weights)


def test_bypassed_metrics_count_the_reference_routing(kernel_env) -> None:
    """Where the kernel routes out of sight, activated experts are those the layer's reference router
    gives the masked inputs over the real rows."""
    configs = kernel_env.configs
    runtime = _publish(configs)
    logits = _logits(0)
    _forward(kernel_env.modules["bypassed"], logits.clone())
    state = runtime.layers[id(configs["bypassed"])]
    ids, _ = route_within(logits, state.keep, top_k=TOP_K, num_valid_tokens=NUM_VALID)
    used = {int(e) for e in ids[ids >= 0]}
    assert runtime.metrics_of("decode")[state.row].tolist()[:2] == [len(used), int(state.keep.sum())]
    assert runtime.metrics_of("decode")[state.row, 3] == 1


def test_unpruned_kernel_calls_are_bit_identical(kernel_env) -> None:
    """Draft layers, phases outside the config, and no runtime at all: SGLang's outputs exactly (the
    BYPASSED output hands on the caller's own logits tensor and the layer's own config)."""
    configs, modules = kernel_env.configs, kernel_env.modules

    def check(name: str, seed: int) -> None:
        logits = _logits(seed)
        got, want = _forward(modules[name], logits), kernel_env.baselines[(name, seed)]
        if configs[name].output_format.name == "TRITON_KERNEL":
            _assert_same_kernel_routing(got, want)
        else:
            assert got.raw_router_logits is logits and got.topk_config is configs[name]
            assert torch.equal(got.to_standard().topk_ids, want.to_standard().topk_ids)

    runtime = _publish(configs)
    check("draft", 0)  # not one of the runtime's layers
    _publish(configs, phase="extend")  # the default phases prune decode and verify only
    for name in ("gptoss", "bypassed", "bypassed_biased"):
        check(name, 1)
    set_runtime(None)
    for name in ("gptoss_raw", "bypassed"):
        check(name, 0)
    assert runtime.faults == 0


def test_kernel_fault_falls_back_to_unpruned_routing(kernel_env, caplog) -> None:
    """A selection failure leaves the call exactly as SGLang routes it, counted and logged, with no
    metrics added."""
    configs, modules = kernel_env.configs, kernel_env.modules
    runtime = _publish(configs)
    for name in ("gptoss", "bypassed"):
        runtime.layers[id(configs[name])].num_experts = 16  # the logits will not fit: a fault
    with caplog.at_level(logging.ERROR, logger="xshare_sglang.sglang_plugin.runtime"):
        kernel = _forward(modules["gptoss"], _logits(0))
        logits = _logits(1)
        bypassed = _forward(modules["bypassed"], logits)
    _assert_same_kernel_routing(kernel, kernel_env.baselines[("gptoss", 0)])
    assert bypassed.raw_router_logits is logits and bypassed.topk_config is configs["bypassed"]
    assert runtime.faults == 2
    assert runtime.metrics.abs().sum() == 0
    assert any("selection failed in layer 0" in r.getMessage() for r in caplog.records)


def test_kernel_path_never_synchronises(kernel_env) -> None:
    """The plugin's per-layer work on these formats (selection, masking, metrics from a histogram or
    from the reference router) as a CUDA graph replays it: no host sync, no host-to-device copy."""
    from xshare_sglang.testing.host_sync import HostSyncDetector

    configs = kernel_env.configs
    runtime = _publish(configs)
    logits = _logits(0)
    counts = (torch.arange(NUM_EXPERTS) % 3).to(torch.int32)  # a routing histogram
    with HostSyncDetector() as detector:
        for name in ("gptoss", "bypassed_biased"):
            config = configs[name]
            call = runtime.begin_call(config, runtime.num_valid_buffer)
            masked = runtime.mask_for_kernel(call, logits, config.correction_bias)
            assert masked is not None
            if name == "gptoss":
                runtime.count_kernel_routing(call, expert_counts=counts)
            else:
                runtime.count_kernel_routing(call, masked_logits=masked[0], masked_bias=masked[1])
            runtime.end_call()
    assert runtime.faults == 0
    assert not detector.findings, detector.report()


def test_truncation_is_refused_on_kernel_routing(kernel_env) -> None:
    """Truncation keeps natural picks and drops the pruned ones after routing: no such step exists
    where the kernel routes, so the config is refused when the model loads, naming both flags."""
    from xshare_sglang.sglang_plugin.model_layers import MoeLayer, PrunerSetupError, check_model

    layer = MoeLayer(kernel_env.modules["gptoss"], NUM_EXPERTS, None)
    truncation = PrunerConfig(policy="xshare", k0=1, budget=4, coverage="truncation")
    with pytest.raises(PrunerSetupError, match=r"--moe-pruner-coverage truncation.*--moe-runner-backend"):
        check_model(truncation, [layer], ep_size=1)
    check_model(PRUNER, [layer], ep_size=1)


def test_guard_finds_gpt_oss_router(kernel_env) -> None:
    """The start-up guard reads a layer's own router logits from its ``gate``, or from GPT-OSS's
    ``router`` (a linear layer that returns ``(logits, bias)``)."""
    from xshare_sglang.sglang_plugin.guard import _router_logits

    class Router(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x), None

    block = torch.nn.Module()
    block.router = Router(16, NUM_EXPERTS)
    states = torch.randn(3, 16)
    torch.testing.assert_close(_router_logits(block, states), block.router(states)[0])
    assert _router_logits(torch.nn.Module(), states) is None
