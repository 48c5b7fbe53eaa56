"""Reference: xshare_sglang.policies.xshare.select_xshare and select_xshare_spec (greedy.greedy_add).

A start set (the warm-up set, or for ``xshare-spec`` the union of per-request sets) grown by the
greedy budget: the ``count`` candidates of largest aggregate.
"""

import triton
import triton.language as tl

from ..order import places


@triton.jit
def greedy_rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG: tl.constexpr):
    """The start set and the budget's candidates [E] (``CONFIG``: :class:`~xshare_sglang.kernels.
    bundles.GreedyConfig`).  With top-k scores at most ``n_valid x top_k`` experts are candidates;
    when every candidate is taken anyway the [E, E] order is skipped (a branch on a value the whole
    block holds)."""
    if CONFIG.FROM_REQUESTS:
        start = base != 0
    else:
        start = warm != 0
    candidate = e_ok & (~start) & (agg > 0)
    count = policy.count
    if CONFIG.SCORE_TOPK:
        most = n_valid * policy.top_k
    else:
        most = tl.full([], 0, tl.int64) + call.num_experts
    keep = start
    if count > 0:
        if CONFIG.ORDER:
            if most > count:
                place = places(agg, candidate, e, e_ok, e, False)
                keep = start | (candidate & (place < count))
            else:
                keep = start | candidate  # every candidate's place is below count
        else:
            keep = start | candidate  # the plan knows that T x top_k <= count
    return keep
