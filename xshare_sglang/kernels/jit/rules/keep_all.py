"""Reference: xshare_sglang.policies.api.select with policy ``none`` (every expert kept).

The rule of policy ``none``: every expert.
"""

import triton
import triton.language as tl


@triton.jit
def keep_all_rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG: tl.constexpr):
    """Every expert [E] (the uniform rule signature: :mod:`xshare_sglang.kernels.jit.rules`)."""
    return e_ok
