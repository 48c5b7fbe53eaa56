"""The Triton code of the fused selection kernels, a module per concern (docs/kernels.md).

Kernels, by the names :func:`xshare_sglang.kernels.plan.plan_call` gives them:

* ``select_kernel`` (:mod:`.select_kernel`): the keep mask of a call; in a one-program call its routing too;
* ``lynx_pick_kernel`` (:mod:`.lynx_kernel`): LYNX's per-token picks above one program;
* ``route_kernel`` (:mod:`.route_kernel`): the routing above one program (alone for ``none`` and static
  moe-spec);
* ``fill_kernel`` (:mod:`.route_kernel`): the coverage ranking's pair sums zeroed as a dependent launch.

The set rules, one jit function each with one signature, are :mod:`.rules` (``RULES``, by the plan's
names), passed to ``select_kernel`` as a constexpr.  Their building blocks: :mod:`.numerics` (the
reference's float32 and fixed-point steps), :mod:`.keys` (packed integer keys and warp maxima), :mod:`.rows`
(reading logits), :mod:`.order` (the experts' order and greedy picks), :mod:`.finish` (the cap, the range,
the mask and metrics), :mod:`.coverage` and :mod:`.coact` (the calibrated rankings' picks), :mod:`.lynx`,
:mod:`.groups`, :mod:`.routing` and :mod:`.group_routing` (routing inside the mask), :mod:`.metrics`.
Every argument and constexpr group is a named tuple of :mod:`xshare_sglang.kernels.bundles`, read by
field name.
"""

from .lynx_kernel import lynx_pick_kernel
from .route_kernel import fill_kernel, route_kernel
from .rules import RULES
from .select_kernel import select_kernel

__all__ = ["RULES", "fill_kernel", "lynx_pick_kernel", "route_kernel", "select_kernel"]
