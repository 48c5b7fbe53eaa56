"""The Triton code of the fused selection kernels, a module per concern (docs/kernels.md).

Kernels, by the names :func:`xshare_sglang.kernels.plan.plan_call` gives them:

* ``select_kernel`` (:mod:`.select_kernel`): the keep mask of a call; in a one-program call its routing too;
* ``lynx_pick_kernel`` (:mod:`.lynx_kernel`): LYNX's per-token picks above one program;
* ``route_kernel`` (:mod:`.route_kernel`): the routing above one program (alone for ``none`` and static
  moe-spec);
* ``fill_kernel`` (:mod:`.route_kernel`): the coverage ranking's pair sums zeroed as a dependent launch.

Their building blocks: :mod:`.numerics` (the reference's float32 and fixed-point steps), :mod:`.keys`
(packed integer keys and warp maxima), :mod:`.rows` (reading logits), :mod:`.rules` (the experts' order,
the set rules, the cap), :mod:`.coverage` and :mod:`.coact` (the calibrated rankings), :mod:`.lynx`,
:mod:`.groups`, :mod:`.routing` and :mod:`.group_routing` (routing inside the mask), :mod:`.metrics`.
A kernel's runtime arguments come in tuples (the wrapper's argument groups, flattened into the same
parameters); helpers that take many constexprs take them as constexpr tuples, named in their docstrings.
"""

from .lynx_kernel import lynx_pick_kernel
from .route_kernel import fill_kernel, route_kernel
from .rules import (
    MODE_ALL,
    MODE_COACT,
    MODE_COVERAGE,
    MODE_GIVEN,
    MODE_GREEDY_BASE,
    MODE_GREEDY_WARM,
    MODE_RANK_ROUNDS,
    MODE_STATIC,
    MODE_THRESHOLD,
    MODE_TOP_AGG,
    MODE_WARM,
)
from .select_kernel import select_kernel

__all__ = [
    "MODE_ALL",
    "MODE_COACT",
    "MODE_COVERAGE",
    "MODE_GIVEN",
    "MODE_GREEDY_BASE",
    "MODE_GREEDY_WARM",
    "MODE_RANK_ROUNDS",
    "MODE_STATIC",
    "MODE_THRESHOLD",
    "MODE_TOP_AGG",
    "MODE_WARM",
    "fill_kernel",
    "lynx_pick_kernel",
    "route_kernel",
    "select_kernel",
]
