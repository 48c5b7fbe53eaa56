"""Reference: xshare_sglang.policies.moe_spec.select_moe_spec with ``ranking="router"``.

The router ranking's top ``count`` experts by aggregate score.
"""

import triton
import triton.language as tl

from ..order import places, places_scored_first


@triton.jit
def top_aggregate_rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG: tl.constexpr):
    """The top ``policy.count`` by aggregate [E] (``CONFIG``: :class:`~xshare_sglang.kernels.bundles.
    TopAggregateConfig`).  The [E, E] order only when more experts than the count can have an
    aggregate: with top-k scores at most ``n_valid x top_k`` (a branch on a value the whole block
    holds; ``ORDER`` off when the launch's rows settle it); otherwise the scored experts, then the rest
    in index order (:func:`~..order.places_scored_first`)."""
    count = policy.count
    if CONFIG.ORDER:
        if CONFIG.SCORE_TOPK:
            if n_valid * policy.top_k > count:
                place = places(agg, e_ok, e, e_ok, e, False)
            else:
                place = places_scored_first(agg, e_ok)
        else:
            place = places(agg, e_ok, e, e_ok, e, False)
    else:
        place = places_scored_first(agg, e_ok)
    return e_ok & (place < count) & (n_valid > 0)
