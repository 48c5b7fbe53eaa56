"""Reference: xshare_sglang.policies.greedy.threshold_add (policy ``xshare-threshold``).

The warm-up set grown by the candidates of largest aggregate until the kept share of the score mass
reaches ``tau``.
"""

import triton
import triton.language as tl

from ..numerics import threshold_target
from ..order import prefix_keep


@triton.jit
def threshold_rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG: tl.constexpr):
    """The warm-up set and the mass prefix of the candidates [E] (``policy.tau_q``: tau, fixed point)."""
    start = warm != 0
    candidate = e_ok & (~start) & (agg > 0)
    kept_mass = tl.sum(tl.where(start, agg, 0), axis=0)
    needed = threshold_target(tl.sum(agg, axis=0), policy.tau_q)
    return start | prefix_keep(agg, candidate, e, kept_mass, needed)
