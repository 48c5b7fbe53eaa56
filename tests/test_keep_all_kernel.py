"""Keep-all through the fused kernel against SGLang's own CUDA router, ``moe_fused_gate`` (Triton).

On a GPU the plugin routes with its kernel instead of SGLang's gate, so a call whose mask keeps every
expert the tokens pick cannot be bit-identical to unpruned SGLang: the two kernels compute the same
softmax with different exp implementations (the kernel's ``exp32``, the gate's ``tl.exp``) and sums
in different orders.  What holds, and what docs/policies.md states:

* the ids, slot order included, are equal (both break ties toward the lower expert index);
* each weight is within a relative 2**-20 of the gate's under Triton's interpreter on CPU, and
  2**-17 on a GPU, where ``tl.exp`` is an approximate hardware exp.

Both kernels run here under ``TRITON_INTERPRET=1`` (tests/conftest.py sets it), and on CUDA when
a device is present.
"""

from __future__ import annotations

import pytest
import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.kernels import prune_route
from xshare_sglang.policies.call import RouterSpec, RoutingCall

pytestmark = [pytest.mark.sglang, pytest.mark.fused_selection]

CPU_BOUND = 2.0**-20
GPU_BOUND = 2.0**-17


def _devices() -> list[str]:
    return ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def _sglang_gate(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from sglang.kernels.ops.moe.moe_fused_gate import moe_fused_gate

    weights, ids = moe_fused_gate(logits, None, top_k, scoring_func="softmax", renormalize=renormalize)
    return ids, weights


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 60, 4), (7, 128, 8), (64, 32, 4), (33, 256, 8)])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "raw"])
def test_kernel_keep_all_matches_sglang_gate(device, dtype, num_tokens, num_experts, top_k, renormalize) -> None:
    generator = torch.Generator().manual_seed(num_tokens * 1000 + num_experts)
    logits = torch.randn(num_tokens, num_experts, generator=generator) * 3
    # a coarse grid makes ties common, among and around each row's top-k
    logits[::2] = torch.round(logits[::2] * 2) / 2
    logits = logits.to(dtype).to(device)
    want_ids, want_weights = _sglang_gate(logits, top_k, renormalize)
    # renormalized softmax: keeping every expert the tokens pick is enough; raw softmax weights are
    # shares of all experts, so only the full set leaves them unchanged
    cfg = PrunerConfig(policy="xshare", k0=top_k, budget=0) if renormalize else PrunerConfig(policy="none")
    ids, weights, keep = prune_route(RoutingCall(logits, RouterSpec(top_k, renormalize=renormalize)), cfg)
    if renormalize and num_experts > num_tokens * top_k:
        assert not keep.all()  # the mask really pruned
    assert torch.equal(ids.long(), want_ids.long())
    bound = GPU_BOUND if device == "cuda" else CPU_BOUND
    torch.testing.assert_close(weights, want_weights, rtol=bound, atol=0.0)
