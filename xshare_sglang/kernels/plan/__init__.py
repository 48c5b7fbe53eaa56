"""What the fused selection kernels launch for one call: the dispatch table, as pure functions.

:func:`plan_call` takes the config and a :class:`CallSpec` (the call's shapes, router and flags, no
tensors) and returns a :class:`CallPlan`: every launch in order, with its grid, warps, launch options
and constexprs.  It chooses the pipeline (:func:`choose_pipeline`), then derives each kernel's launch
(:mod:`.derive`, one function per kernel).  The wrapper (:mod:`..launch`) builds the arguments from it
and decides nothing.  ``python -m xshare_sglang.kernels.plan`` prints the table for the served models
(docs/kernels.md embeds it).

The pipelines (:class:`Pipeline`), by the call's shape:

* ``ONE_PROGRAM``: one tile of at most :data:`~.split.MAX_TILE_ROWS` rows, or one request of a
  per-request policy: ``select_kernel`` selects and routes, one launch;
* ``SPLIT``: above, ``select_kernel`` over up to ``max_parts`` programs, then ``lynx_pick_kernel``
  (LYNX only), then ``route_kernel``; the coverage ranking on top-k scores from
  :data:`~.split.COVERAGE_SPLIT_ROWS` rows takes two programs and its pair sums (zeroed before the
  call: by ``fill_kernel`` as a dependent launch, else by torch);
* ``ROUTE_ALONE``: ``none`` and static moe-spec (whose sets need no selection) above one program:
  ``route_kernel`` alone, a tile of rows per program;
* ``ROUTE_PER_ROW``: 2 to 8 rows of those two on a router whose groups of 32 route on a warp each
  (DeepSeek-V3): ``route_kernel``, a program per row.

The limits (:mod:`.limits`): the fixed ones a call must keep to run on the kernels, and those that
depend on T (``max_parts``, the co-activation keys' ``max_keyed_coact_tokens``), a
:class:`~.limits.PlanLimits`, :data:`~.limits.PRODUCTION_LIMITS` unless the call says otherwise
(:attr:`CallSpec.limits`): a test lowers them to reach at a few dozen rows what a served call reaches
at thousands.
"""

from __future__ import annotations

from ...config import PrunerConfig
from .derive import CallFacts, call_facts, fill_launch, lynx_launch, route_launch, select_launch
from .limits import (
    MAX_COVERAGE_TOKENS,
    MAX_EXPERTS,
    MAX_GROUPS,
    MAX_KEYED_COACT_TOKENS,
    MAX_LYNX_BETA,
    MAX_PARTS,
    MAX_TOKENS,
    MAX_TOKENS_PER_REQUEST,
    MAX_TOP_K,
    PRODUCTION_LIMITS,
    SUPPORTED_DTYPES,
    PlanLimits,
)
from .rule import set_rule
from .spec import CallPlan, CallSpec, Launch, LaunchPlan, Mode, Pipeline, SetRule
from .split import (
    BLOCK_BINS,
    COVERAGE_SPLIT_ROWS,
    KEY_SHIFTS,
    MAX_TILE_ROWS,
    TILE_ELEMENTS,
    call_split,
    group_warp_routing,
    per_request_policy,
    plan_for,
    plan_launch,
    selection_warps,
    tile_rows,
    warp_picks,
)


def choose_pipeline(facts: CallFacts) -> Pipeline:
    """Which kernels the call runs (the module docstring's pipelines)."""
    if facts.split.single:
        return Pipeline.ONE_PROGRAM
    if facts.spec.route and (facts.cfg.policy == "none" or facts.static_alone):
        return Pipeline.ROUTE_PER_ROW if facts.group_warps else Pipeline.ROUTE_ALONE
    return Pipeline.SPLIT


def plan_call(cfg: PrunerConfig, spec: CallSpec) -> CallPlan:
    """Every launch of one call of ``cfg``: the pipeline, then each of its kernels' launch."""
    facts = call_facts(cfg, spec)
    pipeline = choose_pipeline(facts)
    zero_pairs = False
    if pipeline == Pipeline.ONE_PROGRAM:
        launches = [select_launch(facts)]
    elif pipeline in (Pipeline.ROUTE_ALONE, Pipeline.ROUTE_PER_ROW):
        launches = [route_launch(facts)]
    else:
        launches = [fill_launch(facts)] if facts.cover_pairs and spec.pdl else []
        launches.append(select_launch(facts))
        if cfg.policy == "lynx":
            launches.append(lynx_launch(facts))
        if spec.route:
            launches.append(route_launch(facts))
        zero_pairs = facts.cover_pairs and not spec.pdl
    return CallPlan(facts.split, facts.rule, pipeline, tuple(launches), zero_pairs, facts.static_alone)


__all__ = [
    "BLOCK_BINS",
    "COVERAGE_SPLIT_ROWS",
    "KEY_SHIFTS",
    "MAX_COVERAGE_TOKENS",
    "MAX_EXPERTS",
    "MAX_GROUPS",
    "MAX_KEYED_COACT_TOKENS",
    "MAX_LYNX_BETA",
    "MAX_PARTS",
    "MAX_TILE_ROWS",
    "MAX_TOKENS",
    "MAX_TOKENS_PER_REQUEST",
    "MAX_TOP_K",
    "PRODUCTION_LIMITS",
    "SUPPORTED_DTYPES",
    "TILE_ELEMENTS",
    "CallFacts",
    "CallPlan",
    "CallSpec",
    "Launch",
    "LaunchPlan",
    "Mode",
    "Pipeline",
    "PlanLimits",
    "SetRule",
    "call_split",
    "choose_pipeline",
    "group_warp_routing",
    "per_request_policy",
    "plan_call",
    "plan_for",
    "plan_launch",
    "selection_warps",
    "set_rule",
    "tile_rows",
    "warp_picks",
]
