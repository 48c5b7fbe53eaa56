"""A trace's tokens of one phase as dense per-layer tables, and its requests as token sequences."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .trace import Trace, TraceMeta

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenTable:
    """Every recorded token of one phase, N of them, in recording order.

    Attributes
    ----------
    meta : TraceMeta
    logits : list of Tensor, one per layer, each [N, E] float32
    natural_ids : Tensor, shape [N, L, k], int64 (-1 = none)
    natural_weights : Tensor, shape [N, L, k], float32
    request_ids : Tensor, shape [N], int64
    """

    name: str
    meta: TraceMeta
    logits: list[torch.Tensor]
    natural_ids: torch.Tensor
    natural_weights: torch.Tensor
    request_ids: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.request_ids.shape[0]

    def sequences(self) -> dict[str, list[torch.Tensor]]:
        """Token indices of every request, in step order, grouped by the request's source label."""
        out: dict[str, list[torch.Tensor]] = {}
        for request in torch.unique(self.request_ids).tolist():
            rows = torch.nonzero(self.request_ids == request).flatten()
            out.setdefault(self.meta.source_of(request), []).append(rows)
        return dict(sorted(out.items()))


def token_table(trace: Trace, phase: str = "decode") -> TokenTable:
    """Gather the calls of ``phase`` step by step; a step lacking a layer, or whose layers list
    different rows, is skipped with a warning."""
    meta = trace.meta
    steps: dict[int, dict[int, object]] = {}
    for call in trace.calls:
        if call.phase == phase:
            steps.setdefault(call.step, {})[call.layer] = call
    if not steps:
        raise ValueError(f"trace {trace.name} has no {phase} calls (it has: {', '.join(trace.phases()) or 'none'})")
    per_layer_logits: list[list[torch.Tensor]] = [[] for _ in range(meta.num_layers)]
    ids, weights, requests = [], [], []
    skipped = 0
    for step in sorted(steps):
        calls = steps[step]
        if len(calls) != meta.num_layers or any(
            not torch.equal(c.request_ids, calls[0].request_ids) for c in calls.values()
        ):
            skipped += 1
            continue
        step_ids, step_weights = [], []
        for layer in range(meta.num_layers):
            call = calls[layer]
            per_layer_logits[layer].append(call.router_logits(meta.num_experts))
            natural_ids, natural_weights = call.natural_topk(meta)
            step_ids.append(natural_ids)
            step_weights.append(natural_weights)
        ids.append(torch.stack(step_ids, dim=1))
        weights.append(torch.stack(step_weights, dim=1))
        requests.append(calls[0].request_ids)
    if skipped:
        logger.warning("trace %s: skipped %d %s steps without every layer", trace.name, skipped, phase)
    if not requests:
        raise ValueError(f"trace {trace.name}: no {phase} step records every layer")
    return TokenTable(
        name=trace.name,
        meta=meta,
        logits=[torch.cat(chunks) for chunks in per_layer_logits],
        natural_ids=torch.cat(ids),
        natural_weights=torch.cat(weights),
        request_ids=torch.cat(requests),
    )
