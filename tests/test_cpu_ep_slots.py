"""The CPU stand-in's expert-parallel wrapper of SGLang's CPU MoE loop (``standin/_ep_slots.py``).

Under ``--ep-size N`` SGLang's standard dispatcher hands each rank's MoE layer local expert ids with
``-1`` for other ranks' experts.  SGLang's own ``moe_forward_native`` fails on a ``-1``; wrapped, it must
give exactly what the rank owes the all-reduce: the sum over the token's local experts of weight x
expert output.  The reference is SGLang's own function on the same call with the ``-1`` slots' weights
moved onto no expert at all: each token's local slots alone, computed one token at a time.
"""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from xshare_sglang.testing.cpu_server import standin_path

pytestmark = pytest.mark.sglang

LOCAL_EXPERTS = 8
HIDDEN = 16
INTERMEDIATE = 12


@pytest.fixture(scope="module")
def ep_slots():
    sys.path.insert(0, str(standin_path()))
    try:
        yield importlib.import_module("_ep_slots")
    finally:
        sys.path.remove(str(standin_path()))


def _layer(seed: int) -> SimpleNamespace:
    generator = torch.Generator().manual_seed(seed)
    return SimpleNamespace(
        num_experts=2 * LOCAL_EXPERTS,  # the global count, as SGLang's FusedMoE holds it under EP 2
        w13_weight=torch.randn(LOCAL_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator),
        w2_weight=torch.randn(LOCAL_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator),
    )


def _config():
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

    return MoeRunnerConfig(activation="silu")


def _output(topk_weights, topk_ids):
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return StandardTopKOutput(topk_weights=topk_weights, topk_ids=topk_ids, router_logits=None)


def test_fillers_are_distinct_unused_experts_of_weight_0(ep_slots) -> None:
    ids = torch.tensor([[3, -1, 0, -1], [-1, -1, -1, -1], [1, 2, 3, 0], [-1, 7, -1, 1]], dtype=torch.int32)
    weights = torch.rand(4, 4)
    new_weights, new_ids = ep_slots.fill_skipped_slots(weights, ids, LOCAL_EXPERTS)
    assert new_ids.tolist() == [[3, 1, 0, 2], [0, 1, 2, 3], [1, 2, 3, 0], [0, 7, 2, 1]]
    assert new_ids.dtype == ids.dtype and ids[0, 1] == -1  # new tensors, inputs untouched
    assert torch.equal(new_weights, weights.masked_fill(ids < 0, 0))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wrapped_loop_gives_each_rank_its_local_share(ep_slots, seed) -> None:
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native

    generator = torch.Generator().manual_seed(seed)
    tokens, top_k = 9, 4
    layer = _layer(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    global_ids = torch.stack([torch.randperm(2 * LOCAL_EXPERTS, generator=generator)[:top_k] for _ in range(tokens)])
    local = torch.where(global_ids < LOCAL_EXPERTS, global_ids, -1).to(torch.int32)  # rank 0 of EP 2
    weights = torch.rand(tokens, top_k, generator=generator)
    assert bool((local < 0).any()) and bool((local >= 0).any())
    with pytest.raises((IndexError, RuntimeError)):
        moe_forward_native(layer, x, _output(weights, local), _config())
    got = ep_slots.wrap(moe_forward_native)(layer, x, _output(weights, local), _config())
    for token in range(tokens):
        mine = local[token] >= 0
        if not bool(mine.any()):  # every expert of this token on the other rank: it owes nothing
            assert bool((got[token] == 0).all())
            continue
        alone = _output(weights[token : token + 1, mine], local[token : token + 1, mine])
        expected = moe_forward_native(layer, x[token : token + 1], alone, _config())
        torch.testing.assert_close(got[token : token + 1], expected, rtol=1e-5, atol=1e-5)


def test_install_wraps_the_module_once(ep_slots, monkeypatch) -> None:
    import sglang.srt.layers.moe.fused_moe_native as module

    original = module.moe_forward_native
    monkeypatch.setattr(module, "moe_forward_native", original)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    ep_slots.install()
    ep_slots.install()
    wrapped = module.moe_forward_native
    assert wrapped is not original and wrapped.__wrapped__ is original
    assert sum(getattr(f, "name", None) == ep_slots.FINDER_NAME for f in sys.meta_path) == 1
    assert ep_slots.wrap(wrapped) is wrapped
