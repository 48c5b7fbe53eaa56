"""What the fused selection kernels launch for one call: the dispatch table, as one pure function.

:func:`plan_call` takes the config and a :class:`CallSpec` (the call's shapes, router and flags, no
tensors) and returns a :class:`CallPlan`: every launch in order, with its grid, warps, launch options
and constexprs, and the scalars the launch wrapper passes.  The wrapper (:mod:`.launch`) builds the
arguments from it and decides nothing.  ``python -m xshare_sglang.kernels.plan`` prints the table
for the served models (docs/kernels.md embeds it).

The call's shape decides the pipeline:

* one program (a tile of at most :data:`MAX_TILE_ROWS` rows, or one request of a per-request policy):
  ``select_kernel`` selects and routes, one launch;
* above: ``select_kernel`` over up to ``max_parts`` programs, then ``lynx_pick_kernel`` (LYNX
  only), then ``route_kernel``; ``none`` and static moe-spec (whose sets need no selection) launch
  ``route_kernel`` alone;
* 2 to 8 rows of ``none`` or static moe-spec on a router whose groups of 32 route on a warp each
  (DeepSeek-V3): ``route_kernel``, a program per row;
* the coverage ranking on top-k scores from :data:`COVERAGE_SPLIT_ROWS` rows: two programs and its
  pair sums (zeroed before the call: by ``fill_kernel`` as a dependent launch, else by torch).

The limits that depend on T (``max_parts`` and the co-activation keys' ``max_keyed_coact_tokens``)
are a :class:`~.limits.PlanLimits`, :data:`~.limits.PRODUCTION_LIMITS` unless the call says
otherwise (:attr:`CallSpec.limits`): a test lowers them to reach at a few dozen rows what a served
call reaches at thousands.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ...config import PrunerConfig
from ...policies.call import RouterSpec
from .limits import MAX_KEYED_COACT_TOKENS as MAX_KEYED_COACT_TOKENS  # re-exported: the production values
from .limits import MAX_PARTS as MAX_PARTS
from .limits import PRODUCTION_LIMITS, PlanLimits

# ---------------------------------------------------------------------------------------- limits
MAX_EXPERTS = 512
MAX_TOP_K = 16
MAX_GROUPS = 32
MAX_TOKENS_PER_REQUEST = 64
MAX_LYNX_BETA = 14
MAX_TOKENS = 1 << 22  # aggregates stay below 2**56 (E * 2**24 per token at most)
MAX_COVERAGE_TOKENS = 1024  # ranking=coverage keeps every row's scores in the workspace
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# ---------------------------------------------------------------------------------------- layout
TILE_ELEMENTS = 2048  # a tile of rows holds about this many logits
MAX_TILE_ROWS = 8  # rows of one tile at most: more programs of fewer rows
COVERAGE_SPLIT_ROWS = 5  # the coverage ranking on top-k scores takes two programs from this T
WARP_PICKS_MAX_EXPERTS = 128  # greedy picks in every warp up to this E; block-wide maxima above
GROUP_WARP_SIZE = 32  # experts of one group that one warp holds, a lane each
GROUP_WARP_MAX_ROWS = 256  # the routing kernel's rows on a warp per group at most
BLOCK_BINS = 16  # LYNX bins 0..beta plus one carry digit
KEY_SHIFTS = {torch.bfloat16: 16, torch.float16: 13}  # float32 mantissa bits a 16-bit float lacks
FILL_PROGRAMS, FILL_BLOCK = 64, 2048  # fill_kernel: programs at most, words per step

#: The one open A/B switch: above one program, the rules that need no scores (``oea``, static
#: moe-spec, LYNX without a cap) leave the retained-mass metric to the routing kernel (``route_mass``)
#: instead of scoring every row in the selection.  Undecided until a GPU times both sides
#: (``scripts/bench_selection.py --select-mass`` sets it False); docs/kernels.md, "Open switches".
ROUTING_SUMS_MASS = True


class Mode(enum.IntEnum):
    """The selection kernel's set rule (constexpr ``MODE``)."""

    WARM = 0  # oea: the warm-up set
    GREEDY_WARM = 1  # xshare: warm-up, then a greedy budget
    GREEDY_BASE = 2  # xshare-spec: the union of per-request sets, then a greedy budget
    THRESHOLD = 3  # xshare-threshold
    RANK_ROUNDS = 4  # xshare-ep
    TOP_AGG = 5  # moe-spec, router ranking
    STATIC = 6  # moe-spec, static ranking (calibrated places)
    GIVEN = 7  # moe-spec per request, lynx: the union of per-row or per-request picks
    ALL = 8  # none: every expert
    COACT = 9  # moe-spec, co-activation ranking
    COVERAGE = 10  # moe-spec, coverage ranking


