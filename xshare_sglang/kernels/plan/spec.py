"""The plan's inputs and outputs: a call's spec (no tensors), its split, set rule and launches."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ...policies.call import RouterSpec
from .limits import PRODUCTION_LIMITS, PlanLimits


class Mode(enum.IntEnum):
    """The selection's set rule; :attr:`rule` names its jit function (``xshare_sglang.kernels.jit.rules``)."""

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

    @property
    def rule(self) -> str:
        """The name of the rule's jit function in ``jit.rules.RULES``."""
        return _RULE_NAMES[self]


_RULE_NAMES = {
    Mode.WARM: "warm",
    Mode.GREEDY_WARM: "greedy",
    Mode.GREEDY_BASE: "greedy",
    Mode.THRESHOLD: "threshold",
    Mode.RANK_ROUNDS: "rank_rounds",
    Mode.TOP_AGG: "top_aggregate",
    Mode.STATIC: "static",
    Mode.GIVEN: "given",
    Mode.ALL: "keep_all",
    Mode.COACT: "coactivation",
    Mode.COVERAGE: "coverage",
}


class Pipeline(enum.Enum):
    """The kernels one call runs, chosen by :func:`~xshare_sglang.kernels.plan.choose_pipeline`."""

    ONE_PROGRAM = "select_kernel selects (and routes) in one program"
    SPLIT = "select_kernel over programs, then lynx_pick_kernel (LYNX), then route_kernel"
    ROUTE_ALONE = "route_kernel alone, a tile of rows per program (none, static moe-spec)"
    ROUTE_PER_ROW = "route_kernel alone, a row per program on a warp per expert group"


@dataclass(frozen=True)
class CallSpec:
    """What decides a call's launches: shapes, router and flags, no tensor.

    ``metrics`` is ``"off"``, ``"on"`` (a metrics row) or ``"gated"`` (a row and a device gate);
    ``route`` is False for the select-only entry point; ``stats`` asks for the score totals;
    ``limits`` are the T-dependent limits (:data:`~.limits.PRODUCTION_LIMITS` but in tests);
    ``routing_sums_mass`` is the open A/B switch of docs/kernels.md ("Open switches"): above one
    program, the rules that need no scores (``oea``, static moe-spec, LYNX without a cap) leave the
    retained-mass metric to the routing kernel instead of scoring every row in the selection (False:
    the other side, ``scripts/bench_selection.py --select-mass``).  The answer is the same either way.
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
    routing_sums_mass: bool = True

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
    """One kernel launch: grid, warps, launch options and constexprs (named tuples of
    :mod:`xshare_sglang.kernels.bundles` by concern; ``RULE`` names a set rule)."""

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
    pipeline: Pipeline
    launches: tuple[Launch, ...]
    zero_pairs: bool  # the coverage pair sums start at 0: zeroed by torch before the launches
    static_alone: bool  # static moe-spec routes with the routing kernel alone

    @property
    def kernels(self) -> tuple[str, ...]:
        return tuple(launch.kernel for launch in self.launches)
