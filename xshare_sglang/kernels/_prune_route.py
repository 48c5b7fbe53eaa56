"""Triton kernels of ``prune_route``: keep mask and pruned routing of one MoE layer call (jit only).

Three kernels, launched from ``prune_route.py``:

1. ``select_kernel`` - grid of P programs over the tokens.  Each program reads its rows once and
   adds its share (aggregate scores, warm-up and per-request marks, LYNX bin counts) into the
   workspace's accumulators with integer atomics, then takes a ticket from an atomic counter.  The
   program holding the last ticket loads the accumulators and applies the policy's set rule, the
   ``max_experts`` cap and the token range, writes the keep mask and (with metrics) the kept count
   and retained score mass.  Having read them, it puts its ticket and the accumulators back to 0
   (see "Clean counters" below).  With P = 1 (``SINGLE``) there is no ticket, and the same program
   then routes every row itself: one launch for the whole layer call.
2. ``lynx_pick_kernel`` - LYNX with P > 1 only: the selection's last program ranks the experts by
   their LYNX sums and stops; this kernel takes every row's picks in parallel (one tile per program)
   and its last program finishes the mask and clears the picks, the aggregate and its ticket.
3. ``route_kernel`` - grid over the tokens (only when P > 1): each program routes its rows inside
   the keep mask, writing ids and weights in SGLang's ``TopKOutput`` layout; with metrics, each
   program adds a visit (and a mark where it routed a token) to every expert's word, and the
   program that completes an expert's visits counts it if marked and clears the word: no ticket.
   For a rule that needs no scores (``oea``, static moe-spec, LYNX) each program also adds its
   rows' kept and total score mass, and the program holding the last ticket adds their share.
   For policy ``none`` (``ALL_KEPT``) it is the only launch: program 0 writes the full mask.  So
   it is for static moe-spec (``STATIC_KEEP``), whose calibrated mask every program derives.

Clean counters: the workspace's tickets, accumulators and marks are 0 between calls.  Before, the
wrapper zeroed them ahead of every multi-program call, which cost a launch of its own (a kernel in a
CUDA graph costs about 1 us on an H200 before it does any work).  Now the last program of each
kernel, the only reader left once every program holds its ticket (each program's atomics come
before its ticket, acquire-release), clears what its kernel accumulated after a block barrier that
puts every thread's loads before the zeros.  Calls on one workspace run in stream order (one
workspace per stream), so the next call, launched as a programmatic dependent or not, sees the zeros.
A call that fails after queueing part of its kernels is reset by the wrapper
(``SelectionWorkspace.reset``).  The routing kernel's activated-expert count needs no last program:
an expert's visit word is cleared by the program whose atomic add completes its P visits (adds to
one word are totally ordered, so exactly one program sees the other P - 1 before its own).  The
metrics themselves are added with relaxed atomics nobody waits for.  Only the coverage ranking's
[E, E] pair sums are still zeroed before the call (``fill_kernel``): its greedy reads just the kept
experts' rows.

Metrics gate: with ``GATED`` every program of every kernel of a call reads one int32 word
(``metrics_on``) and, while it is 0, adds no metrics and skips their work: the scores a rule computes
only for the retained mass (``METRIC_SCORES``), the sums and the division of ``finish_keep``, the
routing kernel's visit words, its ``route_mass`` and the ticket only that took.  All programs read the
same word, so all take the same branch, and the counters stay clean either way.  A server samples its
metrics this way (one forward in N) and the other forwards skip their cost.

Serial loops and what replaced them (issue 33; ``docs/kernel-sass.md`` has the machine-code counts):

* The order of the experts in the set rules (``places``; top-aggregate, greedy budget, expert-parallel
  rounds and the ``max_experts`` cap) was a loop over chunks of 32 experts, each comparing against
  every expert after a round trip through global memory.  It is now one [E, E] comparison of packed
  keys in registers and one column sum.  Exact: the key ``agg << 10 | (1023 - e)`` orders (agg desc,
  index asc) with one integer comparison, as the reference's stable sort does.
  When the order's answer is known it is not computed: with top-k scores at most ``n_valid x
  top_k`` experts are candidates, so a greedy budget at least that large (or zero) takes all (or
  none) of them; the router ranking's top-count (moe-spec) keeps every expert with an aggregate and
  gives the rest of its count to the others in index order, an exclusive prefix count
  (``places_scored_first``); the rounds take every candidate when ``|warm| + candidates`` does not
  pass their target; the cap changes nothing when no more are kept.  Each is a branch on a value the whole
  block holds, and when the launch's own row count already settles the greedy budget or the
  top-count the wrapper compiles its order out (``ORDER``).  Exact: the skipped order could only have
  answered "every candidate"; for the top-count, aggregates are >= 0, so the experts with one come
  first and the others tie at 0, in index order.
* The threshold rule's mass-before-each-expert (``prefix_keep``) was the same loop with a second sum.
  It is now one bitonic sort of the packed keys (``tl.sort``) and one running sum (``tl.cumsum``).
  Exact: integer sums do not depend on their order, and the taken experts are a prefix of the sorted
  order, so the last taken key marks them all.
* The fixed-point scores divided every element of a tile by its row total in int64 (a subroutine of
  ~85 instructions per element).  ``share_of_row`` takes one float64 reciprocal per row and corrects
  the float64 quotient by its integer remainder (``floor_div``).  Exact: numerator and denominator are
  exact in float64, the quotient is off by less than one, and one remainder test fixes it.  LYNX's
  base-T digits use the same division.
* The last program summed up to 64 per-program partials, one round of loads per program; it now
  loads one accumulator the programs added into with atomics.  Exact: integer sums and maxima do not
  depend on the order the atomics land in.
* LYNX took every row's picks in the last program (linear in T); with P > 1 they run in
  ``lynx_pick_kernel``, one tile per program, with one int64 key per entry so each pick is one max.
  Its bin counts (``lynx_bin_counts``) were one column sum per bin, then one ``tl.histogram`` per
  tile (whose ``mask`` miscounted padding rows on an H200, and which spilled registers at E=256);
  now each entry adds ``16 ** depth`` to its expert's int64 and one sum down the rows counts every
  bin at once.  Exact: a tile has at most 15 rows, so no 4-bit field carries into the next.
* LYNX's expert order ``s = sum_t n ** bin`` was carried into base-n digits and compared digit by
  digit through global memory (``beta + 2`` loads per chunk of experts).  While ``n ** (beta + 1)
  < 2**61`` (beta <= 4 up to ~5000 tokens) ``s`` is one int64 per expert: one weighted sum over the
  bins and one [E, E] comparison.  Exact: the integer is ``s * n**beta`` itself, below 2**63.  The
  digits remain for larger ``n`` and ``beta``.
* The coverage ranking's greedy re-read every row's scores once per pick (``count`` picks x T rows,
  linear in T).  Above one tile each voting row now joins, with one atomic per nonzero score, the
  list of every expert it scores (top_k lists per row with top-k scores); the gains start at the
  aggregate and after each pick only the picked expert's rows are revisited, their terms taken out
  at the old coverage and put back at the new one (``coverage_loss``): about T x top_k / E rows per
  pick.  Up to one tile the rows are read into registers once.  Exact: the same integer terms the
  full recount sums, in any order; the tie-break is one packed key ``agg << 10 | (1023 - e)``.
  Those lists still grew with T (a popular expert is on many rows), so with top-k scores the greedy
  now keeps no rows at all: on its 2**-16 grid each term is exact (no rounding per term), a row's
  scores sum to at most one, and a gain is ``ONE * column sum - sum over kept i of C[i, j]`` with the
  pair sums ``C[i, j] = sum_t c[t, i] c[t, j]``.  Each program adds its rows' top_k x top_k pairs with
  atomics (one packed int32 reduction per pick gives its score and id); each pick of the last program
  is one row of ``C``, whatever T.  Exact: the same integers, summed in any order.  There each pick
  is also one maximum instead of two (the gain, then its tie-break by aggregate and index): the
  experts' places in the order (agg desc, index asc) come from one [E, E] order before the picks,
  and ``gain << 20 | (1023 - place) << 10 | e`` is one int64 key (gains below 2**42: at most 1024
  tokens of 2**32; places and ids below 1024), 72 instructions, 3 barriers and 14 shuffles per pick
  instead of 123, 6 and 28 (E=128).  Dense scores (``score="probs"``) keep the lists.  The greedy
  picks of coverage and co-activation ran ``count`` times; gains never grow, and once none is left
  the reference takes the rest by aggregate (or index) then index, so the picks are a ``while`` loop
  that stops there and one sort of the packed keys (``take_by_order``) takes the rest: with top-k
  scores a batch of T tokens has at most T x top_k experts that gain.  Exact: the same picks in the
  same order, the tail of equal gains in the reference's tie order.  One program still recomputes
  every gain from its tile at each pick (three reductions across the experts, one across the rows),
  which costs more the taller the tile; so the wrapper's plan (``plan_for``) gives a tile of 5 to 8
  rows two programs and the pair sums, and runs a call of one row as the router ranking's top-count
  (``MODE_TOP_AGG``): with one row every gain is the row's score times one factor, so the picks and
  the rest of the budget follow (aggregate desc, index asc).
* The greedy picks of the co-activation ranking and of the per-request sets took two reductions per
  pick (the maximum, then the first index holding it); now one ``tl.argmax`` over (value, index)
  pairs, first index on ties: half the block barriers per pick (6 -> 3 at E=128).  Exact: the same
  first maximum; a per-request pick with no candidate left lands on a non-candidate and is dropped.
  Up to 4096 tokens a co-activation gain is below 2**52 (an aggregate is at most T * 2**24, the
  discount factor at most 2**16), so each pick is the maximum of one int64 key ``gain << 10 |
  (1023 - e)`` (the argmax carried the index through every shuffle step beside the value): 82
  instructions and 14 shuffles per pick instead of 120 and 21 (E=128, Triton 3.6).  Exact: the
  key's order is (gain desc, index asc), the reference's; larger batches keep the argmax.  The
  per-request picks do the same (a request's aggregate is below 2**31): 68 instructions and 10
  shuffles per pick instead of 99 and 15.
* Those two greedy chains (co-activation up to 4096 tokens, coverage from pair sums) still took a
  block-wide maximum per pick, the experts spread over all warps: each warp's shuffle tree, a trip
  through shared memory and 3 barriers, 32-64 times in a row.  Now every warp holds all the gains
  (``coact_picks``, ``coverage_pair_picks``: two [warps, SUB] halves, one copy per warp, each row
  in one warp because the picked row's 128-bit loads cover it with 32 lanes) and takes each pick
  alone, the key's maximum as two int32 warp maxima (``REDUX``), loading the picked row itself: no
  barrier and no shuffle in the loop (``112/0/0/2`` a pick on E=128 instead of ``82/3/14/1``).  The
  loop runs a fixed number of steps (the budget, or fewer experts that can gain) and picks only
  while the best gain is positive, since a per-warp value cannot end a ``while`` without a barrier;
  the rest of the budget is taken in the warp too (index order by a running count; the coverage
  order by bisection on the places), since handing the copies back before it laid the sort after
  them out on every warp.  Exact: the same keys, the same picks in the same order.  A half holds
  128 int32 redundancy entries or 64 int64 pair sums (``prune_route.warp_picks``).  Up to 128
  experts only (``prune_route.WARP_PICKS_MAX_EXPERTS``): on an H200 the copies took 2 us off the
  co-activation ranking on E=128 and added 5 us on DeepSeek-V3's E=256, where each of eight warps
  issues every pick, twice what a scheduler did with the block-wide maximum; E=256 keeps it.
* The retained-mass metric made the selection of a rule that needs no scores (``oea``, static
  moe-spec, LYNX) score every row above one program: the software ``exp``, E aggregate atomics per
  program, and the last program's loads and sums, all before the routing could start.  Now each
  routing program, which holds its rows and the final mask, sums its kept and total mass
  (``route_mass``) before its ticket, and the last one divides (``retained_share``).  Exact: the
  same integer terms as the aggregate's, summed in another order.
* The routing's top-k rounds took two row reductions per pick (the maximum key, then the picked
  expert's softmax term as a sum over the row; a third, its kept flag, under truncation).  The rounds
  now take the maxima alone.  After them the picks' logits come back from their keys (``key_logit``:
  a key holds its value's order-preserving bits, and a 16-bit value's dropped low bits are known);
  the kept flags come from one ``tl.gather``, and the experts routed to are those at or above the
  last pick's key.  Exact: the same values go through the same operations, and keys are distinct
  within a row.  The routing kernel, and a one-program ``none``, run one warp per row of their tile
  (``prune_route.route_warps``): an int32 maximum is then one warp-wide ``REDUX`` on sm_90, and an
  int64 key's maximum two (the value half, then the index half among the value's ties: the int64
  order itself).
* A key of biased routing ranks ``sigmoid(logit) + bias``, which does not give the logit back, so
  the picks' weights were the sigmoids of logits loaded again from memory after the last pick (a
  dependent round trip at the end of every DeepSeek-V3 call).  On a warp per row each pick now also
  takes the maximum of the row's sigmoid bits where the index half matched (one ``REDUX`` that no
  later pick waits for): the weight is the very float32 sigmoid the key was built from, the bits
  of a value >= 0 ordering as the value.  A row over several warps (E > 256, or a one-program pruned
  call's tile on the selection's eight warps) keeps the reload, one round trip for all picks, where a
  block-wide maximum per pick would take a barrier each.
* Grouped routing (DeepSeek-V3) ranked the groups in a loop over groups, three row reductions each,
  and marked the chosen groups in a second loop.  When the groups split a power-of-two E evenly it
  views the tile as [rows, groups, group size] and reduces the last axis: three reductions in all.
  With a bias the group's two best values come from int32 maxima of the keys' value halves (the best,
  the count of its ties, the best below it) instead of two int64 maxima: a tie at the top makes the
  second best the best again, as the second-best distinct key would.  The chosen groups were
  ``topk_group`` maxima over the group keys in a row; now one [G, G] comparison counts the keys above
  each group's, and fewer than ``topk_group`` means chosen.  Exact: the same values, maxima and
  counts, taken per group at once; the keys of groups with candidates are distinct, and a group
  without candidates adds none whether chosen or not.
* One row of DeepSeek-V3's routing (E=256, biased, 8 groups of 32) sat in one warp: 8 software
  sigmoids per lane and 8 picks of 8 registers each (1644 instructions at T=1 for ``none``, the
  routing kernel's tiles of 8 rows the same per warp), or, in a pruned one-program call, over eight
  warps with 3 barriers per pick.  A one-row call, and the routing kernel above one program with a
  program per row (up to 256 rows: on an H200 it lost at 512, see ``prune_route.GROUP_WARP_MAX_ROWS``;
  also a ``none`` of 2 to 8 rows, and static moe-spec's, ``prune_route.plan_rows_alone``),
  now give each group a warp, a lane per expert (``route_row_by_group_warps``,
  ``prune_route.GROUP_WARP_ROUTING``):
  one sigmoid per lane; a group's two best values and its own top-k are warp maxima (``REDUX``); the
  group ranking is one [G, G] comparison across the warps; the row's top-k is taken among the groups'
  picks (8 x 8 keys) in every warp on its own copy, as two [G, 32] halves, with warp maxima again.
  No loop holds a barrier or a shuffle.  Exact: a group's keys are the row's keys, and the k best of
  the row are among the k best of each chosen group, so the row's picks and their order are the
  same; the weights are the picked sigmoids' bits, as on a warp per row.
* ``xshare-ep``'s order inside each rank masked an [E, E] key comparison with an [E, E] group
  equality (hundreds of spilled registers at E=256).  Now the global places ``p`` come first and one
  int32 comparison of ``rank * 1024 + p`` against each expert's rank start, unsigned, counts the
  experts of the same rank before it.  Exact: places are below 1024, so lower ranks wrap to large
  unsigned values and higher ranks are at least 1024.
* Argmax rounds over a row (the warm-up ranks, the routing top-k, LYNX picks) compare int32 keys when
  the logits are bfloat16 or float16 (``pack_key``): half the shuffles of an int64 reduction.  Exact:
  a 16-bit float's value in float32 has its low mantissa bits zero, so the shifted ordered bits of two
  distinct values differ and keep their order; a sanitized +inf gets the rank of +inf.
* One program no longer walks several row tiles or requests (``plan_launch`` spreads them over
  programs), its tiles are no taller than the call, and hold at most 8 rows (more programs of fewer
  rows were faster at T=128 on an H200).  Inside a tile the compiler lays the rows across warps
  (two rows per warp at E=128), so per-row reductions stay within a warp: shuffles, no barriers.

What is still serial: above one tile a call is two launches (the selection, the routing) joined by
a ticket, three for LYNX.  With the counter reset launch it was three, and on an H200 that
structure alone added about 3.4 us over ``none`` whatever the policy (static moe-spec, which
selects nothing per row, measures it); the reset launch is gone since (not yet timed on a GPU).
Two ways around the rest were built and timed on an H200 (``docs/bench_selection.md``), and neither
paid: one launch whose programs wait at a
grid-wide barrier for the program that finishes the mask (its handoff cost what the kernel boundary
did, and it needs every program resident, which Triton's interpreter cannot give), and one program
of up to 32 rows on more warps (up to 1.8x slower: the set rule's reductions across warps grow with
the warps).  On one tile the [E, E] order is 1.6 us at E=128 and 4.3 at E=256, the routing pass
1.8-5 us, the scores and bookkeeping about 3-7 us.  ``enable_pdl`` (off by default; the serving
plugin turns it on for sm_90+, where it took 1.1-2.8 us off calls of two or three launches on an
H200) launches each kernel as a programmatic dependent of the one before it: every program first waits on
the device for its predecessor (``gdc_wait``, before any global memory access), and the selection
kernel lets its follower launch as it starts (``gdc_launch_dependents``), so the routing kernel's
launch overlaps the selection rather than following it.  The coverage ranking's pair sums are then
zeroed by ``fill_kernel``, which does the same for the selection kernel.

Numerics follow ``xshare_sglang.policies.scores`` bit for bit (exp32, fixed-point scores, integer
aggregates and thresholds, and every division that feeds a mask or a metric correctly rounded with
``tl.math.div_rn`` or exact in integers: a plain ``/`` compiles to an approximate division on CUDA);
the routing weights use the hardware ``exp`` and ``/`` and match the reference within a stated
tolerance.  Kernels must be launched with ``enable_fp_fusion=False`` so no multiply and add are fused
into one rounding.  Orders over experts use integer keys that pack an order-preserving copy of the
value with the inverted expert index, so one max reduction finds the highest value with ties to the
lower index.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

FP32_MAX = tl.constexpr(3.4028234663852886e38)
MIN_KEY = tl.constexpr(-(2**62))  # below every packed int64 key
MIN_KEY32 = tl.constexpr(-(2**31))  # below every packed int32 key
INF_ORDERED = tl.constexpr(0x7F800000)  # ordered bits of +inf: the rank of a sanitized +inf logit
ID_BITS = tl.constexpr(10)  # packed keys hold expert ids < 1024
ID_MASK = tl.constexpr(1023)
SCORE_BITS = tl.constexpr(24)
SCORE_ONE = tl.constexpr(16777216.0)  # 2**24
UNIT_ONE = tl.constexpr(1073741824.0)  # 2**30
WARM_FIRST = tl.constexpr(2**52)  # cap key: warm-up experts ahead of any aggregate (< 2**47)

# exp32 constants: identical to policies.scores
EXP_LOW = tl.constexpr(-87.0)
EXP_HIGH = tl.constexpr(88.0)
LOG2E = tl.constexpr(1.4426950216293335)
LN2_HIGH = tl.constexpr(0.693359375)
LN2_LOW = tl.constexpr(-0.00021219444170128554)
P0 = tl.constexpr(0.00019875691214110702)
P1 = tl.constexpr(0.001398199936375022)
P2 = tl.constexpr(0.008333452045917511)
P3 = tl.constexpr(0.04166579619050026)
P4 = tl.constexpr(0.1666666567325592)
P5 = tl.constexpr(0.5)

MODE_WARM = tl.constexpr(0)  # oea
MODE_GREEDY_WARM = tl.constexpr(1)  # xshare
MODE_GREEDY_BASE = tl.constexpr(2)  # xshare-spec (base = union of per-request sets)
MODE_THRESHOLD = tl.constexpr(3)  # xshare-threshold
MODE_RANK_ROUNDS = tl.constexpr(4)  # xshare-ep
MODE_TOP_AGG = tl.constexpr(5)  # moe-spec, router ranking
MODE_STATIC = tl.constexpr(6)  # moe-spec, static ranking (precomputed places)
MODE_GIVEN = tl.constexpr(7)  # moe-spec per request, lynx (base = union)
MODE_ALL = tl.constexpr(8)  # none: every expert
MODE_COACT = tl.constexpr(9)  # moe-spec, co-activation ranking (greedy with redundancy discounts)
MODE_COVERAGE = tl.constexpr(10)  # moe-spec, coverage ranking (greedy on uncovered per-token mass)
SCORE_ONE_INT = tl.constexpr(1 << 24)
# the coverage greedy's grid (policies.greedy.COVERAGE_FRACTION_BITS): scores >> 8, 2**16 = 1
COVER_BITS = tl.constexpr(16)
COVER_ONE = tl.constexpr(1 << 16)
REDUNDANCY_ONE = tl.constexpr(1 << 16)  # 1.0 on the redundancy grid (config.REDUNDANCY_BITS)


# --------------------------------------------------------------------------- numerics
@triton.jit
def exp32(x):
    """policies.scores.exp32, step for step."""
    xc = tl.minimum(tl.maximum(x, EXP_LOW), EXP_HIGH)
    n = tl.floor(xc * LOG2E + 0.5)
    r = (xc - n * LN2_HIGH) - n * LN2_LOW
    poly = r * P0 + P1
    poly = poly * r + P2
    poly = poly * r + P3
    poly = poly * r + P4
    poly = poly * r + P5
    y = (poly * (r * r) + r) + 1.0
    ni = n.to(tl.int32)
    half = ni >> 1
    first = ((half + 127) << 23).to(tl.float32, bitcast=True)
    second = ((ni - half + 127) << 23).to(tl.float32, bitcast=True)
    y = (y * first) * second
    return tl.where(x < EXP_LOW, 0.0, tl.where(x > EXP_HIGH, float("inf"), y))


@triton.jit
def sigmoid32(x):
    """policies.scores.sigmoid32: correctly rounded float32 division."""
    denominator = 1.0 + exp32(-x)
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), denominator)


@triton.jit
def ordered_bits(v):
    """An int32 whose signed order is the float32 order of ``v`` (-0.0 must be canonicalized)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def unordered_value(ordered):
    """Inverse of :func:`ordered_bits`."""
    bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pack_key(v, e, ok, KEY_SHIFT: tl.constexpr):
    """Key of the order (value desc, index asc): ``v`` high, ``1023 - e`` low, the lowest key of its
    type where not ``ok``.

    ``KEY_SHIFT = 0``: int64, any float32 ``v``.  ``KEY_SHIFT = 16`` (bfloat16 logits) or ``13``
    (float16): int32, for ``v`` that hold a 16-bit float's value (the float32 bits below the 16-bit
    mantissa are zero), or ``FP32_MAX`` (a sanitized +inf), which ranks above every finite 16-bit value
    as in float32.  The shifted ordered bits of distinct 16-bit values are distinct and keep their
    order, so an int32 key ranks exactly as the int64 key would, with half the work per comparison.
    """
    if KEY_SHIFT == 0:
        key = (ordered_bits(v).to(tl.int64) << ID_BITS) | (e.to(tl.int64) ^ ID_MASK)
        return tl.where(ok, key, MIN_KEY)
    else:
        high = tl.where(v == FP32_MAX, INF_ORDERED >> KEY_SHIFT, ordered_bits(v) >> KEY_SHIFT)
        return tl.where(ok, (high << ID_BITS) | (e ^ ID_MASK), MIN_KEY32)


