"""The set rules of the selection kernel: one jit function per rule, one module per rule.

Every rule has one signature, ``rule(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok,
CONFIG)``: the call's totals from phase 1 (aggregate scores [E] int64, warm-up marks and per-request
sets [E] int32), the kernel's argument bundles (:mod:`xshare_sglang.kernels.bundles`), the number of
valid tokens, the expert lanes, and the rule's own constexpr config (a named tuple of that module's
knobs, or :class:`~xshare_sglang.kernels.bundles.NoConfig`); it returns the keep mask [E] before the cap
and the token range (:func:`~..finish.finish_keep`).  The selection kernel takes the rule as a
constexpr (``RULE``) and its config (``RULE_CONFIG``); the plan names the rule (:data:`RULES`' keys)
and the launch wrapper passes the function.  Each module names its torch reference in ``policies/`` on
its first line.

=================  ==========================================  ===================================
rule               policy                                      config
=================  ==========================================  ===================================
``keep_all``       ``none``                                    ``NoConfig``
``warm``           ``oea``                                     ``NoConfig``
``greedy``         ``xshare``, ``xshare-spec``                 ``GreedyConfig``
``threshold``      ``xshare-threshold``                        ``NoConfig``
``rank_rounds``    ``xshare-ep``                               ``RankRoundsConfig``
``top_aggregate``  moe-spec, router ranking                    ``TopAggregateConfig``
``static``         moe-spec, static ranking                    ``NoConfig``
``given``          moe-spec per request, ``lynx``              ``NoConfig``
``coactivation``   moe-spec, co-activation ranking             ``CoactivationConfig``
``coverage``       moe-spec, coverage ranking                  ``CoverageConfig``
=================  ==========================================  ===================================
"""

from .coactivation import coactivation_rule
from .coverage import coverage_rule
from .given import given_rule
from .greedy import greedy_rule
from .keep_all import keep_all_rule
from .rank_rounds import rank_rounds_rule
from .static import static_rule
from .threshold import threshold_rule
from .top_aggregate import top_aggregate_rule
from .warm import warm_rule

#: The rules by the names the plan gives them (:class:`xshare_sglang.kernels.plan.Mode`'s ``rule``).
RULES = {
    "keep_all": keep_all_rule,
    "warm": warm_rule,
    "greedy": greedy_rule,
    "threshold": threshold_rule,
    "rank_rounds": rank_rounds_rule,
    "top_aggregate": top_aggregate_rule,
    "static": static_rule,
    "given": given_rule,
    "coactivation": coactivation_rule,
    "coverage": coverage_rule,
}

__all__ = ["RULES"]
