"""GPT-OSS's default MoE path without SGLang: what the ``TopK.forward_cuda`` hook runs, on CPU and a GPU.

Where SGLang routes with ``triton_kernels`` (``TRITON_KERNEL`` top-k format), the hook asks the
runtime for the keep mask and masked logits (:meth:`PrunerRuntime.mask_for_kernel`), SGLang's routing
wrapper (``layers/moe/topk.py:56`` in 0.5.23) calls ``triton_kernels.topk.topk`` on them, and the
runtime counts the call from the routing's expert histogram (:meth:`count_kernel_routing`).  The GPU
machine has ``triton_kernels`` (carried, see docs/benchmarks.md) but no SGLang, so this module drives
those three steps directly, on GPT-OSS-120B's and GPT-OSS-20B's router shapes:

* every routed expert is kept, and the routing equals ``triton_kernels``' top-k of the masked logits
  computed on its own; the weights are the softmax of each token's picks (bfloat16 tolerance);
* on CUDA, no step waits for the host (``set_sync_debug_mode("error")``), and a CUDA graph captured
  once replays new logits and real-token counts exactly as the eager steps compute them, metrics
  included.

On CPU it runs under ``TRITON_INTERPRET=1`` (tests/conftest.py); ``tests/test_sglang_kernel_routing.py``
runs the same path through SGLang's own ``TopK``.
"""

from __future__ import annotations

import pytest
import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.bench.kernel_routing import gptoss_layer_runtime, pruned_kernel_routing
from xshare_sglang.policies.apply import MASKED_LOGIT, mask_router_inputs
from xshare_sglang.policies.rewrite import RETAINED_ONE, selection_metrics

topk_module = pytest.importorskip("triton_kernels.topk", reason="needs triton_kernels (SGLang's dependency)")

#: (experts, top_k) of the routers
SHAPES = {"gpt-oss-120b": (128, 4), "gpt-oss-20b": (32, 4)}
PRUNER = PrunerConfig(policy="xshare", k0=1, budget=8)
BF16_RTOL = 2.0**-7


def _devices():
    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _runtime(num_experts: int, top_k: int, device: str):
    runtime, config = gptoss_layer_runtime(num_experts, top_k, PRUNER, device)
    return runtime, config, runtime.layers[id(config)]


def _pruned_routing(runtime, config, logits: torch.Tensor, num_valid: torch.Tensor, top_k: int):
    """The hook's three steps: keep mask and masked logits, triton_kernels' top-k, metrics."""
    return pruned_kernel_routing(topk_module.topk, runtime, config, logits, num_valid, top_k)


def _logits(num_tokens: int, num_experts: int, seed: int, device: str) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, num_experts, generator=generator) * 2).to(torch.bfloat16).to(device)


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 8, 32])
def test_kernel_routing_stays_in_the_mask(device, shape, num_tokens) -> None:
    num_experts, top_k = SHAPES[shape]
    runtime, config, state = _runtime(num_experts, top_k, device)
    state.stats = torch.zeros(2, dtype=torch.int64, device=device)  # the test hook: the score totals
    logits = _logits(num_tokens, num_experts, seed=num_tokens, device=device)
    num_valid = torch.tensor([max(1, num_tokens - 2)], dtype=torch.int32, device=device)
    masked, sparse = _pruned_routing(runtime, config, logits, num_valid, top_k)
    real = int(num_valid)
    keep = state.keep
    if num_tokens >= 8:
        assert not keep.all()  # the policy pruned
    ids = sparse.indx[:real].long()
    assert keep[ids].all()
    # the masked logits are the plain logits on kept experts and the mask's fill value elsewhere
    assert torch.equal(masked, logits.masked_fill(~keep, MASKED_LOGIT))
    # the same top-k as triton_kernels computes on the masked logits by itself
    alone = topk_module.topk(masked, top_k, apply_softmax=True, n_rows=num_valid)
    assert torch.equal(sparse.indx[:real], alone.indx[:real])
    assert torch.equal(sparse.vals[:real], alone.vals[:real])
    # each token's picks are its top-k kept experts, weighted by the softmax over the picks
    picked = masked[:real].float().gather(1, ids)
    best = torch.topk(masked[:real].float(), top_k, dim=1).values
    assert torch.equal(picked.sort(dim=1, descending=True).values, best)
    torch.testing.assert_close(sparse.vals[:real].float(), torch.softmax(picked, dim=1), rtol=BF16_RTOL, atol=1e-3)
    # metrics: one call, activated = experts that received a real token (from the histogram), the
    # kept experts and retained mass as the selection determined them (added by its kernel)
    activated = torch.zeros(num_experts, dtype=torch.bool, device=device)
    activated[ids.flatten()] = True
    assert int(sparse.mask_metadata.col_sum.sum()) == real * top_k
    assert torch.equal(sparse.mask_metadata.col_sum[:num_experts] > 0, activated)
    want = selection_metrics(keep, state.stats[0], state.stats[1])
    want[0] = activated.sum()
    assert runtime.metrics_of("decode")[0].tolist() == want.tolist()
    assert 0 < want[2] <= RETAINED_ONE


