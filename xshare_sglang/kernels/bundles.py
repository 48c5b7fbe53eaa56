"""The kernels' argument bundles: named tuples the jit code reads by field name.

A kernel takes its runtime arguments in a few bundles (:data:`KERNEL_BUNDLES` says which, in order) and
its constexprs as a few more: one named tuple per concern, built by the plan (:mod:`.plan`), and the
set rule as a jit function with its own small config (:mod:`.jit.rules`).  Triton flattens a named
tuple into the kernel's parameters in field order and gives the jit code its fields by name, so no
kernel or helper reads an argument by position.  Pure Python: the plan, the launch wrapper and the
tools import this without Triton.
"""

from __future__ import annotations

from typing import NamedTuple


# ------------------------------------------------------------------------------------ runtime bundles
class CallArgs(NamedTuple):
    """The call's logits and counts (every kernel)."""

    logits_ptr: object
    stride_t: int
    stride_e: int
    num_tokens: int
    num_experts: int
    n_valid_ptr: object  # the number of valid tokens on the device (a placeholder with ``HAS_NV_PTR`` off)
    n_valid_arg: int  # ... or on the host
    weights_ptr: object  # the tokens' vote weights (a placeholder with ``HAS_WEIGHTS`` off)


class SplitArgs(NamedTuple):
    """How the selection's programs split the rows."""

    rows_per_program: int
    rows_per_request: int


class PolicyArgs(NamedTuple):
    """The policy's scalars, as the selection kernel reads them."""

    k0: int
    top_k: int
    request_budget: int
    count: int  # the rule's budget, top count or calibrated count
    tau_q: int
    rank_budget: int
    cap: int
    min_tokens: int
    max_tokens: int
    alpha: float
    beta: int


class TableArgs(NamedTuple):
    """Per-expert tables: calibrated places, co-activation redundancy, expert-parallel ranks."""

    static_ptr: object
    redundancy_ptr: object
    group_ptr: object


class CoverageArgs(NamedTuple):
    """The coverage ranking's workspace."""

    row_scores_ptr: object
    cover_rows_ptr: object
    cover_count_ptr: object
    cover_capacity: int
    cover_agg_ptr: object
    cover_pairs_ptr: object


class ShareArgs(NamedTuple):
    """The accumulators the selection's programs add their shares into."""

    agg_acc_ptr: object
    warm_acc_ptr: object
    base_acc_ptr: object
    counts_acc_ptr: object


class LynxArgs(NamedTuple):
    """LYNX's digits (the batch order above 2**61) and its experts' ranks."""

    digits_ptr: object
    s_rank_ptr: object


class OutputArgs(NamedTuple):
    """What the kernel that finishes the mask writes."""

    keep_ptr: object
    metrics_ptr: object
    metrics_gate_ptr: object
    stats_ptr: object


class RoutingArgs(NamedTuple):
    """The router's inputs and the routing's outputs."""

    bias_ptr: object
    ids_ptr: object
    ids_stride: int
    out_w_ptr: object
    out_w_stride: int
    top_k: int
    topk_group: int
    group_size: int
    num_groups: int
    scale: float


class LynxPolicyArgs(NamedTuple):
    """The scalars ``lynx_pick_kernel`` reads (the cap and range as :class:`PolicyArgs` names them)."""

    top_k: int
    alpha: float
    beta: int
    cap: int
    min_tokens: int
    max_tokens: int


class LynxPickArgs(NamedTuple):
    """``lynx_pick_kernel``'s workspace."""

    s_rank_ptr: object
    agg_acc_ptr: object
    picked_ptr: object
    ticket_ptr: object


class RouteStateArgs(NamedTuple):
    """What the routing programs read and write besides the routing outputs."""

    keep_ptr: object
    visits_ptr: object
    ticket_ptr: object
    metrics_ptr: object
    metrics_gate_ptr: object
    mass_ptr: object


class StaticArgs(NamedTuple):
    """Static moe-spec's calibrated set, for a routing kernel that derives the mask."""

    static_ptr: object
    static_count: int
    min_tokens: int
    max_tokens: int


#: Each kernel's runtime parameters in order: a bundle class, or None for a plain argument.
KERNEL_BUNDLES: dict[str, tuple[tuple[str, type | None], ...]] = {
    "fill_kernel": (("ptr", None), ("numel", None)),
    "select_kernel": (
        ("call", CallArgs),
        ("split", SplitArgs),
        ("policy", PolicyArgs),
        ("tables", TableArgs),
        ("coverage", CoverageArgs),
        ("shares", ShareArgs),
        ("lynx", LynxArgs),
        ("ticket_ptr", None),
        ("outputs", OutputArgs),
        ("routing", RoutingArgs),
    ),
    "lynx_pick_kernel": (
        ("call", CallArgs),
        ("policy", LynxPolicyArgs),
        ("workspace", LynxPickArgs),
        ("outputs", OutputArgs),
    ),
    "route_kernel": (
        ("call", CallArgs),
        ("routing", RoutingArgs),
        ("state", RouteStateArgs),
        ("tables", StaticArgs),
    ),
}


