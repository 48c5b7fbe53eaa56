"""Reference: xshare_sglang.policies.moe_spec.select_moe_spec with ``ranking="static"``.

The calibrated set: the experts placed below the layer's budget by the offline ranking.
"""

import triton
import triton.language as tl


@triton.jit
def static_rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG: tl.constexpr):
    """The ``policy.count`` experts of the calibrated places (``tables.static_ptr``) [E], none without
    a valid token."""
    place = tl.load(tables.static_ptr + e, mask=e_ok, other=2147483647)
    return e_ok & (place < policy.count) & (n_valid > 0)