@triton.jit
def lowest_key(KEY_SHIFT: tl.constexpr):
    """The key below every packed key of this width (:func:`pack_key`)."""
    if KEY_SHIFT == 0:
        return MIN_KEY
    else:
        return MIN_KEY32


@triton.jit
def key_expert(key):
    """Expert id of a packed key."""
    return ((key & ID_MASK) ^ ID_MASK).to(tl.int32)


@triton.jit
def key_value(key):
    return unordered_value((key >> ID_BITS).to(tl.int32))


@triton.jit
def key_logit(key, KEY_SHIFT: tl.constexpr):
    """The float32 value packed into a key by :func:`pack_key`, exactly (a sanitized +inf gives
    ``FP32_MAX`` back).  At ``KEY_SHIFT`` > 0 the dropped low bits of the ordered bits are zero for
    a non-negative value and ones for a negative one, whose bits are then the shifted high part
    xor the shifted flip mask."""
    if KEY_SHIFT == 0:
        return key_value(key)
    else:
        high = key >> ID_BITS
        bits = tl.where(high >= 0, high, high ^ (0x7FFFFFFF >> KEY_SHIFT)) << KEY_SHIFT
        value = bits.to(tl.float32, bitcast=True)
        return tl.where(value == float("inf"), FP32_MAX, value)


@triton.jit
def floor_div(num, den):
    """Exact ``num // den`` for int64 ``0 <= num < 2**55`` and ``0 < den < 2**53`` (broadcast), without
    an int64 division: a float64 quotient is within 2**-28 of the true one (both operands exact in
    float64, two roundings), so its floor is off by at most one, and the remainder corrects it."""
    q = tl.floor(num.to(tl.float64) * (1.0 / den.to(tl.float64))).to(tl.int64)
    rem = num - q * den
    return q + (rem >= den).to(tl.int64) - (rem < 0).to(tl.int64)


@triton.jit
def share_of_row(units):
    """``(units << 24) // sum(units)`` per row of a [rows, E] int64 tile (0 for a row summing to 0);
    units <= 2**30, so the quotient is at most 2**24.  One reciprocal per row, none per element."""
    total = tl.sum(units, axis=1)
    q = floor_div(units << SCORE_BITS, tl.maximum(total, 1)[:, None])
    return tl.where(total[:, None] > 0, q, 0)


@triton.jit
def fixed_scores(x, member, wq, SIGMOID: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_WEIGHTS: tl.constexpr):
    """policies.scores.token_scores (times the fixed-point row weights) for a [rows, E] tile, int64."""
    if SIGMOID:
        s = sigmoid32(x)
        if RENORMALIZE:
            units = tl.where(member, tl.floor(s * UNIT_ONE).to(tl.int64), 0)
            q = share_of_row(units)
        else:
            q = tl.where(member, tl.floor(s * SCORE_ONE).to(tl.int64), 0)
    else:
        masked = tl.where(member, x, float("-inf"))
        top = tl.max(masked, axis=1)
        top = tl.where(top > float("-inf"), top, 0.0)
        units = tl.where(member, tl.floor(exp32(masked - top[:, None]) * UNIT_ONE).to(tl.int64), 0)
        q = share_of_row(units)
    if HAS_WEIGHTS:
        q = (q * wq[:, None]) >> SCORE_BITS
    return q


@triton.jit
def threshold_target(total, tau_q):
    """policies.greedy.threshold_target: ceil(tau_q * total / 2**30), exact in int64."""
    high = total >> 23
    low = total & ((1 << 23) - 1)
    a = high * tau_q
    b = low * tau_q
    rest = (a & 127) * (1 << 23) + b
    return (a >> 7) + ((rest + (1 << 30) - 1) >> 30)


# --------------------------------------------------------------------------- rows
@triton.jit
def num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR: tl.constexpr):
    """Real-token count, clamped to [0, num_tokens]; read from the device when given as a tensor."""
    if HAS_NV_PTR:
        n = tl.load(n_valid_ptr).to(tl.int64)
    else:
        n = tl.full([], n_valid_arg, tl.int64)
    return tl.minimum(tl.maximum(n, 0), num_tokens)


@triton.jit
def sanitize_logits(x):
    """Logits as float32 the kernels compare: NaN -> -inf, +inf -> the largest float32, -0 -> +0."""
    x = x.to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)
    return tl.where(x == float("inf"), FP32_MAX, x) + 0.0


@triton.jit
def load_bias(bias_ptr, e, e_ok):
    """The correction bias of experts ``e`` (0 outside ``e_ok``), float32: NaN -> 0, infinities -> the
    float32 extremes."""
    bias = tl.load(bias_ptr + e, mask=e_ok, other=0.0).to(tl.float32)
    bias = tl.where(bias != bias, 0.0, bias)
    return tl.minimum(tl.maximum(bias, -3.4028234663852886e38), FP32_MAX)