# ------------------------------------------------------------------------------------ constexpr bundles
class Rows(NamedTuple):
    """How every kernel reads the call's rows."""

    HAS_NV_PTR: bool  # the number of valid tokens is on the device
    HAS_WEIGHTS: bool  # the rows carry vote weights


class Scores(NamedTuple):
    """The selection's fixed-point scores."""

    NEED_SCORES: bool  # the rule, its cap, the stats or the metrics read the aggregate
    SCORE_TOPK: bool  # top-k scores (otherwise every candidate's)
    SIGMOID: bool
    KEY_SHIFT: int  # float32 mantissa bits the logits' dtype lacks
    METRIC_SCORES: bool  # only the metrics read them: scored only in calls that add metrics


class Read(NamedTuple):
    """What the selection's phase 1 builds from the rows besides the aggregate."""

    MARKS: bool  # the warm-up marks (every rule but ``all`` and ``static``)
    PER_REQUEST: bool  # per-request sets
    REQUEST_TOP: bool  # ... as moe-spec's per-request top count
    LYNX: bool  # LYNX's bin counts
    COVERAGE: bool  # the coverage ranking's column sums
    COVER_PAIRS: bool  # ... and pair sums
    COVER_LISTS: bool  # ... or per-expert row lists
    CHUNK_T: int  # rows loaded per tile
    BLOCK_BINS: int
    LYNX_CHUNK: int  # experts per step of LYNX's digit comparison


class Finish(NamedTuple):
    """The end of every set rule (:func:`~.jit.finish.finish_keep`)."""

    HAS_CAP: bool
    HAS_RANGE: bool
    HAS_METRICS: bool
    GATED: bool
    HAS_STATS: bool
    NEED_SCORES: bool
    ROUTE_MASS: bool  # the routing kernel adds the retained mass


class Router(NamedTuple):
    """The routing of a tile of rows inside the mask (:func:`~.jit.routing.route_block`)."""

    HAS_WEIGHTS: bool
    HAS_BIAS: bool
    SIGMOID: bool
    RENORMALIZE: bool
    TRUNCATION: bool
    GROUPED: bool
    HAS_SCALE: bool
    FILL: bool
    BLOCK_E: int
    BLOCK_K: int
    BLOCK_G: int
    GROUP_SIZE: int  # every group at once when the groups split a power-of-two E evenly (else 0)
    KEY_SHIFT: int
    ROW_WARPS: bool  # a warp per row
    GROUP_WARPS: bool  # one row on a warp per expert group


class Mask(NamedTuple):
    """Where a routing program's keep mask comes from (:func:`~.jit.route_kernel.routing_keep`)."""

    ALL_KEPT: bool  # policy ``none``
    STATIC_KEEP: bool  # static moe-spec's calibrated set, derived here
    HAS_RANGE: bool


class RouteMass(NamedTuple):
    """The retained mass summed by the routing kernel (:func:`~.jit.metrics.add_route_mass`)."""

    SCORE_TOPK: bool
    KEY_SHIFT: int


# ------------------------------------------------------------------------------------ the rules' configs
class NoConfig(NamedTuple):
    """A rule without knobs (``all``, ``warm``, ``given``, ``static``, ``threshold``)."""


class GreedyConfig(NamedTuple):
    FROM_REQUESTS: bool  # start from the union of per-request sets (xshare-spec), else the warm-up set
    SCORE_TOPK: bool
    ORDER: bool  # the [E, E] order is compiled (off: the launch's rows settle its answer)


class RankRoundsConfig(NamedTuple):
    SEARCH_STEPS: int


class TopAggregateConfig(NamedTuple):
    SCORE_TOPK: bool
    ORDER: bool


class CoactivationConfig(NamedTuple):
    KEYS: bool  # block-wide maxima of one int64 key (up to the keyed-token limit)
    WARP_PICKS: bool  # picks in every warp on its own copy of the gains
    BLOCK_E: int
    WARPS: int


class CoverageConfig(NamedTuple):
    PAIRS: bool  # the pair sums' picks
    LISTS: bool  # the row lists' picks (else the register tile's)
    WARP_PICKS: bool
    TILE_ROWS: int  # rows of the register tile
    SEARCH_STEPS: int
    BLOCK_E: int
    WARPS: int


def flat_constexprs(constexprs: dict) -> dict:
    """A launch's constexprs with each bundle's fields as ``NAME.FIELD`` (for tables and tools)."""
    flat = {}
    for name, value in constexprs.items():
        if hasattr(value, "_asdict"):
            flat.update({f"{name}.{field}": field_value for field, field_value in value._asdict().items()})
        else:
            flat[name] = value
    return flat
