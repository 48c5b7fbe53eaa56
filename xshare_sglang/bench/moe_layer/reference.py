"""The float32 reference MoE and the routing arithmetic the checks and rows use: the model's top-k
(:func:`route_topk`), activated experts and routed slots of a routing, the relative error against the
reference, routing equality up to ties, and the tolerances of those checks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..moe_align import local_ids

MOE_TOLERANCE = 2e-2  # ||out - ref|| / ||ref|| against the float32 reference (bf16/fp16 operands)
WEIGHT_TOLERANCE = 1e-4  # routing weights, kernel path vs route_within


def route_topk(logits: torch.Tensor, top_k: int, scoring: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's top-k (SGLang's fused_topk semantics): scores, top-k, renormalized; int32 ids."""
    scores = torch.softmax(logits.float(), -1) if scoring == "softmax" else torch.sigmoid(logits.float())
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)


def activated_experts(ids: torch.Tensor, offset: int, num_local: int) -> int:
    local, valid = local_ids(ids, offset, num_local)
    return int(torch.unique(local[valid]).numel())


def routed_slots(ids: torch.Tensor, offset: int, num_local: int) -> int:
    """Slots of ``ids`` [T, k] this rank computes: ids in ``[offset, offset + num_local)`` (not ``-1``)."""
    _, valid = local_ids(ids, offset, num_local)
    return int(valid.sum())


def reference_moe(x, ids, weights, w13, w2, offset: int) -> torch.Tensor:
    """float32 loop over the activated local experts: sum_j w_j * down(silu(gate) * up)."""
    num_local, inter = w13.shape[0], w2.shape[2]
    local, valid = local_ids(ids, offset, num_local)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(local[valid]).tolist():
        rows, slots = torch.nonzero(valid & (local == e), as_tuple=True)
        h = x[rows].float() @ w13[e].float().t()
        y = (F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].float().t()
        out.index_add_(0, rows, y * weights[rows, slots].float()[:, None])
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    err = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    return err if math.isfinite(err) else float("inf")


def _same_routing(logits, ids, w, ref_ids, ref_w) -> bool:
    """Same routing up to ties: per row, the sorted logits of the chosen experts and the sorted weights."""

    def summary(i, weights):
        chosen = torch.where(i >= 0, logits.float().gather(1, i.long().clamp_min(0)), float("-inf"))
        return chosen.sort(1).values, torch.where(i >= 0, weights, 0.0).sort(1).values

    a_logit, a_w = summary(ids, w)
    b_logit, b_w = summary(ref_ids, ref_w)
    return bool(torch.equal(a_logit, b_logit) and (a_w - b_w).abs().max() <= WEIGHT_TOLERANCE)