@triton.jit
def load_rows(
    logits_ptr,
    stride_t,
    stride_e,
    rows,
    rows_in_block,
    n_valid,
    e,
    e_ok,
    weights_ptr,
    HAS_WEIGHTS: tl.constexpr,
):
    """A [rows, BLOCK_E] float32 tile of sanitized logits (NaN -> -inf, +inf -> max, -0 -> +0).

    Rows outside the block, at/after ``n_valid`` (padding) or of vote weight 0 read as -inf.
    Returns the tile, which rows vote, and their fixed-point weights ``floor(w * 2**24)`` (int64).
    """
    row_ok = rows_in_block & (rows < n_valid)
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        w = tl.where(w != w, 0.0, w)
        w = tl.minimum(tl.maximum(w, 0.0), 1.0)
        row_ok = row_ok & (w > 0)
        wq = tl.floor(w * SCORE_ONE).to(tl.int64)
    else:
        wq = tl.zeros(rows.shape, tl.int64) + (1 << 24)
    ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_t + e[None, :] * stride_e
    x = sanitize_logits(tl.load(ptrs, mask=row_ok[:, None] & e_ok[None, :], other=float("-inf")))
    return x, row_ok, wq


@triton.jit
def row_ranks(key, n_iter, KEY_SHIFT: tl.constexpr):
    """Place of each expert in its row's key order for the first ``n_iter`` places (``n_iter`` for
    the rest and for unset keys), int32."""
    lowest = lowest_key(KEY_SHIFT)
    rank = tl.zeros(key.shape, tl.int32) + n_iter
    work = key
    for i in range(0, n_iter):
        best = tl.max(work, axis=1)
        chosen = (work == best[:, None]) & (best[:, None] > lowest)
        rank = tl.where(chosen, i, rank)
        work = tl.where(chosen, lowest, work)
    return rank


@triton.jit
def greedy_iterative(base, agg, e, e_ok, count, active, ALLOW_ZERO: tl.constexpr, BLOCK_E: tl.constexpr):
    """G(S, agg, count) on one vector: ``count`` times, add the best outside expert with agg > 0
    (with ``ALLOW_ZERO``: agg >= 0, the plain top-``count``).  Adds nothing unless ``active``.

    A request's aggregate is below 2**31 (at most 64 rows of at most 2**24), so each pick is the
    maximum of one int64 key ``agg << 10 | (1023 - e)``: the largest aggregate at its first index."""
    chosen = base
    if ALLOW_ZERO:
        candidate = (base == 0) & e_ok & active
    else:
        candidate = (base == 0) & e_ok & (agg > 0) & active
    key = tl.where(candidate, (agg << 10) | (1023 - e), -1)
    for _ in range(0, count):
        # with no candidate left the maximum is -1, which names no expert
        best = tl.max(key, axis=0)
        hit = (e == 1023 - (best & 1023)) & (best >= 0)
        chosen = tl.where(hit, 1, chosen)
        key = tl.where(hit, -1, key)
    return chosen


@triton.jit
def coverage_top(gain, chosen, e_ok):
    """The coverage greedy's candidates' gains (``-1`` off them) and their maximum."""
    key = tl.where(e_ok & (chosen == 0), gain, -1)
    return key, tl.max(key, axis=0)


@triton.jit
def coverage_first(key, top, agg, e):
    """The coverage greedy's next expert: the gain ``top`` (the largest in ``key``), ties to the larger
    aggregate, then the lower index.  One reduction: the tie-break is one int64 key
    ``agg << 10 | (1023 - e)`` (coverage aggregates stay below 2**53: fewer than 2**29 rows of at most
    2**24 each; ids below 1024)."""
    order = (agg << 10) | (1023 - e).to(tl.int64)
    return 1023 - (tl.max(tl.where(key == top, order, -1), axis=0) & 1023).to(tl.int32)


@triton.jit
def take_by_order(prim, chosen, e, e_ok, rest):
    """``chosen`` plus the ``rest`` first experts outside it in the order (prim desc, index asc): the
    greedy rules' picks once every gain left is zero, all at once.  One sort of the packed keys (they
    are distinct) and the ``rest``-th key as the threshold."""
    flag = e_ok & (chosen == 0)
    key = order_key(prim, e, flag)
    ranked = tl.sort(key, descending=True)
    threshold = tl.max(tl.where(e == rest - 1, ranked, MIN_KEY), axis=0)
    return tl.where(flag & (key >= threshold) & (rest > 0), 1, chosen)


@triton.jit
def coverage_loss(q, chosen, e, pick):
    """What keeping ``pick`` takes from every expert's coverage gain, summed over the rows of ``q``.

    ``q`` [rows, E] int64 holds the rows' fixed-point scores (zero rows add nothing), read on the
    greedy's grid ``c = q >> 8``.  A row is covered to ``m = sum of c over chosen``; the pick raises
    it to ``m + c[:, pick]``; each expert's term ``c * max(ONE - m, 0)`` drops by ``c`` times the
    difference of the two clamps.  Exact: the same integer terms the full recount sums.
    """
    c = q >> (SCORE_BITS - COVER_BITS)
    covered = tl.sum(tl.where(chosen[None, :] != 0, c, 0), axis=1)
    picked = tl.sum(tl.where(e[None, :] == pick, c, 0), axis=1)
    left = tl.where(covered < COVER_ONE, COVER_ONE - covered, 0)
    after = covered + picked
    left_after = tl.where(after < COVER_ONE, COVER_ONE - after, 0)
    return tl.sum(c * (left - left_after)[:, None], axis=0)


@triton.jit
def lynx_depths(x, alpha, beta):
    """LYNX bin depths ``-max(-beta, ceil((l - max) * alpha))`` in [0, beta], int32, float32 steps."""
    top = tl.max(x, axis=1)
    top = tl.where(top > float("-inf"), top, 0.0)
    scaled = tl.ceil((x - top[:, None]) * alpha)
    return -tl.maximum(scaled, 0.0 - beta).to(tl.int32)


@triton.jit
def lynx_bin_counts(x, row_ok, e, alpha, beta, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_BINS: tl.constexpr):
    """[BLOCK_E, BLOCK_BINS] int32: the voting rows of a [ROWS, BLOCK_E] tile per (expert, LYNX bin).

    Each entry adds ``16 ** depth`` to its expert's int64: with at most 15 rows a bin's count fits its
    4 bits without carrying into the next, and 15 bins (depth <= beta <= 14) fill 60 bits.  One sum down
    the rows, then each bin is four bits of it.  (``tl.histogram`` over ``e * BLOCK_BINS + depth``
    spilled hundreds of registers at E=256 on sm_90, and its ``mask`` argument miscounted padding rows
    on an H200 with Triton 3.6.)"""
    tl.static_assert(ROWS <= 15, "LYNX bin counts pack up to 15 rows per 4-bit field")
    depth = lynx_depths(x, alpha, beta).to(tl.int64)
    code = tl.where(row_ok[:, None] & (e[None, :] >= 0), tl.full([], 1, tl.int64) << (depth * 4), 0)
    packed = tl.sum(code, axis=0)
    bin_shift = (tl.arange(0, BLOCK_BINS) * 4).to(tl.int64)
    return ((packed[:, None] >> bin_shift[None, :]) & 15).to(tl.int32)


@triton.jit
def order_key(prim, e, flag):
    """int64 key of the order (prim desc, index asc) for ``0 <= prim < 2**53``: ``prim`` high, the
    inverted expert index low, so one integer comparison decides; ``MIN_KEY`` where not ``flag``."""
    return tl.where(flag, (prim << ID_BITS) | (e ^ ID_MASK), MIN_KEY)


@triton.jit
def places(prim, flag, e, e_ok, group, USE_GROUP: tl.constexpr):
    """For every expert: how many flagged experts (of its group, with ``USE_GROUP``) come before it in
    the order (prim desc, index asc), int32.  All pairs at once in registers: one [E, E] comparison of
    packed keys and one sum down the columns (the compiler moves the vector across threads once).

    With groups (``0 <= group < 2**20``), the global places ``p`` come first; then ``group * 1024 + p``
    (places are below 1024: E <= 512) orders the experts by group and, inside a group, as ``prim``
    does.  A flagged expert j is before e in e's group exactly when its composite key less e's group
    start, as an unsigned number, is below ``p[e]``: lower groups wrap to large values, higher groups
    are at least 1024.  One int32 comparison per pair.  (A mask of group equality and-ed with the key
    comparison spilled over 500 registers to local memory at E=256 on sm_90.)"""
    key_e = order_key(prim, e, e_ok)
    key_j = order_key(prim, e, flag & e_ok)
    before = tl.sum((key_j[:, None] > key_e[None, :]).to(tl.int32), axis=0)
    if USE_GROUP:
        group_start = group.to(tl.int32) * 1024
        composite_j = tl.where(flag & e_ok, group_start + before, -1)  # -1: never counted (0xFFFFFFFF)
        offset = (composite_j[:, None] - group_start[None, :]).to(tl.uint32, bitcast=True)
        before = tl.sum((offset < before[None, :].to(tl.uint32)).to(tl.int32), axis=0)
    return before


@triton.jit
def places_scored_first(agg, e_ok):
    """:func:`places` in the order (agg desc, index asc) as far as a count of at least the number of
    experts with an aggregate needs them, int32: each of those at 0 (every one is kept), every other
    expert after them in index order (their count plus an exclusive prefix count).  Exact for any
    count >= #{agg > 0}: aggregates are >= 0, so the scored experts come first in the order, and the
    rest tie at 0, ordered by index."""
    scored = e_ok & (agg > 0)
    rest = (e_ok & (agg <= 0)).to(tl.int32)
    num_scored = tl.sum(scored.to(tl.int32), axis=0)
    return tl.where(scored, 0, num_scored + tl.cumsum(rest, axis=0) - rest)


@triton.jit
def prefix_keep(prim, flag, e, kept_mass, needed):
    """Flagged experts taken in the order (prim desc, index asc) while the mass before each, plus
    ``kept_mass``, is below ``needed`` (the ``prim`` are the masses).  One sort of the packed keys,
    one running sum over the sorted masses; the taken ones are a prefix, so a key comparison with the
    last taken key marks them."""
    key = order_key(prim, e, flag)
    ranked = tl.sort(key, descending=True)
    mass = tl.where(ranked > MIN_KEY, ranked >> ID_BITS, 0)
    before = tl.cumsum(mass, axis=0) - mass
    taken = tl.sum(((ranked > MIN_KEY) & (kept_mass + before < needed)).to(tl.int32), axis=0)
    last = tl.max(tl.where(e == taken - 1, ranked, MIN_KEY), axis=0)
    return flag & (taken > 0) & (key >= last)


