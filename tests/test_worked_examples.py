"""Small examples worked out by hand; the expected masks are written out, not computed.

Main example: T=4 tokens, E=8 experts, top_k=2, softmax.  Logits (unlisted entries are -10):

    t0: e0=3.0  e1=2.0                 top-2 weights  e0 .731  e1 .269
    t1: e0=3.0  e2=2.9                                e0 .525  e2 .475
    t2: e3=3.0  e1=1.0                                e3 .881  e1 .119
    t3: e4=3.0  e1=2.5                                e4 .622  e1 .378

Aggregates of the "topk" score: e0 1.256, e3 .881, e1 .766, e4 .622, e2 .475, others 0 (total 4).
Top-1 of each token: e0, e0, e3, e4, so W(1) = {0, 3, 4}.
"""

from __future__ import annotations

import json

import pytest
import torch

from xshare_sglang import PrunerConfig, route_within, select_experts_mask


def _logits() -> torch.Tensor:
    logits = torch.full((4, 8), -10.0)
    logits[0, 0], logits[0, 1] = 3.0, 2.0
    logits[1, 0], logits[1, 2] = 3.0, 2.9
    logits[2, 3], logits[2, 1] = 3.0, 1.0
    logits[3, 4], logits[3, 1] = 3.0, 2.5
    return logits


def _mask(*experts: int, num_experts: int = 8) -> list[bool]:
    return [e in experts for e in range(num_experts)]


def _keep(cfg: PrunerConfig, **kwargs) -> list[bool]:
    return select_experts_mask(_logits(), cfg, top_k=2, **kwargs).tolist()


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        # W(1) = {0, 3, 4}
        (PrunerConfig(policy="oea", k0=1), _mask(0, 3, 4)),
        # W(2) = every token's top-2 = {0, 1, 2, 3, 4}
        (PrunerConfig(policy="oea", k0=2), _mask(0, 1, 2, 3, 4)),
        # W(1) plus the best outside aggregate, e1 (.766)
        (PrunerConfig(policy="xshare", k0=1, budget=1), _mask(0, 1, 3, 4)),
        # ... plus e2 (.475); a larger budget adds nothing more (others have aggregate 0)
        (PrunerConfig(policy="xshare", k0=1, budget=2), _mask(0, 1, 2, 3, 4)),
        (PrunerConfig(policy="xshare", k0=1, budget=50), _mask(0, 1, 2, 3, 4)),
        # no warm-up: the two highest aggregates, e0 and e3
        (PrunerConfig(policy="xshare", k0=0, budget=2), _mask(0, 3)),
        # kept mass 2.759/4 = .69 < .8: add e1 -> 3.525/4 = .881, stop
        (PrunerConfig(policy="xshare-threshold", k0=1, tau=0.8), _mask(0, 1, 3, 4)),
        # .881 < .95: add e2 too -> 4/4
        (PrunerConfig(policy="xshare-threshold", k0=1, tau=0.95), _mask(0, 1, 2, 3, 4)),
        # W(1) already holds .69 >= .5: nothing added
        (PrunerConfig(policy="xshare-threshold", k0=1, tau=0.5), _mask(0, 3, 4)),
        # max_experts caps xshare's {0,1,2,3,4}: warm-up {0,3,4} first, then e1 by aggregate
        (PrunerConfig(policy="xshare", k0=1, budget=2, max_experts=4), _mask(0, 1, 3, 4)),
        # a cap below the warm-up keeps the warm-up experts with the highest aggregates, e0 and e3
        (PrunerConfig(policy="xshare", k0=1, budget=2, max_experts=2), _mask(0, 3)),
        # 4 real tokens < min_tokens: not pruned
        (PrunerConfig(policy="oea", k0=1, min_tokens=5), _mask(*range(8))),
        # MoE-Spec, probs score: aggregates order e0 > e3 > e1 > e4 > e2: top 3
        (PrunerConfig(policy="moe-spec", max_experts=3), _mask(0, 1, 3)),
    ],
)
def test_main_example(cfg: PrunerConfig, expected: list[bool]) -> None:
    assert _keep(cfg) == expected


def test_num_valid_tokens_limits_the_voters() -> None:
    # only t0 and t1 vote: W(1) = {0}; the best outside aggregate is e2 (.475 > e1's .269)
    assert _keep(PrunerConfig(policy="xshare", k0=1, budget=1), num_valid_tokens=2) == _mask(0, 2)


def test_xshare_spec_per_request_greedy() -> None:
    """D=2: request 0 = {t0, t1}, request 1 = {t2, t3}.

    r0: W = {0}; its aggregates e0 1.256, e2 .475, e1 .269 -> adds e2.
    r1: W = {3, 4}; its aggregates e3 .881, e4 .622, e1 .497 -> adds e1.
    Union {0, 1, 2, 3, 4}.  The batch-level xshare with budget 1 would have taken e1 only.
    """
    cfg = PrunerConfig(policy="xshare-spec", k0=1, request_budget=1, budget=0)
    assert _keep(cfg, tokens_per_request=2) == _mask(0, 1, 2, 3, 4)
    # One request of four tokens is the batch-level greedy step: e1 is added.
    assert _keep(cfg, tokens_per_request=4) == _mask(0, 1, 3, 4)


