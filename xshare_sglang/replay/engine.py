"""Offline replay: run policies over batches built from a trace, through the server's code path.

Every layer call of every batch goes through the policies' selection and
:func:`~xshare_sglang.route_within` (see :func:`.metrics.evaluate_call`); the rows report means over
layer calls and the bandwidth cost model's figures (:mod:`.cost`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..config import PrunerConfig
from ..policies.call import RoutingCall
from .batches import BatchShape
from .cost import DEVICES, Device, modeled_speedup, moe_read_seconds
from .metrics import evaluate_call
from .tokens import TokenTable

logger = logging.getLogger(__name__)

EP_RANKS = 8


@dataclass(frozen=True)
class ReplayRow:
    """Means over all layer calls of one (trace, scenario, shape, config).

    ``activated`` and ``baseline_activated`` are distinct experts per layer call with and without
    the policy; ``speedup`` is the cost model's ratio of expert bytes read; ``modeled_us`` maps a
    device name to the modeled MoE time per layer call in microseconds.
    """

    trace: str
    scenario: str
    shape: str
    policy: str
    params: str
    layer_calls: int
    activated: float
    kept: float
    retained_mass: float
    top1_kept: float
    baseline_activated: float
    speedup: float
    modeled_us: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def contiguous_ranks(num_experts: int, num_ranks: int) -> torch.Tensor:
    """Rank of each expert when experts are split into equal contiguous blocks (SGLang's EP layout)."""
    per_rank = -(-num_experts // num_ranks)
    return torch.arange(num_experts) // per_rank


def chain_vote_weights(shape: BatchShape, depth_decay: float | None) -> torch.Tensor | None:
    """Vote weights of a replayed verify batch: D consecutive tokens stand in for a chain of drafts,
    so token j of a request sits at depth j.  None when no decay is set."""
    if depth_decay is None or shape.tokens_per_request == 1:
        return None
    from ..spec import VerifyLayout, vote_weights

    layout = VerifyLayout(shape.requests, shape.tokens_per_request)
    return vote_weights(layout.node_ids(), depth_decay)


def natural_activated(natural_ids: torch.Tensor) -> int:
    """Distinct experts in unpruned top-k routing, ids [T, k] (-1 = none)."""
    return int(torch.unique(natural_ids[natural_ids >= 0]).numel())


def replay_table(
    table: TokenTable,
    batches: list[torch.Tensor],
    configs: list[PrunerConfig],
    *,
    scenario: str,
    shape: BatchShape,
    devices: tuple[Device, ...] = DEVICES,
    on_config_done: Callable[[], None] | None = None,
) -> list[ReplayRow]:
    """One row per config: every batch (token indices [R*D], request-major) at every layer.

    Returns an empty list when there are no batches.
    """
    if not batches:
        return []
    meta = table.meta
    expert_to_rank = contiguous_ranks(meta.num_experts, EP_RANKS)
    # a trace that does not know its experts' size still gets a speed-up: every expert counts the same
    bytes_known = any(meta.expert_bytes)
    layer_bytes = meta.expert_bytes if bytes_known else (1,) * meta.num_layers
    baseline = [
        [natural_activated(table.natural_ids[batch, layer]) for batch in batches] for layer in range(meta.num_layers)
    ]
    baseline_bytes = sum(count * layer_bytes[layer] for layer in range(meta.num_layers) for count in baseline[layer])
    calls = meta.num_layers * len(batches)
    rows = []
    for cfg in configs:
        token_weights = chain_vote_weights(shape, cfg.depth_decay)
        totals = torch.zeros(4, dtype=torch.float64)
        pruned_bytes = 0.0
        for layer in range(meta.num_layers):
            for batch in batches:
                call = RoutingCall.of(
                    table.logits[layer][batch],
                    top_k=meta.top_k,
                    scoring=meta.scoring,
                    tokens_per_request=shape.tokens_per_request,
                    expert_to_rank=expert_to_rank,
                    layer_id=layer,
                    token_weights=token_weights,
                )
                m = evaluate_call(call, table.natural_ids[batch, layer], table.natural_weights[batch, layer], cfg)
                totals += torch.tensor([m.activated, m.kept, m.retained_mass, m.top1_kept], dtype=torch.float64)
                pruned_bytes += m.activated * layer_bytes[layer]
        mean = (totals / calls).tolist()
        params = " ".join(f"{name}={value}" for name, value in cfg.policy_parameters().items())
        modeled = (
            {device.name: 1e6 * moe_read_seconds(pruned_bytes / calls, 1, device) for device in devices}
            if bytes_known
            else {}
        )
        rows.append(
            ReplayRow(
                trace=table.name,
                scenario=scenario,
                shape=str(shape),
                policy=cfg.policy,
                params=params,
                layer_calls=calls,
                activated=mean[0],
                kept=mean[1],
                retained_mass=mean[2],
                top1_kept=mean[3],
                baseline_activated=sum(map(sum, baseline)) / calls,
                speedup=modeled_speedup(baseline_bytes, pruned_bytes),
                modeled_us=modeled,
            )
        )
        if on_config_done is not None:
            on_config_done()
    return rows
