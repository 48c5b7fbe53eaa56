"""Graph-safe launch wrappers of the fused selection kernels.

* :func:`prune_route` - keep mask and pruned routing of one MoE layer call (ids and weights in
  SGLang's ``TopKOutput`` layout), in place of SGLang's own top-k: one launch when the call fits
  one program (small batches), two otherwise (the selection, then the routing);
* :func:`select_keep_mask` - the keep mask alone, in one launch.

Same inputs and meaning as the torch references :func:`xshare_sglang.policies.prune_route.prune_route`
and :func:`xshare_sglang.policies.select` (a :class:`~xshare_sglang.policies.RoutingCall`, checked
when it was built, and the config), plus preallocated outputs and a workspace, so that a call inside
a CUDA graph allocates nothing and never talks to the host.  Launch shapes depend only on
the input shapes and the config, which capture fixes; the real-token count may be a device tensor
the caller refills before each replay.

Where the kernels do not cover a case (CPU tensors without ``TRITON_INTERPRET=1``, E > 512,
top_k > 16, more than 32 expert groups, D > 64, LYNX with beta > 14, more than 2**22 tokens, another
dtype) the call goes to the torch reference and a warning says so once per reason.  The answer is
the same either way.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from ..config import PrunerConfig
from ..devices import canonical_device, stream_key
from ..policies.api import select
from ..policies.call import RoutingCall
from ..policies.greedy import tau_fixed_point
from ..policies.moe_spec import layer_redundancy, static_positions
from ..policies.prune_route import PrunedRouting, check_outputs, route_checked
from ..policies.rewrite import add_metrics, selection_metrics
from ..policies.scores import float32_value

logger = logging.getLogger(__name__)

MAX_EXPERTS = 512
MAX_TOP_K = 16
MAX_GROUPS = 32
MAX_TOKENS_PER_REQUEST = 64
MAX_LYNX_BETA = 14
MAX_TOKENS = 1 << 22  # aggregates stay below 2**56 (E * 2**24 per token at most)
TILE_ELEMENTS = 2048  # a tile of rows holds about this many logits
MAX_TILE_ROWS = 8  # more programs of fewer rows: 20-35% faster calls at T=128, E=128 on an H200
#: Programs of the selection at most (each adds its share into the accumulators with atomics).  At 64,
#: the per-request policies at T=512 (128 requests of 4 rows, two per program) took 2-5 µs more than
#: at T=256 (one per program) on an H200 at f53d4e0, while 16 to 64 programs of one request each cost
#: the same; 128 programs are still one wave on an H100's or H200's 132 SMs.
MAX_PARTS = 128
COVERAGE_SPLIT_ROWS = 5  # the coverage ranking on top-k scores runs as two programs from this T (see plan_for)
# ranking=coverage keeps every row's scores in the workspace for its greedy: rows it can hold
MAX_COVERAGE_TOKENS = 1024
# the co-activation greedy packs gain and index into one int64 key up to this many tokens (gain < 2**52)
MAX_KEYED_COACT_TOKENS = 4096
#: The calibrated rankings' greedy picks (co-activation up to MAX_KEYED_COACT_TOKENS, coverage from
#: pair sums) run in every warp on its own copy of the gains, with warp-wide maxima and no block
#: barrier per pick, on at most this many experts (the block's: 64, 128, 256) and where a warp's copy
#: fits (see :func:`warp_picks`); otherwise with block-wide maxima.  Measured on an H200 at
#: ``040baec`` in one call (docs/gpu/h200-2026-11-28-040baec): the co-activation ranking at T=1 took
#: 15.2 us per call in every warp and 17.2 block-wide on Qwen3-30B-A3B's E=128 (GPT-OSS-120B 14.9 and
#: 16.8), but 38.8 and 33.8 on DeepSeek-V3's E=256, where each of eight warps issues every pick (45.6
#: and 40.6 at T=8).  ``bench_selection.py --block-picks`` sets it to 0, the block-wide side of that
#: A/B.
WARP_PICKS_MAX_EXPERTS = 128
#: One warp per row in more one-program calls on at most 128 experts (see :func:`kernel_warps`): up to
#: four rows, ``oea``, static moe-spec and the co-activation ranking, whose rules run no order, join
#: the light rules.  On an H200 (dd6694a, docs/bench_selection.md) that took 0.8-1.4 us off these
#: three at T = 1 and 2 on Qwen3-30B-A3B (``oea`` 4.6 against 6.0 us at T=2) and was even at T=4.  The
#: same switch once also gave every rule eight warps, one per row, at T = 5 to 8: that lost 0.4-2.2 us
#: at T=8 on both E=128 routers (xshare 10.8 against 9.7, lynx 13.4 against 11.5 on Qwen3-30B-A3B) and
#: is gone; a rule there runs on a tile's four warps.  ``bench_selection.py --tile-warps`` sets it
#: False, the other side of the A/B.
ONE_PROGRAM_ROW_WARPS = True
#: Rows of biased grouped routing whose groups are 32 experts each (DeepSeek-V3: E=256 in 8 groups)
#: route with a warp per group (``_prune_route.route_row_by_group_warps``, :func:`group_warp_routing`):
#: a one-program call of one row, instead of one warp for the row (policy ``none``) or the row over a
#: tile's eight warps with block-wide picks (every other policy); and the routing kernel above one
#: program, a program per row instead of tiles of 8 rows on a warp each, up to
#: :data:`GROUP_WARP_MAX_ROWS` rows.  Compiled for sm_90 (Triton 3.6, ``kernel_sass.py``): half the
#: routing's serial instructions, no barrier per pick (docs/kernel-sass.md, "Fourteenth pass").  On an
#: H200 (dd6694a): 0.3-0.4 us off every rule at T=1, 2.9-4.0 us at T=32 (``none`` 3.8-4.3 against
#: 5.0-5.2 us), 0.5-1.6 at T=256.  ``bench_selection.py --no-group-warps`` sets it False, the other
#: side of that A/B.
GROUP_WARP_ROUTING = True
#: Above one program, the rules that need no scores (``oea``, static moe-spec, LYNX without a cap)
#: compute none in the selection: the routing kernel sums the kept and total score mass of the rows it
#: routes for the retained-mass metric (``_prune_route.route_mass``), and its last program adds the
#: share.  Before, the selection computed every row's scores for that metric alone and the last
#: program summed E aggregates: on an H200 at f53d4e0 the metrics row cost these rules 4.3-8.3 us
#: above one tile, 1.8-4.4 for the rules that score anyway.  Compiled for sm_90 (Triton 3.6) the
#: selection of static moe-spec falls from 1338 to 120 instructions per program (Qwen3-30B-A3B, T=32)
#: and the routing kernel grows from 465 to 1188 (docs/kernel-sass.md, "Seventeenth pass").  Not
#: timed yet: ``bench_selection.py --select-mass`` sets it False, the other side of that A/B.  With
#: it, static moe-spec above one program launches the routing kernel alone (:func:`routes_static_alone`).
ROUTING_SUMS_MASS = True
GROUP_WARP_SIZE = 32  # experts of one group that one warp holds, a lane each
#: The routing kernel's rows on a warp per group, at most: at T=512 on an H200 (dd6694a) a program per
#: row cost 1.3-2.0 us more than tiles of 8 rows (``none`` 6.5 against 5.1 us), where each expert's
#: word of the activated-expert count takes an atomic add per program.
GROUP_WARP_MAX_ROWS = 256
#: A ``none`` call of 2 to 8 such rows runs the routing kernel with a program per row
#: (:func:`plan_rows_alone`) instead of one program with a warp per row and 8 software sigmoids per
#: lane: on an H200 (dd6694a) DeepSeek-V3's ``none`` took 5.3 us at T=8 that way, 3.8-4.3 at T=32 and
#: 3.7-4.1 at T=1 on warps per group.  So does static moe-spec where it routes alone
#: (:func:`routes_static_alone`): its calibrated set needs no selection, and one program of up to 8 such
#: rows routed them on the selection's tile, a row per warp with 8 sigmoids per lane (7.0 us over
#: ``none`` at T=8 on an H200 at dd6694a, with the metrics row).  Not timed yet:
#: ``bench_selection.py --no-group-warps`` sets :data:`GROUP_WARP_ROUTING` False, which turns this off too.
FEW_ROWS_ON_GROUP_WARPS = True
BLOCK_BINS = 16  # LYNX bins 0..beta plus one carry digit
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# mantissa bits a 16-bit float lacks in float32: its order keys fit 32 bits (_prune_route.pack_key)
KEY_SHIFTS = {torch.bfloat16: 16, torch.float16: 13}

_MODES = {
    "none": "MODE_ALL",
    "oea": "MODE_WARM",
    "xshare": "MODE_GREEDY_WARM",
    "xshare-spec": "MODE_GREEDY_BASE",
    "xshare-threshold": "MODE_THRESHOLD",
    "xshare-ep": "MODE_RANK_ROUNDS",
    "lynx": "MODE_GIVEN",
}
_reported: set[str] = set()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def warp_picks(mode: str, block_experts: int) -> bool:
    """Whether a call's greedy picks run in every warp (``_prune_route.coact_picks``,
    ``coverage_pair_picks``).  A warp holds its copy of the gains as two halves of one row each, and
    a row lies in one warp when the picked row's 128-bit loads cover it with the warp's 32 lanes:
    128 experts a half for the co-activation ranking's int32 redundancy rows, 64 for the coverage
    ranking's int64 pair sums.  (A tile of more axes would leave to the compiler which of two
    strideless axes the warps go to: Triton 3.6 and 3.8 choose differently.)"""
    per_half = 128 if mode == "MODE_COACT" else 64
    return block_experts <= min(2 * per_half, WARP_PICKS_MAX_EXPERTS)


def kernel_warps(
    block_experts: int,
    plan: LaunchPlan,
    policy: str,
    light_rule: bool = False,
    group_warps: int = 0,
) -> int:
    """Warps per program of the selection (and, in a one-program call, its routing).

    Four warps (eight from 256 experts) hold a tile of rows.  A one-program call of policy ``none``
    (the fused top-k alone, no set rule) takes one warp per row, as the routing kernel does (see
    :func:`route_warps`): on an H200 the E=128 top-8 at T=1 took 2.5 us with one warp and 3.3 with four,
    while any set rule ran slower on fewer warps (xshare 9.0 us with one warp, 6.4 with four: its
    [E, E] order then held 512 comparisons per lane).  ``light_rule``: the call's set rule runs no
    order (xshare whose budget takes every candidate, see :func:`_policy_args`) on at most 128
    experts; a one-program call then takes one warp per row too, while that is no more warps than a
    tile's.  Its row reductions are then warp-wide (``REDUX``) instead of block-wide: xshare at T=1,
    E=128 compiles to 1 barrier instead of 27, for about 330 more instructions per lane (Triton 3.6;
    at E=256 it would be 1900 more, so DeepSeek-V3 keeps its eight warps).  :func:`is_light_rule` says
    which rules are light.  A rule on a tile taller than four rows keeps the tile's four warps: eight
    warps, one per row, lost 0.4-2.2 us at T=8 on an H200 (:data:`ONE_PROGRAM_ROW_WARPS`).
    ``group_warps``: the call's one row routes with a warp per expert group
    (:func:`group_warp_routing`), this many.
    """
    if plan.single and group_warps:
        return group_warps
    if plan.single:
        row_warps = route_warps(block_experts, plan)
        if policy == "none":
            return row_warps
        if block_experts <= 128 and light_rule and row_warps <= tile_warps(block_experts):
            return row_warps
    return tile_warps(block_experts)


def is_light_rule(policy_args: dict) -> bool:
    """Whether a call's set rule is light (:func:`kernel_warps`): it runs no order of the experts and
    has no ``max_experts`` cap.  xshare whose greedy budget takes every candidate (measured on an
    H200); with :data:`ONE_PROGRAM_ROW_WARPS`, also ``oea`` (the union of every row's warm experts),
    static moe-spec (the calibrated places), the co-activation ranking (its picks run in every
    warp anyway, see :func:`warp_picks`, and the rest of its budget is taken in index order) and the
    router ranking's top-count when ``T x top_k`` fits its count (every expert with an aggregate,
    then the rest in index order: no order compiled, see :func:`_policy_args`)."""
    if policy_args["has_cap"]:
        return False
    if policy_args["mode"] == "MODE_GREEDY_WARM":
        return not policy_args["order"]
    if policy_args["mode"] == "MODE_TOP_AGG":
        return ONE_PROGRAM_ROW_WARPS and not policy_args["order"]
    return ONE_PROGRAM_ROW_WARPS and policy_args["mode"] in ("MODE_WARM", "MODE_STATIC", "MODE_COACT")


def group_warp_routing(router, num_experts: int, plan: LaunchPlan, has_bias: bool, truncation: bool, fill: bool) -> int:
    """Warps of a program that routes one row with a warp per expert group (:data:`GROUP_WARP_ROUTING`),
    or 0 when the call does not route that way: a one-program call of one row, or, above one program,
    the routing kernel of up to :data:`GROUP_WARP_MAX_ROWS` rows, which then runs a program per row.

    Biased sigmoid routing (DeepSeek-V3's) whose groups split E into a power of two of groups of
    :data:`GROUP_WARP_SIZE` experts, at most 8 (a warp each), without truncation or filled slots (which
    read the whole row's picks), and where the groups' picks fit two copies of 32 lanes per warp
    (``groups x top_k``, top-k to a power of two, at most 64)."""
    num_groups = router.num_expert_group
    if not (GROUP_WARP_ROUTING and num_groups > 1):
        return 0
    if plan.single and plan.route_rows != 1:
        return 0
    if not plan.single and plan.route_programs * plan.route_rows > GROUP_WARP_MAX_ROWS:
        return 0
    if not (has_bias and router.scoring == "sigmoid") or truncation or fill:
        return 0
    if not (_is_pow2(num_groups) and num_groups <= 8 and num_experts == num_groups * GROUP_WARP_SIZE):
        return 0
    if num_groups * max(2, _next_pow2(router.top_k)) > 2 * GROUP_WARP_SIZE:
        return 0
    return num_groups


def plan_rows_alone(
    cfg: PrunerConfig,
    plan: LaunchPlan,
    num_tokens: int,
    tokens_per_request: int,
    router,
    num_experts: int,
    has_bias: bool,
    truncation: bool,
    fill: bool,
    static_alone: bool = False,
) -> LaunchPlan:
    """The plan of a call that routes, given :func:`plan_for`'s: a call of 2 to 8 rows that needs no
    selection launch (policy ``none``, or static moe-spec where ``static_alone``, see
    :func:`routes_static_alone`) and whose rows can route on a warp per expert group
    (:func:`group_warp_routing`, :data:`FEW_ROWS_ON_GROUP_WARPS`) runs the routing kernel, a program per
    row, instead of one program that routes the rows on its tile.  Still one launch; each row then
    takes the one-row call's path.  For calls that route (a keep mask alone needs no rows routed)."""
    alone = cfg.policy == "none" or static_alone
    if not (FEW_ROWS_ON_GROUP_WARPS and alone and plan.single and num_tokens > 1):
        return plan
    split = plan_launch(num_tokens, num_experts, tokens_per_request, False, min_parts=2)
    if split.single or not group_warp_routing(router, num_experts, split, has_bias, truncation, fill):
        return plan
    return split


def route_warps(block_experts: int, plan: LaunchPlan) -> int:
    """Warps per program that route a tile of rows: one per row.

    A row that fills a warp's 32 lanes takes each of its top-k maxima of int32 keys (16-bit logits)
    with one warp-wide ``REDUX`` instruction on sm_90, where two rows per warp (16 lanes each) need
    four shuffle-and-max steps, and a row over two warps a barrier per pick: the routing loop of
    E=128 at T=32 compiles to 23 instructions per pick instead of 40, 0 shuffles instead of 4
    (Triton 3.6).  Above 256 experts a row takes one warp per 256 (a warp per row would hold 16 or
    more logits per thread).
    """
    return plan.route_rows * max(1, block_experts // 256)


def tile_warps(block_experts: int) -> int:
    """Four warps hold a tile of rows, eight from 256 experts."""
    return 8 if block_experts >= 256 else 4


def per_request_policy(cfg: PrunerConfig) -> bool:
    """Whether the selection builds per-request sets (xshare-spec, moe-spec with scope=request)."""
    return cfg.policy == "xshare-spec" or (cfg.policy == "moe-spec" and cfg.scope == "request")


def unsupported_reason(call: RoutingCall, cfg: PrunerConfig) -> str | None:
    """Why the kernels cannot serve this call, or None when they can."""
    logits = call.logits
    if not (logits.is_cuda or (_interpreting() and logits.device.type == "cpu")):
        return f"logits on {logits.device.type} (the kernels need CUDA, or TRITON_INTERPRET=1 on CPU)"
    if logits.dtype not in SUPPORTED_DTYPES:
        return f"logits dtype {logits.dtype} (supported: float32, bfloat16, float16)"
    num_tokens, num_experts = logits.shape
    if num_experts > MAX_EXPERTS:
        return f"E={num_experts} experts (the kernels support up to {MAX_EXPERTS})"
    if call.top_k > MAX_TOP_K:
        return f"top_k={call.top_k} (the kernels support up to {MAX_TOP_K})"
    if num_tokens > MAX_TOKENS:
        return f"T={num_tokens} tokens (the kernels support up to {MAX_TOKENS})"
    if per_request_policy(cfg) and call.tokens_per_request > MAX_TOKENS_PER_REQUEST:
        return f"tokens_per_request={call.tokens_per_request} (the kernels support up to {MAX_TOKENS_PER_REQUEST})"
    if cfg.policy == "moe-spec" and cfg.ranking == "coverage" and num_tokens > MAX_COVERAGE_TOKENS:
        return f"T={num_tokens} tokens with ranking=coverage (the kernels support up to {MAX_COVERAGE_TOKENS})"
    if cfg.policy == "lynx" and cfg.beta > MAX_LYNX_BETA:
        return f"lynx beta={cfg.beta} (the kernels support up to {MAX_LYNX_BETA})"
    if call.router.num_expert_group > MAX_GROUPS:
        return f"{call.router.num_expert_group} expert groups (the kernels support up to {MAX_GROUPS})"
    return None


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

    def kernels(self, policy: str, static_alone: bool = False) -> tuple[str, ...]:
        """The kernels one ``prune_route`` call launches, in order: the selection alone for one
        program; above, the selection, LYNX's per-row picks (lynx only) and the routing, or the
        routing alone for ``none`` (every expert kept: nothing to select) and, where
        :func:`routes_static_alone`, for static moe-spec (the calibrated set)."""
        if self.single:
            return ("select_kernel",)
        if policy == "none" or static_alone:
            return ("route_kernel",)
        if policy == "lynx":
            return ("select_kernel", "lynx_pick_kernel", "route_kernel")
        return ("select_kernel", "route_kernel")


def plan_launch(
    num_tokens: int, num_experts: int, tokens_per_request: int, per_request: bool, min_parts: int = 1
) -> LaunchPlan:
    """Split T tokens over at most :data:`MAX_PARTS` programs; requests never straddle programs.

    A call runs as one program (one launch: selection and routing) only when it is one tile of rows,
    or one request of a per-request policy; anything larger is spread over programs, because a second
    tile or request run serially in one program costs more than the second launch (on an H200 a
    second 16-row tile added ~13 µs to an xshare call, the second launch ~3 µs).  One program's tiles
    are no taller than the call (a 16-row tile at T=1 did the work of 16 rows).  Tiles hold at most
    :data:`MAX_TILE_ROWS` rows: at T=128 on an H200, 16 programs of 8 rows beat 8 programs of 16
    (E=128: ``none`` 3.5 against 5.2 us, xshare 11.3 against 14.3).  ``min_parts`` (not with
    ``per_request``): a call of one tile but at least that many rows is split into that many
    programs of equal power-of-two tiles instead (see :func:`plan_for`).
    """
    block_experts = max(16, _next_pow2(num_experts))
    tile = tile_rows(num_experts)
    # a request's rows are read in tiles of at most D rows (a request shorter than D is padding)
    chunk = min(tile, _next_pow2(tokens_per_request)) if per_request else tile
    rows = max(num_tokens, 1)
    if per_request:
        num_requests = max(1, -(-num_tokens // tokens_per_request))
        requests_per_program = -(-num_requests // MAX_PARTS)
        num_parts = -(-num_requests // requests_per_program)
        rows_per_program = requests_per_program * tokens_per_request
        rows_per_request = tokens_per_request
    else:
        rows_per_program = max(tile, -(-rows // MAX_PARTS))
        rows_per_program = -(-rows_per_program // tile) * tile
        num_parts = max(1, -(-num_tokens // rows_per_program))
        if num_parts < min_parts <= num_tokens:
            tile = _next_pow2(-(-num_tokens // min_parts))
            chunk = rows_per_program = tile
            num_parts = -(-num_tokens // tile)
    if num_parts == 1:
        tile = min(tile, _next_pow2(rows))
        if not per_request:
            chunk = tile
            rows_per_program = -(-rows // tile) * tile
    if not per_request:
        rows_per_request = rows_per_program
    route_programs = 0 if num_parts == 1 else -(-num_tokens // tile)
    return LaunchPlan(num_parts, rows_per_program, rows_per_request, chunk, block_experts, tile, route_programs)


def plan_for(cfg: PrunerConfig, num_tokens: int, num_experts: int, tokens_per_request: int) -> LaunchPlan:
    """The launch plan of one call of ``cfg`` (what :func:`prune_route` launches).

    :func:`plan_launch`, except that the coverage ranking on top-k scores takes two programs from
    :data:`COVERAGE_SPLIT_ROWS` rows: above one program its greedy reads one row of pair sums per
    pick, while one program recomputes every gain from its tile of rows at each pick, which costs
    more the taller the tile.  On an H200 at ``f53d4e0`` (with the metrics row) one program of 8 rows
    added 44-59 µs on the E=128 routers and 163 µs on DeepSeek-V3, the pair sums 29-32 and 57 µs at
    any T from 32 to 512 (docs/bench_selection.md).  T = 5 to 8 read the same 8-row tile; at T <= 4
    the tile is at most 4 rows and the call stays one launch.
    """
    per_request = per_request_policy(cfg)
    split = (
        cfg.policy == "moe-spec"
        and cfg.ranking == "coverage"
        and cfg.effective_score == "topk"
        and not per_request
        and num_tokens >= COVERAGE_SPLIT_ROWS
    )
    return plan_launch(num_tokens, num_experts, tokens_per_request, per_request, min_parts=2 if split else 1)


def tile_rows(num_experts: int) -> int:
    """Rows of one tile of logits for E experts (the routing kernel's rows per program)."""
    return max(1, min(MAX_TILE_ROWS, TILE_ELEMENTS // max(16, _next_pow2(num_experts))))


class SelectionWorkspace:
    """Scratch memory of the fused kernels for one device and expert count.

    Allocate it before CUDA-graph capture and pass it to every call.  One workspace may serve every
    layer of one stream (calls issued on one stream run one after the other), never two streams at
    once: :func:`default_workspace` keeps one per stream.  About ``E * 8.5 KiB``, most of it the
    coverage ranking's row scores and row lists.

    Parameters
    ----------
    num_experts : int
    device : torch.device or str
        ``"cuda"``, ``"cuda:0"`` and ``torch.device("cuda")`` are one device (see
        :func:`xshare_sglang.devices.canonical_device`).
    """

    def __init__(self, num_experts: int, device: torch.device | str) -> None:
        self.num_experts = num_experts
        self.device = canonical_device(device)
        kw = dict(device=self.device)
        # placeholders for optional pointer arguments (vote weights, bias, metrics, ranks, outputs of
        # a keep-mask-only call): passed where a constexpr flag says the kernel never touches them
        self.prim = torch.zeros(num_experts, dtype=torch.int64, **kw)
        self.flag = torch.zeros(num_experts, dtype=torch.int8, **kw)
        self.mass = torch.zeros(num_experts, dtype=torch.int64, **kw)
        self.lynx_digits = torch.zeros(num_experts, BLOCK_BINS, dtype=torch.int64, **kw)
        self.lynx_rank = torch.zeros(num_experts, dtype=torch.int32, **kw)
        # Everything a multi-program call accumulates with atomics, in one buffer that is 0 between
        # calls (the last program of each kernel clears its share; reset() zeroes it all): the three
        # tickets (selection, routing, LYNX picks; one word of padding), a placeholder of E words, the
        # LYNX picks, the warm-up and per-request marks, LYNX bin counts, the int64 aggregate scores,
        # the coverage ranking's column sums and the routing kernel's per-expert visits and marks
        # (8-byte aligned: the offsets 4 + 20 E, 4 + 22 E and 4 + 24 E words are even), and the lengths
        # of the coverage ranking's row lists.
        # After them, 8-byte aligned, the coverage ranking's [E, E] int64 pair sums, zeroed before
        # each call that uses them.
        n = num_experts
        words = 4 + 27 * n
        self.zeroed = torch.zeros(words + words % 2 + 2 * n * n, dtype=torch.int32, **kw)
        self.counters = self.zeroed[:words]
        self.tickets = self.counters[:3]
        self.placeholder_i32 = self.counters[4 : 4 + n]  # an int32 [E] placeholder, never written
        self.picked = self.counters[4 + n : 4 + 2 * n]
        self.warm_marks = self.counters[4 + 2 * n : 4 + 3 * n]
        self.base_marks = self.counters[4 + 3 * n : 4 + 4 * n]
        self.lynx_counts = self.counters[4 + 4 * n : 4 + 20 * n].view(n, BLOCK_BINS)
        self.aggregate = self.counters[4 + 20 * n : 4 + 22 * n].view(torch.int64)
        self.cover_aggregate = self.counters[4 + 22 * n : 4 + 24 * n].view(torch.int64)
        self.visits = self.counters[4 + 24 * n : 4 + 26 * n].view(torch.int64)
        self.cover_counts = self.counters[4 + 26 * n :]
        self.cover_pairs = self.zeroed[words + words % 2 :].view(torch.int64).view(n, n)
        # ranking=coverage: every row's scores, and for each expert the rows that score it
        self.row_scores = torch.zeros(MAX_COVERAGE_TOKENS, num_experts, dtype=torch.int32, **kw)
        self.cover_rows = torch.zeros(num_experts, MAX_COVERAGE_TOKENS, dtype=torch.int32, **kw)

    def reset(self) -> None:
        """Zero the tickets, accumulators and marks (queued on the current stream).

        Every call that completes leaves them at 0 (the last program of each kernel clears what its
        kernel accumulated), so calls never need this; ``prune_route`` calls it when a call fails
        after queueing part of its kernels.  Call it yourself after anything else wrote into the
        workspace (the one rule: a workspace serves one stream).
        """
        self.counters.zero_()


_workspaces: dict[tuple[torch.device, int, int], SelectionWorkspace] = {}


def workspace_key(num_experts: int, device: torch.device | str) -> tuple[torch.device, int, int]:
    """(device, E, current stream): calls with one key may share a workspace."""
    device = canonical_device(device)
    return device, num_experts, stream_key(device)


def default_workspace(num_experts: int, device: torch.device | str) -> SelectionWorkspace:
    """A workspace shared by calls that pass none: one per (device, E, stream), created on first use
    and never freed, so a CUDA graph captured with it stays valid."""
    key = workspace_key(num_experts, device)
    if key not in _workspaces:
        _workspaces[key] = SelectionWorkspace(num_experts, key[0])
    return _workspaces[key]


def _report(reason: str) -> None:
    if reason not in _reported:
        _reported.add(reason)
        logger.warning("moe-pruner selection uses the torch reference: %s", reason)


def _policy_args(cfg: PrunerConfig, call: RoutingCall) -> dict:
    """The policy's part of the selection kernel's arguments."""
    policy, layer_id, device, num_experts = cfg.policy, call.layer_id, call.device, call.num_experts
    static = policy == "moe-spec" and cfg.ranking == "static"
    coact = policy == "moe-spec" and cfg.ranking == "coactivation"
    coverage = policy == "moe-spec" and cfg.ranking == "coverage"
    request_top = policy == "moe-spec" and cfg.scope == "request"
    layer_budget = cfg.layer_budget(layer_id) if policy == "moe-spec" else 0
    if request_top:
        mode, count = "MODE_GIVEN", 0
    elif policy == "moe-spec":
        mode = {"static": "MODE_STATIC", "coactivation": "MODE_COACT", "coverage": "MODE_COVERAGE"}.get(
            cfg.ranking, "MODE_TOP_AGG"
        )
        count = min(layer_budget, num_experts) if (coact or coverage) else layer_budget
    else:
        mode, count = _MODES[policy], (cfg.budget if policy != "none" else 0)
    if coverage and call.logits.shape[0] == 1:
        # One row: each gain is the row's score on the greedy's grid times the row's one uncovered
        # share, so the greedy keeps the experts in the order (score desc, index asc) while they gain,
        # then the rest of the budget by aggregate, the same order: the router ranking's top-count,
        # without a serial pick (on an H200 at f53d4e0, T=1: 5.7-10.6 us over none for the greedy,
        # 2.8-4.2 for the router ranking).
        mode = "MODE_TOP_AGG"
    count = min(count, num_experts + 1)
    # The greedy budget takes every candidate (or, at 0, none) whatever the batch when top-k scores
    # reach at most T x top_k experts and that fits the budget: no [E, E] order to compile or run.
    # Likewise the router ranking's top-count: every expert with an aggregate, then the rest of the
    # count in index order (``_prune_route.places_scored_first``).
    fits = cfg.effective_score == "topk" and call.logits.shape[0] * call.router.top_k <= count
    takes_all = (mode in ("MODE_GREEDY_WARM", "MODE_GREEDY_BASE") and (count <= 0 or fits)) or (
        mode == "MODE_TOP_AGG" and fits
    )
    return dict(
        mode=mode,
        count=count,
        order=not takes_all,
        k0=cfg.k0 if policy not in ("moe-spec", "lynx", "none") else 0,
        request_budget=min(layer_budget if request_top else cfg.request_budget, num_experts),
        static=static_positions(cfg, layer_id, device) if static else None,
        redundancy=layer_redundancy(cfg, layer_id, device) if coact else None,
        has_cap=cfg.max_experts is not None and policy not in ("moe-spec", "none"),
        # aggregates are needed by every rule but oea, static moe-spec, lynx and none
        rule_scores=policy not in ("oea", "lynx", "none") and not static,
        request_top=request_top,
    )


def routes_static_alone(cfg: PrunerConfig, has_metrics: bool) -> bool:
    """Whether static moe-spec routes above one program with the routing kernel alone.

    The calibrated set is known before the call, so each routing program derives the keep mask
    itself and no selection launch comes before it (one launch, as for ``none``): about 2 us of
    static moe-spec's cost above one tile on an H200 at f53d4e0 was that second launch.  The retained
    mass then has to come from the routing (:data:`ROUTING_SUMS_MASS`); without it, only calls without
    a metrics row.  Calls of one program, select-only calls and calls with stats keep the selection.
    """
    static = cfg.policy == "moe-spec" and cfg.ranking == "static" and cfg.scope != "request"
    return static and (ROUTING_SUMS_MASS or not has_metrics)


def call_plan(
    call: RoutingCall,
    cfg: PrunerConfig,
    *,
    route: bool = True,
    has_metrics: bool = False,
    has_stats: bool = False,
    fill_dropped: bool = False,
) -> tuple[LaunchPlan, bool]:
    """The launch plan of one :func:`prune_route` call and whether static moe-spec routes alone in it
    (the routing kernel, no selection launch): :func:`plan_for`, then, for a call that routes,
    :func:`plan_rows_alone`.  ``plan.kernels(cfg.policy, static_alone)`` names its launches."""
    num_tokens, num_experts = call.logits.shape
    plan = plan_for(cfg, num_tokens, num_experts, call.tokens_per_request)
    static_rule = route and not has_stats and routes_static_alone(cfg, has_metrics)
    if route:
        truncation = cfg.coverage == "truncation"
        has_bias = call.correction_bias is not None
        plan = plan_rows_alone(
            cfg,
            plan,
            num_tokens,
            call.tokens_per_request,
            call.router,
            num_experts,
            has_bias,
            truncation,
            fill_dropped,
            static_alone=static_rule,
        )
    return plan, static_rule and not plan.single


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _launch(call: RoutingCall, cfg: PrunerConfig, *, workspace: SelectionWorkspace | None, **kwargs) -> None:
    """Launch the call's kernels on ``workspace`` (the shared one of the device, E and stream when
    None).  The kernels leave the workspace's counters at 0 when they complete; a call that fails
    part-way (a compile or launch error after an earlier kernel of the call was queued) resets them,
    so that the next call finds them at 0 as well.  Not while a CUDA graph is being captured, where
    nothing ran."""
    logits = call.logits
    num_experts = logits.shape[1]
    ws = workspace if workspace is not None else default_workspace(num_experts, logits.device)
    if ws.num_experts != num_experts or ws.device != canonical_device(logits.device):
        raise ValueError(
            f"workspace is for E={ws.num_experts} on {ws.device}, the call has E={num_experts} on {logits.device}"
        )
    try:
        _launch_kernels(call, cfg, ws, **kwargs)
    except BaseException:
        if not _capturing(ws.device):
            ws.reset()
        raise


def _launch_kernels(
    call: RoutingCall,
    cfg: PrunerConfig,
    ws: SelectionWorkspace,
    *,
    route: bool,
    keep: torch.Tensor,
    ids: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    fill_dropped: bool = False,
    metrics_row: torch.Tensor | None = None,
    metrics_gate: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
    enable_pdl: bool = False,
) -> None:
    from . import _prune_route as jit  # imports triton

    logits, router = call.logits, call.router
    num_tokens, num_experts = logits.shape
    policy = _policy_args(cfg, call)
    per_request = per_request_policy(cfg)
    has_metrics = metrics_row is not None
    has_stats = stats_out is not None
    plan, static_alone = call_plan(
        call,
        cfg,
        route=route,
        has_metrics=has_metrics,
        has_stats=has_stats,
        fill_dropped=fill_dropped,
    )
    num_valid_tokens = call.num_valid_tokens
    nv_tensor = isinstance(num_valid_tokens, torch.Tensor)
    nv_ptr = num_valid_tokens if nv_tensor else ws.tickets
    nv_arg = num_tokens if (num_valid_tokens is None or nv_tensor) else int(num_valid_tokens)
    token_weights = call.token_weights
    has_weights = token_weights is not None
    weights_in = token_weights.contiguous() if has_weights else ws.prim
    # A rule that needs no scores (oea, static moe-spec, LYNX) would compute them only for the
    # retained-mass metric: above one program the routing kernel sums that mass from the rows it
    # routes, off the selection's critical path (_prune_route.route_mass)
    route_mass = (
        ROUTING_SUMS_MASS
        and has_metrics
        and route
        and not plan.single
        and cfg.policy != "none"
        and not (policy["rule_scores"] or policy["has_cap"] or has_stats)
    )
    need_scores = policy["rule_scores"] or policy["has_cap"] or (has_metrics and not route_mass) or has_stats
    if cfg.policy == "none":
        need_scores = False  # every expert kept: the retained mass is whole, the aggregate unused
    # with a gate, the kernels read it and skip the metrics' work in calls that add none: the scores
    # when only the retained mass wants them, the activated count, the routing's mass and its ticket
    gated = has_metrics and metrics_gate is not None
    metric_scores = need_scores and not (policy["rule_scores"] or policy["has_cap"] or has_stats)
    num_groups = router.num_expert_group
    correction_bias = call.correction_bias
    has_bias = correction_bias is not None
    group_route = (router, num_experts, has_bias, cfg.coverage == "truncation", fill_dropped)
    block_e = plan.block_experts
    group_warps = group_warp_routing(*group_route[:2], plan, *group_route[2:])
    common = dict(
        HAS_NV_PTR=nv_tensor,
        HAS_WEIGHTS=has_weights,
        HAS_BIAS=has_bias,
        SIGMOID=router.scoring == "sigmoid",
        RENORMALIZE=router.renormalize,
        TRUNCATION=cfg.coverage == "truncation",
        GROUPED=num_groups > 1,
        HAS_SCALE=router.routed_scaling_factor is not None,
        FILL=fill_dropped,
        BLOCK_E=block_e,
        BLOCK_K=max(2, _next_pow2(router.top_k)),
        BLOCK_G=max(2, _next_pow2(num_groups)),
        # every group at once when the groups split a power-of-two E evenly into a power-of-two count
        GROUP_SIZE=num_experts // num_groups
        if num_groups > 1 and num_experts == block_e and _is_pow2(num_groups)
        else 0,
        num_warps=kernel_warps(
            block_e,
            plan,
            cfg.policy,
            light_rule=is_light_rule(policy),
            group_warps=group_warps if plan.single else 0,
        ),
        enable_fp_fusion=False,
        # each launch waits for the kernel before it (griddepcontrol.wait) before touching memory
        PDL=enable_pdl,
        launch_pdl=enable_pdl,
    )
    # int32 order keys when the logits are 16-bit floats (exact: see _prune_route.pack_key); the
    # routing ranks sigmoid + bias, a float32 value, when biased
    key_shift = KEY_SHIFTS.get(logits.dtype, 0)
    route_key_shift = 0 if has_bias else key_shift
    scale = float32_value(router.routed_scaling_factor) if router.routed_scaling_factor is not None else 1.0
    # argument runs both kernels take in the same order: the rows, then the routing
    rows = (logits, logits.stride(0), logits.stride(1), num_tokens, num_experts, nv_ptr, nv_arg, weights_in)
    ids_out, weights_out = (ids, weights) if route else (ws.placeholder_i32, ws.prim)
    routing = (
        correction_bias if has_bias else ws.prim,
        ids_out,
        ids_out.stride(0) if route else 0,
        weights_out,
        weights_out.stride(0) if route else 0,
        router.top_k,
        router.topk_group,
        num_experts // num_groups,
        num_groups,
        scale,
    )
    metrics = metrics_row if has_metrics else ws.mass
    gate = metrics_gate if gated else ws.placeholder_i32
    has_range = cfg.policy != "none" and (cfg.min_tokens is not None or cfg.max_tokens is not None)
    lynx = cfg.policy == "lynx"
    # policy none above one program: the routing kernel alone, keeping every expert
    route_only = route and cfg.policy == "none" and not plan.single
    # the coverage greedy: in one program, every row in registers; above it, with top-k scores (each
    # row scores top_k experts, summing to at most 1), the gains as column sums less the kept experts'
    # rows of the [E, E] pair sums (one row per pick, whatever T; plan_for sends a tile of 5 rows or
    # more here); with dense scores, above one register tile, per-expert row lists.  Pair sums and
    # lists are built with atomics into buffers the fill below zeroes, so never in a single program.
    cover_tile_rows = min(_next_pow2(max(num_tokens, 1)), max(TILE_ELEMENTS // block_e, plan.chunk_rows))
    coverage = policy["mode"] == "MODE_COVERAGE"
    cover_pairs = coverage and not plan.single and cfg.effective_score == "topk"
    cover_lists = coverage and not cover_pairs and num_tokens > cover_tile_rows
    assert not (cover_lists and plan.single), "coverage row lists need the multi-program fill"
    if cover_pairs:
        # the [E, E] pair sums start at 0 (the greedy reads only the kept experts' rows, so the kernels
        # cannot clear the rest); as a programmatic dependent, by a kernel of ours that lets the
        # selection launch while it runs.  Tickets, accumulators and marks need no reset: the last
        # program of each kernel leaves them at 0 (see _prune_route, "Clean counters").
        pairs = ws.cover_pairs.view(-1).view(torch.int32)
        if enable_pdl:
            programs = max(1, min(64, -(-pairs.numel() // 8192)))
            jit.fill_kernel[(programs,)](pairs, pairs.numel(), BLOCK=2048, num_warps=4, launch_pdl=True)
        else:
            pairs.zero_()
    if route and not plan.single:
        # a program per row on a warp per expert group, or a tile of rows on a warp per row
        route_grid = (num_tokens,) if group_warps else (plan.route_programs,)
        route_args = dict(
            HAS_METRICS=has_metrics,
            GATED=gated,
            HAS_RANGE=has_range,
            SCORE_TOPK=cfg.effective_score == "topk",
            SCORE_KEY_SHIFT=key_shift,
            CHUNK_T=1 if group_warps else plan.route_rows,
            KEY_SHIFT=route_key_shift,
            ROW_WARPS=not group_warps and route_warps(block_e, plan) == plan.route_rows,
            GROUP_WARPS=group_warps > 0,
            **(common | dict(num_warps=group_warps or route_warps(block_e, plan))),
        )
        # (the routing's kept and total mass in the aggregate's first two words: no selection of
        # such a rule touches the aggregate)
        route_inputs = (
            *rows,
            *routing,
            keep,
            ws.visits,
            ws.tickets[1:],
            metrics,
            gate,
            ws.aggregate,
            policy["static"] if static_alone else ws.placeholder_i32,
            policy["count"],
            cfg.min_tokens if cfg.min_tokens is not None else 0,
            cfg.max_tokens if cfg.max_tokens is not None else MAX_TOKENS,
        )
    if route_only:
        jit.route_kernel[route_grid](*route_inputs, ALL_KEPT=True, STATIC_KEEP=False, ROUTE_MASS=False, **route_args)
        return
    if static_alone:
        assert policy["mode"] == "MODE_STATIC" and (route_mass or not has_metrics)
        jit.route_kernel[route_grid](
            *route_inputs, ALL_KEPT=False, STATIC_KEEP=True, ROUTE_MASS=route_mass, **route_args
        )
        return
    jit.select_kernel[(plan.num_parts,)](
        *rows,
        plan.rows_per_program,
        plan.rows_per_request,
        policy["k0"],
        router.top_k,
        policy["request_budget"],
        policy["count"],
        tau_fixed_point(cfg.tau),
        cfg.rank_budget,
        cfg.max_experts if policy["has_cap"] else 0,
        cfg.min_tokens if cfg.min_tokens is not None else 0,
        cfg.max_tokens if cfg.max_tokens is not None else MAX_TOKENS,
        float32_value(cfg.alpha),
        cfg.beta,
        policy["static"] if policy["static"] is not None else ws.placeholder_i32,
        policy["redundancy"] if policy["redundancy"] is not None else ws.placeholder_i32,
        call.expert_to_rank if call.expert_to_rank is not None else ws.flag,
        ws.row_scores,
        ws.cover_rows,
        ws.cover_counts,
        MAX_COVERAGE_TOKENS,
        ws.cover_aggregate,
        ws.cover_pairs,
        ws.aggregate,
        ws.warm_marks,
        ws.base_marks,
        ws.lynx_counts,
        ws.lynx_digits,
        ws.lynx_rank,
        ws.tickets,
        keep,
        metrics,
        gate,
        stats_out if has_stats else ws.mass,
        *routing,
        MODE=getattr(jit, policy["mode"]).value,
        NEED_SCORES=need_scores,
        SCORE_TOPK=cfg.effective_score == "topk",
        PER_REQUEST=per_request,
        REQUEST_TOP=policy["request_top"],
        LYNX=lynx,
        HAS_CAP=policy["has_cap"],
        HAS_RANGE=has_range,
        HAS_METRICS=has_metrics,
        GATED=gated,
        METRIC_SCORES=metric_scores,
        HAS_STATS=has_stats,
        ROUTE_MASS=route_mass,
        SINGLE=plan.single,
        ROUTE=route,
        BLOCK_BINS=BLOCK_BINS,
        CHUNK=max(1, min(32, 4096 // block_e)),  # experts per step of LYNX's digit comparison
        SEARCH_STEPS=block_e.bit_length() + 1,
        COVER_T=cover_tile_rows,
        COVER_LISTS=cover_lists,
        COVER_PAIRS=cover_pairs,
        COACT_KEYS=num_tokens <= MAX_KEYED_COACT_TOKENS,
        CHUNK_T=plan.chunk_rows,
        ROUTE_T=plan.route_rows,
        KEY_SHIFT=key_shift,
        ROUTE_KEY_SHIFT=route_key_shift,
        ROW_WARPS=common["num_warps"] == plan.route_rows,
        GROUP_WARPS=group_warps > 0 and plan.single,
        WARPS=common["num_warps"],
        WARP_PICKS=warp_picks(policy["mode"], block_e),
        # let this call's next kernel (routing or LYNX picks) launch early and wait on the device
        PDL_TRIGGER=enable_pdl and not plan.single and (route or lynx),
        ORDER=policy["order"],
        **common,
    )
    if lynx and not plan.single:
        jit.lynx_pick_kernel[(plan.route_programs,)](
            *rows,
            router.top_k,
            float32_value(cfg.alpha),
            cfg.beta,
            cfg.max_experts if policy["has_cap"] else 0,
            cfg.min_tokens if cfg.min_tokens is not None else 0,
            cfg.max_tokens if cfg.max_tokens is not None else MAX_TOKENS,
            ws.lynx_rank,
            ws.aggregate,
            ws.picked,
            ws.tickets[2:],
            keep,
            metrics,
            gate,
            stats_out if has_stats else ws.mass,
            HAS_NV_PTR=nv_tensor,
            HAS_WEIGHTS=has_weights,
            NEED_SCORES=need_scores,
            HAS_CAP=policy["has_cap"],
            HAS_RANGE=has_range,
            HAS_METRICS=has_metrics,
            GATED=gated,
            HAS_STATS=has_stats,
            ROUTE_MASS=route_mass,
            KEY_SHIFT=key_shift,
            BLOCK_E=block_e,
            CHUNK_T=plan.route_rows,
            PDL=enable_pdl,
            PDL_TRIGGER=enable_pdl and route,
            num_warps=common["num_warps"],
            enable_fp_fusion=False,
            launch_pdl=enable_pdl,
        )
    if route and not plan.single:
        jit.route_kernel[route_grid](
            *route_inputs, ALL_KEPT=False, STATIC_KEEP=False, ROUTE_MASS=route_mass, **route_args
        )


def prune_route(
    call: RoutingCall,
    cfg: PrunerConfig,
    *,
    fill_dropped: bool = False,
    keep_out: torch.Tensor | None = None,
    ids_out: torch.Tensor | None = None,
    weights_out: torch.Tensor | None = None,
    metrics_row: torch.Tensor | None = None,
    metrics_gate: torch.Tensor | None = None,
    workspace: SelectionWorkspace | None = None,
    enable_pdl: bool = False,
) -> PrunedRouting:
    """Keep mask and routing of one MoE layer call, on the device, in one or two launches.

    See :func:`xshare_sglang.policies.prune_route.prune_route` for the parameters; ``workspace`` is
    the scratch memory (default: one shared per (device, E), created on first use).

    ``enable_pdl`` launches every kernel of the call as a programmatic dependent of the kernel
    before it in the stream (Hopper and newer; a ``ValueError`` on an older GPU): each program waits
    for that kernel to finish (``griddepcontrol.wait``) before it reads or writes memory, and a
    selection kernel that another kernel of the call follows lets it launch at once, so the
    follower's launch overlaps the selection.  Inside a CUDA graph the launches become programmatic
    edges.  The results are the same; on an H200 calls of two or three launches took 1.1-2.8 us less
    (``bench_selection.py --pdl``), one launch the same.  Off by default here; the serving plugin
    turns it on where :func:`dependent_launch_supported`.  No effect under Triton's interpreter
    (which runs no PTX).

    Returns
    -------
    PrunedRouting
        ``topk_ids`` [T, top_k] int32, ``topk_weights`` [T, top_k] float32, ``keep`` [E] bool.
    """
    check_outputs(call, keep_out, ids_out, weights_out, metrics_row, metrics_gate)
    if enable_pdl:
        check_pdl(call.device)
    outputs = dict(
        keep_out=keep_out, ids_out=ids_out, weights_out=weights_out, metrics_row=metrics_row, metrics_gate=metrics_gate
    )
    reason = unsupported_reason(call, cfg)
    if reason is not None:
        _report(reason)
        return route_checked(call, cfg, fill_dropped=fill_dropped, **outputs)
    call.check_config(cfg)
    num_tokens, num_experts = call.logits.shape
    device = call.device
    keep = keep_out if keep_out is not None else torch.empty(num_experts, dtype=torch.bool, device=device)
    ids = ids_out if ids_out is not None else torch.empty(num_tokens, call.top_k, dtype=torch.int32, device=device)
    weights = (
        weights_out
        if weights_out is not None
        else torch.empty(num_tokens, call.top_k, dtype=torch.float32, device=device)
    )
    _launch(
        call,
        cfg,
        route=True,
        keep=keep,
        ids=ids,
        weights=weights,
        fill_dropped=fill_dropped,
        metrics_row=metrics_row,
        metrics_gate=metrics_gate,
        workspace=workspace,
        # not under the interpreter, which runs no PTX (read from the environment itself: the
        # compile-only capture of bench.kernel_compile stands in for _interpreting())
        enable_pdl=enable_pdl and os.environ.get("TRITON_INTERPRET") != "1",
    )
    return PrunedRouting(ids, weights, keep)


def check_pdl(device: torch.device) -> None:
    """Raise ``ValueError`` unless ``device`` can launch programmatic dependents (CUDA, sm_90+)."""
    if device.type != "cuda":
        return  # the interpreter (or the compile-only capture) on CPU tensors: no launch to overlap
    major, minor = _capability(canonical_device(device))
    if major < 9:
        raise ValueError(
            f"enable_pdl needs a GPU of compute capability 9.0 or newer (programmatic dependent launch); "
            f"{device} is {major}.{minor}"
        )


def dependent_launch_supported(device: torch.device) -> bool:
    """Whether ``prune_route(..., enable_pdl=True)`` launches programmatic dependents on ``device``:
    a CUDA GPU of compute capability 9.0 or newer, with the kernels compiled (not under Triton's
    interpreter)."""
    if device.type != "cuda" or _interpreting():
        return False
    return _capability(canonical_device(device))[0] >= 9


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def select_keep_mask(
    call: RoutingCall,
    cfg: PrunerConfig,
    *,
    out: torch.Tensor | None = None,
    stats_out: torch.Tensor | None = None,
    metrics_row: torch.Tensor | None = None,
    metrics_gate: torch.Tensor | None = None,
    workspace: SelectionWorkspace | None = None,
) -> torch.Tensor:
    """Keep mask of one MoE layer call, computed on the device in one launch.

    Parameters
    ----------
    call : RoutingCall
        Its router's ``top_k`` and scoring are read; the rest of the router is not.
    cfg : PrunerConfig
    out : Tensor, shape [E], bool, optional
        Written in place and returned; pass one inside CUDA graphs.
    stats_out : Tensor, shape [2], int64, optional
        Receives the aggregate score of the kept experts and of all experts (fixed point, the
        policy's score over the real tokens): their ratio is the share of score mass kept.
    metrics_row : Tensor, shape [4], int64, optional
        Receives ``+=`` the call's kept experts, retained score mass and call count (columns 1-3 of
        :data:`~xshare_sglang.policies.rewrite.METRIC_COLUMNS`, as
        :func:`~xshare_sglang.policies.rewrite.selection_metrics` computes them), added by the
        kernel that finishes the mask.  Column 0, the activated experts, is left to whoever routes
        the call.
    metrics_gate : Tensor, shape [1], int32, optional
        With ``metrics_row``: add them only while this device value is nonzero (see
        :func:`prune_route`).
    workspace : SelectionWorkspace, optional

    Returns
    -------
    Tensor, shape [E], bool
    """
    num_experts = call.num_experts
    if out is not None and (out.shape != (num_experts,) or out.dtype != torch.bool or out.device != call.device):
        raise ValueError(f"out must be a bool tensor of shape ({num_experts},) on {call.device}")
    if stats_out is not None and (stats_out.shape != (2,) or stats_out.dtype != torch.int64):
        raise ValueError("stats_out must be an int64 tensor of shape (2,)")
    check_outputs(call, None, None, None, metrics_row, metrics_gate)
    if cfg.policy == "none" and stats_out is None and metrics_row is None:
        return torch.ones(num_experts, dtype=torch.bool, device=call.device) if out is None else out.fill_(True)
    reason = unsupported_reason(call, cfg)
    if reason is not None:
        _report(reason)
        keep, aggregate = select(call, cfg)
        kept_total, total = torch.where(keep, aggregate, 0).sum(), aggregate.sum()
        if stats_out is not None:
            stats_out[0] = kept_total
            stats_out[1] = total
        if metrics_row is not None:
            add_metrics(metrics_row, selection_metrics(keep, kept_total, total), metrics_gate)
        return keep if out is None else out.copy_(keep)
    call.check_config(cfg)
    keep = out if out is not None else torch.empty(num_experts, dtype=torch.bool, device=call.device)
    _launch(
        call,
        cfg,
        route=False,
        keep=keep,
        stats_out=stats_out,
        metrics_row=metrics_row,
        metrics_gate=metrics_gate,
        workspace=workspace,
    )
    return keep
