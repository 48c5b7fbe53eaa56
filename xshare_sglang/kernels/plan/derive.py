"""Each kernel's launch for one call: one small function per kernel, from the call's :class:`CallFacts`.

The facts are what several kernels' constexprs read (who sums the retained mass, whether the
selection scores, the group warps, the key shift); each ``*_launch`` function turns them into that
kernel's grid, warps and constexpr bundles (:mod:`xshare_sglang.kernels.bundles`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import PrunerConfig
from ..bundles import (
    CoactivationConfig,
    CoverageConfig,
    Finish,
    GreedyConfig,
    Mask,
    NoConfig,
    RankRoundsConfig,
    Read,
    RouteMass,
    Router,
    Rows,
    Scores,
    TopAggregateConfig,
)
from .rule import set_rule
from .spec import CallSpec, Launch, LaunchPlan, Mode, SetRule
from .split import (
    BLOCK_BINS,
    FILL_BLOCK,
    FILL_PROGRAMS,
    KEY_SHIFTS,
    TILE_ELEMENTS,
    call_split,
    group_warp_routing,
    is_pow2,
    next_pow2,
    per_request_policy,
    route_warps,
    selection_warps,
    warp_picks,
)


@dataclass(frozen=True)
class CallFacts:
    """What one call's kernels share: the config, the spec, the split and rule, and the derived flags."""

    cfg: PrunerConfig
    spec: CallSpec
    split: LaunchPlan
    rule: SetRule
    static_alone: bool  # static moe-spec routes with the routing kernel alone
    route_mass: bool  # the routing kernel adds the retained mass
    need_scores: bool  # the selection scores the rows
    group_warps: int  # warps of a program that routes a row on a warp per group (0: none)
    key_shift: int
    has_range: bool

    @property
    def cover_pairs(self) -> bool:
        """The coverage ranking above one program on top-k scores: pair sums in the workspace."""
        return self.rule.mode == Mode.COVERAGE and not self.split.single and self.cfg.effective_score == "topk"

    @property
    def rows(self) -> Rows:
        return Rows(HAS_NV_PTR=self.spec.num_valid_on_device, HAS_WEIGHTS=self.spec.has_vote_weights)

    @property
    def finish(self) -> Finish:
        return Finish(
            HAS_CAP=self.rule.has_cap,
            HAS_RANGE=self.has_range,
            HAS_METRICS=self.spec.has_metrics,
            GATED=self.spec.metrics == "gated",
            HAS_STATS=self.spec.stats,
            NEED_SCORES=self.need_scores,
            ROUTE_MASS=self.route_mass,
        )


def call_facts(cfg: PrunerConfig, spec: CallSpec) -> CallFacts:
    """The call's split and rule, and what its kernels' constexprs share.  Above one program the rules
    that need no scores leave the retained mass to the routing kernel (``spec.routing_sums_mass``)."""
    split, static_alone = call_split(cfg, spec)
    rule = set_rule(cfg, spec.num_tokens, spec.num_experts, spec.router.top_k, spec.layer_id)
    route_mass = (
        spec.routing_sums_mass
        and spec.has_metrics
        and spec.route
        and not split.single
        and cfg.policy != "none"
        and not (rule.rule_scores or rule.has_cap or spec.stats)
    )
    need_scores = cfg.policy != "none" and (
        rule.rule_scores or rule.has_cap or (spec.has_metrics and not route_mass) or spec.stats
    )
    return CallFacts(
        cfg=cfg,
        spec=spec,
        split=split,
        rule=rule,
        static_alone=static_alone,
        route_mass=route_mass,
        need_scores=need_scores,
        group_warps=group_warp_routing(spec, cfg, split),
        key_shift=KEY_SHIFTS.get(spec.dtype, 0),
        has_range=cfg.policy != "none" and (cfg.min_tokens is not None or cfg.max_tokens is not None),
    )


