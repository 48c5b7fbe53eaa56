"""The demo: replay the shipped routing traces through every policy and tabulate the result.

For each trace and batch shape (R requests x D tokens, cut from the recorded sequence), every layer
call of every batch is run through :func:`~xshare_sglang.select_experts_mask` and
:func:`~xshare_sglang.route_within` (the server's code path), and the means over layer calls are
reported.  The offline-evaluation tools grow out of this module.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from ..config import PrunerConfig
from .batches import BatchShape, segment_batches
from .metrics import evaluate_call
from .route_csv import RouteTrace

logger = logging.getLogger(__name__)

DEFAULT_SHAPES = ("8x1", "32x1", "4x4", "8x4")
VERIFY_SHAPES = ("4x4", "4x8", "8x4", "8x8")
EP_RANKS = 8


def default_configs(top_k: int, num_experts: int) -> list[PrunerConfig]:
    """One or two representative settings per policy, scaled to the trace's top-k."""
    return [
        PrunerConfig(policy="none"),
        PrunerConfig(policy="oea", k0=1),
        PrunerConfig(policy="xshare", k0=1, budget=top_k),
        PrunerConfig(policy="xshare", k0=1, budget=4 * top_k),
        PrunerConfig(policy="xshare-threshold", k0=1, tau=0.9),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=1, budget=0),
        PrunerConfig(policy="xshare-ep", k0=1, rank_budget=1),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 4 * top_k)),
        PrunerConfig(policy="lynx", alpha=2.0, beta=4),
    ]


def verify_configs(top_k: int, num_experts: int) -> list[PrunerConfig]:
    """Speculative-verify comparison: batch-level and per-request policies at similar sizes."""
    return [
        PrunerConfig(policy="none"),
        PrunerConfig(policy="xshare", k0=1, budget=top_k),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=1, budget=0),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=top_k, budget=0),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 4 * top_k)),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, top_k), scope="request"),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 2 * top_k), scope="request"),
    ]


def chain_vote_weights(shape: BatchShape, depth_decay: float | None) -> torch.Tensor | None:
    """Vote weights of a replayed verify batch: D consecutive tokens stand in for a chain of drafts,
    so token j of a request sits at depth j.  None when no decay is set."""
    if depth_decay is None or shape.tokens_per_request == 1:
        return None
    from ..spec import VerifyLayout, vote_weights

    layout = VerifyLayout(shape.requests, shape.tokens_per_request)
    return vote_weights(layout.node_ids(), depth_decay)


@dataclass(frozen=True)
class ReplayRow:
    """Means over all layer calls of one (trace, shape, config)."""

    trace: str
    shape: str
    policy: str
    params: str
    layer_calls: int
    activated: float
    kept: float
    retained_mass: float
    top1_kept: float

    def as_dict(self) -> dict:
        return asdict(self)


def contiguous_ranks(num_experts: int, num_ranks: int) -> torch.Tensor:
    """Rank of each expert when experts are split into equal contiguous blocks (SGLang's EP layout)."""
    per_rank = -(-num_experts // num_ranks)
    return torch.arange(num_experts) // per_rank


def replay_trace(trace: RouteTrace, shape: BatchShape, configs: list[PrunerConfig]) -> list[ReplayRow]:
    """Run every config over every batch of ``shape`` and every layer of ``trace``."""
    batches = segment_batches(trace.num_tokens, shape)
    if not batches:
        logger.warning("trace %s has %d tokens: too few for batches of %s", trace.name, trace.num_tokens, shape)
        return []
    expert_to_rank = contiguous_ranks(trace.num_experts, EP_RANKS)
    layer_logits = [trace.logits(layer) for layer in range(trace.num_layers)]
    rows = []
    for cfg in configs:
        token_weights = chain_vote_weights(shape, cfg.depth_decay)
        totals = torch.zeros(4, dtype=torch.float64)
        calls = 0
        for layer in range(trace.num_layers):
            for batch in batches:
                m = evaluate_call(
                    layer_logits[layer][batch],
                    trace.ids[batch, layer],
                    trace.weights[batch, layer],
                    cfg,
                    top_k=trace.top_k,
                    tokens_per_request=shape.tokens_per_request,
                    expert_to_rank=expert_to_rank,
                    layer_id=layer,
                    token_weights=token_weights,
                )
                totals += torch.tensor([m.activated, m.kept, m.retained_mass, m.top1_kept], dtype=torch.float64)
                calls += 1
        mean = (totals / calls).tolist()
        params = " ".join(f"{name}={value}" for name, value in cfg.policy_parameters().items())
        rows.append(ReplayRow(trace.name, str(shape), cfg.policy, params, calls, *mean))
    return rows