@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_routing_metrics_cost_three_device_ops(shape) -> None:
    """Per layer call, the histogram's count of activated experts is three device ops (compare, sum,
    add into the row; the selection kernel adds the other columns), and masking the logits one: in a
    CUDA graph each op is a kernel node of its own.  The torch ops are what a GPU launches."""
    num_experts, top_k = SHAPES[shape]
    runtime, config, state = _runtime(num_experts, top_k, "cpu")
    call = runtime.begin_call(config, torch.tensor([8], dtype=torch.int32))
    counts = (torch.arange(num_experts) % 3).to(torch.int32)
    logits = _logits(8, num_experts, seed=0, device="cpu")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as counting:
        runtime.count_kernel_routing(call, expert_counts=counts)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as masking:
        mask_router_inputs(logits, state.keep)
    runtime.end_call()
    assert _device_ops(counting) == ["aten::gt", "aten::sum", "aten::add_"]
    assert _device_ops(masking) == ["aten::where"]
    assert runtime.metrics_of("decode")[0, 0] == int((counts > 0).sum()) and runtime.faults == 0


#: ops that only make a view or an empty tensor (no kernel)
_NO_KERNEL = {"aten::slice", "aten::select", "aten::view", "aten::as_strided", "aten::unsqueeze", "aten::empty"}


def _device_ops(prof) -> list[str]:
    events = [e for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None]
    return [e.name for e in events if e.name not in _NO_KERNEL]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_routing_in_cuda_graphs(shape) -> None:
    """No host sync on the path; one capture, replays with new logits and real-token counts equal to
    the eager steps on the same inputs (routing, keep mask and the metrics' increments)."""
    num_experts, top_k = SHAPES[shape]
    device = "cuda"
    padded = 64
    runtime, config, state = _runtime(num_experts, top_k, device)
    logits = _logits(padded, num_experts, seed=0, device=device)
    num_valid = runtime.num_valid_buffer
    num_valid.fill_(padded)
    _pruned_routing(runtime, config, logits, num_valid, top_k)  # compile, allocate
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _pruned_routing(runtime, config, logits, num_valid, top_k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, captured = _pruned_routing(runtime, config, logits, num_valid, top_k)
    for seed, real in ((1, 64), (2, 7), (3, 1), (4, 33)):
        fresh = _logits(padded, num_experts, seed=seed, device=device)
        logits.copy_(fresh)
        num_valid.fill_(real)
        before = runtime.metrics.clone()
        graph.replay()
        torch.cuda.synchronize()
        replay_keep, replay_delta = state.keep.clone(), runtime.metrics - before
        replay_ids, replay_vals = captured.indx[:real].clone(), captured.vals[:real].clone()
        before = runtime.metrics.clone()
        _, eager = _pruned_routing(
            runtime, config, fresh, torch.tensor([real], dtype=torch.int32, device=device), top_k
        )
        torch.cuda.synchronize()
        assert torch.equal(replay_keep, state.keep), (seed, real)
        assert torch.equal(replay_ids, eager.indx[:real]), (seed, real)
        assert torch.equal(replay_vals, eager.vals[:real]), (seed, real)
        assert torch.equal(replay_delta, runtime.metrics - before), (seed, real)