@triton.jit
def lynx_s_ranks(
    counts,
    base,
    digits_ptr,
    num_experts,
    beta,
    e,
    e_ok,
    BLOCK_E: tl.constexpr,
    BLOCK_BINS: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Exact rank of every expert by ``s[e] = sum_t n ** bin[t, e]``: equal s, equal rank; higher s,
    higher rank.  ``counts`` [BLOCK_E, BLOCK_BINS] int64: tokens per (expert, bin).

    ``s * n**beta = sum_b counts[e, b] * n**(beta - b)`` is at most ``n**(beta + 1)``.  While that
    stays below 2**61 (every call with beta <= 4 and n <= 5000 voting tokens) it is one int64 per
    expert: one weighted sum over the bins and one [E, E] comparison rank it.  Above, it is carried
    into base-n digits (through ``digits_ptr``) and compared digit by digit."""
    bin_id = tl.arange(0, BLOCK_BINS)
    # n ** (beta + 1) < 2**61, with a margin far wider than float32's rounding of log2
    if (beta + 1) * tl.log2(base.to(tl.float32)) < 61.0:
        weight = tl.where(bin_id <= beta, 1, 0).to(tl.int64)
        for i in range(0, beta):
            weight = tl.where(bin_id < beta - i, weight * base, weight)
        s = tl.sum(counts * weight[None, :], axis=1)
        # through memory once: compared across all pairs in the layout of the sum over bins, the
        # [E, E] comparison spilled thousands of registers at E=256 on sm_90; reloaded, it takes the
        # layout of a plain [E] vector and spills none
        tl.store(digits_ptr + e, tl.where(e_ok, s, -1))  # s >= 0: a padded expert is never larger
        tl.debug_barrier()
        s_e = tl.load(digits_ptr + e)
        larger = tl.sum((s_e[:, None] > s_e[None, :]).to(tl.int32), axis=0)
    else:
        num_digits = beta + 2
        carry = tl.zeros([BLOCK_E], tl.int64)
        for i in range(0, beta + 1):
            value = tl.sum(tl.where(bin_id[None, :] == beta - i, counts, 0), axis=1) + carry
            carry = floor_div(value, base)
            tl.store(digits_ptr + e * BLOCK_BINS + i, value - carry * base, mask=e_ok)
        tl.store(digits_ptr + e * BLOCK_BINS + beta + 1, carry, mask=e_ok)
        tl.debug_barrier()
        larger = tl.zeros([BLOCK_E], tl.int32)
        for j0 in range(0, BLOCK_E, CHUNK):
            j = j0 + tl.arange(0, CHUNK)
            j_ok = j < num_experts
            greater = tl.zeros([CHUNK, BLOCK_E], tl.int32)
            equal = tl.zeros([CHUNK, BLOCK_E], tl.int32) + 1
            for k in range(0, num_digits):
                i = num_digits - 1 - k
                d_j = tl.load(digits_ptr + j * BLOCK_BINS + i, mask=j_ok, other=0)
                d_e = tl.load(digits_ptr + e * BLOCK_BINS + i, mask=e_ok, other=0)
                greater = tl.where((equal != 0) & (d_j[:, None] > d_e[None, :]), 1, greater)
                equal = tl.where(d_j[:, None] == d_e[None, :], equal, 0)
            larger += tl.sum(tl.where(j_ok[:, None], greater, 0), axis=0)
    return num_experts - 1 - larger


@triton.jit
def lynx_picks(
    logits_ptr,
    stride_t,
    stride_e,
    first_row,
    end_row,
    n_valid,
    weights_ptr,
    s_rank,
    e,
    e_ok,
    top_k,
    alpha,
    beta,
    HAS_WEIGHTS: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_T: tl.constexpr,
):
    """Union of the LYNX picks of the voting rows in [first_row, end_row): each row's top_k by (bin
    desc, s desc, logit desc, index asc)."""
    picked_any = tl.zeros([BLOCK_E], tl.int32)
    for c in range(first_row, end_row, CHUNK_T):
        rows = c + tl.arange(0, CHUNK_T)
        x, row_ok, _ = load_rows(
            logits_ptr, stride_t, stride_e, rows, rows < end_row, n_valid, e, e_ok, weights_ptr, HAS_WEIGHTS
        )
        depth = lynx_depths(x, alpha, beta)
        open_ = (x > float("-inf")) & row_ok[:, None] & e_ok[None, :]
        # one int64 key per entry, so each pick is one max: (bin desc, s desc) as an integer below
        # (beta + 1) * BLOCK_E <= 2**13 in bits 42 and up, (logit desc, index asc) as a packed key
        # (|key| < 2**41 at any width) offset to non-negative below them; -1 where not open
        coarse = (beta - depth).to(tl.int64) * BLOCK_E + s_rank[None, :].to(tl.int64)
        fine = pack_key(x, e[None, :], open_, KEY_SHIFT).to(tl.int64) + (1 << 41)
        key = tl.where(open_, (coarse << 42) | fine, -1)
        picked = tl.zeros(x.shape, tl.int32)
        for _ in range(0, top_k):
            best = tl.max(key, axis=1)
            chosen = (key == best[:, None]) & (best[:, None] >= 0)
            picked = tl.where(chosen, 1, picked)
            key = tl.where(chosen, -1, key)
        picked_any = tl.maximum(picked_any, tl.max(picked, axis=0))
    return picked_any


@triton.jit
def group_order_key(k1, k2, count, g, HAS_BIAS: tl.constexpr, KEY_SHIFT: tl.constexpr):
    """int64 key of a group's rank in grouped routing (higher first, ties to the lower group): with a
    bias, groups of two or more candidates first, by the sum of their two best values; without, by
    their best value.  ``k1``, ``k2``: the group's best and second-best packed keys; ``count``: its
    candidates; ``MIN_KEY`` for a group without candidates."""
    if HAS_BIAS:
        packed = biased_group_key((k1 >> ID_BITS).to(tl.int32), (k2 >> ID_BITS).to(tl.int32), count, g)
    else:
        primary = tl.minimum(count, 1)
        if KEY_SHIFT == 0:
            order = ordered_bits(key_value(k1) + 0.0).to(tl.int64)
        else:
            order = (k1 >> ID_BITS).to(tl.int64)  # the same order as the value's bits
        packed = (primary.to(tl.int64) << 42) | ((order + (1 << 31)) << ID_BITS) | (1023 - g)
        packed = tl.where(count > 0, packed, MIN_KEY)
    return packed


@triton.jit
def biased_group_key(high1, high2, count, g):
    """:func:`group_order_key` of biased routing from the ordered bits (int32) of the group's best
    and second-best values."""
    first = unordered_value(high1)
    score = tl.where(count >= 2, first + unordered_value(high2), first)
    primary = tl.minimum(count, 2)
    order = ordered_bits(score + 0.0).to(tl.int64)
    packed = (primary.to(tl.int64) << 42) | ((order + (1 << 31)) << ID_BITS) | (1023 - g)
    return tl.where(count > 0, packed, MIN_KEY)


# --------------------------------------------------------------------------- phase C: routing
@triton.jit
def biased_groups_key(high, count, g, AXIS: tl.constexpr):
    """:func:`biased_group_key` of every group, from the ordered bits (int32) of its candidates'
    values (``MIN_KEY32`` elsewhere) laid along ``AXIS``, the last: the best, the count of its ties and
    the best below it, as int32 maxima (a tie at the top makes the second best the best again)."""
    high1 = tl.max(high, axis=AXIS)
    ties = tl.sum((high == tl.expand_dims(high1, AXIS)).to(tl.int32), axis=AXIS)
    below = tl.max(tl.where(high < tl.expand_dims(high1, AXIS), high, MIN_KEY32), axis=AXIS)
    return biased_group_key(high1, tl.where(ties >= 2, high1, below), count, g)


@triton.jit
def half_key_pick(high, low):
    """One pick per row of [rows, n] int64 keys held as halves: ``high`` their value bits (int32,
    ``MIN_KEY32`` where taken or not a candidate), ``low`` their inverted index (distinct in a row).
    Two int32 maxima (one ``REDUX`` each when a row is in one warp); returns the picked key
    (``MIN_KEY`` when none is left) and its index half, [rows] each."""
    best_high = tl.max(high, axis=1)
    best_low = tl.max(tl.where(high == best_high[:, None], low, -1), axis=1)
    best = tl.where(best_high > MIN_KEY32, (best_high.to(tl.int64) << ID_BITS) | best_low, MIN_KEY)
    return best, best_low


@triton.jit
def route_row_by_group_warps(
    logits_ptr,
    stride_t,
    stride_e,
    rows,
    rows_in_block,
    n_valid,
    weights_ptr,
    bias_ptr,
    keep,
    ids_ptr,
    ids_stride,
    out_w_ptr,
    out_w_stride,
    top_k,
    topk_group,
    scale,
    HAS_WEIGHTS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
):
    """:func:`route_block` of one row in biased grouped routing (DeepSeek-V3: 8 groups of 32), with
    each of the program's ``BLOCK_G`` warps holding one group (``GROUP_SIZE`` = 32, a lane per expert).

    One warp per row held 8 experts per lane on E=256: eight software sigmoids and every pick a
    maximum over 8 registers.  Here each lane takes one sigmoid; a group's two best values and its
    own top-k are warp maxima (``REDUX``, no barrier); the group ranking and the row's top-k are
    each one comparison across the warps: the k best keys of the row are among the k best of each
    chosen group, and a key's slot is the number of those candidates above it.

    Exact as :func:`route_block`: the same keys and group ranking; keys are distinct within a row
    (the inverted index is their low bits), so the candidates' counts of keys above them are their
    places in the order of picks.  Returns the experts routed to, [BLOCK_E] int32."""
    g = tl.arange(0, BLOCK_G)
    e2 = g[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]  # [G, S]: a group per warp
    row = tl.max(rows, axis=0)
    row_ok = (tl.max(rows_in_block.to(tl.int32), axis=0) != 0) & (row < n_valid)
    if HAS_WEIGHTS:
        w = tl.load(weights_ptr + row, mask=row_ok, other=0.0).to(tl.float32)
        row_ok = row_ok & (w == w) & (w > 0)  # as load_rows: a row of vote weight 0 is not routed
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_t + e2 * stride_e, mask=row_ok, other=float("-inf"))
    x = sanitize_logits(x)
    candidates = (x > float("-inf")) & (tl.reshape(keep, [BLOCK_G, GROUP_SIZE]) != 0)
    bias = load_bias(bias_ptr, e2, e2 >= 0)
    score_bits = sigmoid32(x).to(tl.int32, bitcast=True)  # a sigmoid's bits order as its value
    key = pack_key(score_bits.to(tl.float32, bitcast=True) + bias, e2, candidates, 0)
    # the int64 keys as (value bits, inverted index) halves: each maximum is two int32 warp maxima
    high = tl.where(candidates, (key >> ID_BITS).to(tl.int32), MIN_KEY32)
    low = (key & ID_MASK).to(tl.int32)
    # rank the groups (group_order_key): each group's two best values and its candidates, in its warp
    group_key = biased_groups_key(high, tl.sum(candidates.to(tl.int32), axis=1), g, 1)
    above = tl.sum((group_key[None, :] > group_key[:, None]).to(tl.int32), axis=1)
    chosen = (above < topk_group)[:, None]
    high = tl.where(chosen, high, MIN_KEY32)
    # each group's top-k in its warp: the key and the sigmoid's bits of every pick
    slot = tl.arange(0, BLOCK_K)
    group_keys = tl.zeros([BLOCK_G, BLOCK_K], tl.int64) + MIN_KEY
    group_bits = tl.zeros([BLOCK_G, BLOCK_K], tl.int32)
    for i in range(0, top_k):
        best, best_low = half_key_pick(high, low)
        bits = tl.max(tl.where(low == best_low[:, None], score_bits, 0), axis=1)
        group_keys = tl.where(slot[None, :] == i, best[:, None], group_keys)
        group_bits = tl.where(slot[None, :] == i, bits[:, None], group_bits)
        high = tl.where(low == best_low[:, None], MIN_KEY32, high)
    # the row's top-k among the groups' picks, in every warp on its own copy of them: two [G, SUB]
    # halves, a row per warp (SUB = G * K / 2 <= 32 lanes, see group_warp_routing)
    SUB: tl.constexpr = BLOCK_G * BLOCK_K // 2
    keys_a, keys_b = warp_halves(tl.reshape(group_keys, [2 * SUB]), SUB, BLOCK_G)
    bits_a, bits_b = warp_halves(tl.reshape(group_bits, [2 * SUB]), SUB, BLOCK_G)
    high_a = tl.where(keys_a > MIN_KEY, (keys_a >> ID_BITS).to(tl.int32), MIN_KEY32)
    high_b = tl.where(keys_b > MIN_KEY, (keys_b >> ID_BITS).to(tl.int32), MIN_KEY32)
    low_a = (keys_a & ID_MASK).to(tl.int32)
    low_b = (keys_b & ID_MASK).to(tl.int32)
    # the picks in the halves' layout (slot i in column i): no conversion inside the loop
    col = tl.arange(0, SUB)[None, :] + tl.zeros([BLOCK_G, 1], tl.int32)
    pick_key = tl.zeros([BLOCK_G, SUB], tl.int64) + MIN_KEY
    pick_bits = tl.zeros([BLOCK_G, SUB], tl.int32)
    for i in range(0, top_k):
        best_high = warp_max(high_a, high_b)
        best_low = warp_max(tl.where(high_a == best_high, low_a, -1), tl.where(high_b == best_high, low_b, -1))
        at_a = (low_a == best_low) & (high_a > MIN_KEY32)
        at_b = (low_b == best_low) & (high_b > MIN_KEY32)
        bits = warp_max(tl.where(at_a, bits_a, 0), tl.where(at_b, bits_b, 0))
        best = tl.where(best_high > MIN_KEY32, (best_high.to(tl.int64) << ID_BITS) | best_low, MIN_KEY)
        pick_key = tl.where(col == i, best, pick_key)
        pick_bits = tl.where(col == i, bits, pick_bits)
        high_a = tl.where(at_a, MIN_KEY32, high_a)
        high_b = tl.where(at_b, MIN_KEY32, high_b)
    # every warp holds the same picks and stores them (the same values to the same addresses)
    slot = col
    slot_ok = slot < top_k
    got = (pick_key > MIN_KEY) & slot_ok
    ids = tl.where(got, key_expert(pick_key), -1)
    wts = tl.where(got, pick_bits.to(tl.float32, bitcast=True), 0.0)
    if RENORMALIZE:
        denominator = tl.sum(wts, axis=1)[:, None]
        wts = tl.where(denominator > 0, wts / tl.where(denominator > 0, denominator, 1.0), 0.0)
    if HAS_SCALE:
        wts = wts * scale
    wts = tl.where(got, wts, 0.0)
    out_ok = (tl.max(rows_in_block.to(tl.int32), axis=0) != 0) & slot_ok
    tl.store(ids_ptr + row.to(tl.int64) * ids_stride + slot, ids, mask=out_ok)
    tl.store(out_w_ptr + row.to(tl.int64) * out_w_stride + slot, wts, mask=out_ok)
    # the picks are the candidates at or above the last one (every candidate when fewer than top_k)
    last = tl.min(tl.where(slot_ok, pick_key, 2**62), axis=1)[:, None]
    routed = (key > MIN_KEY) & chosen & (key >= last)
    return tl.reshape(routed.to(tl.int32), [BLOCK_E])


@triton.jit
def route_block(
    logits_ptr,
    stride_t,
    stride_e,
    rows,
    rows_in_block,
    n_valid,
    weights_ptr,
    bias_ptr,
    keep,
    e,
    e_ok,
    ids_ptr,
    ids_stride,
    out_w_ptr,
    out_w_stride,
    top_k,
    topk_group,
    group_size,
    num_groups,
    scale,
    HAS_WEIGHTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TRUNCATION: tl.constexpr,
    GROUPED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FILL: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    ROW_WARPS: tl.constexpr,
    GROUP_WARPS: tl.constexpr,
):
    """Route a block of rows inside ``keep`` and store ids/weights; returns the experts routed to.

    ``ROW_WARPS``: one warp holds each row of the block (as many warps as rows), where a maximum of
    int32 values is one warp-wide instruction; int64 keys then take each pick as two int32 maxima
    (the value half, then the index half among its ties) rather than one int64 shuffle tree.
    ``GROUP_WARPS``: one row of biased grouped routing, a warp per group
    (:func:`route_row_by_group_warps`)."""
    if GROUP_WARPS:
        return route_row_by_group_warps(
            logits_ptr,
            stride_t,
            stride_e,
            rows,
            rows_in_block,
            n_valid,
            weights_ptr,
            bias_ptr,
            keep,
            ids_ptr,
            ids_stride,
            out_w_ptr,
            out_w_stride,
            top_k,
            topk_group,
            scale,
            HAS_WEIGHTS,
            RENORMALIZE,
            HAS_SCALE,
            BLOCK_E,
            BLOCK_K,
            BLOCK_G,
            GROUP_SIZE,
        )
    x, _, _ = load_rows(logits_ptr, stride_t, stride_e, rows, rows_in_block, n_valid, e, e_ok, weights_ptr, HAS_WEIGHTS)
    finite = (x > float("-inf")) & e_ok[None, :]
    if TRUNCATION:
        candidates = finite
    else:
        candidates = finite & keep[None, :]
    if HAS_BIAS:
        bias = load_bias(bias_ptr, e, e_ok)
        score = sigmoid32(x)
        value = score + bias[None, :]
        # a sigmoid is >= 0, so its bits as an int32 order as its value: on a warp per row each pick's
        # weight is read off the row with the pick (one more REDUX, off the picks' dependency chain)
        # instead of reloading the picked logits from memory after the picks
        score_bits = score.to(tl.int32, bitcast=True)
    else:
        value = x
    key = pack_key(value, e[None, :], candidates, KEY_SHIFT)
    lowest = lowest_key(KEY_SHIFT)
    if GROUPED:
        # rank the groups that hold a candidate; keep the best topk_group of them
        g_col = tl.arange(0, BLOCK_G)
        if GROUP_SIZE > 0:
            # E = BLOCK_G * GROUP_SIZE: every group at once, as the last axis of a [rows, G, size] view
            key3 = tl.reshape(key, [x.shape[0], BLOCK_G, GROUP_SIZE])
            cand3 = tl.reshape(candidates, [x.shape[0], BLOCK_G, GROUP_SIZE])
            count = tl.sum(cand3.to(tl.int32), axis=2)
            if HAS_BIAS:
                # the two best values of each group from the int64 keys' value halves, as int32
                # maxima: the second best is the best again when two candidates share that value
                high3 = tl.where(cand3, (key3 >> ID_BITS).to(tl.int32), MIN_KEY32)
                group_key = biased_groups_key(high3, count, g_col[None, :], 2)
            else:
                k1 = tl.max(tl.where(cand3, key3, lowest), axis=2)
                group_key = group_order_key(k1, k1, count, g_col[None, :], HAS_BIAS, KEY_SHIFT)
        else:
            group_of = e // group_size
            group_key = tl.zeros([x.shape[0], BLOCK_G], tl.int64) + MIN_KEY
            for g in range(0, num_groups):
                in_group = (group_of == g)[None, :] & candidates
                k1 = tl.max(tl.where(in_group, key, lowest), axis=1)
                count = tl.sum(in_group.to(tl.int32), axis=1)
                if HAS_BIAS:
                    k2 = tl.max(tl.where(in_group & (key != k1[:, None]), key, MIN_KEY), axis=1)
                else:
                    k2 = k1
                packed = group_order_key(k1, k2, count, g, HAS_BIAS, KEY_SHIFT)
                group_key = tl.where(g_col[None, :] == g, packed[:, None], group_key)
        # the best topk_group groups: those with fewer than topk_group keys above their own (one
        # [G, G] comparison, not topk_group maxima in a row).  Keys of groups with candidates are
        # distinct; a group without any (MIN_KEY) may count as chosen, and adds no candidate
        above = tl.sum((group_key[:, None, :] > group_key[:, :, None]).to(tl.int32), axis=2)
        chosen_groups = (above < topk_group).to(tl.int32)
        if GROUP_SIZE > 0:
            in_chosen = tl.reshape(
                tl.broadcast_to(chosen_groups[:, :, None], [x.shape[0], BLOCK_G, GROUP_SIZE]),
                [x.shape[0], BLOCK_E],
            )
        else:
            in_chosen = tl.zeros(x.shape, tl.int32)
            for g in range(0, BLOCK_G):
                flag = tl.sum(tl.where(g_col[None, :] == g, chosen_groups, 0), axis=1)
                in_chosen = tl.where((group_of == g)[None, :] & (flag[:, None] != 0), 1, in_chosen)
        key = tl.where(in_chosen != 0, key, lowest)
    # the top_k rounds take only the row maxima: one reduction per pick.  Each pick's expert, weight
    # and kept flag are read off after the rounds with one gather per row (not one sum per pick)
    slot = tl.arange(0, BLOCK_K)
    pick_key = tl.zeros([x.shape[0], BLOCK_K], key.dtype) + lowest
    pick_score_bits = tl.zeros([x.shape[0], BLOCK_K], tl.int32)
    best = tl.zeros([x.shape[0]], key.dtype) + lowest
    if KEY_SHIFT == 0 and ROW_WARPS:
        # (value bits, inverted index) halves of the int64 keys; candidates' value bits are above
        # MIN_KEY32 (ordered bits of finite values), and the index half is distinct within a row
        high = tl.where(key > lowest, (key >> ID_BITS).to(tl.int32), MIN_KEY32)
        low = (key & ID_MASK).to(tl.int32)
        for i in range(0, top_k):
            best, best_low = half_key_pick(high, low)  # lowest is MIN_KEY (int64 keys)
            pick_key = tl.where(slot[None, :] == i, best[:, None], pick_key)
            if HAS_BIAS:
                bits = tl.max(tl.where(low == best_low[:, None], score_bits, 0), axis=1)
                pick_score_bits = tl.where(slot[None, :] == i, bits[:, None], pick_score_bits)
            high = tl.where(low == best_low[:, None], MIN_KEY32, high)
    else:
        work = key
        for i in range(0, top_k):
            best = tl.max(work, axis=1)
            pick_key = tl.where(slot[None, :] == i, best[:, None], pick_key)
            work = tl.where(work == best[:, None], lowest, work)
    got = pick_key > lowest
    pick_e = tl.where(got, key_expert(pick_key), 0)
    # keys are distinct within a row, so the picks are the candidates at or above the last pick's key
    # (every candidate when the row had fewer than top_k)
    picked = ((key > lowest) & (key >= best[:, None])).to(tl.int32)
    if TRUNCATION:
        kept_pick = got & (tl.gather(tl.broadcast_to(keep[None, :], x.shape).to(tl.int32), pick_e, 1) != 0)
        picked = tl.where(keep[None, :], picked, 0)
    else:
        kept_pick = got
    ids = tl.where(kept_pick, pick_e, -1)
    # raw weights of the picks: softmax terms over the candidates, or sigmoids.  Keys of biased scores
    # (a bias implies sigmoid scoring) do not hold the logit: on a warp per row the picks' sigmoids
    # were taken with the picks; a row over several warps reloads the picked logits (one round trip
    # for all picks, where a maximum per pick would cost a block barrier each).  Other keys give
    # the picked logit back.  The weight of a raw +inf is that of its sanitized FP32_MAX (1.0)
    if HAS_BIAS and KEY_SHIFT == 0 and ROW_WARPS:
        wts = pick_score_bits.to(tl.float32, bitcast=True)
        denominator = tl.zeros([x.shape[0]], tl.float32) + 1.0
    elif SIGMOID:
        if HAS_BIAS:
            x_pick = tl.load(
                logits_ptr + rows.to(tl.int64)[:, None] * stride_t + pick_e * stride_e,
                mask=got & rows_in_block[:, None],
                other=float("-inf"),
            ).to(tl.float32)
        else:
            x_pick = key_logit(pick_key, KEY_SHIFT)
        wts = 1.0 / (1.0 + tl.exp(-x_pick))
        denominator = tl.zeros([x.shape[0]], tl.float32) + 1.0
    else:
        top = tl.max(tl.where(candidates, x, float("-inf")), axis=1)
        top = tl.where(top > float("-inf"), top, 0.0)
        wts = tl.exp(key_logit(pick_key, KEY_SHIFT) - top[:, None])
        if not RENORMALIZE:
            denominator = tl.sum(tl.where(candidates, tl.exp(x - top[:, None]), 0.0), axis=1)
    wts = tl.where(got, wts, 0.0)
    if RENORMALIZE:
        denominator = tl.sum(wts, axis=1)
    # routing weights: a plain (approximate) division, within the stated tolerance of the reference
    # (correctly rounded divisions here made a T=1 call 2.3 us slower on an H200)
    wts = tl.where(denominator[:, None] > 0, wts / tl.where(denominator > 0, denominator, 1.0)[:, None], 0.0)
    if HAS_SCALE:
        wts = wts * scale
    wts = tl.where(ids >= 0, wts, 0.0)
    slot_ok = slot < top_k
    if FILL:
        # the j-th dropped slot of a row takes the row's j-th free expert: kept ones first, then pruned
        drop = (ids < 0) & slot_ok[None, :]
        free = (picked == 0) & e_ok[None, :]
        kept_free = free & keep[None, :]
        pruned_free = free & (~keep[None, :])
        num_kept_free = tl.sum(kept_free.to(tl.int32), axis=1)
        place = tl.where(
            keep[None, :],
            tl.cumsum(kept_free.to(tl.int32), axis=1),
            num_kept_free[:, None] + tl.cumsum(pruned_free.to(tl.int32), axis=1),
        )
        # running count of dropped slots, as a sum over slots i <= j rather than tl.cumsum: Triton 3.6
        # cannot lower a scan over this narrow [rows, BLOCK_K] tile (an assertion in ScanOpToLLVM)
        slot_le = slot[:, None] <= slot[None, :]
        wanted = tl.sum(tl.where(slot_le[None, :, :] & drop[:, :, None], 1, 0), axis=1)
        match = (place[:, None, :] == wanted[:, :, None]) & free[:, None, :] & drop[:, :, None]
        filler = tl.sum(tl.where(match, e[None, None, :], 0), axis=2)
        ids = tl.where(drop, filler, ids)
        picked = tl.maximum(picked, tl.max(match.to(tl.int32), axis=1))
    out_ok = rows_in_block[:, None] & slot_ok[None, :]
    row64 = rows.to(tl.int64)[:, None]
    tl.store(ids_ptr + row64 * ids_stride + slot[None, :], ids, mask=out_ok)
    tl.store(out_w_ptr + row64 * out_w_stride + slot[None, :], wts, mask=out_ok)
    return tl.max(tl.where(rows_in_block[:, None], picked, 0), axis=0)


# --------------------------------------------------------------------------- kernels
@triton.jit
def add_metric(ptr, value):
    """Add ``value`` (an integer) to one int64 metric: a relaxed atomic nobody waits for (see finish_keep)."""
    tl.atomic_add(ptr, tl.zeros([], tl.int64) + value, sem="relaxed")


@triton.jit
def metrics_on(gate_ptr, GATED: tl.constexpr):
    """Whether this call adds its metrics: with ``GATED``, the caller's device gate (an int32, nonzero:
    add them), read by every program, so every program of every kernel of the call takes the same
    branch; without, always.  (A constant true branch compiles away.)"""
    if GATED:
        return tl.load(gate_ptr) != 0
    else:
        return tl.full([], 1, tl.int1)


@triton.jit
def warp_halves(x, SUB: tl.constexpr, WARPS: tl.constexpr):
    """A [2 * SUB] vector as two [WARPS, SUB] tiles (experts [0, SUB) and [SUB, 2 * SUB)), each row a
    copy: the picks below hold one copy per warp."""
    low, high = tl.split(tl.permute(tl.reshape(x, [2, SUB]), (1, 0)))
    return tl.broadcast_to(low[None, :], [WARPS, SUB]), tl.broadcast_to(high[None, :], [WARPS, SUB])


@triton.jit
def warp_max(a, b):
    """Each row's maximum over two [rows, SUB] tiles, as [rows, 1]: a row sits in one warp, so no
    barrier (int32: one ``REDUX`` per tile on sm_90)."""
    return tl.maximum(tl.max(a, axis=1), tl.max(b, axis=1))[:, None]


@triton.jit
def warp_key_max(key_a, key_b):
    """Each row's maximum of two [rows, SUB] tiles of int64 keys in [0, 2**62), as [rows, 1]: two int32
    maxima, the bits from 31 up, then the low 31 bits among the keys holding that high part."""
    high_a = (key_a >> 31).to(tl.int32)
    high_b = (key_b >> 31).to(tl.int32)
    best_high = warp_max(high_a, high_b)
    low_a = tl.where(high_a == best_high, (key_a & 0x7FFFFFFF).to(tl.int32), -1)
    low_b = tl.where(high_b == best_high, (key_b & 0x7FFFFFFF).to(tl.int32), -1)
    return (best_high.to(tl.int64) << 31) | warp_max(low_a, low_b)


@triton.jit
def coact_picks(agg, count, redundancy_ptr, num_experts, BLOCK_E: tl.constexpr, WARPS: tl.constexpr):
    """The co-activation greedy's picks up to 4096 tokens, then the rest of ``count`` in index order
    ([BLOCK_E] int32, 1 per kept expert), with no barrier per pick.

    Every warp holds all the gains, as two [WARPS, SUB] tiles of copies (a row per warp), takes each
    pick on its own and loads the picked redundancy row itself: a pick is two int32 warp maxima
    (:func:`warp_key_max`) and one load, never a block reduction.  The tiles are 2-D with the experts
    on the contiguous axis, so the row load lays each row in one warp whatever the compiler's order
    among other axes (int32 rows: up to 128 experts a row, so up to 256 experts).

    Exact as the greedy: a gain is below 2**52 (agg <= T * 2**24 <= 2**36, the factor <= 2**16), so
    ``gain << 10 | (1023 - e)`` is a key below 2**62 whose maximum is the largest gain at its first
    index.  A pick is made only while the best gain is positive (gains never grow, so once none is,
    none will be); at most ``min(count, experts with an aggregate)`` steps, as only those can gain.
    The rest are the free experts of the lowest indices, by a running count in each warp."""
    SUB: tl.constexpr = BLOCK_E // 2
    e_a = tl.arange(0, SUB)[None, :] + tl.zeros([WARPS, 1], tl.int32)
    e_b = e_a + SUB
    ok_a = e_a < num_experts
    ok_b = e_b < num_experts
    agg_a, agg_b = warp_halves(agg, SUB, WARPS)
    chosen_a = tl.zeros([WARPS, SUB], tl.int32)
    chosen_b = tl.zeros([WARPS, SUB], tl.int32)
    discount_a = tl.zeros([WARPS, SUB], tl.int32)
    discount_b = tl.zeros([WARPS, SUB], tl.int32)
    steps = tl.minimum(tl.sum((agg > 0).to(tl.int32), axis=0), count)
    for _ in range(0, steps):
        gain_a = agg_a * (REDUNDANCY_ONE - discount_a)  # int64: agg is
        gain_b = agg_b * (REDUNDANCY_ONE - discount_b)
        best = warp_key_max(
            tl.where(ok_a & (chosen_a == 0), (gain_a << 10) | (1023 - e_a), 0),
            tl.where(ok_b & (chosen_b == 0), (gain_b << 10) | (1023 - e_b), 0),
        )
        live = best >= 1024  # a positive gain
        first = tl.where(live, 1023 - (best & 1023), -1).to(tl.int32)
        chosen_a = tl.where(e_a == first, 1, chosen_a)
        chosen_b = tl.where(e_b == first, 1, chosen_b)
        row = redundancy_ptr + first * num_experts
        discount_a = tl.maximum(discount_a, tl.load(row + e_a, mask=ok_a & live, other=0))
        discount_b = tl.maximum(discount_b, tl.load(row + e_b, mask=ok_b & live, other=0))
    # the rest of the budget in index order: the free experts whose place among the free ones is
    # below what is left
    free_a = (ok_a & (chosen_a == 0)).to(tl.int32)
    free_b = (ok_b & (chosen_b == 0)).to(tl.int32)
    rest = count - tl.sum(chosen_a, axis=1)[:, None] - tl.sum(chosen_b, axis=1)[:, None]
    place_a = tl.cumsum(free_a, axis=1)
    place_b = tl.cumsum(free_b, axis=1) + tl.sum(free_a, axis=1)[:, None]
    chosen_a = tl.where((free_a != 0) & (place_a <= rest), 1, chosen_a)
    chosen_b = tl.where((free_b != 0) & (place_b <= rest), 1, chosen_b)
    # the copies are equal: one of them, the halves joined
    return tl.reshape(tl.permute(tl.join(tl.max(chosen_a, axis=0), tl.max(chosen_b, axis=0)), (1, 0)), [BLOCK_E])


@triton.jit
def coverage_pair_picks(
    tie,
    picks,
    cover_agg_ptr,
    cover_pairs_ptr,
    num_experts,
    BLOCK_E: tl.constexpr,
    WARPS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
):
    """The coverage greedy's picks from the pair sums, then the rest of ``picks`` in the order (agg
    desc, index asc) ([BLOCK_E] int32, 1 per kept expert), with no barrier per pick: as
    :func:`coact_picks`, two [WARPS, SUB] tiles of copies of the gains (int64 rows: up to 64 experts
    a row, so up to 128 experts), each pick two int32 warp maxima and one load of the picked row of
    pair sums in each warp.

    Before any pick every row is uncovered: a gain is COVER_ONE times the column sum; keeping an
    expert takes its row of C (the pair sums) off every gain.  Each pick is the maximum of
    ``gain << 20 | (1023 - tie) << 10 | e``, with ``tie`` the expert's place in the order (agg desc,
    index asc): gains stay below 2**42 (at most 1024 tokens of 2**32 each), places and ids below
    1024, so the key is below 2**62.  A pick is made while the best gain is positive (gains never
    grow); at most ``min(picks, experts with a positive column sum)`` steps.  The rest are the free
    experts of the smallest places: the smallest bound with ``rest`` free experts below it (places
    are distinct), by bisection."""
    SUB: tl.constexpr = BLOCK_E // 2
    e_a = tl.arange(0, SUB)[None, :] + tl.zeros([WARPS, 1], tl.int32)
    e_b = e_a + SUB
    ok_a = e_a < num_experts
    ok_b = e_b < num_experts
    gain_a = tl.load(cover_agg_ptr + e_a, mask=ok_a, other=0, cache_modifier=".cg") << COVER_BITS
    gain_b = tl.load(cover_agg_ptr + e_b, mask=ok_b, other=0, cache_modifier=".cg") << COVER_BITS
    tie_a, tie_b = warp_halves(tie, SUB, WARPS)
    low_a = (((1023 - tie_a) << 10) | e_a).to(tl.int64)
    low_b = (((1023 - tie_b) << 10) | e_b).to(tl.int64)
    chosen_a = tl.zeros([WARPS, SUB], tl.int32)
    chosen_b = tl.zeros([WARPS, SUB], tl.int32)
    gaining = tl.sum((gain_a > 0).to(tl.int32), axis=1) + tl.sum((gain_b > 0).to(tl.int32), axis=1)
    steps = tl.minimum(tl.max(gaining, axis=0), picks)
    for _ in range(0, steps):
        best = warp_key_max(
            tl.where(ok_a & (chosen_a == 0), (gain_a << 20) | low_a, 0),
            tl.where(ok_b & (chosen_b == 0), (gain_b << 20) | low_b, 0),
        )
        live = best >= (1 << 20)  # a positive gain
        first = tl.where(live, best & 1023, -1).to(tl.int32)
        chosen_a = tl.where(e_a == first, 1, chosen_a)
        chosen_b = tl.where(e_b == first, 1, chosen_b)
        row = cover_pairs_ptr + first.to(tl.int64) * num_experts
        gain_a -= tl.load(row + e_a, mask=ok_a & live, other=0, cache_modifier=".cg")
        gain_b -= tl.load(row + e_b, mask=ok_b & live, other=0, cache_modifier=".cg")
    free_a = ok_a & (chosen_a == 0)
    free_b = ok_b & (chosen_b == 0)
    rest = picks - tl.sum(chosen_a, axis=1)[:, None] - tl.sum(chosen_b, axis=1)[:, None]
    lo = tl.zeros([WARPS, 1], tl.int32)
    hi = tl.zeros([WARPS, 1], tl.int32) + BLOCK_E
    for _ in tl.static_range(0, SEARCH_STEPS):
        mid = (lo + hi) // 2
        below = tl.sum((free_a & (tie_a < mid)).to(tl.int32), axis=1) + tl.sum(
            (free_b & (tie_b < mid)).to(tl.int32), axis=1
        )
        enough = below[:, None] >= rest
        hi = tl.where(enough, mid, hi)
        lo = tl.where(enough, lo, mid + 1)
    chosen_a = tl.where(free_a & (tie_a < hi), 1, chosen_a)
    chosen_b = tl.where(free_b & (tie_b < hi), 1, chosen_b)
    # the copies are equal: one of them, the halves joined
    return tl.reshape(tl.permute(tl.join(tl.max(chosen_a, axis=0), tl.max(chosen_b, axis=0)), (1, 0)), [BLOCK_E])


@triton.jit
def finish_keep(
    keep,
    warm_b,
    agg,
    e,
    e_ok,
    n_valid,
    cap,
    min_tokens,
    max_tokens,
    keep_ptr,
    metrics_ptr,
    collect,
    stats_ptr,
    HAS_CAP: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    HAS_METRICS: tl.constexpr,
    HAS_STATS: tl.constexpr,
    NEED_SCORES: tl.constexpr,
    ROUTE_MASS: tl.constexpr,
):
    """The end of every set rule: the ``max_experts`` cap (warm-up experts first, then by aggregate),
    the token range, then store the mask, the score stats and the per-call metrics.  Returns keep.

    The metrics are added with relaxed atomics whose result is unused (``RED`` on sm_90): the GPU
    queues them without waiting, where a load-add-store waited a memory round trip per column and
    held back every load after it (the routing's logits in a one-program call).  Without scores
    (policy ``none``, every expert kept) the retained mass is whole.  With ``ROUTE_MASS`` the routing
    kernel adds the retained mass (``route_mass``), and this adds the other two columns.  ``collect``:
    this call adds its metrics (:func:`metrics_on`)."""
    if HAS_CAP:
        # the [E, E] order only when the cap binds
        if tl.sum((keep & e_ok).to(tl.int32), axis=0) > cap:
            cap_key = warm_b.to(tl.int64) * WARM_FIRST + agg
            place = places(cap_key, keep, e, e_ok, e, False)
            keep = keep & (place < cap)
    if HAS_RANGE:
        in_range = (n_valid >= min_tokens) & (n_valid <= max_tokens)
        keep = tl.where(in_range, keep, e_ok)
    keep = keep & e_ok
    tl.store(keep_ptr + e, keep, mask=e_ok)
    if HAS_STATS:
        tl.store(stats_ptr, tl.sum(tl.where(keep, agg, 0), axis=0))
        tl.store(stats_ptr + 1, tl.sum(agg, axis=0))
    if HAS_METRICS:
        if collect:
            if NEED_SCORES and not ROUTE_MASS:
                total = tl.sum(agg, axis=0)
                # the kept mass and the kept count in one sum: agg << 10 | 1 per kept expert (aggregates
                # stay below 2**53 and at most 512 experts are kept, as the set rules' order keys assume)
                kept_packed = tl.sum(tl.where(keep, (agg << 10) + 1, 0), axis=0)
                kept_count = kept_packed & 1023
                retained = retained_share(kept_packed >> 10, total)
            else:
                kept_count = tl.sum(keep.to(tl.int32), axis=0)
                retained = tl.full([], 1 << 24, tl.int64)
            add_metric(metrics_ptr + 1, kept_count)
            if not ROUTE_MASS:
                add_metric(metrics_ptr + 2, retained)
            add_metric(metrics_ptr + 3, 1)
    return keep


@triton.jit
def retained_share(kept_total, total):
    """policies.rewrite.selection_metrics' retained mass: ``floor(float32(kept_total) /
    float32(total) * 2**24)``, a full ``2**24`` when the total is 0 (int64 scalars in and out)."""
    # correctly rounded, as the reference divides (a plain / compiles to an approximate division)
    ratio = tl.math.div_rn(kept_total.to(tl.float32), tl.where(total > 0, total, 1).to(tl.float32))
    return tl.where(total > 0, tl.floor(ratio * SCORE_ONE).to(tl.int64), 1 << 24)


@triton.jit
def route_mass(
    logits_ptr,
    stride_t,
    stride_e,
    rows,
    rows_in_block,
    n_valid,
    weights_ptr,
    keep,
    e,
    e_ok,
    top_k,
    HAS_WEIGHTS: tl.constexpr,
    SCORE_TOPK: tl.constexpr,
    SIGMOID: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
):
    """The kept and the total score mass of a routing tile's voting rows (int64 scalars): the
    selection's aggregate of these rows, summed over the kept experts and over all of them.

    For the rules that need no scores (``oea``, static moe-spec, LYNX) the selection computed the
    scores above one program only for the retained-mass metric, on the call's critical path (scores,
    E atomics, the ticket, the last program's loads and sums); the routing programs hold their rows
    and the final mask, so each adds two sums instead.  Exact: the same integer terms as the
    selection's aggregate, summed in another order."""
    x, _voting, wq = load_rows(
        logits_ptr, stride_t, stride_e, rows, rows_in_block, n_valid, e, e_ok, weights_ptr, HAS_WEIGHTS
    )
    candidate = (x > float("-inf")) & e_ok[None, :]
    if SCORE_TOPK:
        member = row_ranks(pack_key(x, e[None, :], candidate, KEY_SHIFT), top_k, KEY_SHIFT) < top_k
    else:
        member = candidate
    # (a row that does not vote reads as -inf: no member, every score 0)
    q = fixed_scores(x, member, wq, SIGMOID, SCORE_TOPK, HAS_WEIGHTS)
    return tl.sum(tl.sum(tl.where(keep[None, :], q, 0), axis=1), axis=0), tl.sum(tl.sum(q, axis=1), axis=0)


