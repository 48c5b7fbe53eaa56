"""The torch reference on a GPU: same masks as on CPU, no host syncs, and CUDA-graph replay.

Run on a machine with CUDA (skipped elsewhere).  The reference is the GPU fallback of the kernels,
so it must be capturable: static shapes, the real-token count read from a device tensor.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.strategies import make_logits
from xshare_sglang import POLICIES, PrunerConfig, route_within, select_experts_mask

pytestmark = pytest.mark.gpu


def _config(policy: str, tmp_path) -> PrunerConfig:
    if policy == "moe-spec":
        return PrunerConfig(policy=policy, max_experts=24)
    return PrunerConfig(policy=policy, k0=1, budget=8, request_budget=2, rank_budget=3, max_experts=40)


def _static_config(tmp_path, num_experts: int) -> PrunerConfig:
    path = tmp_path / "ranking.json"
    counts = [[float((e * 7 + layer) % 13) for e in range(num_experts)] for layer in range(3)]
    path.write_text(json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}))
    return PrunerConfig(policy="moe-spec", max_experts=16, ranking="static", static_ranking_path=str(path))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(("num_tokens", "num_experts"), [(1, 60), (7, 64), (255, 128), (4097, 160), (64, 256)])
def test_gpu_matches_cpu_without_host_sync(policy: str, num_tokens: int, num_experts: int, tmp_path) -> None:
    cfg = _config(policy, tmp_path)
    logits = make_logits(num_tokens, num_experts, "nonfinite", seed=num_tokens)
    ranks = torch.arange(num_experts) // (-(-num_experts // 8))
    kwargs = dict(top_k=8, tokens_per_request=4, scoring="softmax")
    num_valid = max(0, num_tokens - 3)
    expected = select_experts_mask(logits, cfg, num_valid_tokens=num_valid, expert_to_rank=ranks, **kwargs)
    device_logits, device_ranks = logits.cuda(), ranks.cuda()
    device_valid = torch.tensor([num_valid], device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        keep = select_experts_mask(
            device_logits, cfg, num_valid_tokens=device_valid, expert_to_rank=device_ranks, **kwargs
        )
        ids, weights = route_within(device_logits, keep, top_k=8, num_valid_tokens=device_valid)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(keep.cpu(), expected)
    assert torch.isfinite(weights).all()
    assert ((ids >= -1) & (ids < num_experts)).all()


@pytest.mark.parametrize("policy", [*POLICIES, "moe-spec-static"])
def test_cuda_graph_replay(policy: str, tmp_path) -> None:
    """Capture once at the largest batch, replay with new logits and real-token counts."""
    num_tokens, num_experts = 64, 128
    cfg = _static_config(tmp_path, num_experts) if policy == "moe-spec-static" else _config(policy, tmp_path)
    ranks = (torch.arange(num_experts) // 16).cuda()
    static_logits = torch.zeros(num_tokens, num_experts, device="cuda")
    static_valid = torch.tensor([num_tokens], device="cuda")
    kwargs = dict(top_k=8, tokens_per_request=4, expert_to_rank=ranks, layer_id=1)

    def run():
        keep = select_experts_mask(static_logits, cfg, num_valid_tokens=static_valid, **kwargs)
        return keep, route_within(static_logits, keep, top_k=8, num_valid_tokens=static_valid)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()  # warm-up outside the graph (allocator, cached device copies)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        keep_out, (ids_out, weights_out) = run()

    for replay, num_valid in enumerate([64, 1, 0, 37, 63]):
        fresh = make_logits(num_tokens, num_experts, ["normal", "integers", "nonfinite"][replay % 3], seed=replay)
        static_logits.copy_(fresh.cuda())
        static_valid.fill_(num_valid)
        graph.replay()
        cpu_kwargs = {**kwargs, "expert_to_rank": ranks.cpu()}
        want_keep = select_experts_mask(fresh, cfg, num_valid_tokens=num_valid, **cpu_kwargs)
        want_ids, want_weights = route_within(fresh, want_keep, top_k=8, num_valid_tokens=num_valid)
        assert torch.equal(keep_out.cpu(), want_keep), f"replay {replay}"
        assert torch.equal(ids_out.cpu(), want_ids), f"replay {replay}"
        torch.testing.assert_close(weights_out.cpu(), want_weights, atol=1e-6, rtol=1e-5)
