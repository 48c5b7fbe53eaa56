"""The expert-aware tier decision (``xshare_sglang.spec_tiers``) on hand-made observations."""

from __future__ import annotations

import pytest

from xshare_sglang.spec_tiers import MIN_OBSERVATIONS, AcceptanceByDepth, StepCosts, choose_tiers


def _acceptance(shares: list[float], n: int = 100) -> AcceptanceByDepth:
    """Observations whose share of requests accepting depth j is ``shares[j-1]`` (a chain: each
    share at most the one before)."""
    acceptance = AcceptanceByDepth()
    depth = len(shares)
    counts = []
    for i in range(n):
        counts.append(sum(1 for share in shares if i < share * n))
    acceptance.observe(depth, counts)
    return acceptance


def test_acceptance_by_depth_is_the_share_of_each_prefix() -> None:
    acceptance = AcceptanceByDepth()
    acceptance.observe(3, [0, 1, 3, 2] * MIN_OBSERVATIONS)
    acceptance.observe(1, [1, 5] * MIN_OBSERVATIONS)  # 5 is clamped to the one drafted token
    n1, n3 = 6 * MIN_OBSERVATIONS, 4 * MIN_OBSERVATIONS
    assert acceptance.drafted == [n1, n3, n3]
    assert acceptance.accepted == [5 * MIN_OBSERVATIONS, 2 * MIN_OBSERVATIONS, MIN_OBSERVATIONS]
    assert acceptance.expected_accepted(1) == pytest.approx(5 / 6)
    assert acceptance.expected_accepted(3) == pytest.approx(5 / 6 + 1 / 2 + 1 / 4)
    assert acceptance.expected_accepted(4) is None  # depth 4 never drafted
    sparse = AcceptanceByDepth()
    sparse.observe(2, [2] * (MIN_OBSERVATIONS - 1))
    assert sparse.share(1) is None and sparse.expected_accepted(1) is None


def test_costs_fill_what_was_not_measured_from_the_moe_timings() -> None:
    """Bucket 1 ran 1 step: its target forward at D = 2 took 5 (3 outside the MoE stack of 2), the
    whole step 7, so a draft forward is (7 - 5) / 2 = 1.  3 steps: fixed 3 + MoE 6 at D = 4, plus
    4 draft forwards; 0 steps: 3 + MoE 1.5 at D = 1, plus one draft forward (the extend)."""
    costs = StepCosts(
        moe_s={(1, 1): 1.5, (1, 2): 2.0, (1, 4): 6.0},
        target_s={(1, 2): 5.0},
        step_s_measured={(1, 1): 7.0},
    )
    assert costs.fixed_s(1) == 3.0 and costs.draft_forward_s(1) == 1.0
    assert costs.step_s(1, 1) == 7.0  # measured
    assert costs.step_s(1, 3) == 3.0 + 6.0 + 4 * 1.0
    assert costs.step_s(1, 0) == 3.0 + 1.5 + 1.0
    assert costs.draft_forward_s(8) == 1.0  # a bucket that never ran takes every bucket's
    assert costs.step_s(8, 1) is None  # neither timed nor run
    assert StepCosts(moe_s={(2, 2): 1.0}).step_s(2, 1) == 1.0  # nothing measured: the MoE stack alone


def test_a_verify_that_reads_many_more_experts_loses_where_acceptance_cannot_pay_for_it() -> None:
    """Bucket 1: verify costs little more than decode, speculation pays.  Bucket 32: 4 tokens per
    request read nearly every expert, 3.2x the decode step; a(3) = 1.75 gives 2.75 tokens, less
    than 3.2: 3 steps loses, 1 step (1.3x the cost, 1.75 tokens) still wins."""
    acceptance = _acceptance([0.75, 0.6, 0.4])
    assert acceptance.expected_accepted(3) == pytest.approx(1.75)
    moe = {(1, 1): 1.0, (1, 2): 1.1, (1, 4): 1.3, (32, 1): 1.0, (32, 2): 1.3, (32, 4): 3.2}
    decisions = choose_tiers({1: [1, 3], 32: [0, 1, 3]}, StepCosts(moe_s=moe), acceptance, margin=0.05)
    assert decisions[1].allowed == (1, 3)
    assert decisions[32].allowed == (0, 1)
    assert decisions[32].rates[3] == pytest.approx(2.75 / 3.2)
    # no acceptance at all: every positive step count loses; bucket 1 cannot stop drafting
    none = choose_tiers({1: [1, 3], 32: [0, 1, 3]}, StepCosts(moe_s=moe), _acceptance([0.0, 0.0, 0.0]), margin=0.05)
    assert none[32].allowed == (0,) and none[1].allowed == (1,)
    assert "cannot stop drafting" in none[1].reason


