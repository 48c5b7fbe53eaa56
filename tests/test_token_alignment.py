"""The routed slots sorted by expert (issue 33, item 3): the layout a fused-MoE kernel reads, written
by the launches that route instead of by an alignment kernel of its own.

* The torch reference (``policies.token_alignment``) on a worked example and on random routings:
  every slot once, in its bucket, in order; every bucket padded to the block; each block's expert.
* ``kernels.prune_route(..., alignment=...)`` against the reference, exactly (sorted slots, block
  experts, bounds), under TRITON_INTERPRET=1 here: every policy, T in {0, 1, 7, 255, 4097}, E in
  {60, 64, 128, 160, 256}, block sizes 1 to 128, expert-parallel shards, dropped slots filled or
  not, padding rows, per-request calls; the ids, weights and mask are those of a call without it.
* Buffers that do not fit are refused with the name of the buffer.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import make_logits, routing_call
from xshare_sglang import PrunerConfig
from xshare_sglang.kernels import prune_route, token_alignment
from xshare_sglang.policies.call import RouterSpec
from xshare_sglang.policies.prune_route import prune_route as prune_route_reference
from xshare_sglang.policies.token_alignment import TokenAlignment, align_reference, aligned_length

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POLICIES = ["none", "oea", "xshare", "xshare-threshold", "xshare-spec", "xshare-ep", "moe-spec", "lynx"]
TOKEN_COUNTS = [0, 1, 7, 255]
EXPERT_COUNTS = [60, 64, 128, 160, 256]
BLOCKS = [1, 16, 64, 128]


def test_reference_worked_example() -> None:
    # 4 tokens x 2 slots, experts 0..3 on this rank, block 2; slot 5 is dropped (-1), slot 7 remote (9)
    ids = torch.tensor([[2, 0], [2, 3], [0, -1], [3, 9]])
    sorted_ids, expert_ids, bounds = align_reference(ids, block_m=2, num_local=4)
    # buckets: 0 <- slots 1, 4; 1 <- none; 2 <- 0, 2; 3 <- 3, 6; skipped <- 5, 7
    assert bounds.tolist() == [0, 2, 2, 4, 6, 8]
    assert sorted_ids.tolist() == [1, 4, 0, 2, 3, 6, 5, 7]
    assert expert_ids.tolist() == [0, 2, 3, -1]
    # block 4: each bucket padded to 4 with the sentinel T * top_k = 8; a shard of experts [2, 4)
    sorted_ids, expert_ids, bounds = align_reference(ids, block_m=4, num_local=2, expert_offset=2)
    assert bounds.tolist() == [0, 4, 8, 12]
    assert sorted_ids.tolist() == [0, 2, 8, 8, 3, 6, 8, 8, 1, 4, 5, 7]
    assert expert_ids.tolist() == [0, 1, -1]


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.integers(0, 40),
    top_k=st.integers(1, 8),
    num_local=st.integers(1, 20),
    expert_offset=st.integers(0, 6),
    block_m=st.sampled_from([1, 2, 3, 16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reference_places_every_slot_once_in_its_bucket(num_tokens, top_k, num_local, expert_offset, block_m, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, num_local + 2 * expert_offset + 1, (num_tokens, top_k), generator=gen)
    sorted_ids, expert_ids, bounds = align_reference(ids, block_m, num_local, expert_offset)
    numel = ids.numel()
    assert int(bounds[-1]) <= aligned_length(numel, block_m, num_local)
    sizes = bounds[1:] - bounds[:-1]
    assert bool((sizes % block_m == 0).all())
    real = sorted_ids[sorted_ids < numel]
    assert sorted(real.tolist()) == list(range(numel))  # every slot exactly once; the rest is padding
    flat = ids.reshape(-1)
    for b in range(num_local + 1):
        run = sorted_ids[bounds[b] : bounds[b + 1]]
        slots = run[run < numel]
        assert slots.tolist() == sorted(slots.tolist())  # slots keep their order
        assert len(slots) > sizes[b] - block_m  # padding shorter than a block
        local = flat[slots.long()] - expert_offset
        if b < num_local:
            assert bool((local == b).all())
        else:
            assert bool(((flat[slots.long()] < 0) | (local < 0) | (local >= num_local)).all())
        owner = expert_ids[bounds[b] // block_m : bounds[b + 1] // block_m]
        assert bool((owner == (b if b < num_local else -1)).all())


def _config(policy: str, num_experts: int, top_k: int, rng: random.Random) -> PrunerConfig:
    if policy == "moe-spec":
        return PrunerConfig(policy=policy, max_experts=rng.randint(1, num_experts))
    if policy == "none":
        return PrunerConfig(policy="none")
    return PrunerConfig(
        policy=policy, k0=rng.randint(0, min(2, top_k)), budget=rng.choice([1, 8, 24]), request_budget=2
    )


def _cases() -> list[tuple]:
    cases = []
    for i, (num_tokens, num_experts) in enumerate(itertools.product(TOKEN_COUNTS, EXPERT_COUNTS)):
        for j in range(2):
            policy = POLICIES[(2 * i + j) % len(POLICIES)]
            cases.append((policy, num_tokens, num_experts, BLOCKS[(i + j) % len(BLOCKS)], i * 2 + j))
    cases.append(("xshare", 4097, 64, 64, 101))  # many routing programs; one E (the interpreter is slow)
    cases.append(("lynx", 4097, 160, 16, 102))
    return cases


def _check(policy, num_tokens, num_experts, block_m, seed, *, routing="softmax", fill=False) -> None:
    rng = random.Random(seed)
    top_k = rng.choice([1, 2, 4, 6, 8])
    cfg = _config(policy, num_experts, top_k, rng)
    num_ranks = rng.choice([1, 1, 2, 4])
    num_local = num_experts // num_ranks
    expert_offset = rng.randrange(num_ranks) * num_local
    if routing == "softmax":
        router, bias = RouterSpec(top_k, "softmax", renormalize=rng.random() < 0.5), None
    else:  # grouped and biased, as DeepSeek-V3 routes
        groups = 4 if num_experts % 8 else 8
        topk_group = max(2, -(-top_k // (num_experts // groups)))
        router = RouterSpec(top_k, "sigmoid", True, groups, topk_group, 2.5)
        bias = torch.randn(num_experts, generator=torch.Generator().manual_seed(seed)) * 0.5
    fields = dict(
        tokens_per_request=rng.choice([1, 3, 4]) if policy == "xshare-spec" else 1,
        num_valid_tokens=rng.choice([num_tokens, max(0, num_tokens - 3)]),
        correction_bias=bias,
        expert_to_rank=torch.arange(num_experts) % 4 if policy == "xshare-ep" else None,
    )
    logits = make_logits(num_tokens, num_experts, ["normal", "integers"][seed % 2], seed)
    want = prune_route_reference(routing_call(logits, router, **fields), cfg, fill_dropped=fill)
    call = routing_call(logits, router, device=DEVICE, as_tensor=True, **fields)
    alignment = token_alignment(num_tokens, top_k, num_experts, block_m, num_local, expert_offset, DEVICE)
    got = prune_route(call, cfg, fill_dropped=fill, alignment=alignment)
    label = (
        f"{cfg.summary()} T={num_tokens} E={num_experts} k={top_k} block={block_m} shard={expert_offset}+{num_local}"
    )
    assert torch.equal(got.topk_ids.cpu(), want.topk_ids), label
    assert torch.equal(got.keep.cpu(), want.keep), label
    sorted_ids, expert_ids, bounds = align_reference(want.topk_ids, block_m, num_local, expert_offset)
    assert alignment.bounds.cpu().tolist() == bounds.tolist(), label
    end = int(bounds[-1])
    assert alignment.sorted_ids[:end].cpu().tolist() == sorted_ids.tolist(), label
    assert alignment.expert_ids[: end // block_m].cpu().tolist() == expert_ids.tolist(), label


@pytest.mark.fused_selection
@pytest.mark.parametrize(("policy", "num_tokens", "num_experts", "block_m", "seed"), _cases())
def test_kernel_alignment_matches_reference(policy, num_tokens, num_experts, block_m, seed) -> None:
    _check(policy, num_tokens, num_experts, block_m, seed)


@pytest.mark.fused_selection
@pytest.mark.parametrize(("policy", "num_tokens", "num_experts"), [("xshare", 7, 256), ("xshare-ep", 64, 256)])
@pytest.mark.parametrize("fill", [False, True])
def test_kernel_alignment_grouped_router_and_filled_slots(policy, num_tokens, num_experts, fill) -> None:
    _check(policy, num_tokens, num_experts, 16, 7, routing="biased", fill=fill)


@pytest.mark.fused_selection
def test_reference_path_writes_the_same_alignment() -> None:
    """The torch path (the kernels' fallback, and the CPU path) fills the same buffers."""
    logits = make_logits(33, 64, "normal", 5)
    call = routing_call(logits, RouterSpec(4, "softmax"))
    cfg = PrunerConfig(policy="xshare", k0=1, budget=8)
    by_torch = TokenAlignment.empty(33, 4, 16, 64)
    routed = prune_route_reference(call, cfg, alignment=by_torch)
    by_kernel = token_alignment(33, 4, 64, 16, device=DEVICE)
    prune_route(routing_call(logits, RouterSpec(4, "softmax"), device=DEVICE), cfg, alignment=by_kernel)
    end = int(by_torch.bounds[-1])
    assert end == int(by_kernel.bounds[-1].cpu()) and end >= routed.topk_ids.numel()
    assert torch.equal(by_torch.sorted_ids[:end], by_kernel.sorted_ids[:end].cpu())
    assert torch.equal(by_torch.expert_ids[: end // 16], by_kernel.expert_ids[: end // 16].cpu())


def test_buffers_that_do_not_fit_are_refused() -> None:
    call = routing_call(make_logits(9, 64, "normal", 1), RouterSpec(4, "softmax"))
    cfg = PrunerConfig(policy="xshare", k0=1, budget=8)
    small = TokenAlignment.empty(8, 4, 16, 64)  # sized for T=8
    with pytest.raises(ValueError, match=r"alignment\.sorted_ids"):
        prune_route_reference(call, cfg, alignment=small)
    no_scratch = TokenAlignment.empty(9, 4, 16, 64)
    with pytest.raises(ValueError, match=r"alignment\.scratch"):
        prune_route(call, cfg, alignment=no_scratch)
    with pytest.raises(ValueError, match="block_m"):
        token_alignment(9, 4, 64, 0)
    with pytest.raises(ValueError, match="num_local"):
        token_alignment(9, 4, 64, 16, num_local=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("policy", "num_tokens", "num_experts", "dtype", "block_m"),
    [
        ("xshare", 8, 128, torch.bfloat16, 16),
        ("xshare", 200, 128, torch.bfloat16, 64),
        ("lynx", 512, 256, torch.float16, 32),
    ],
)
def test_alignment_replays_in_a_cuda_graph(policy, num_tokens, num_experts, dtype, block_m) -> None:
    """Captured once; every replay, with new logits and real-token counts, writes the reference's
    layout of the ids that replay routed."""
    device = "cuda"
    cfg = PrunerConfig(policy=policy, k0=1, budget=16) if policy == "xshare" else PrunerConfig(policy=policy)
    router = RouterSpec(8, "softmax")
    logits = make_logits(num_tokens, num_experts, "normal", 0).to(dtype).to(device)
    num_valid = torch.tensor([num_tokens], dtype=torch.int32, device=device)
    call = routing_call(logits, router, num_valid_tokens=num_valid)
    alignment = token_alignment(num_tokens, 8, num_experts, block_m, num_experts // 2, num_experts // 4, device)
    ids = torch.empty(num_tokens, 8, dtype=torch.int32, device=device)
    weights = torch.empty(num_tokens, 8, dtype=torch.float32, device=device)
    keep = torch.empty(num_experts, dtype=torch.bool, device=device)
    outputs = dict(keep_out=keep, ids_out=ids, weights_out=weights, alignment=alignment)
    prune_route(call, cfg, **outputs)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prune_route(call, cfg, **outputs)
    for seed, real in ((1, num_tokens), (2, max(1, num_tokens // 3)), (3, 1), (4, num_tokens - 1)):
        logits.copy_(make_logits(num_tokens, num_experts, "normal", seed).to(dtype).to(device))
        num_valid.fill_(real)
        graph.replay()
        torch.cuda.synchronize()
        want = prune_route_reference(routing_call(logits.cpu(), router, num_valid_tokens=real), cfg)
        assert torch.equal(ids.cpu(), want.topk_ids), (seed, real)
        sorted_ids, expert_ids, bounds = align_reference(want.topk_ids, block_m, num_experts // 2, num_experts // 4)
        end = int(bounds[-1])
        assert alignment.bounds.cpu().tolist() == bounds.tolist(), (seed, real)
        assert torch.equal(alignment.sorted_ids[:end].cpu(), sorted_ids), (seed, real)
        assert torch.equal(alignment.expert_ids[: end // block_m].cpu(), expert_ids), (seed, real)