def test_xshare_spec_last_request_is_shorter() -> None:
    """D=3 with 4 tokens: r0 = {t0, t1, t2}, r1 = {t3}.

    r0: W = {0, 3}; aggregates e0 1.256, e3 .881, e2 .475, e1 .388 -> adds e2.
    r1: W = {4}; adds e1 (.378).  Union {0, 1, 2, 3, 4}.
    """
    cfg = PrunerConfig(policy="xshare-spec", k0=1, request_budget=1, budget=0)
    assert _keep(cfg, tokens_per_request=3) == _mask(0, 1, 2, 3, 4)
    # with only 3 valid tokens there is a single request: W = {0, 3} plus e2
    assert _keep(cfg, tokens_per_request=3, num_valid_tokens=3) == _mask(0, 2, 3)


def test_xshare_ep_rounds() -> None:
    """Ranks: {0,1} {2,3} {4,5} {6,7}.  W(1) = {0, 3, 4}; target 1 x 4 ranks = 4.

    One round: rank 0 adds e1, rank 1 adds e2, rank 2 has only e5 (aggregate 0): skip, rank 3 the
    same.  |S| = 5 >= 4: stop.  Global greedy with one addition would have taken e1 only.
    """
    ranks = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    cfg = PrunerConfig(policy="xshare-ep", k0=1, rank_budget=1)
    assert _keep(cfg, expert_to_rank=ranks) == _mask(0, 1, 2, 3, 4)
    # Without warm-up: round 1 adds e0, e3, e4 (rank 3 has nothing); 3 < 4, so round 2 adds e1
    # and e2; 5 >= 4: stop.
    cfg = PrunerConfig(policy="xshare-ep", k0=0, rank_budget=1)
    assert _keep(cfg, expert_to_rank=ranks) == _mask(0, 1, 2, 3, 4)
    # Two ranks {0..3} {4..7}, no warm-up, target 2: round 1 adds e0 and e4.
    cfg = PrunerConfig(policy="xshare-ep", k0=0, rank_budget=1)
    assert _keep(cfg, expert_to_rank=torch.tensor([0] * 4 + [1] * 4)) == _mask(0, 4)


def test_threshold_stops_exactly_at_tau() -> None:
    """One token with two equal logits: both weigh exactly .5.  W(1) = {0} already holds .5 of the
    total, which reaches tau = .5, so e1 is not added; any tau above .5 adds it."""
    logits = torch.tensor([[1.0, 1.0, -5.0]])
    kwargs = dict(top_k=2)
    half = PrunerConfig(policy="xshare-threshold", k0=1, tau=0.5)
    more = PrunerConfig(policy="xshare-threshold", k0=1, tau=0.5000001)
    assert select_experts_mask(logits, half, **kwargs).tolist() == [True, False, False]
    assert select_experts_mask(logits, more, **kwargs).tolist() == [True, True, False]


def test_ties_go_to_the_lower_index() -> None:
    """Equal logits everywhere: warm-up, greedy and moe-spec all pick the lowest indices."""
    logits = torch.zeros(3, 6)
    assert select_experts_mask(logits, PrunerConfig(policy="oea", k0=2), top_k=2).tolist() == _mask(0, 1, num_experts=6)
    cfg = PrunerConfig(policy="xshare", k0=0, budget=3, score="probs")
    assert select_experts_mask(logits, cfg, top_k=2).tolist() == _mask(0, 1, 2, num_experts=6)
    cfg = PrunerConfig(policy="moe-spec", max_experts=4)
    assert select_experts_mask(logits, cfg, top_k=2).tolist() == _mask(0, 1, 2, 3, num_experts=6)


def test_moe_spec_static_ranking(tmp_path) -> None:
    """Counts 5,1,0,9,3,3,0,0: top-3 = e3 (9), e0 (5), then e4 and e5 tie at 3 -> the lower, e4."""
    path = tmp_path / "ranking.json"
    path.write_text(
        json.dumps(
            {
                "format": "xshare-sglang.static-ranking",
                "version": 1,
                "num_layers": 2,
                "num_experts": 8,
                "counts": [[5, 1, 0, 9, 3, 3, 0, 0], [0, 0, 0, 0, 1, 1, 1, 1]],
            }
        )
    )
    cfg = PrunerConfig(policy="moe-spec", max_experts=3, ranking="static", static_ranking_path=str(path))
    assert _keep(cfg, layer_id=0) == _mask(0, 3, 4)
    assert _keep(cfg, layer_id=1) == _mask(4, 5, 6)
    assert _keep(cfg, layer_id=0, num_valid_tokens=0) == _mask()
    with pytest.raises(ValueError, match="layer_id"):
        _keep(cfg)