def test_unknown_costs_or_acceptance_keep_sglangs_tiers() -> None:
    few = AcceptanceByDepth()
    few.observe(3, [3] * (MIN_OBSERVATIONS - 1))
    moe = {(4, 1): 1.0, (4, 2): 1.0, (4, 4): 1.0}
    assert choose_tiers({4: [0, 1, 3]}, StepCosts(moe_s=moe), few, 0.05)[4].allowed == (0, 1, 3)
    untimed = choose_tiers({4: [0, 1, 3]}, StepCosts(moe_s={(4, 1): 1.0}), _acceptance([1.0] * 3), 0.05)
    assert untimed[4].allowed == (0, 1, 3) and untimed[4].reason.startswith("not known yet")
    with pytest.raises(ValueError, match="margin"):
        choose_tiers({4: [0]}, StepCosts(), few, 1.0)


def test_a_depth_never_drafted_is_bounded_by_the_last_one_seen() -> None:
    """Only 1-step verifies seen: a(3) is at most 3 * share(1).  With nothing accepted, 3 steps is ruled
    out without ever running it; with everything accepted at depth 1, 3 steps might win and stays."""
    moe = {(4, 1): 1.0, (4, 2): 1.2, (4, 4): 1.6}
    nothing = AcceptanceByDepth()
    nothing.observe(1, [0] * MIN_OBSERVATIONS)
    assert nothing.expected_accepted(3) is None and nothing.expected_accepted_at_most(3) == 0.0
    decision = choose_tiers({4: [0, 1, 3]}, StepCosts(moe_s=moe), nothing, 0.05)[4]
    assert decision.allowed == (0,) and "[1, 3]" in decision.reason
    everything = AcceptanceByDepth()
    everything.observe(1, [1] * MIN_OBSERVATIONS)
    assert everything.expected_accepted_at_most(3) == 3.0
    assert choose_tiers({4: [0, 1, 3]}, StepCosts(moe_s=moe), everything, 0.05)[4].allowed == (0, 1, 3)


def test_the_served_moe_stack_comes_from_the_guards_decisions() -> None:
    """Per (bucket, D): the decision of its phase at bucket * D rows (the smallest timed bucket that
    holds them), pruned median where it prunes; decode untimed (its policy none) takes the unpruned
    verify median at as many rows; scaled from 4 timed layers to 8."""
    from xshare_sglang.break_even import BucketDecision, GuardTable
    from xshare_sglang.sglang_plugin.adaptive_tiers import moe_stack_seconds

    guard = GuardTable(
        (
            BucketDecision("verify", 2, 1.0, 0.5, True, ""),
            BucketDecision("verify", 8, 3.0, 2.0, True, ""),
            BucketDecision("verify", 32, 9.0, 9.5, False, ""),
        ),
        timed_layers=4,
    )
    assert guard.decision_for("verify", 5).num_tokens == 8 and guard.decision_for("verify", 64).num_tokens == 32
    assert guard.decision_for("decode", 1) is None
    got = moe_stack_seconds(guard, {1: (1,), 4: (0, 1, 3)}, num_layers=8)
    assert got == {
        (1, 1): 2 * 1.0,  # D = 1 (baseline, decode untimed): unpruned verify median at >= 1 row
        (1, 2): 2 * 0.5,
        (4, 1): 2 * 3.0,  # 4 rows: the 8-row bucket's unpruned median
        (4, 2): 2 * 2.0,
        (4, 4): 2 * 9.0,  # 16 rows: the 32-row bucket, not pruned
    }
