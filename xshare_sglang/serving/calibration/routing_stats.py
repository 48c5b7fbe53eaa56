"""Routing statistics for calibration: co-activation counts and per-layer budget curves.

What ``budget_allocation="calibrated"`` and ``ranking="coactivation"`` read from the calibration file,
accumulated from the top-k picks of recorded layer calls (an ``xshare-trace``, or SGLang's
``per_token`` recorder dump, which keeps each forward pass's top-k ids):

* ``coactivation[l, i, j]``: tokens of layer ``l`` that picked both ``i`` and ``j`` (the diagonal is
  each expert's own count);
* ``budget_curves[l, b]``: in a selection group (a decode batch, or one request's verify rows), the
  share of the group's picks that its ``b`` most-picked experts cover, averaged over groups.  The
  curve is what a budget of ``b`` experts keeps in that layer, so it says which layers need more.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RoutingStats:
    """Running sums over recorded layer calls; :meth:`add` one call's picks at a time.

    Attributes
    ----------
    coactivation : Tensor, shape [L, E, E], float64
        Pair counts (exact integers below ``2**53``).
    curve_sums : Tensor, shape [L, E + 1], float64
        Sum over selection groups of each group's coverage curve.
    groups : Tensor, shape [L], int64
        Selection groups with at least one pick, per layer.
    """

    coactivation: torch.Tensor
    curve_sums: torch.Tensor
    groups: torch.Tensor

    @classmethod
    def empty(cls, num_layers: int, num_experts: int) -> RoutingStats:
        return cls(
            coactivation=torch.zeros(num_layers, num_experts, num_experts, dtype=torch.float64),
            curve_sums=torch.zeros(num_layers, num_experts + 1, dtype=torch.float64),
            groups=torch.zeros(num_layers, dtype=torch.int64),
        )

    @property
    def num_layers(self) -> int:
        return int(self.coactivation.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.coactivation.shape[1])

    def add(self, layer: int, topk_ids: torch.Tensor, group_ids: torch.Tensor | None = None) -> None:
        """Count one layer call.

        Parameters
        ----------
        layer : int
        topk_ids : Tensor, shape [T, k], integer
            Each token's picks; ``-1`` (or any id outside ``[0, E)``) is no pick.
        group_ids : Tensor, shape [T], optional
            Selection group of each row (e.g. its request in a verify batch); None: one group.
        """
        num_experts = self.num_experts
        ids = topk_ids.long().cpu()
        valid = (ids >= 0) & (ids < num_experts)
        picks = torch.zeros(ids.shape[0], num_experts, dtype=torch.float64)
        picks.scatter_(1, torch.where(valid, ids, 0), valid.double())
        picks = picks.clamp(max=1.0)  # a token counts an expert once
        self.coactivation[layer] += picks.T @ picks
        if group_ids is None:
            groups = [picks]
        else:
            group_ids = group_ids.cpu()
            groups = [picks[group_ids == g] for g in torch.unique(group_ids)]
        for members in groups:
            per_expert = members.sum(0)
            total = per_expert.sum()
            if total <= 0:
                continue
            covered = torch.cumsum(torch.sort(per_expert, descending=True).values, 0) / total
            self.curve_sums[layer, 1:] += covered.clamp(max=1.0)
            self.groups[layer] += 1

    def budget_curves(self) -> torch.Tensor:
        """Mean coverage curve per layer, float64 [L, E + 1]; all zero for a layer with no pick."""
        return self.curve_sums / self.groups.clamp(min=1).double()[:, None]

    def counts(self) -> torch.Tensor:
        """Per-layer pick counts, int64 [L, E] (the co-activation diagonal)."""
        return torch.diagonal(self.coactivation, dim1=1, dim2=2).round().long()

    def merge(self, other: RoutingStats) -> None:
        if other.coactivation.shape != self.coactivation.shape:
            raise ValueError(
                f"routing statistics of {other.num_layers} layers x {other.num_experts} experts cannot be added to "
                f"{self.num_layers} x {self.num_experts}"
            )
        self.coactivation += other.coactivation
        self.curve_sums += other.curve_sums
        self.groups += other.groups


def stats_from_trace(trace) -> RoutingStats:
    """Routing statistics of every call of an ``xshare-trace`` (:class:`~xshare_sglang.replay.trace.Trace`).

    Picks are the calls' unpruned top-k.  A verify call's rows are grouped by request (one
    selection group per draft tree, as ``scope="request"`` budgets them); any other call is one group.
    """
    meta = trace.meta
    stats = RoutingStats.empty(meta.num_layers, meta.num_experts)
    for call in trace.calls:
        ids, _ = call.natural_topk(meta)
        stats.add(call.layer, ids, call.request_ids if call.phase == "verify" else None)
    return stats
