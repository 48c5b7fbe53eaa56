"""MoE-Spec's oracle ranking (section 3.2, eq. 6), for offline analysis only.

Given every expert's output for every token, the oracle grows the kept set one expert at a time,
each time adding the expert whose addition leaves the smallest squared reconstruction error against
the unpruned MoE output.  It needs all experts to run, so it can never speed anything up; replay
reports use it as the quality ceiling a router-driven policy can be compared with.

The reconstruction of a candidate set routes tokens exactly as the server would under the chosen
coverage (:func:`~xshare_sglang.policies.routing.route_logits`).  With ``coverage="truncation"``
this is eq. 6 with the sum restricted to each token's natural top-k, as eq. 7 defines the output.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import COVERAGES
from .call import RouterSpec, check_routing_args
from .routing import route_logits
from .scores import sanitize_logits, valid_token_mask


class OracleRanking(NamedTuple):
    """Result of :func:`oracle_ranking`.

    Attributes
    ----------
    order : Tensor, shape [B], int64
        Experts in the order the oracle adds them.
    errors : Tensor, shape [B], float64
        Squared reconstruction error summed over valid tokens after each addition.
    baseline_error : float
        Error with no expert kept (the squared norm of the unpruned outputs).
    """

    order: torch.Tensor
    errors: torch.Tensor
    baseline_error: float

    def keep_mask(self, budget: int, num_experts: int) -> torch.Tensor:
        """The oracle's keep mask at ``budget`` experts, shape [E], bool."""
        keep = torch.zeros(num_experts, dtype=torch.bool, device=self.order.device)
        keep[self.order[:budget]] = True
        return keep


def _moe_outputs(ids: torch.Tensor, weights: torch.Tensor, expert_outputs: torch.Tensor) -> torch.Tensor:
    """Weighted sum of the routed experts' outputs; ids/weights [..., T, k] -> [..., T, H]."""
    index = ids.clamp(min=0)
    hidden = expert_outputs.shape[-1]
    rows = expert_outputs.expand(*ids.shape[:-2], *expert_outputs.shape)
    picked = rows.gather(-2, index[..., None].expand(*index.shape, hidden))
    return (weights.to(expert_outputs.dtype)[..., None] * picked).sum(dim=-2)


def oracle_ranking(
    logits: torch.Tensor,
    expert_outputs: torch.Tensor,
    *,
    top_k: int,
    budget: int | None = None,
    coverage: str = "truncation",
    scoring: str = "softmax",
    renormalize: bool = True,
    num_valid_tokens: int | None = None,
) -> OracleRanking:
    """Greedy expert ranking on reconstruction error (MoE-Spec eq. 6).

    Parameters
    ----------
    logits : Tensor, shape [T, E]
        Router logits.
    expert_outputs : Tensor, shape [T, E, H]
        Output of every expert for every token.
    top_k : int
    budget : int, optional
        Experts to rank (default: all E).
    coverage : {"truncation", "substitution"}
        How tokens are routed inside a candidate set.
    scoring : {"softmax", "sigmoid"}
    renormalize : bool
    num_valid_tokens : int, optional
        Only the first rows count towards the error.

    Returns
    -------
    OracleRanking

    Notes
    -----
    Cost is ``budget * E`` routings of the batch; it is meant for traces, not for serving.  Ties go
    to the lower expert index.
    """
    check_routing_args(logits, top_k, scoring)
    if coverage not in COVERAGES:
        raise ValueError(f"coverage={coverage!r} is invalid: choose one of {', '.join(COVERAGES)}")
    num_tokens, num_experts = logits.shape
    if expert_outputs.dim() != 3 or expert_outputs.shape[:2] != (num_tokens, num_experts):
        raise ValueError(
            f"expert_outputs must have shape ({num_tokens}, {num_experts}, H), got {tuple(expert_outputs.shape)}"
        )
    budget = num_experts if budget is None else budget
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget <= num_experts:
        raise ValueError(f"budget={budget!r} is invalid: must be an integer in [0, {num_experts}]")

    clean = sanitize_logits(logits)
    outputs = expert_outputs.to(torch.float64)
    valid = valid_token_mask(num_tokens, num_valid_tokens, logits.device)[:, None]
    route = dict(router=RouterSpec(top_k, scoring, renormalize), coverage=coverage)
    all_experts = torch.ones(num_experts, dtype=torch.bool, device=logits.device)
    target = torch.where(valid, _moe_outputs(*route_logits(clean, all_experts, **route), outputs), 0.0)

    kept = torch.zeros(num_experts, dtype=torch.bool, device=logits.device)
    one_more = torch.eye(num_experts, dtype=torch.bool, device=logits.device)
    order, errors = [], []
    for _ in range(budget):
        trial = (kept | one_more)[:, None, :]  # [E candidates, 1, E]
        recon = _moe_outputs(*route_logits(clean, trial, **route), outputs)
        error = (torch.where(valid, target - recon, 0.0) ** 2).sum(dim=(1, 2))
        error = torch.where(kept, float("inf"), error)
        best = int(torch.argmin(error))
        kept[best] = True
        order.append(best)
        errors.append(float(error[best]))
    return OracleRanking(
        order=torch.tensor(order, dtype=torch.int64, device=logits.device),
        errors=torch.tensor(errors, dtype=torch.float64),
        baseline_error=float((target**2).sum()),
    )