_POLICY_MODES = {
    "none": Mode.ALL,
    "oea": Mode.WARM,
    "xshare": Mode.GREEDY_WARM,
    "xshare-spec": Mode.GREEDY_BASE,
    "xshare-threshold": Mode.THRESHOLD,
    "xshare-ep": Mode.RANK_ROUNDS,
    "lynx": Mode.GIVEN,
}
_RANKING_MODES = {"static": Mode.STATIC, "coactivation": Mode.COACT, "coverage": Mode.COVERAGE}


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# ---------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class CallSpec:
    """What decides a call's launches: shapes, router and flags, no tensor.

    ``metrics`` is ``"off"``, ``"on"`` (a metrics row) or ``"gated"`` (a row and a device gate);
    ``route`` is False for the select-only entry point; ``stats`` asks for the score totals;
    ``limits`` are the T-dependent limits (:data:`~.limits.PRODUCTION_LIMITS` but in tests).
    """

    num_tokens: int
    num_experts: int
    router: RouterSpec
    dtype: torch.dtype = torch.float32
    tokens_per_request: int = 1
    layer_id: int | None = None
    has_bias: bool = False
    has_vote_weights: bool = False
    num_valid_on_device: bool = False
    route: bool = True
    fill_dropped: bool = False
    metrics: str = "off"
    stats: bool = False
    pdl: bool = False
    limits: PlanLimits = PRODUCTION_LIMITS

    @property
    def has_metrics(self) -> bool:
        return self.metrics != "off"


@dataclass(frozen=True)
class LaunchPlan:
    """How one call is split over programs: static for a given (T, D, E, policy)."""

    num_parts: int  # programs of the selection kernel; 1 = everything in one program
    rows_per_program: int
    rows_per_request: int  # rows of one request (= rows_per_program outside per-request policies)
    chunk_rows: int  # rows loaded per tile
    block_experts: int
    route_rows: int  # rows one routing tile covers
    route_programs: int  # programs of the routing kernel (0 when the selection program routes)

    @property
    def single(self) -> bool:
        return self.num_parts == 1


@dataclass(frozen=True)
class SetRule:
    """The policy's part of the selection: the rule, its count and the scalars it reads."""

    mode: Mode
    count: int  # the budget, the top count or the calibrated count, capped at E + 1
    order: bool  # the [E, E] order is compiled (False: the launch's rows settle its answer)
    k0: int
    request_budget: int
    has_cap: bool  # a max_experts cap the set rule applies
    rule_scores: bool  # the rule reads the aggregate scores
    request_top: bool  # moe-spec with scope=request
    static: bool  # reads the calibrated places
    coactivation: bool  # reads the co-activation redundancy


@dataclass(frozen=True)
class Launch:
    """One kernel launch: grid, warps, launch options and constexprs."""

    kernel: str
    grid: tuple[int, ...]
    num_warps: int
    constexprs: dict = field(default_factory=dict)
    launch_pdl: bool = False
    fp_fusion: bool | None = False  # enable_fp_fusion (None: not passed)

    @property
    def options(self) -> dict:
        options: dict = dict(num_warps=self.num_warps, launch_pdl=self.launch_pdl)
        if self.fp_fusion is not None:
            options["enable_fp_fusion"] = self.fp_fusion
        return options


