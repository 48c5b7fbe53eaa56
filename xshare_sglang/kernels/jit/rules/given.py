"""Reference: xshare_sglang.policies.moe_spec.select_moe_spec with ``scope="request"``, and lynx.select_lynx.

The union of the sets phase 1 (or LYNX's batch order) built per request or per row.
"""

import triton
import triton.language as tl


@triton.jit
def given_rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG: tl.constexpr):
    """The union of the per-request (or per-row) sets [E]."""
    return base != 0
