"""The end of every set rule: the ``max_experts`` cap, the token range, the mask and the call's metrics."""

import triton
import triton.language as tl

from .metrics import add_metric
from .numerics import retained_share
from .order import places

WARM_FIRST = tl.constexpr(2**52)  # cap key: warm-up experts ahead of any aggregate (< 2**47)


@triton.jit
def finish_keep(keep, warm_b, agg, e, e_ok, n_valid, policy, outputs, collect, FINISH: tl.constexpr):
    """The ``max_experts`` cap (warm-up experts first, then by aggregate), the token range, then store
    the mask, the score stats and the per-call metrics.  Returns keep [E].

    ``policy`` holds ``cap``, ``min_tokens`` and ``max_tokens``, ``outputs`` the output pointers
    (:class:`~xshare_sglang.kernels.bundles.OutputArgs`), ``FINISH`` a
    :class:`~xshare_sglang.kernels.bundles.Finish`.  The metrics are added with relaxed atomics whose
    result is unused (``RED`` on sm_90): the GPU queues them without waiting, where a load-add-store
    waited a memory round trip per column and held back every load after it (the routing's logits in
    a one-program call).  Without scores (policy ``none``, every expert kept) the retained mass is
    whole.  With ``ROUTE_MASS`` the routing kernel adds the retained mass (``route_mass``), and this
    adds the other two columns.  ``collect``: this call adds its metrics (:func:`~.metrics.metrics_on`)."""
    if FINISH.HAS_CAP:
        # the [E, E] order only when the cap binds
        if tl.sum((keep & e_ok).to(tl.int32), axis=0) > policy.cap:
            cap_key = warm_b.to(tl.int64) * WARM_FIRST + agg
            place = places(cap_key, keep, e, e_ok, e, False)
            keep = keep & (place < policy.cap)
    if FINISH.HAS_RANGE:
        in_range = (n_valid >= policy.min_tokens) & (n_valid <= policy.max_tokens)
        keep = tl.where(in_range, keep, e_ok)
    keep = keep & e_ok
    tl.store(outputs.keep_ptr + e, keep, mask=e_ok)
    if FINISH.HAS_STATS:
        tl.store(outputs.stats_ptr, tl.sum(tl.where(keep, agg, 0), axis=0))
        tl.store(outputs.stats_ptr + 1, tl.sum(agg, axis=0))
    if FINISH.HAS_METRICS:
        if collect:
            if FINISH.NEED_SCORES and not FINISH.ROUTE_MASS:
                total = tl.sum(agg, axis=0)
                # the kept mass and the kept count in one sum: agg << 10 | 1 per kept expert (aggregates
                # stay below 2**53 and at most 512 experts are kept, as the set rules' order keys assume)
                kept_packed = tl.sum(tl.where(keep, (agg << 10) + 1, 0), axis=0)
                kept_count = kept_packed & 1023
                retained = retained_share(kept_packed >> 10, total)
            else:
                kept_count = tl.sum(keep.to(tl.int32), axis=0)
                retained = tl.full([], 1 << 24, tl.int64)
            add_metric(outputs.metrics_ptr + 1, kept_count)
            if not FINISH.ROUTE_MASS:
                add_metric(outputs.metrics_ptr + 2, retained)
            add_metric(outputs.metrics_ptr + 3, 1)
    return keep