def test_lynx_remaps_near_ties() -> None:
    """T=3, E=4, top_k=2, alpha=1, beta=1 (bins 0 and -1), n=3.

    t0 [ 2,  0, -1, 1.5 ]  bins [ 0, -1, -1,  0]
    t1 [ 2, -1, -1, 1.95]  bins [ 0, -1, -1,  0]
    t2 [-1,  0,  2, -5  ]  bins [-1, -1,  0, -1]
    s = sum 3**bin: e0 1+1+1/3 = 7/3, e1 1, e2 5/3, e3 7/3.
    Picks: t0 {0, 3}, t1 {0, 3}; t2 takes e2 (bin 0), then in bin -1 the highest s: e0 and e3 tie
    at 7/3, e0 has the higher logit -> e0.  Keep {0, 2, 3}: e1, t2's natural second choice, is gone.
    """
    logits = torch.tensor([[2.0, 0.0, -1.0, 1.5], [2.0, -1.0, -1.0, 1.95], [-1.0, 0.0, 2.0, -5.0]])
    cfg = PrunerConfig(policy="lynx", alpha=1.0, beta=1)
    assert select_experts_mask(logits, cfg, top_k=2).tolist() == [True, False, True, True]
    natural = PrunerConfig(policy="oea", k0=2)
    assert select_experts_mask(logits, natural, top_k=2).tolist() == [True, True, True, True]


def test_lynx_single_token_keeps_its_own_top_k() -> None:
    """With one token s is the same for every expert (1 ** bin = 1): picks follow bins, then logits."""
    logits = torch.tensor([[0.3, 2.0, 1.9, -4.0, 1.0]])
    cfg = PrunerConfig(policy="lynx", alpha=1.0, beta=2)
    assert select_experts_mask(logits, cfg, top_k=2).tolist() == [False, True, True, False, False]


class TestRouteWithin:
    keep = torch.tensor(_mask(0, 3))

    def test_substitution(self) -> None:
        ids, weights = route_within(_logits(), self.keep, top_k=2)
        # every token routes to its two kept experts in logit order
        assert ids.tolist() == [[0, 3], [0, 3], [3, 0], [0, 3]]
        # softmax over the kept experts: 3 vs -10 for t0..t2; t3 has -10 for both kept experts
        near_one = 1 / (1 + torch.exp(torch.tensor(-13.0)))
        expected = torch.tensor([[near_one, 1 - near_one]] * 2 + [[near_one, 1 - near_one], [0.5, 0.5]])
        torch.testing.assert_close(weights, expected)

    def test_truncation(self) -> None:
        ids, weights = route_within(_logits(), self.keep, top_k=2, coverage="truncation")
        # natural top-2 kept in place, pruned slots -1
        assert ids.tolist() == [[0, -1], [0, -1], [3, -1], [-1, -1]]
        w = lambda gap: 1 / (1 + torch.exp(torch.tensor(-gap)))  # noqa: E731  top-1 share of a pair
        expected = torch.tensor([[w(1.0), 0.0], [w(0.1), 0.0], [w(2.0), 0.0], [0.0, 0.0]])
        torch.testing.assert_close(weights, expected)

    def test_few_kept_candidates(self) -> None:
        ids, weights = route_within(_logits(), torch.tensor(_mask(4)), top_k=2)
        assert ids.tolist() == [[4, -1]] * 4
        torch.testing.assert_close(weights, torch.tensor([[1.0, 0.0]] * 4))

    def test_padding_rows(self) -> None:
        ids, weights = route_within(_logits(), self.keep, top_k=2, num_valid_tokens=torch.tensor(3))
        assert ids[3].tolist() == [-1, -1] and weights[3].tolist() == [0.0, 0.0]
        assert ids.dtype == torch.int32


def test_scores_below_the_grid_count_as_zero() -> None:
    """One token, logits [0, -12, -40], probs score: e1 has probability e**-12 = 6.1e-6, at least
    2**-24 (6.0e-8), so its aggregate is > 0 and greedy may add it; e2 has e**-40 = 4e-18, below the
    grid: aggregate 0, never added."""
    logits = torch.tensor([[0.0, -12.0, -40.0]])
    cfg = PrunerConfig(policy="xshare", k0=1, budget=2, score="probs")
    assert select_experts_mask(logits, cfg, top_k=1).tolist() == [True, True, False]


def test_lynx_scores_compare_exactly_across_carries() -> None:
    """n = 2 tokens, alpha = 1, beta = 1 (bins 0 and -1); experts X=0, A=1, C=2.

    t0 [5, 0, 4.5]: bins X 0, A -1, C 0.    t1 [5, 0, 0]: bins X 0, A -1, C -1.
    s = sum 2**bin: X 2, A 1/2 + 1/2 = 1 (two tokens in one bin carry into the next digit), C 1.5.
    t1 picks X, then A or C (both bin -1, equal logits): C has the larger s.  Keep {X, C}.
    """
    logits = torch.tensor([[5.0, 0.0, 4.5], [5.0, 0.0, 0.0]])
    cfg = PrunerConfig(policy="lynx", alpha=1.0, beta=1)
    assert select_experts_mask(logits, cfg, top_k=2).tolist() == [True, False, True]
