"""Reference: xshare_sglang.policies.xshare.select_oea (policy ``oea``; greedy.warm_up).

The warm-up set: every expert among some valid token's ``k0`` best.
"""

import triton
import triton.language as tl


@triton.jit
def warm_rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG: tl.constexpr):
    """The warm-up set [E] as phase 1 marked it."""
    return warm != 0