@dataclass(frozen=True)
class CallPlan:
    """Everything one call launches, in order, and what the wrapper passes besides its buffers."""

    split: LaunchPlan
    rule: SetRule
    launches: tuple[Launch, ...]
    zero_pairs: bool  # the coverage pair sums start at 0: zeroed by torch before the launches
    static_alone: bool  # static moe-spec routes with the routing kernel alone

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(launch.kernel for launch in self.launches)


# ---------------------------------------------------------------------------------------- the split
def tile_rows(num_experts: int) -> int:
    """Rows of one tile of logits for E experts (the routing kernel's rows per program)."""
    return max(1, min(MAX_TILE_ROWS, TILE_ELEMENTS // max(16, next_pow2(num_experts))))


def per_request_policy(cfg: PrunerConfig) -> bool:
    """Whether the selection builds per-request sets (xshare-spec, moe-spec with scope=request)."""
    return cfg.policy == "xshare-spec" or (cfg.policy == "moe-spec" and cfg.scope == "request")


def plan_launch(
    num_tokens: int,
    num_experts: int,
    tokens_per_request: int,
    per_request: bool,
    min_parts: int = 1,
    *,
    limits: PlanLimits = PRODUCTION_LIMITS,
) -> LaunchPlan:
    """Split T tokens over at most ``limits.max_parts`` programs; requests never straddle programs.

    One program (one launch) only for one tile of rows or one request of a per-request policy: a
    second tile or request run serially costs more than a second launch.  One program's tiles are
    no taller than the call; tiles hold at most :data:`MAX_TILE_ROWS` rows.  ``min_parts`` (not with
    ``per_request``): a call of one tile but at least that many rows is split into that many programs
    of equal power-of-two tiles instead (see :func:`plan_for`).  ``limits``: see :class:`~.limits.PlanLimits`.
    """
    block_experts = max(16, next_pow2(num_experts))
    tile = tile_rows(num_experts)
    # a request's rows are read in tiles of at most D rows (a request shorter than D is padding)
    chunk = min(tile, next_pow2(tokens_per_request)) if per_request else tile
    rows = max(num_tokens, 1)
    if per_request:
        num_requests = max(1, -(-num_tokens // tokens_per_request))
        requests_per_program = -(-num_requests // limits.max_parts)
        num_parts = -(-num_requests // requests_per_program)
        rows_per_program = requests_per_program * tokens_per_request
        rows_per_request = tokens_per_request
    else:
        rows_per_program = max(tile, -(-rows // limits.max_parts))
        rows_per_program = -(-rows_per_program // tile) * tile
        num_parts = max(1, -(-num_tokens // rows_per_program))
        if num_parts < min_parts <= num_tokens:
            tile = next_pow2(-(-num_tokens // min_parts))
            chunk = rows_per_program = tile
            num_parts = -(-num_tokens // tile)
    if num_parts == 1:
        tile = min(tile, next_pow2(rows))
        if not per_request:
            chunk = tile
            rows_per_program = -(-rows // tile) * tile
    if not per_request:
        rows_per_request = rows_per_program
    route_programs = 0 if num_parts == 1 else -(-num_tokens // tile)
    return LaunchPlan(num_parts, rows_per_program, rows_per_request, chunk, block_experts, tile, route_programs)


def plan_for(
    cfg: PrunerConfig,
    num_tokens: int,
    num_experts: int,
    tokens_per_request: int,
    *,
    limits: PlanLimits = PRODUCTION_LIMITS,
) -> LaunchPlan:
    """:func:`plan_launch` for ``cfg``: the coverage ranking on top-k scores takes two programs from
    :data:`COVERAGE_SPLIT_ROWS` rows, where its greedy reads one row of pair sums per pick instead of
    recomputing every gain from the tile at each pick (at T <= 4 the tile is small and stays one
    launch)."""
    per_request = per_request_policy(cfg)
    split = (
        cfg.policy == "moe-spec"
        and cfg.ranking == "coverage"
        and cfg.effective_score == "topk"
        and not per_request
        and num_tokens >= COVERAGE_SPLIT_ROWS
    )
    min_parts = 2 if split else 1
    return plan_launch(num_tokens, num_experts, tokens_per_request, per_request, min_parts, limits=limits)


# ---------------------------------------------------------------------------------------- the rule
def set_rule(cfg: PrunerConfig, num_tokens: int, num_experts: int, top_k: int, layer_id: int | None) -> SetRule:
    """The selection's rule for one call of ``cfg``.

    The coverage ranking of one row is the router ranking's top count: each gain is the row's score
    times its one uncovered share, so the greedy keeps experts in the order (score desc, index asc).
    ``order`` is off when the launch's rows settle the order's answer: with top-k scores at most
    ``T x top_k`` experts have an aggregate, so a greedy budget that large (or zero) takes all (or
    none) of them, and the top count takes every scored expert, then the rest in index order.
    """
    policy = cfg.policy
    static = policy == "moe-spec" and cfg.ranking == "static"
    coact = policy == "moe-spec" and cfg.ranking == "coactivation"
    coverage = policy == "moe-spec" and cfg.ranking == "coverage"
    request_top = policy == "moe-spec" and cfg.scope == "request"
    layer_budget = cfg.layer_budget(layer_id) if policy == "moe-spec" else 0
    if request_top:
        mode, count = Mode.GIVEN, 0
    elif policy == "moe-spec":
        mode = _RANKING_MODES.get(cfg.ranking, Mode.TOP_AGG)
        count = min(layer_budget, num_experts) if (coact or coverage) else layer_budget
    else:
        mode, count = _POLICY_MODES[policy], (cfg.budget if policy != "none" else 0)
    if coverage and num_tokens == 1:
        mode = Mode.TOP_AGG
    count = min(count, num_experts + 1)
    fits = cfg.effective_score == "topk" and num_tokens * top_k <= count
    takes_all = (mode in (Mode.GREEDY_WARM, Mode.GREEDY_BASE) and (count <= 0 or fits)) or (
        mode == Mode.TOP_AGG and fits
    )
    return SetRule(
        mode=mode,
        count=count,
        order=not takes_all,
        k0=cfg.k0 if policy not in ("moe-spec", "lynx", "none") else 0,
        request_budget=min(layer_budget if request_top else cfg.request_budget, num_experts),
        has_cap=cfg.max_experts is not None and policy not in ("moe-spec", "none"),
        rule_scores=policy not in ("oea", "lynx", "none") and not static,
        request_top=request_top,
        static=static,
        coactivation=coact,
    )


# ---------------------------------------------------------------------------------------- warps
def tile_warps(block_experts: int) -> int:
    """Four warps hold a tile of rows, eight from 256 experts."""
    return 8 if block_experts >= 256 else 4


def route_warps(block_experts: int, split: LaunchPlan) -> int:
    """Warps of a program that routes a tile: one per row, where each top-k maximum of a row is one
    warp-wide ``REDUX``; above 256 experts one warp per 256 of a row."""
    return split.route_rows * max(1, block_experts // 256)


def is_light_rule(rule: SetRule) -> bool:
    """A rule that runs no order of the experts and has no cap: its one-program calls take a warp
    per row (:func:`selection_warps`), its row reductions then warp-wide."""
    if rule.has_cap:
        return False
    if rule.mode in (Mode.GREEDY_WARM, Mode.TOP_AGG):
        return not rule.order
    return rule.mode in (Mode.WARM, Mode.STATIC, Mode.COACT)


def selection_warps(split: LaunchPlan, policy: str, rule: SetRule, group_warps: int) -> int:
    """Warps per program of the selection (and, in a one-program call, its routing): a tile's four
    (eight from 256 experts); in a one-program call, a warp per routed row for ``none`` and for a
    light rule on at most 128 experts while that is no more than a tile's, and a warp per expert
    group where one row routes on them (``group_warps``)."""
    block_experts = split.block_experts
    if split.single and group_warps:
        return group_warps
    if split.single:
        row_warps = route_warps(block_experts, split)
        if policy == "none":
            return row_warps
        if block_experts <= 128 and is_light_rule(rule) and row_warps <= tile_warps(block_experts):
            return row_warps
    return tile_warps(block_experts)


def warp_picks(mode: Mode, block_experts: int) -> bool:
    """Whether the calibrated rankings' greedy picks run in every warp on its own copy of the gains
    (no block barrier per pick): a warp holds two halves of one row each, 128 experts a half for the
    co-activation ranking's int32 rows, 64 for the coverage ranking's int64 pair sums, and at most
    :data:`WARP_PICKS_MAX_EXPERTS` experts."""
    per_half = 128 if mode == Mode.COACT else 64
    return block_experts <= min(2 * per_half, WARP_PICKS_MAX_EXPERTS)


def group_warp_routing(spec: CallSpec, cfg: PrunerConfig, split: LaunchPlan) -> int:
    """Warps of a program that routes one row with a warp per expert group, or 0.

    Biased sigmoid routing (DeepSeek-V3's) whose groups split E into a power of two of groups of
    :data:`GROUP_WARP_SIZE` experts, at most 8, without truncation or filled slots (which read the
    whole row's picks), where the groups' picks fit two copies of 32 lanes per warp; in a one-program
    call of one row, or the routing kernel of up to :data:`GROUP_WARP_MAX_ROWS` rows, a program per
    row."""
    router, num_experts = spec.router, spec.num_experts
    num_groups = router.num_expert_group
    if num_groups <= 1:
        return 0
    if split.single and split.route_rows != 1:
        return 0
    if not split.single and split.route_programs * split.route_rows > GROUP_WARP_MAX_ROWS:
        return 0
    if not (spec.has_bias and router.scoring == "sigmoid") or cfg.coverage == "truncation" or spec.fill_dropped:
        return 0
    if not (is_pow2(num_groups) and num_groups <= 8 and num_experts == num_groups * GROUP_WARP_SIZE):
        return 0
    if num_groups * max(2, next_pow2(router.top_k)) > 2 * GROUP_WARP_SIZE:
        return 0
    return num_groups


# ---------------------------------------------------------------------------------------- the call
def routes_static_alone(cfg: PrunerConfig, spec: CallSpec) -> bool:
    """Whether static moe-spec may route with the routing kernel alone: its calibrated set is known
    before the call, so each routing program derives the mask.  The retained mass then comes from the
    routing (:data:`ROUTING_SUMS_MASS`; without it, only calls without metrics).  Not for calls that
    want the score totals."""
    static = cfg.policy == "moe-spec" and cfg.ranking == "static" and cfg.scope != "request"
    return static and spec.route and not spec.stats and (ROUTING_SUMS_MASS or not spec.has_metrics)


def call_split(cfg: PrunerConfig, spec: CallSpec) -> tuple[LaunchPlan, bool]:
    """The call's split and whether static moe-spec routes alone in it: :func:`plan_for`, then, for 2
    to 8 rows that need no selection launch (``none``, static moe-spec routing alone) and can route
    on a warp per expert group, the routing kernel with a program per row."""
    split = plan_for(cfg, spec.num_tokens, spec.num_experts, spec.tokens_per_request, limits=spec.limits)
    static_rule = routes_static_alone(cfg, spec)
    if spec.route and (cfg.policy == "none" or static_rule) and split.single and spec.num_tokens > 1:
        rows = plan_launch(spec.num_tokens, spec.num_experts, spec.tokens_per_request, False, 2, limits=spec.limits)
        if not rows.single and group_warp_routing(spec, cfg, rows):
            split = rows
    return split, static_rule and not split.single


def plan_call(cfg: PrunerConfig, spec: CallSpec) -> CallPlan:
    """Every launch of one call of ``cfg`` (see the module docstring)."""
    router, num_tokens, num_experts = spec.router, spec.num_tokens, spec.num_experts
    split, static_alone = call_split(cfg, spec)
    rule = set_rule(cfg, num_tokens, num_experts, router.top_k, spec.layer_id)
    block_e = split.block_experts
    has_metrics, pdl = spec.has_metrics, spec.pdl
    # the rules that need no scores leave the retained mass to the routing kernel above one program
    route_mass = (
        ROUTING_SUMS_MASS
        and has_metrics
        and spec.route
        and not split.single
        and cfg.policy != "none"
        and not (rule.rule_scores or rule.has_cap or spec.stats)
    )
    need_scores = cfg.policy != "none" and (
        rule.rule_scores or rule.has_cap or (has_metrics and not route_mass) or spec.stats
    )
    metric_scores = need_scores and not (rule.rule_scores or rule.has_cap or spec.stats)
    gated = spec.metrics == "gated"
    group_warps = group_warp_routing(spec, cfg, split)
    num_groups = router.num_expert_group
    key_shift = KEY_SHIFTS.get(spec.dtype, 0)
    has_range = cfg.policy != "none" and (cfg.min_tokens is not None or cfg.max_tokens is not None)
    lynx = cfg.policy == "lynx"
    even_groups = num_groups > 1 and num_experts == block_e and is_pow2(num_groups)
    group_size = num_experts // num_groups if even_groups else 0
    rows = dict(HAS_NV_PTR=spec.num_valid_on_device, HAS_WEIGHTS=spec.has_vote_weights)
    routing = dict(
        HAS_BIAS=spec.has_bias,
        SIGMOID=router.scoring == "sigmoid",
        RENORMALIZE=router.renormalize,
        TRUNCATION=cfg.coverage == "truncation",
        GROUPED=num_groups > 1,
        HAS_SCALE=router.routed_scaling_factor is not None,
        FILL=spec.fill_dropped,
        BLOCK_E=block_e,
        BLOCK_K=max(2, next_pow2(router.top_k)),
        BLOCK_G=max(2, next_pow2(num_groups)),
        # every group at once when the groups split a power-of-two E evenly into a power-of-two count
        GROUP_SIZE=group_size,
    )
    launches: list[Launch] = []
    coverage = rule.mode == Mode.COVERAGE
    cover_pairs = coverage and not split.single and cfg.effective_score == "topk"
    if cover_pairs and pdl:
        words = 2 * num_experts * num_experts  # the int64 [E, E] pair sums as int32 words
        programs = max(1, min(FILL_PROGRAMS, -(-words // 8192)))
        launches.append(Launch("fill_kernel", (programs,), 4, dict(BLOCK=FILL_BLOCK), True, None))
    if spec.route and not split.single:
        # a program per row on a warp per expert group, or a tile of rows on a warp per row
        route = dict(
            **rows,
            **routing,
            HAS_METRICS=has_metrics,
            GATED=gated,
            ROUTE_MASS=route_mass,
            # the scores' settings matter only to the routing's retained mass, the range only to static
            SCORE_TOPK=route_mass and cfg.effective_score == "topk",
            SCORE_KEY_SHIFT=key_shift if route_mass else 0,
            CHUNK_T=1 if group_warps else split.route_rows,
            KEY_SHIFT=0 if spec.has_bias else key_shift,
            ALL_KEPT=cfg.policy == "none",
            STATIC_KEEP=static_alone,
            HAS_RANGE=has_range and static_alone,
            ROW_WARPS=not group_warps and route_warps(block_e, split) == split.route_rows,
            GROUP_WARPS=group_warps > 0,
            PDL=pdl,
        )
        grid = (num_tokens,) if group_warps else (split.route_programs,)
        route_launch = Launch("route_kernel", grid, group_warps or route_warps(block_e, split), route, pdl)
        if cfg.policy == "none" or static_alone:
            return CallPlan(split, rule, (*launches, route_launch), False, static_alone)
    warps = selection_warps(split, cfg.policy, rule, group_warps if split.single else 0)
    # the coverage greedy: in one program, every row in registers; above, with top-k scores, the pair
    # sums (one row per pick); with dense scores above one register tile, per-expert row lists
    cover_tile_rows = min(next_pow2(max(num_tokens, 1)), max(TILE_ELEMENTS // block_e, split.chunk_rows))
    cover_lists = coverage and not cover_pairs and num_tokens > cover_tile_rows
    routes_here = split.single and spec.route
    select = dict(
        **rows,
        MODE=int(rule.mode),
        NEED_SCORES=need_scores,
        SCORE_TOPK=cfg.effective_score == "topk",
        SIGMOID=router.scoring == "sigmoid",
        PER_REQUEST=per_request_policy(cfg),
        REQUEST_TOP=rule.request_top,
        LYNX=lynx,
        HAS_CAP=rule.has_cap,
        HAS_RANGE=has_range,
        HAS_METRICS=has_metrics,
        GATED=gated,
        METRIC_SCORES=metric_scores,
        HAS_STATS=spec.stats,
        ROUTE_MASS=route_mass,
        SINGLE=split.single,
        BLOCK_E=block_e,
        BLOCK_BINS=BLOCK_BINS,
        CHUNK=max(1, min(32, 4096 // block_e)),  # experts per step of LYNX's digit comparison
        SEARCH_STEPS=block_e.bit_length() + 1,
        # the calibrated rankings' settings only where they rank (one compile for the other rules)
        COVER_T=cover_tile_rows if coverage else 1,
        COVER_LISTS=cover_lists,
        COVER_PAIRS=cover_pairs,
        COACT_KEYS=num_tokens <= spec.limits.max_keyed_coact_tokens or rule.mode != Mode.COACT,
        CHUNK_T=split.chunk_rows,
        KEY_SHIFT=key_shift,
        WARPS=warps,
        WARP_PICKS=rule.mode in (Mode.COACT, Mode.COVERAGE) and warp_picks(rule.mode, block_e),
        ORDER=rule.order and rule.mode in (Mode.TOP_AGG, Mode.GREEDY_WARM, Mode.GREEDY_BASE),
        PDL=pdl,
        # let this call's next kernel (routing or LYNX picks) launch early and wait on the device
        PDL_TRIGGER=pdl and not split.single and (spec.route or lynx),
    )
    # the routing's settings, where this program routes; canonical values elsewhere (one compile)
    select.update(
        ROUTE=routes_here,
        ROUTE_T=split.route_rows if routes_here else 1,
        ROUTE_KEY_SHIFT=(0 if spec.has_bias else key_shift) if routes_here else 0,
        ROW_WARPS=routes_here and warps == split.route_rows,
        GROUP_WARPS=routes_here and group_warps > 0,
        **{
            name: value if routes_here else _NOT_ROUTING[name]
            for name, value in routing.items()
            if name not in ("SIGMOID", "BLOCK_E")
        },
    )
    launches.append(Launch("select_kernel", (split.num_parts,), warps, select, pdl))
    if lynx and not split.single:
        picks = dict(
            **rows,
            NEED_SCORES=need_scores,
            HAS_CAP=rule.has_cap,
            HAS_RANGE=has_range,
            HAS_METRICS=has_metrics,
            GATED=gated,
            HAS_STATS=spec.stats,
            ROUTE_MASS=route_mass,
            KEY_SHIFT=key_shift,
            BLOCK_E=block_e,
            CHUNK_T=split.route_rows,
            PDL=pdl,
            PDL_TRIGGER=pdl and spec.route,
        )
        launches.append(Launch("lynx_pick_kernel", (split.route_programs,), warps, picks, pdl))
    if spec.route and not split.single:
        launches.append(route_launch)
    return CallPlan(split, rule, tuple(launches), cover_pairs and not pdl, False)


#: The routing constexprs of a selection program that does not route: one compile for all such calls.
_NOT_ROUTING = dict(
    HAS_BIAS=False,
    RENORMALIZE=False,
    TRUNCATION=False,
    GROUPED=False,
    HAS_SCALE=False,
    FILL=False,
    BLOCK_K=2,
    BLOCK_G=2,
    GROUP_SIZE=0,
)