@triton.jit
def select_kernel(
    logits_ptr,
    stride_t,
    stride_e,
    num_tokens,
    num_experts,
    n_valid_ptr,
    n_valid_arg,
    weights_ptr,
    rows_per_program,
    rows_per_request,
    # policy
    k0,
    top_k,
    request_budget,
    count,
    tau_q,
    rank_budget,
    cap,
    min_tokens,
    max_tokens,
    alpha,
    beta,
    static_ptr,
    redundancy_ptr,
    group_ptr,
    # workspace
    row_scores_ptr,
    cover_rows_ptr,
    cover_count_ptr,
    cover_capacity,
    cover_agg_ptr,
    cover_pairs_ptr,
    agg_acc_ptr,
    warm_acc_ptr,
    base_acc_ptr,
    counts_acc_ptr,
    digits_ptr,
    s_rank_ptr,
    ticket_ptr,
    # outputs
    keep_ptr,
    metrics_ptr,
    metrics_gate_ptr,
    stats_ptr,
    # routing (SINGLE and ROUTE only)
    bias_ptr,
    ids_ptr,
    ids_stride,
    out_w_ptr,
    out_w_stride,
    route_top_k,
    topk_group,
    group_size,
    num_groups,
    scale,
    HAS_NV_PTR: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    MODE: tl.constexpr,
    NEED_SCORES: tl.constexpr,
    SCORE_TOPK: tl.constexpr,
    SIGMOID: tl.constexpr,
    PER_REQUEST: tl.constexpr,
    REQUEST_TOP: tl.constexpr,
    LYNX: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    HAS_METRICS: tl.constexpr,
    GATED: tl.constexpr,
    METRIC_SCORES: tl.constexpr,
    HAS_STATS: tl.constexpr,
    ROUTE_MASS: tl.constexpr,
    SINGLE: tl.constexpr,
    ROUTE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TRUNCATION: tl.constexpr,
    GROUPED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FILL: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_BINS: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CHUNK_T: tl.constexpr,
    CHUNK: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    COVER_T: tl.constexpr,
    COVER_LISTS: tl.constexpr,
    COVER_PAIRS: tl.constexpr,
    COACT_KEYS: tl.constexpr,
    ROUTE_T: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    ROUTE_KEY_SHIFT: tl.constexpr,
    ROW_WARPS: tl.constexpr,
    GROUP_WARPS: tl.constexpr,
    PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
    ORDER: tl.constexpr,
    WARPS: tl.constexpr,
    WARP_PICKS: tl.constexpr,
):
    if PDL:
        gdc_wait()  # launched as a programmatic dependent: the kernel before has finished, its writes seen
    if PDL_TRIGGER:
        gdc_launch_dependents()  # the call's next kernel may launch now; it waits for this one to finish
    pid = tl.program_id(0)
    num_parts = tl.num_programs(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)
    collect = metrics_on(metrics_gate_ptr, GATED)
    # scores wanted: always when the rule, its cap or the stats read them; when only the metrics do
    # (METRIC_SCORES: oea, static moe-spec and LYNX in one program), only in calls that add metrics
    if METRIC_SCORES:
        scoring = collect
    else:
        scoring = tl.full([], 1, tl.int1)

    agg = tl.zeros([BLOCK_E], tl.int64)
    cover_agg = tl.zeros([BLOCK_E], tl.int64)  # the coverage greedy's column sums, on its grid
    warm = tl.zeros([BLOCK_E], tl.int32)
    base = tl.zeros([BLOCK_E], tl.int32)
    counts = tl.zeros([BLOCK_E, BLOCK_BINS], tl.int32)
    # phase A: this program's rows (requests of rows_per_request rows never straddle programs):
    # aggregates, warm-up set, per-request sets, LYNX bin counts
    first_row = pid * rows_per_program
    num_rows = tl.minimum(rows_per_program, tl.maximum(num_tokens - first_row, 0))
    # every rule but none and static moe-spec reads the rows; those two only for aggregates (metrics)
    # (the wrapper passes k0 = 0 and no per-request or LYNX work for them)
    if (MODE != MODE_ALL and MODE != MODE_STATIC) or NEED_SCORES:
        if NEED_SCORES and SCORE_TOPK:
            n_iter = tl.where(scoring, tl.maximum(top_k, k0), k0)
        else:
            n_iter = k0
        if MODE == MODE_ALL or MODE == MODE_STATIC:
            rows_read = tl.where(scoring, num_rows, 0)  # the rows hold nothing else for these rules
        else:
            rows_read = num_rows
        bin_id = tl.arange(0, BLOCK_BINS)
        for r0 in range(0, rows_read, rows_per_request):
            agg_r = tl.zeros([BLOCK_E], tl.int64)
            warm_r = tl.zeros([BLOCK_E], tl.int32)
            votes_r = tl.zeros([], tl.int32)
            for c in range(0, rows_per_request, CHUNK_T):
                offs = r0 + c + tl.arange(0, CHUNK_T)
                in_block = (offs < num_rows) & (offs < r0 + rows_per_request)
                rows = first_row + offs
                x, row_ok, wq = load_rows(
                    logits_ptr, stride_t, stride_e, rows, in_block, n_valid, e, e_ok, weights_ptr, HAS_WEIGHTS
                )
                votes_r += tl.sum(row_ok.to(tl.int32), axis=0)
                if LYNX:
                    counts += lynx_bin_counts(x, row_ok, e, alpha, beta, CHUNK_T, BLOCK_E, BLOCK_BINS)
                candidate = (x > float("-inf")) & e_ok[None, :]
                key = pack_key(x, e[None, :], candidate, KEY_SHIFT)
                rank = row_ranks(key, n_iter, KEY_SHIFT)
                warm_rows = (rank < k0) & row_ok[:, None]
                warm_r = tl.maximum(warm_r, tl.max(warm_rows.to(tl.int32), axis=0))
                if NEED_SCORES:
                    if scoring:
                        if SCORE_TOPK:
                            member = rank < top_k
                        else:
                            member = candidate
                        q = fixed_scores(x, member, wq, SIGMOID, SCORE_TOPK, HAS_WEIGHTS)
                        agg_r += tl.sum(tl.where(row_ok[:, None], q, 0), axis=0)
                        if MODE == MODE_COVERAGE and not SINGLE:
                            cover_agg += tl.sum(tl.where(row_ok[:, None], q, 0) >> (SCORE_BITS - COVER_BITS), axis=0)
                        if MODE == MODE_COVERAGE and COVER_PAIRS:
                            # top-k scores: each voting row adds c[t, i] * c[t, j] to C[i, j] for every
                            # pair of its scored experts, one of its picks at a time; phase B's gains are
                            # then COVER_ONE * column sum - the kept experts' rows of C
                            cq = tl.where(row_ok[:, None], q, 0) >> (SCORE_BITS - COVER_BITS)
                            # a score and its expert in one int32 (c <= 2**16, ids below 1024): one
                            # reduction per pick gives both
                            packed = (cq.to(tl.int32) << 10) | e[None, :]
                            for b in range(0, top_k):
                                picked_b = tl.sum(tl.where(rank == b, packed, 0), axis=1)
                                id_b = picked_b & 1023
                                cq_b = (picked_b >> 10).to(tl.int64)
                                # (the diagonal is never read: a kept expert's own gain no longer counts)
                                tl.atomic_add(
                                    cover_pairs_ptr + id_b.to(tl.int64)[:, None] * num_experts + e[None, :],
                                    cq * cq_b[:, None],
                                    mask=(in_block & (cq_b != 0))[:, None] & (cq != 0) & (e[None, :] != id_b[:, None]),
                                    sem="relaxed",
                                )
                        elif MODE == MODE_COVERAGE:
                            # every row's scores (0 on rows that do not vote), for the greedy of phase B
                            tl.store(
                                row_scores_ptr + rows[:, None] * num_experts + e[None, :],
                                tl.where(row_ok[:, None], q, 0).to(tl.int32),
                                mask=in_block[:, None] & e_ok[None, :],
                            )
                            if COVER_LISTS:
                                # each voting row joins the list of every expert it scores: a pick then
                                # revisits only the rows whose coverage it changes
                                listed = (in_block & row_ok)[:, None] & e_ok[None, :] & (q != 0)
                                slot = tl.atomic_add(
                                    cover_count_ptr + (e[None, :] + 0 * rows[:, None]), 1, mask=listed, sem="relaxed"
                                )
                                tl.store(
                                    cover_rows_ptr + e[None, :] * cover_capacity + slot,
                                    rows[:, None] + 0 * e[None, :],
                                    mask=listed,
                                )
            agg += agg_r
            warm = tl.maximum(warm, warm_r)
            if PER_REQUEST:
                chosen = greedy_iterative(warm_r, agg_r, e, e_ok, request_budget, votes_r > 0, REQUEST_TOP, BLOCK_E)
                base = tl.maximum(base, chosen)
    if not SINGLE:
        # this program's share, added into the call's accumulators (0 when the call starts: the last
        # program of the call before cleared them): integer sums and maxima do not depend on the order
        # the programs arrive in
        if MODE != MODE_ALL and MODE != MODE_STATIC:
            tl.atomic_max(warm_acc_ptr + e, warm, mask=e_ok & (warm != 0), sem="relaxed")
        if NEED_SCORES:
            tl.atomic_add(agg_acc_ptr + e, agg, mask=e_ok & (agg != 0), sem="relaxed")
        if MODE == MODE_COVERAGE:
            tl.atomic_add(cover_agg_ptr + e, cover_agg, mask=e_ok & (cover_agg != 0), sem="relaxed")
        if PER_REQUEST:
            tl.atomic_max(base_acc_ptr + e, base, mask=e_ok & (base != 0), sem="relaxed")
        if LYNX:
            bin_id = tl.arange(0, BLOCK_BINS)
            tl.atomic_add(
                counts_acc_ptr + e[:, None] * BLOCK_BINS + bin_id[None, :],
                counts,
                mask=e_ok[:, None] & (counts != 0),
                sem="relaxed",
            )

    if SINGLE:
        last = True
    else:
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
        last = ticket == num_parts - 1
    if last:
        if not SINGLE:
            # every program's share is in the accumulators (its atomics precede its ticket)
            if MODE != MODE_ALL and MODE != MODE_STATIC:
                warm = tl.load(warm_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
            if NEED_SCORES:
                agg = tl.load(agg_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
            if PER_REQUEST:
                base = tl.load(base_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
            if LYNX:
                bin_id = tl.arange(0, BLOCK_BINS)
                counts = tl.load(
                    counts_acc_ptr + e[:, None] * BLOCK_BINS + bin_id[None, :],
                    mask=e_ok[:, None],
                    other=0,
                    cache_modifier=".cg",
                )
        if LYNX:
            s_rank = lynx_s_ranks(
                counts.to(tl.int64),
                tl.maximum(n_valid, 1),
                digits_ptr,
                num_experts,
                beta,
                e,
                e_ok,
                BLOCK_E,
                BLOCK_BINS,
                CHUNK,
            )
            if SINGLE:
                base = lynx_picks(
                    logits_ptr,
                    stride_t,
                    stride_e,
                    0,
                    num_tokens,
                    n_valid,
                    weights_ptr,
                    s_rank,
                    e,
                    e_ok,
                    top_k,
                    alpha,
                    beta,
                    HAS_WEIGHTS,
                    KEY_SHIFT,
                    BLOCK_E,
                    CHUNK_T,
                )
            else:
                # the picks of every row run in parallel in lynx_pick_kernel, which finishes the mask
                tl.store(s_rank_ptr + e, s_rank, mask=e_ok)
    if LYNX and not SINGLE:
        finish = False  # lynx_pick_kernel finishes the mask
    else:
        finish = last
    if finish:
        warm_b = warm != 0

        # phase B: the set rule
        if MODE == MODE_ALL:
            keep = e_ok
        elif MODE == MODE_WARM:
            keep = warm_b
        elif MODE == MODE_GIVEN:
            keep = base != 0
        elif MODE == MODE_STATIC:
            place = tl.load(static_ptr + e, mask=e_ok, other=2147483647)
            keep = e_ok & (place < count) & (n_valid > 0)
        elif MODE == MODE_COVERAGE:
            # greedy: each step keeps the expert with the most uncovered per-token mass
            # sum_t (q[t, j] * max(ONE - covered_t, 0)) >> 24; ties to the larger agg, then the lower id
            tl.debug_barrier()
            # The picks run while some candidate gains: gains never grow, and once every one is zero
            # the reference picks the rest by aggregate, then index, which take_by_order does at once
            # (with T tokens at most T x top_k experts gain, so small batches stop early).
            chosen = tl.zeros([BLOCK_E], tl.int32)
            picks = tl.minimum(count, num_experts)
            taken = tl.zeros([], tl.int32)
            if COVER_PAIRS:
                # before any pick every row is uncovered: a gain is COVER_ONE times the column sum;
                # keeping an expert takes its row of C (the pair sums) off every gain.  Each pick is
                # one maximum of gain << 20 | (1023 - tie) << 10 | e, with tie the expert's place in
                # the order (agg desc, index asc): gains stay below 2**42 (at most 1024 tokens of
                # 2**32 each), places and ids below 1024
                tie = places(agg, e_ok, e, e_ok, e, False)
                if WARP_PICKS:
                    chosen = coverage_pair_picks(
                        tie, picks, cover_agg_ptr, cover_pairs_ptr, num_experts, BLOCK_E, WARPS, SEARCH_STEPS
                    )
                else:
                    # block-wide picks (the A/B of WARP_PICKS), the same keys
                    low = ((1023 - tie.to(tl.int64)) << 10) | e
                    gain = tl.load(cover_agg_ptr + e, mask=e_ok, other=0, cache_modifier=".cg") << COVER_BITS
                    best = tl.max(tl.where(e_ok, (gain << 20) | low, -1), axis=0)
                    while (taken < picks) & ((best >> 20) > 0):
                        first = (best & 1023).to(tl.int32)
                        gain -= tl.load(
                            cover_pairs_ptr + first.to(tl.int64) * num_experts + e,
                            mask=e_ok,
                            other=0,
                            cache_modifier=".cg",
                        )
                        chosen = tl.where(e == first, 1, chosen)
                        taken += 1
                        best = tl.max(tl.where(e_ok & (chosen == 0), (gain << 20) | low, -1), axis=0)
                    chosen = take_by_order(agg, chosen, e, e_ok, picks - taken)
            elif COVER_LISTS:
                # the gains are kept up to date: before any pick every row is uncovered and a gain is
                # COVER_ONE times the column sum; a pick changes only the rows on its list, so only
                # their terms are taken out at the old coverage and put back at the new one
                listed = tl.load(cover_count_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
                gain = tl.load(cover_agg_ptr + e, mask=e_ok, other=0, cache_modifier=".cg") << COVER_BITS
                key, top = coverage_top(gain, chosen, e_ok)
                while (taken < picks) & (top > 0):
                    first = coverage_first(key, top, agg, e)
                    num_listed = tl.sum(tl.where(e == first, listed, 0), axis=0)
                    for c in range(0, num_listed, COVER_T):
                        slot = c + tl.arange(0, COVER_T)
                        slot_ok = slot < num_listed
                        rows = tl.load(
                            cover_rows_ptr + first * cover_capacity + slot, mask=slot_ok, other=0, cache_modifier=".cg"
                        )
                        q = tl.load(
                            row_scores_ptr + rows[:, None] * num_experts + e[None, :],
                            mask=slot_ok[:, None] & e_ok[None, :],
                            other=0,
                            cache_modifier=".cg",
                        ).to(tl.int64)
                        gain -= coverage_loss(q, chosen, e, first)
                    chosen = tl.where(e == first, 1, chosen)
                    taken += 1
                    key, top = coverage_top(gain, chosen, e_ok)
            else:
                # every row in one register tile, read once; each step recomputes the gains from it
                t = tl.arange(0, COVER_T)
                q_rows = tl.load(
                    row_scores_ptr + t[:, None] * num_experts + e[None, :],
                    mask=(t < num_tokens)[:, None] & e_ok[None, :],
                    other=0,
                    cache_modifier=".cg",
                )
                c_rows = q_rows.to(tl.int64) >> (SCORE_BITS - COVER_BITS)
                key, top = coverage_top(tl.sum(c_rows, axis=0) << COVER_BITS, chosen, e_ok)
                while (taken < picks) & (top > 0):
                    first = coverage_first(key, top, agg, e)
                    chosen = tl.where(e == first, 1, chosen)
                    taken += 1
                    covered = tl.sum(tl.where(chosen[None, :] != 0, c_rows, 0), axis=1)
                    left = tl.where(covered < COVER_ONE, COVER_ONE - covered, 0)
                    key, top = coverage_top(tl.sum(c_rows * left[:, None], axis=0), chosen, e_ok)
            if not COVER_PAIRS:
                chosen = take_by_order(agg, chosen, e, e_ok, picks - taken)
            keep = e_ok & (chosen != 0) & (n_valid > 0)
        elif MODE == MODE_COACT:
            # greedy: each step keeps the largest agg * (1 - redundancy with the kept set), first id on ties
            # while some candidate gains: gains never grow, and once every one is zero the reference
            # takes the rest in index order (at most T x top_k experts have an aggregate)
            chosen = tl.zeros([BLOCK_E], tl.int32)
            discount = tl.zeros([BLOCK_E], tl.int64)
            taken = tl.zeros([], tl.int32)
            if COACT_KEYS and WARP_PICKS:
                chosen = coact_picks(agg, count, redundancy_ptr, num_experts, BLOCK_E, WARPS)
            elif COACT_KEYS:
                # block-wide picks (the A/B of WARP_PICKS): up to 4096 tokens gain << 10 | (1023 - e)
                # is one int64 key below 2**62 whose maximum is the largest gain at its first index
                best = tl.max(tl.where(e_ok, ((agg * REDUNDANCY_ONE) << 10) | (1023 - e), -1), axis=0)
                while (taken < count) & ((best >> 10) > 0):
                    first = 1023 - (best & 1023)
                    chosen = tl.where(e == first, 1, chosen)
                    taken += 1
                    row = tl.load(redundancy_ptr + first * num_experts + e, mask=e_ok, other=0)
                    discount = tl.maximum(discount, row.to(tl.int64))
                    gain = agg * (REDUNDANCY_ONE - discount)
                    best = tl.max(tl.where(e_ok & (chosen == 0), (gain << 10) | (1023 - e), -1), axis=0)
                chosen = take_by_order(tl.zeros([BLOCK_E], tl.int64), chosen, e, e_ok, count - taken)
            else:
                # the largest gain and its first index, one reduction
                gain = tl.where(e_ok, agg * REDUNDANCY_ONE, -1)
                top, first = tl.max(gain, axis=0, return_indices=True, return_indices_tie_break_left=True)
                while (taken < count) & (top > 0):
                    chosen = tl.where(e == first, 1, chosen)
                    taken += 1
                    row = tl.load(redundancy_ptr + first * num_experts + e, mask=e_ok, other=0)
                    discount = tl.maximum(discount, row.to(tl.int64))
                    gain = tl.where(e_ok & (chosen == 0), agg * (REDUNDANCY_ONE - discount), -1)
                    top, first = tl.max(gain, axis=0, return_indices=True, return_indices_tie_break_left=True)
                chosen = take_by_order(tl.zeros([BLOCK_E], tl.int64), chosen, e, e_ok, count - taken)
            keep = e_ok & (chosen != 0) & (n_valid > 0)
        elif MODE == MODE_TOP_AGG:
            # the [E, E] order only when more experts than the count can have an aggregate: with
            # top-k scores at most n_valid x top_k (a branch on a value the whole block holds; the
            # wrapper compiles the order out when T x top_k settles it), else with dense scores
            if ORDER:
                if SCORE_TOPK:
                    if n_valid * top_k > count:
                        place = places(agg, e_ok, e, e_ok, e, False)
                    else:
                        place = places_scored_first(agg, e_ok)
                else:
                    place = places(agg, e_ok, e, e_ok, e, False)
            else:
                place = places_scored_first(agg, e_ok)
            keep = e_ok & (place < count) & (n_valid > 0)
        else:
            if MODE == MODE_GREEDY_BASE:
                start = base != 0
            else:
                start = warm_b
            candidate = e_ok & (~start) & (agg > 0)
            # With top-k scores at most T x top_k experts have an aggregate.  When every candidate is
            # taken anyway (small batches) the [E, E] order is skipped: a branch on a value the whole
            # block holds, so every thread takes the same side.
            if MODE == MODE_RANK_ROUNDS:
                group_e = tl.load(group_ptr + e, mask=e_ok, other=-1)
                target = rank_budget * (tl.max(tl.where(e_ok, group_e, -1), axis=0) + 1)
                # |start| and the candidates in one sum (disjoint sets, E < 2**16)
                both = tl.sum(start.to(tl.int32) + (candidate.to(tl.int32) << 16), axis=0)
                kept = (both & 0xFFFF).to(tl.int64)
                if kept + (both >> 16) > target:
                    place = places(agg, candidate, e, e_ok, group_e, True)
                    # fewest rounds R in [0, E] with |start| + #{candidates placed < R} >= target;
                    # monotone: bisect
                    lo = tl.full([], 0, tl.int64)
                    hi = tl.full([], 0, tl.int64) + num_experts
                    for _ in range(0, SEARCH_STEPS):
                        mid = (lo + hi) // 2
                        added = tl.sum((candidate & (place < mid)).to(tl.int64), axis=0)
                        enough = (kept + added >= target) | (mid >= num_experts)
                        moving = lo < hi
                        hi = tl.where(moving & enough, mid, hi)
                        lo = tl.where(moving & (~enough), mid + 1, lo)
                    keep = start | (candidate & (place < lo))
                else:
                    # the target is not passed before every candidate is in: the rounds take them all
                    keep = start | candidate
            elif MODE == MODE_THRESHOLD:
                kept_mass = tl.sum(tl.where(start, agg, 0), axis=0)
                needed = threshold_target(tl.sum(agg, axis=0), tau_q)
                keep = start | prefix_keep(agg, candidate, e, kept_mass, needed)
            else:
                # top-k scores: each voting row scores top_k experts, so at most n_valid x top_k
                # experts are candidates (a bound known without a block-wide count)
                if SCORE_TOPK:
                    most = n_valid * top_k
                else:
                    most = tl.full([], 0, tl.int64) + num_experts
                keep = start
                if count > 0:
                    if ORDER:
                        if most > count:
                            place = places(agg, candidate, e, e_ok, e, False)
                            keep = start | (candidate & (place < count))
                        else:
                            keep = start | candidate  # every candidate's place is below count
                    else:
                        keep = start | candidate  # the wrapper knows that T x top_k <= count
        keep = finish_keep(
            keep,
            warm_b,
            agg,
            e,
            e_ok,
            n_valid,
            cap,
            min_tokens,
            max_tokens,
            keep_ptr,
            metrics_ptr,
            collect,
            stats_ptr,
            HAS_CAP,
            HAS_RANGE,
            HAS_METRICS,
            HAS_STATS,
            NEED_SCORES,
            ROUTE_MASS,
        )

        # phase C in the same program (P = 1)
        if SINGLE and ROUTE:
            used = tl.zeros([BLOCK_E], tl.int32)
            for c in range(0, num_tokens, ROUTE_T):
                rows = c + tl.arange(0, ROUTE_T)
                block_used = route_block(
                    logits_ptr,
                    stride_t,
                    stride_e,
                    rows,
                    rows < num_tokens,
                    n_valid,
                    weights_ptr,
                    bias_ptr,
                    keep,
                    e,
                    e_ok,
                    ids_ptr,
                    ids_stride,
                    out_w_ptr,
                    out_w_stride,
                    route_top_k,
                    topk_group,
                    group_size,
                    num_groups,
                    scale,
                    HAS_WEIGHTS,
                    HAS_BIAS,
                    SIGMOID,
                    RENORMALIZE,
                    TRUNCATION,
                    GROUPED,
                    HAS_SCALE,
                    FILL,
                    BLOCK_E,
                    BLOCK_K,
                    BLOCK_G,
                    GROUP_SIZE,
                    ROUTE_KEY_SHIFT,
                    ROW_WARPS,
                    GROUP_WARPS,
                )
                used = tl.maximum(used, block_used)
            if HAS_METRICS:
                if collect:
                    add_metric(metrics_ptr, tl.sum(used, axis=0))
    if not SINGLE:
        if last:
            # Leave what the programs accumulated at 0 for the next call (no counter reset launch):
            # every program added its share before its ticket, so nothing writes these any more, and
            # the barrier puts every thread's loads above before the zeros.  The LYNX aggregate is
            # still read by lynx_pick_kernel, which clears it.
            tl.debug_barrier()
            tl.store(ticket_ptr, 0)
            if MODE != MODE_ALL and MODE != MODE_STATIC:
                tl.store(warm_acc_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
            if NEED_SCORES and not LYNX:
                tl.store(agg_acc_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)
            if MODE == MODE_COVERAGE:
                tl.store(cover_agg_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)
            if COVER_LISTS:
                tl.store(cover_count_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
            if PER_REQUEST:
                tl.store(base_acc_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
            if LYNX:
                bin_id = tl.arange(0, BLOCK_BINS)
                tl.store(
                    counts_acc_ptr + e[:, None] * BLOCK_BINS + bin_id[None, :],
                    tl.zeros([BLOCK_E, BLOCK_BINS], tl.int32),
                    mask=e_ok[:, None],
                )


@triton.jit
def fill_kernel(ptr, numel, BLOCK: tl.constexpr):
    """Zero ``numel`` int32 words at ``ptr``: the coverage ranking's pair sums before a multi-program
    call launched as programmatic dependents (``enable_pdl``; otherwise the wrapper zeroes them with torch).
    It waits for the kernel before it (which may still read the counters) and lets the selection
    kernel launch at once; the selection waits for these zeros on the device."""
    gdc_wait()
    gdc_launch_dependents()
    for start in range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.zeros([BLOCK], tl.int32), mask=offs < numel)


@triton.jit
def lynx_pick_kernel(
    logits_ptr,
    stride_t,
    stride_e,
    num_tokens,
    num_experts,
    n_valid_ptr,
    n_valid_arg,
    weights_ptr,
    top_k,
    alpha,
    beta,
    cap,
    min_tokens,
    max_tokens,
    s_rank_ptr,
    agg_acc_ptr,
    picked_ptr,
    ticket_ptr,
    keep_ptr,
    metrics_ptr,
    metrics_gate_ptr,
    stats_ptr,
    HAS_NV_PTR: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    NEED_SCORES: tl.constexpr,
    HAS_CAP: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    HAS_METRICS: tl.constexpr,
    GATED: tl.constexpr,
    HAS_STATS: tl.constexpr,
    ROUTE_MASS: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK_T: tl.constexpr,
    PDL: tl.constexpr,
    PDL_TRIGGER: tl.constexpr,
):
    """LYNX on more than one program: each program takes the picks of its CHUNK_T rows (the s-ranks
    come from the selection kernel's last program), marks them, and the last program finishes the
    mask.  The serial work per program is one tile, whatever T."""
    if PDL:
        gdc_wait()
    if PDL_TRIGGER:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)
    s_rank = tl.load(s_rank_ptr + e, mask=e_ok, other=0)
    first_row = pid * CHUNK_T
    picked = lynx_picks(
        logits_ptr,
        stride_t,
        stride_e,
        first_row,
        tl.minimum(first_row + CHUNK_T, num_tokens),
        n_valid,
        weights_ptr,
        s_rank,
        e,
        e_ok,
        top_k,
        alpha,
        beta,
        HAS_WEIGHTS,
        KEY_SHIFT,
        BLOCK_E,
        CHUNK_T,
    )
    tl.atomic_max(picked_ptr + e, picked, mask=e_ok & (picked != 0))
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        keep = (tl.load(picked_ptr + e, mask=e_ok, other=0, cache_modifier=".cg") != 0) & e_ok
        agg = tl.zeros([BLOCK_E], tl.int64)
        if NEED_SCORES:
            agg = tl.load(agg_acc_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
        finish_keep(
            keep,
            e < 0,
            agg,
            e,
            e_ok,
            n_valid,
            cap,
            min_tokens,
            max_tokens,
            keep_ptr,
            metrics_ptr,
            metrics_on(metrics_gate_ptr, GATED),
            stats_ptr,
            HAS_CAP,
            HAS_RANGE,
            HAS_METRICS,
            HAS_STATS,
            NEED_SCORES,
            ROUTE_MASS,
        )
        # the marks, the aggregate and the ticket back at 0 for the next call (after every thread's loads)
        tl.debug_barrier()
        tl.store(ticket_ptr, 0)
        tl.store(picked_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e_ok)
        if NEED_SCORES:
            tl.store(agg_acc_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=e_ok)


@triton.jit
def route_kernel(
    logits_ptr,
    stride_t,
    stride_e,
    num_tokens,
    num_experts,
    n_valid_ptr,
    n_valid_arg,
    weights_ptr,
    bias_ptr,
    ids_ptr,
    ids_stride,
    out_w_ptr,
    out_w_stride,
    top_k,
    topk_group,
    group_size,
    num_groups,
    scale,
    keep_ptr,
    visits_ptr,
    ticket_ptr,
    metrics_ptr,
    metrics_gate_ptr,
    mass_ptr,
    static_ptr,
    static_count,
    min_tokens,
    max_tokens,
    HAS_NV_PTR: tl.constexpr,
    HAS_WEIGHTS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SIGMOID: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    TRUNCATION: tl.constexpr,
    GROUPED: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    FILL: tl.constexpr,
    HAS_METRICS: tl.constexpr,
    GATED: tl.constexpr,
    ROUTE_MASS: tl.constexpr,
    SCORE_TOPK: tl.constexpr,
    SCORE_KEY_SHIFT: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    CHUNK_T: tl.constexpr,
    KEY_SHIFT: tl.constexpr,
    ALL_KEPT: tl.constexpr,
    STATIC_KEEP: tl.constexpr,
    HAS_RANGE: tl.constexpr,
    ROW_WARPS: tl.constexpr,
    GROUP_WARPS: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    n_valid = num_valid_tokens(n_valid_ptr, n_valid_arg, num_tokens, HAS_NV_PTR)
    collect = metrics_on(metrics_gate_ptr, GATED)
    if ALL_KEPT:
        # policy none: no selection launch; program 0 writes the full mask and the call's metrics
        # (every expert kept, the whole score mass retained, as the selection kernel would)
        keep = e_ok
        if pid == 0:
            tl.store(keep_ptr + e, keep, mask=e_ok)
            if HAS_METRICS:
                if collect:
                    add_metric(metrics_ptr + 1, num_experts)
                    add_metric(metrics_ptr + 2, 1 << 24)
                    add_metric(metrics_ptr + 3, 1)
    elif STATIC_KEEP:
        # static moe-spec: the calibrated set is known before the call, so no selection launch.  Every
        # program derives the mask the selection's static rule and finish_keep would (no cap for
        # moe-spec); program 0 stores it and adds the kept count and the call (the retained mass is
        # route_mass's, below)
        place = tl.load(static_ptr + e, mask=e_ok, other=2147483647)
        keep = e_ok & (place < static_count) & (n_valid > 0)
        if HAS_RANGE:
            keep = tl.where((n_valid >= min_tokens) & (n_valid <= max_tokens), keep, e_ok)
        if pid == 0:
            tl.store(keep_ptr + e, keep, mask=e_ok)
            if HAS_METRICS:
                if collect:
                    add_metric(metrics_ptr + 1, tl.sum(keep.to(tl.int32), axis=0))
                    add_metric(metrics_ptr + 3, 1)
    else:
        keep = (tl.load(keep_ptr + e, mask=e_ok, other=0) != 0) & e_ok
    rows = pid * CHUNK_T + tl.arange(0, CHUNK_T)
    used = route_block(
        logits_ptr,
        stride_t,
        stride_e,
        rows,
        rows < num_tokens,
        n_valid,
        weights_ptr,
        bias_ptr,
        keep,
        e,
        e_ok,
        ids_ptr,
        ids_stride,
        out_w_ptr,
        out_w_stride,
        top_k,
        topk_group,
        group_size,
        num_groups,
        scale,
        HAS_WEIGHTS,
        HAS_BIAS,
        SIGMOID,
        RENORMALIZE,
        TRUNCATION,
        GROUPED,
        HAS_SCALE,
        FILL,
        BLOCK_E,
        BLOCK_K,
        BLOCK_G,
        GROUP_SIZE,
        KEY_SHIFT,
        ROW_WARPS,
        GROUP_WARPS,
    )
    if HAS_METRICS:
        if collect:
            # the activated experts without a ticket: each program adds to every expert's int64 word
            # one visit (low half) and, where it routed a token, one mark (high half).  The program
            # whose add finds P - 1 visits before its own is the last to touch that word in this call:
            # it counts the expert when any program marked it, and clears the word for the next call
            visit = tl.where(used != 0, (1 << 32) + 1, 1).to(tl.int64)
            before = tl.atomic_add(visits_ptr + e, visit, mask=e_ok, sem="relaxed")
            marks_before = before >> 32
            last_visit = e_ok & (before - (marks_before << 32) == tl.num_programs(0) - 1)
            activated = last_visit & ((marks_before > 0) | (used != 0))
            tl.atomic_add(metrics_ptr + e * 0, tl.full([BLOCK_E], 1, tl.int64), mask=activated, sem="relaxed")
            tl.store(visits_ptr + e, tl.zeros([BLOCK_E], tl.int64), mask=last_visit)
    if ROUTE_MASS:
        if collect:
            # the retained mass of a rule that needs no scores: this tile's kept and total score mass
            kept_mass, total_mass = route_mass(
                logits_ptr,
                stride_t,
                stride_e,
                rows,
                rows < num_tokens,
                n_valid,
                weights_ptr,
                keep,
                e,
                e_ok,
                top_k,
                HAS_WEIGHTS,
                SCORE_TOPK,
                SIGMOID,
                SCORE_KEY_SHIFT,
            )
            tl.atomic_add(mass_ptr, kept_mass, sem="relaxed")
            tl.atomic_add(mass_ptr + 1, total_mass, sem="relaxed")
    if ROUTE_MASS:
        # the retained mass alone takes no ticket in a call without metrics (the same gate in every
        # program: all of them take one, or none)
        if collect:
            tl.debug_barrier()  # every thread's atomics and stores before the ticket (acquire-release)
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
            if ticket == tl.num_programs(0) - 1:
                tl.store(ticket_ptr, 0)  # every program has its ticket: back at 0 for the next call
                kept_total = tl.load(mass_ptr, cache_modifier=".cg")
                total = tl.load(mass_ptr + 1, cache_modifier=".cg")
                add_metric(metrics_ptr + 2, retained_share(kept_total, total))
                tl.debug_barrier()  # every thread's loads before the zeros
                tl.store(mass_ptr, tl.zeros([], tl.int64))
                tl.store(mass_ptr + 1, tl.zeros([], tl.int64))
