"""XShare-family policies: ``oea``, ``xshare``, ``xshare-threshold``, ``xshare-spec``, ``xshare-ep``.

Sources: XShare (final version) Alg. 1-6; XShare (earlier version) Alg. 1 with a threshold; OEA is
XShare Alg. 2 with budget 0.
"""

from __future__ import annotations

import torch

from ._batch import LayerBatch, Selection
from .greedy import greedy_add, rank_rounds_add, threshold_add, warm_up
from .scores import per_request_sums, top_by_logit


def select_oea(batch: LayerBatch) -> Selection:
    """``oea``: the warm-up set W(k0) alone."""
    warm = warm_up(batch.logits, batch.valid, batch.cfg.k0)
    return Selection(warm, warm)


def select_xshare(batch: LayerBatch) -> Selection:
    """``xshare``: G(W(k0), batch aggregate, budget)."""
    warm = warm_up(batch.logits, batch.valid, batch.cfg.k0)
    return Selection(greedy_add(warm, batch.batch_aggregate, batch.cfg.budget), warm)


def select_xshare_threshold(batch: LayerBatch) -> Selection:
    """``xshare-threshold``: grow W(k0) until ``tau`` of the batch's aggregate is kept."""
    warm = warm_up(batch.logits, batch.valid, batch.cfg.k0)
    return Selection(threshold_add(warm, batch.batch_aggregate, batch.cfg.tau), warm)


def select_xshare_spec(batch: LayerBatch) -> Selection:
    """``xshare-spec``: per-request greedy, then batch greedy on the union (XShare Alg. 3-4).

    Request r is the block of rows ``[r*D, (r+1)*D)``; only voting rows count, so a last, shorter
    block of real tokens is a request of its own and blocks of padding contribute nothing.
    """
    cfg = batch.cfg
    d = batch.call.tokens_per_request
    warm_rows = top_by_logit(batch.logits, cfg.k0) & batch.valid[:, None]
    warm_per_request = per_request_sums(warm_rows.to(torch.int64), d) > 0
    agg_per_request = per_request_sums(batch.valid_scores, d)

    per_request = greedy_add(warm_per_request, agg_per_request, cfg.request_budget)
    union = per_request.any(dim=0)
    keep = greedy_add(union, batch.batch_aggregate, cfg.budget)
    return Selection(keep, warm_per_request.any(dim=0))


def select_xshare_ep(batch: LayerBatch) -> Selection:
    """``xshare-ep``: W(k0), then GPU-balanced greedy rounds (XShare Alg. 5-6)."""
    warm = warm_up(batch.logits, batch.valid, batch.cfg.k0)
    keep = rank_rounds_add(warm, batch.batch_aggregate, batch.call.expert_to_rank, batch.cfg.rank_budget)
    return Selection(keep, warm)
