"""The call's split over programs and warps: tiles of rows, programs, and who routes on which warps."""

from __future__ import annotations

import torch

from ...config import PrunerConfig
from .limits import PRODUCTION_LIMITS, PlanLimits
from .spec import CallSpec, LaunchPlan, Mode, SetRule

TILE_ELEMENTS = 2048  # a tile of rows holds about this many logits
MAX_TILE_ROWS = 8  # rows of one tile at most: more programs of fewer rows
COVERAGE_SPLIT_ROWS = 5  # the coverage ranking on top-k scores takes two programs from this T
WARP_PICKS_MAX_EXPERTS = 128  # greedy picks in every warp up to this E; block-wide maxima above
GROUP_WARP_SIZE = 32  # experts of one group that one warp holds, a lane each
GROUP_WARP_MAX_ROWS = 256  # the routing kernel's rows on a warp per group at most
BLOCK_BINS = 16  # LYNX bins 0..beta plus one carry digit
KEY_SHIFTS = {torch.bfloat16: 16, torch.float16: 13}  # float32 mantissa bits a 16-bit float lacks
FILL_PROGRAMS, FILL_BLOCK = 64, 2048  # fill_kernel: programs at most, words per step


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


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
    routing (:attr:`~.spec.CallSpec.routing_sums_mass`; without it, only calls without metrics).  Not for calls that
    want the score totals."""
    static = cfg.policy == "moe-spec" and cfg.ranking == "static" and cfg.scope != "request"
    return static and spec.route and not spec.stats and (spec.routing_sums_mass or not spec.has_metrics)


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