def router(facts: CallFacts, row_warps: bool) -> Router:
    """The routing's constexprs, for a program whose warps hold a row each (``row_warps``) or not."""
    spec, num_groups, block_e = facts.spec, facts.spec.router.num_expert_group, facts.split.block_experts
    even_groups = num_groups > 1 and spec.num_experts == block_e and is_pow2(num_groups)
    return Router(
        HAS_WEIGHTS=spec.has_vote_weights,
        HAS_BIAS=spec.has_bias,
        SIGMOID=spec.router.scoring == "sigmoid",
        RENORMALIZE=spec.router.renormalize,
        TRUNCATION=facts.cfg.coverage == "truncation",
        GROUPED=num_groups > 1,
        HAS_SCALE=spec.router.routed_scaling_factor is not None,
        FILL=spec.fill_dropped,
        BLOCK_E=block_e,
        BLOCK_K=max(2, next_pow2(spec.router.top_k)),
        BLOCK_G=max(2, next_pow2(num_groups)),
        GROUP_SIZE=spec.num_experts // num_groups if even_groups else 0,
        KEY_SHIFT=0 if spec.has_bias else facts.key_shift,
        ROW_WARPS=row_warps,
        GROUP_WARPS=facts.group_warps > 0,
    )


def fill_launch(facts: CallFacts) -> Launch:
    """``fill_kernel``: the coverage pair sums (int64 [E, E] as int32 words) zeroed as a dependent launch."""
    words = 2 * facts.spec.num_experts * facts.spec.num_experts
    programs = max(1, min(FILL_PROGRAMS, -(-words // 8192)))
    return Launch("fill_kernel", (programs,), 4, dict(BLOCK=FILL_BLOCK), True, None)


def route_launch(facts: CallFacts) -> Launch:
    """``route_kernel`` above one program: a program per row on a warp per expert group, or a tile of
    rows on a warp per row.  The scores' settings matter only to its retained mass, the range only to
    static moe-spec's derived mask."""
    spec, split, group_warps = facts.spec, facts.split, facts.group_warps
    warps = group_warps or route_warps(split.block_experts, split)
    constexprs = dict(
        ROWS=facts.rows,
        ROUTER=router(facts, not group_warps and warps == split.route_rows),
        MASK=Mask(
            ALL_KEPT=facts.cfg.policy == "none",
            STATIC_KEEP=facts.static_alone,
            HAS_RANGE=facts.has_range and facts.static_alone,
        ),
        MASS=RouteMass(facts.cfg.effective_score == "topk", facts.key_shift) if facts.route_mass else None,
        HAS_METRICS=spec.has_metrics,
        GATED=spec.metrics == "gated",
        CHUNK_T=1 if group_warps else split.route_rows,
        PDL=spec.pdl,
    )
    grid = (spec.num_tokens,) if group_warps else (split.route_programs,)
    return Launch("route_kernel", grid, warps, constexprs, spec.pdl)


def rule_config(facts: CallFacts, warps: int):
    """The set rule's own constexprs (:mod:`xshare_sglang.kernels.jit.rules`)."""
    mode, split, spec = facts.rule.mode, facts.split, facts.spec
    block_e, score_topk = split.block_experts, facts.cfg.effective_score == "topk"
    search_steps = block_e.bit_length() + 1
    if mode in (Mode.GREEDY_WARM, Mode.GREEDY_BASE):
        return GreedyConfig(FROM_REQUESTS=mode == Mode.GREEDY_BASE, SCORE_TOPK=score_topk, ORDER=facts.rule.order)
    if mode == Mode.TOP_AGG:
        return TopAggregateConfig(SCORE_TOPK=score_topk, ORDER=facts.rule.order)
    if mode == Mode.RANK_ROUNDS:
        return RankRoundsConfig(SEARCH_STEPS=search_steps)
    if mode == Mode.COACT:
        keyed = spec.num_tokens <= spec.limits.max_keyed_coact_tokens
        return CoactivationConfig(KEYS=keyed, WARP_PICKS=warp_picks(mode, block_e), BLOCK_E=block_e, WARPS=warps)
    if mode == Mode.COVERAGE:
        return CoverageConfig(
            PAIRS=facts.cover_pairs,
            LISTS=cover_lists(facts),
            WARP_PICKS=warp_picks(mode, block_e),
            TILE_ROWS=cover_tile_rows(facts),
            SEARCH_STEPS=search_steps,
            BLOCK_E=block_e,
            WARPS=warps,
        )
    return NoConfig()


def cover_tile_rows(facts: CallFacts) -> int:
    """Rows of the coverage greedy's register tile (every row, in one program)."""
    split = facts.split
    return min(next_pow2(max(facts.spec.num_tokens, 1)), max(TILE_ELEMENTS // split.block_experts, split.chunk_rows))


def cover_lists(facts: CallFacts) -> bool:
    """The coverage greedy on dense scores above one register tile: per-expert row lists."""
    coverage = facts.rule.mode == Mode.COVERAGE
    return coverage and not facts.cover_pairs and facts.spec.num_tokens > cover_tile_rows(facts)


def select_launch(facts: CallFacts) -> Launch:
    """``select_kernel``: the selection over ``split.num_parts`` programs; in one program it also routes
    (``ROUTER``; None where it does not)."""
    cfg, spec, split, rule = facts.cfg, facts.spec, facts.split, facts.rule
    warps = selection_warps(split, cfg.policy, rule, facts.group_warps if split.single else 0)
    routes_here = split.single and spec.route
    lynx = cfg.policy == "lynx"
    constexprs = dict(
        ROWS=facts.rows,
        SCORES=Scores(
            NEED_SCORES=facts.need_scores,
            SCORE_TOPK=cfg.effective_score == "topk",
            SIGMOID=spec.router.scoring == "sigmoid",
            KEY_SHIFT=facts.key_shift,
            METRIC_SCORES=facts.need_scores and not (rule.rule_scores or rule.has_cap or spec.stats),
        ),
        READ=Read(
            MARKS=rule.mode not in (Mode.ALL, Mode.STATIC),
            PER_REQUEST=per_request_policy(cfg),
            REQUEST_TOP=rule.request_top,
            LYNX=lynx,
            COVERAGE=rule.mode == Mode.COVERAGE,
            COVER_PAIRS=facts.cover_pairs,
            COVER_LISTS=cover_lists(facts),
            CHUNK_T=split.chunk_rows,
            BLOCK_BINS=BLOCK_BINS,
            LYNX_CHUNK=max(1, min(32, 4096 // split.block_experts)),
        ),
        RULE=rule.mode.rule,
        RULE_CONFIG=rule_config(facts, warps),
        FINISH=facts.finish,
        ROUTER=router(facts, warps == split.route_rows) if routes_here else None,
        ROUTE_T=split.route_rows if routes_here else 1,
        SINGLE=split.single,
        BLOCK_E=split.block_experts,
        PDL=spec.pdl,
        # let this call's next kernel (routing or LYNX picks) launch early and wait on the device
        PDL_TRIGGER=spec.pdl and not split.single and (spec.route or lynx),
    )
    return Launch("select_kernel", (split.num_parts,), warps, constexprs, spec.pdl)


def lynx_launch(facts: CallFacts) -> Launch:
    """``lynx_pick_kernel``: LYNX's per-token picks above one program, on the selection's warps."""
    spec, split = facts.spec, facts.split
    warps = selection_warps(split, facts.cfg.policy, facts.rule, 0)
    constexprs = dict(
        ROWS=facts.rows,
        FINISH=facts.finish,
        KEY_SHIFT=facts.key_shift,
        BLOCK_E=split.block_experts,
        CHUNK_T=split.route_rows,
        PDL=spec.pdl,
        PDL_TRIGGER=spec.pdl and spec.route,
    )
    return Launch("lynx_pick_kernel", (split.route_programs,), warps, constexprs, spec.pdl)
