"""The selection kernel's parallel building blocks and its set rules against brute force, exactly.

Each ``@triton.jit`` helper of ``kernels/jit/`` that replaced a serial loop (the int64
division of the scores, the pairwise order through global memory) is run alone through a small test
kernel, on inputs chosen to hit its edges: ties in the order, exact multiples and off-by-one numerators
in the division, flags and groups at random.  Every set rule of ``kernels/jit/rules/`` is run alone on
given totals (aggregates, warm-up marks, per-request sets) against its torch reference in ``policies/``.
On CPU under ``TRITON_INTERPRET=1``; natively on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from xshare_sglang.calibration_file import REDUNDANCY_BITS
from xshare_sglang.kernels import bundles
from xshare_sglang.kernels.jit import lynx, numerics, order
from xshare_sglang.kernels.jit.rules import RULES
from xshare_sglang.kernels.plan import MAX_KEYED_COACT_TOKENS, MAX_TOKENS
from xshare_sglang.policies.greedy import (
    coactivation_add,
    coverage_add,
    greedy_add,
    rank_rounds_add,
    tau_fixed_point,
    threshold_add,
)
from xshare_sglang.policies.moe_spec import _top

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _floor_div_kernel(num_ptr, den_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = i < n
    num = tl.load(num_ptr + i, mask=ok, other=0)
    den = tl.load(den_ptr + i, mask=ok, other=1)
    tl.store(out_ptr + i, numerics.floor_div(num, den), mask=ok)


@triton.jit
def _share_kernel(units_ptr, out_ptr, rows, cols, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    ok = (r < rows)[:, None] & (c < cols)[None, :]
    offs = r[:, None] * cols + c[None, :]
    units = tl.load(units_ptr + offs, mask=ok, other=0)
    tl.store(out_ptr + offs, numerics.share_of_row(units), mask=ok)


@triton.jit
def _order_kernel(
    prim_ptr,
    flag_ptr,
    group_ptr,
    place_ptr,
    keep_ptr,
    n,
    kept_mass,
    needed,
    USE_GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    e = tl.arange(0, BLOCK)
    e_ok = e < n
    prim = tl.load(prim_ptr + e, mask=e_ok, other=0)
    flag = (tl.load(flag_ptr + e, mask=e_ok, other=0) != 0) & e_ok
    group = tl.load(group_ptr + e, mask=e_ok, other=-1)
    tl.store(place_ptr + e, order.places(prim, flag, e, e_ok, group, USE_GROUP), mask=e_ok)
    tl.store(keep_ptr + e, order.prefix_keep(prim, flag, e, kept_mass, needed).to(tl.int8), mask=e_ok)


def _on(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def test_floor_div_is_exact_at_the_edges() -> None:
    rng = random.Random(3)
    pairs = []
    for _ in range(400):
        den = rng.choice([1, 2, 3, rng.randrange(1, 1 << 20), rng.randrange(1, 1 << 40), rng.randrange(1, 1 << 53)])
        quotient = rng.randrange(0, min(1 << 25, ((1 << 55) - 1) // den + 1))
        for num in (quotient * den, quotient * den - 1, quotient * den + den - 1, rng.randrange(0, 1 << 55)):
            if 0 <= num < (1 << 55) and num // den <= 1 << 25:
                pairs.append((num, den))
    num = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    den = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    out = torch.empty_like(num)
    block = triton.next_power_of_2(len(pairs))
    out_dev = _on(out)
    _floor_div_kernel[(1,)](_on(num), _on(den), out_dev, len(pairs), BLOCK=block)
    assert out_dev.cpu().tolist() == [a // b for a, b in pairs]


@pytest.mark.parametrize("cols", [1, 8, 60, 128, 256])
def test_share_of_row_matches_integer_division(cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    rows = 7
    units = torch.randint(0, (1 << 30) + 1, (rows, cols), generator=gen, dtype=torch.int64)
    units[1] = 0  # a row with no mass
    units[2, :] = 0
    units[2, 0] = 1 << 30  # all mass on one expert: exactly 2**24
    units[3] = torch.where(torch.rand(cols, generator=gen) < 0.9, 0, units[3])  # sparse, as top-k rows are
    total = units.sum(dim=1, keepdim=True)
    want = torch.where(total > 0, (units << 24) // total.clamp(min=1), 0)
    out = _on(torch.empty_like(units))
    _share_kernel[(1,)](_on(units), out, rows, cols, BLOCK_R=8, BLOCK_C=triton.next_power_of_2(cols))
    assert torch.equal(out.cpu(), want)


def _brute_places(prim, flag, group, use_group):
    n = len(prim)
    return [
        sum(
            1
            for j in range(n)
            if flag[j]
            and (prim[j] > prim[e] or (prim[j] == prim[e] and j < e))
            and (not use_group or group[j] == group[e])
        )
        for e in range(n)
    ]


def _brute_prefix(prim, flag, kept_mass, needed):
    order = sorted((j for j in range(len(prim)) if flag[j]), key=lambda j: (-prim[j], j))
    keep, before = [False] * len(prim), 0
    for j in order:
        if kept_mass + before >= needed:
            break
        keep[j] = True
        before += prim[j]
    return keep


@pytest.mark.parametrize("num_experts", [1, 60, 64, 128, 160, 256, 512])
@pytest.mark.parametrize("use_group", [False, True])
def test_order_by_places_and_by_prefix(num_experts: int, use_group: bool) -> None:
    for seed in range(6):
        rng = random.Random(seed * 1000 + num_experts)
        high = rng.choice([3, 50, 1 << 46])  # few distinct values: many ties
        prim = [rng.randrange(1, high) for _ in range(num_experts)]
        flag = [rng.random() < rng.choice([0.1, 0.5, 1.0]) for _ in range(num_experts)]
        group = [rng.randrange(0, rng.choice([1, 4, 8, 64, 512])) for _ in range(num_experts)]
        total = sum(p for p, f in zip(prim, flag, strict=True) if f)
        kept_mass = rng.choice([0, rng.randrange(0, total + 1)])
        needed = rng.choice([0, 1, total // 2, total, total + kept_mass, rng.randrange(0, total + 2)])
        place = _on(torch.empty(num_experts, dtype=torch.int32))
        keep = _on(torch.empty(num_experts, dtype=torch.int8))
        _order_kernel[(1,)](
            _on(torch.tensor(prim, dtype=torch.int64)),
            _on(torch.tensor(flag, dtype=torch.int8)),
            _on(torch.tensor(group, dtype=torch.int32)),
            place,
            keep,
            num_experts,
            kept_mass,
            needed,
            USE_GROUP=use_group,
            BLOCK=max(16, triton.next_power_of_2(num_experts)),
        )
        label = f"E={num_experts} seed={seed}"
        assert place.cpu().tolist() == _brute_places(prim, flag, group, use_group), label
        assert [bool(v) for v in keep.cpu().tolist()] == _brute_prefix(prim, flag, kept_mass, needed), label


@triton.jit
def _take_kernel(prim_ptr, chosen_ptr, out_ptr, n, rest, BLOCK: tl.constexpr):
    e = tl.arange(0, BLOCK)
    e_ok = e < n
    prim = tl.load(prim_ptr + e, mask=e_ok, other=0)
    chosen = tl.load(chosen_ptr + e, mask=e_ok, other=0)
    tl.store(out_ptr + e, order.take_by_order(prim, chosen, e, e_ok, rest), mask=e_ok)


def _brute_take(prim, chosen, rest):
    order = sorted((j for j in range(len(prim)) if not chosen[j]), key=lambda j: (-prim[j], j))
    taken = set(order[: max(rest, 0)])
    return [int(chosen[j] or j in taken) for j in range(len(prim))]


@pytest.mark.parametrize("num_experts", [1, 60, 64, 128, 160, 256, 512])
def test_take_by_order_finishes_a_greedy(num_experts: int) -> None:
    """The greedy rankings' tail: the ``rest`` first experts outside the chosen set by (prim desc,
    index asc), ties included; none for ``rest <= 0``, all of them when fewer are left."""
    for seed in range(6):
        rng = random.Random(seed * 7919 + num_experts)
        high = rng.choice([1, 3, 1 << 40])  # 1: every prim 0, the pure index order of co-activation
        prim = [rng.randrange(0, high) for _ in range(num_experts)]
        chosen = [int(rng.random() < rng.choice([0.0, 0.3, 0.9])) for _ in range(num_experts)]
        rest = rng.choice([-1, 0, 1, num_experts // 3, num_experts - sum(chosen), num_experts + 5])
        out = _on(torch.empty(num_experts, dtype=torch.int32))
        _take_kernel[(1,)](
            _on(torch.tensor(prim, dtype=torch.int64)),
            _on(torch.tensor(chosen, dtype=torch.int32)),
            out,
            num_experts,
            rest,
            BLOCK=max(16, triton.next_power_of_2(num_experts)),
        )
        assert out.cpu().tolist() == _brute_take(prim, chosen, rest), f"E={num_experts} seed={seed} rest={rest}"


@triton.jit
def _bin_counts_kernel(
    x_ptr, out_ptr, rows, n, alpha, beta, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_BINS: tl.constexpr
):
    r = tl.arange(0, ROWS)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(x_ptr + r[:, None] * n + e[None, :], mask=(e < n)[None, :], other=float("-inf"))
    counts = lynx.lynx_bin_counts(x, r < rows, e, alpha, beta, ROWS, BLOCK_E, BLOCK_BINS)
    b = tl.arange(0, BLOCK_BINS)
    tl.store(out_ptr + e[:, None] * BLOCK_BINS + b[None, :], counts)


@pytest.mark.parametrize("num_experts", [60, 128, 256])
@pytest.mark.parametrize(("rows", "voting_rows"), [(8, 0), (8, 1), (8, 5), (8, 8), (2, 2), (1, 1)])
def test_lynx_bin_counts_ignore_rows_that_do_not_vote(num_experts: int, rows: int, voting_rows: int) -> None:
    """Per (expert, bin) counts of the voting rows only, with depth ``min(beta, ceil(max - l) * alpha)``.
    The padding rows hold the highest logits, so counting any of them changes the counts (on an H200 with
    Triton 3.6, ``tl.histogram``'s own mask did).  Full tiles put every row's vote in one bin."""
    block_bins, alpha, beta = 16, 2.0, 6
    block_e = triton.next_power_of_2(num_experts)
    gen = torch.Generator().manual_seed(num_experts + voting_rows)
    x = torch.randn(rows, num_experts, generator=gen)
    if voting_rows == rows:
        x[:, :3] = 9.0  # every row's best three: all the rows' votes in one bin
    x[voting_rows:] = 50.0  # padding: every expert in bin 0 if it were counted
    out = _on(torch.full((block_e, block_bins), -1, dtype=torch.int32))
    _bin_counts_kernel[(1,)](
        _on(x), out, voting_rows, num_experts, alpha, beta, ROWS=rows, BLOCK_E=block_e, BLOCK_BINS=block_bins
    )
    want = torch.zeros(block_e, block_bins, dtype=torch.int32)
    for t in range(voting_rows):
        top = x[t].max()
        for e in range(num_experts):
            depth = min(beta, int(-torch.ceil((x[t, e] - top) * alpha).item()))
            want[e, depth] += 1
    want[num_experts:, beta] = voting_rows  # padded experts (logit -inf) sit in the lowest bin
    assert torch.equal(out.cpu(), want)


@triton.jit
def _rule_kernel(
    agg_ptr,
    warm_ptr,
    base_ptr,
    keep_ptr,
    call,
    policy,
    tables,
    coverage,
    n_valid,
    RULE: tl.constexpr,
    CONFIG: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """One set rule alone (``RULE``, with its ``CONFIG``) on given totals, as the selection's last
    program applies it."""
    e = tl.arange(0, BLOCK_E)
    e_ok = e < call.num_experts
    agg = tl.load(agg_ptr + e, mask=e_ok, other=0)
    warm = tl.load(warm_ptr + e, mask=e_ok, other=0)
    base = tl.load(base_ptr + e, mask=e_ok, other=0)
    keep = RULE(agg, warm, base, call, policy, tables, coverage, n_valid, e, e_ok, CONFIG)
    tl.store(keep_ptr + e, keep.to(tl.int8), mask=e_ok)


def _run_rule(
    rule: str,
    config,
    agg,
    *,
    warm=None,
    base=None,
    count=0,
    tau=1.0,
    rank_budget=0,
    num_valid=1,
    static=None,
    redundancy=None,
    ranks=None,
    scores=None,
    warps=4,
) -> list[bool]:
    """The keep mask [E] of ``rule`` on the totals ``agg`` (int64), ``warm`` and ``base`` (bool)."""
    num_experts = agg.shape[0]
    zeros = torch.zeros(num_experts, dtype=torch.int32)
    placeholder = _on(torch.zeros(1, dtype=torch.int32))
    num_tokens = 1 if scores is None else scores.shape[0]
    call = bundles.CallArgs(placeholder, num_experts, 1, num_tokens, num_experts, placeholder, num_valid, placeholder)
    policy = bundles.PolicyArgs(0, 8, 0, count, tau_fixed_point(tau), rank_budget, 0, 0, 0, 1.0, 0)
    tables = bundles.TableArgs(
        _on(static if static is not None else zeros),
        _on(redundancy if redundancy is not None else zeros),
        _on(ranks if ranks is not None else zeros),
    )
    row_scores = _on(scores.to(torch.int32).contiguous()) if scores is not None else placeholder
    coverage = bundles.CoverageArgs(row_scores, placeholder, placeholder, 0, placeholder, placeholder)
    out = _on(torch.full((num_experts,), -1, dtype=torch.int8))
    as_int = lambda flags: _on((flags if flags is not None else torch.zeros(num_experts, dtype=torch.bool)).int())  # noqa: E731
    _rule_kernel[(1,)](
        _on(agg),
        as_int(warm),
        as_int(base),
        out,
        call,
        policy,
        tables,
        coverage,
        num_valid,
        RULE=RULES[rule],
        CONFIG=config,
        BLOCK_E=triton.next_power_of_2(num_experts),
        num_warps=warps,
    )
    return out.cpu().bool().tolist()


def _totals(num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Aggregates with ties, zeros and large values; warm-up marks and per-request sets at random."""
    gen = torch.Generator().manual_seed(seed)
    agg = torch.randint(0, 1 << 30, (num_experts,), generator=gen, dtype=torch.int64)
    agg[::7] = agg[1]  # ties
    agg[3::5] = 0  # experts no row scores
    warm = torch.rand(num_experts, generator=gen) < 0.1
    base = torch.rand(num_experts, generator=gen) < 0.15
    return agg, warm, base


@pytest.mark.parametrize("num_experts", [60, 128, 256])
def test_each_set_rule_alone_is_its_reference(num_experts: int) -> None:
    """Each rule of ``jit.rules`` on given totals equals its torch reference: the trivial sets exactly as
    given; the greedy budget, mass threshold and expert-parallel rounds on the warm-up set (or, for
    xshare-spec, the per-request sets); the router ranking's and the calibrated places' top count; the
    co-activation and coverage greedies.  Budgets below, at and above the candidates."""
    agg, warm, base = _totals(num_experts, num_experts)
    steps = triton.next_power_of_2(num_experts).bit_length() + 1
    no_config = bundles.NoConfig()
    every = [True] * num_experts
    assert _run_rule("keep_all", no_config, agg) == every
    assert _run_rule("warm", no_config, agg, warm=warm) == warm.tolist()
    assert _run_rule("given", no_config, agg, base=base) == base.tolist()
    static = torch.randperm(num_experts, generator=torch.Generator().manual_seed(1)).int()
    ranks = torch.arange(num_experts, dtype=torch.int32) % 4
    for count in (0, 1, 5, num_experts // 2, num_experts + 1):
        label = (num_experts, count)
        for from_requests, start in ((False, warm), (True, base)):
            config = bundles.GreedyConfig(FROM_REQUESTS=from_requests, SCORE_TOPK=False, ORDER=True)
            got = _run_rule("greedy", config, agg, warm=warm, base=base, count=count)
            assert got == greedy_add(start, agg, count).tolist(), label
        config = bundles.TopAggregateConfig(SCORE_TOPK=False, ORDER=True)
        assert _run_rule("top_aggregate", config, agg, count=count) == _top(agg, count).tolist(), label
        assert _run_rule("static", no_config, agg, count=count, static=static) == (static < count).tolist(), label
        assert _run_rule("static", no_config, agg, count=count, static=static, num_valid=0) == [False] * num_experts
        config = bundles.RankRoundsConfig(SEARCH_STEPS=steps)
        want = rank_rounds_add(warm, agg, ranks.long(), count).tolist()
        assert _run_rule("rank_rounds", config, agg, warm=warm, rank_budget=count, ranks=ranks) == want, label
    for tau in (0.0, 0.5, 0.9, 1.0):
        want = threshold_add(warm, agg, tau).tolist()
        assert _run_rule("threshold", no_config, agg, warm=warm, tau=tau) == want, (num_experts, tau)


@pytest.mark.parametrize("num_experts", [60, 128])
def test_the_coverage_rule_on_its_register_tile_is_its_reference(num_experts: int) -> None:
    """The coverage ranking's rule, every row in its register tile, equals ``coverage_add``: rows that
    share experts, ties, a budget below and above the experts that gain."""
    num_tokens = 6
    gen = torch.Generator().manual_seed(num_experts)
    scores = torch.zeros(num_tokens, num_experts, dtype=torch.int64)
    for t in range(num_tokens):
        picked = torch.randperm(num_experts, generator=gen)[:4]
        scores[t, picked] = torch.randint(1, 1 << 22, (4,), generator=gen, dtype=torch.int64)
    scores[1] = scores[0]  # two rows alike: the second adds no coverage
    agg = scores.sum(dim=0)
    block_e = triton.next_power_of_2(num_experts)
    config = bundles.CoverageConfig(
        PAIRS=False,
        LISTS=False,
        WARP_PICKS=False,
        TILE_ROWS=8,
        SEARCH_STEPS=block_e.bit_length() + 1,
        BLOCK_E=block_e,
        WARPS=4,
    )
    for count in (1, 3, 10, num_experts + 1):
        want = coverage_add(scores, agg, count, torch.tensor(True)).tolist()
        assert _run_rule("coverage", config, agg, count=count, scores=scores) == want, count


#: The largest aggregate a call of 4095 tokens (the packed keys' limit) can hold: every row's whole
#: mass, 2**24, on one expert (a router whose float32 probability rounds to 1 on every row gives it).
KEYED_LARGEST = MAX_KEYED_COACT_TOKENS << 24


@pytest.mark.parametrize(
    ("coact_keys", "warp_picks", "num_experts", "largest"),
    [
        (True, True, 128, KEYED_LARGEST - 1),  # picks in every warp on packed keys below 2**62 ...
        (True, True, 128, KEYED_LARGEST),  # ... and at the largest a keyed call can hold
        (True, False, 160, KEYED_LARGEST),  # block-wide packed keys (above the warps' reach)
        (False, False, 160, MAX_TOKENS << 24),  # above the keys' limit: a (gain, index) maximum
    ],
)
def test_coactivation_picks_hold_at_the_largest_aggregates(coact_keys, warp_picks, num_experts, largest) -> None:
    """The co-activation greedy's picks equal the reference's with aggregates at ``largest`` and just
    below, tied at it and inside groups of redundant experts: with the packed keys
    ``gain << 10 | (1023 - e)`` of a call of up to 4095 tokens (the plan's ``max_keyed_coact_tokens``),
    which stay below 2**62 there (at 4096 tokens they would reach it, past what the warp maxima
    take: the limit is 4095), and with a (gain, index) maximum up to MAX_TOKENS tokens.  Interpreted
    calls stay far below these magnitudes (4096 rows take a minute)."""
    one = 1 << REDUNDANCY_BITS
    gen = torch.Generator().manual_seed(num_experts + largest % 7)
    agg = largest - torch.randint(0, 4, (num_experts,), generator=gen, dtype=torch.int64) * (1 << 20)
    agg[::5] = largest  # ties at the bound
    agg[3::11] = torch.randint(0, 1 << 24, agg[3::11].shape, generator=gen, dtype=torch.int64)
    agg[7::13] = 0  # experts no row scores
    group = torch.arange(num_experts) // 4  # experts in groups of four always picked together
    partial = torch.randint(0, one + 1, (num_experts, num_experts), generator=gen, dtype=torch.int32)
    redundancy = torch.where(group[:, None] == group[None, :], one, torch.minimum(partial, partial.T))
    redundancy = torch.where(torch.rand(num_experts, num_experts, generator=gen) < 0.7, 0, redundancy)
    redundancy = torch.maximum(redundancy, redundancy.T).to(torch.int32).contiguous()
    for count in (1, 5, num_experts // 2, num_experts + 3):
        want = coactivation_add(agg, redundancy, count, torch.tensor(True))
        block_e = triton.next_power_of_2(num_experts)
        config = bundles.CoactivationConfig(KEYS=coact_keys, WARP_PICKS=warp_picks, BLOCK_E=block_e, WARPS=4)
        got = _run_rule("coactivation", config, agg, count=count, redundancy=redundancy)
        assert got == want.tolist(), count
