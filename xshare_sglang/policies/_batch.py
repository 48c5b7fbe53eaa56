"""The inputs one policy call sees, prepared once, and the result it returns."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from ..config import PrunerConfig
from .call import RoutingCall
from .scores import aggregate, fixed_point_weights, token_scores, weigh_scores


@dataclass
class LayerBatch:
    """One MoE layer call, as every policy reads it.

    Attributes
    ----------
    call : RoutingCall
        The call as it entered: the policies read its top-k, scoring, D, ranks and layer.
    cfg : PrunerConfig
    logits : Tensor, shape [T, E], float32
        Sanitized router logits (:func:`~xshare_sglang.policies.scores.sanitize_logits`).
    valid : Tensor, shape [T], bool
        Voting tokens: real rows (padding never votes) whose token weight is > 0.
    real : Tensor, shape [T], bool
        Real rows (not CUDA-graph padding), voting or not; their count is the batch size n that
        ``min_tokens`` / ``max_tokens``, ``moe-spec``'s empty-batch rule and LYNX's base read.
    token_weights : Tensor, shape [T], float32, or None
        Sanitized vote weight of each row (speculative verify: depth decay); None weighs every row 1.
    """

    call: RoutingCall
    cfg: PrunerConfig
    logits: torch.Tensor
    valid: torch.Tensor
    real: torch.Tensor
    token_weights: torch.Tensor | None

    @property
    def num_experts(self) -> int:
        return self.logits.shape[1]

    @cached_property
    def num_valid(self) -> torch.Tensor:
        """Count of real tokens (voting or not), a 0-d int64 device tensor."""
        return self.real.sum()

    @cached_property
    def quantized_scores(self) -> torch.Tensor:
        """Fixed-point per-token scores of the configured kind, times the token weights, [T, E] int64."""
        call = self.call
        scores = token_scores(self.logits, score=self.cfg.effective_score, scoring=call.scoring, top_k=call.top_k)
        if self.token_weights is not None:
            scores = weigh_scores(scores, fixed_point_weights(self.token_weights))
        return scores

    @cached_property
    def valid_scores(self) -> torch.Tensor:
        """:attr:`quantized_scores` with the rows that do not vote zeroed, [T, E] int64."""
        return torch.where(self.valid[:, None], self.quantized_scores, 0)

    @cached_property
    def batch_aggregate(self) -> torch.Tensor:
        """Aggregate score of every expert over the valid tokens, shape [E], int64."""
        return aggregate(self.quantized_scores, self.valid)


class Selection(NamedTuple):
    """A policy's answer before the common controls.

    Attributes
    ----------
    keep : Tensor, shape [E], bool
    warm : Tensor, shape [E], bool
        Warm-up experts (kept first when ``max_experts`` caps the mask); empty for policies
        without a warm-up.
    """

    keep: torch.Tensor
    warm: torch.Tensor
