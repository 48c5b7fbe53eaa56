"""The start-up guard's decision, a pure function of a timing table, on synthetic tables: clear
gains kept, clear losses and ties turned off, noise that cannot flip a clear decision, buckets with
too few timings left off, and the serving-time lookup of a forward's bucket."""

from __future__ import annotations

import contextlib
import random

import pytest

from xshare_sglang.break_even import MIN_SAMPLES, BucketTiming, GuardTable, decide
from xshare_sglang.config import PrunerConfig
from xshare_sglang.sglang_plugin.guard import plan_buckets, powers_of_two

pytestmark = pytest.mark.break_even


def _timing(unpruned: float, pruned: float, *, n: int = 7, noise: float = 0.0, seed: int = 0, tokens: int = 8):
    rng = random.Random(seed)
    jitter = [rng.gauss(0.0, noise) for _ in range(2 * n)]
    return BucketTiming(
        "decode",
        tokens,
        tuple(max(1e-9, unpruned * (1 + j)) for j in jitter[:n]),
        tuple(max(1e-9, pruned * (1 + j)) for j in jitter[n:]),
    )


@pytest.mark.parametrize(
    ("unpruned", "pruned", "margin", "prune"),
    [
        (1.0, 0.5, 0.05, True),  # twice as fast
        (1.0, 0.96, 0.05, False),  # faster, but by less than the margin
        (1.0, 0.94, 0.05, True),  # faster by more than the margin
        (1.0, 1.0, 0.0, False),  # a tie falls to off, even with no margin
        (1.0, 0.999, 0.0, True),  # any gain with no margin
        (1.0, 1.5, 0.05, False),  # slower
    ],
)
def test_decision_on_clean_tables(unpruned, pruned, margin, prune) -> None:
    (decision,) = decide([_timing(unpruned, pruned)], margin)
    assert decision.prune is prune
    assert decision.unpruned_s == pytest.approx(unpruned) and decision.pruned_s == pytest.approx(pruned)
    assert decision.speedup == pytest.approx(unpruned / pruned)


@pytest.mark.parametrize("seed", range(20))
def test_noise_does_not_flip_a_clear_decision(seed) -> None:
    """10% Gaussian noise plus one wild outlier per variant: a 1.6x gain stays on, a 1.25x loss stays off."""
    gain, loss = _timing(1.0, 0.625, noise=0.1, seed=seed), _timing(1.0, 1.25, noise=0.1, seed=seed + 100)
    gain = BucketTiming("decode", 8, (*gain.unpruned_s[:-1], 0.01), (*gain.pruned_s[:-1], 50.0))
    loss = BucketTiming("decode", 16, (*loss.unpruned_s[:-1], 50.0), (*loss.pruned_s[:-1], 0.01))
    first, second = decide([gain, loss], 0.05)
    assert first.prune and not second.prune


@pytest.mark.parametrize("seed", range(20))
def test_equal_distributions_fall_to_off(seed) -> None:
    """Pruned and unpruned from one noisy distribution: with a 5% margin the bucket is never pruned."""
    rng = random.Random(seed)
    same = [1.0 + rng.gauss(0.0, 0.01) for _ in range(14)]
    (decision,) = decide([BucketTiming("decode", 4, tuple(same[:7]), tuple(same[7:]))], 0.05)
    assert not decision.prune


def test_too_few_timings_and_failed_selection_stay_off() -> None:
    short = BucketTiming("decode", 1, (1.0,) * (MIN_SAMPLES - 1), (0.1,) * (MIN_SAMPLES - 1))
    failed = BucketTiming("decode", 2, (1.0,) * 5, (0.1,) * 5, note="the selection failed while it was timed")
    untimed = BucketTiming("decode", 4)
    decisions = decide([short, failed, untimed], 0.05)
    assert [d.prune for d in decisions] == [False, False, False]
    assert decisions[0].reason == f"{MIN_SAMPLES - 1} timings, {MIN_SAMPLES} needed"
    assert decisions[1].reason == "the selection failed while it was timed"
    assert decisions[2].unpruned_s is None and decisions[2].speedup is None


@pytest.mark.parametrize("margin", [-0.1, 1.0, 2.0])
def test_margin_outside_zero_one_is_refused(margin) -> None:
    with pytest.raises(ValueError, match="margin"):
        decide([_timing(1.0, 0.5)], margin)


def test_forwards_are_judged_by_the_bucket_they_are_padded_to() -> None:
    timings = [_timing(1.0, p, tokens=t) for t, p in [(1, 1.2), (2, 1.1), (4, 0.8), (8, 0.5)]]
    verify = [BucketTiming("verify", 16, (1.0,) * 3, (2.0,) * 3)]
    table = GuardTable(decide([*timings, *verify], 0.05))
    assert [table.prunes("decode", n) for n in (1, 2, 3, 4, 5, 8, 9, 1000)] == [
        False,
        False,
        True,  # 3 tokens run in the graph of 4
        True,
        True,
        True,
        True,  # beyond the largest bucket: the largest bucket's decision
        True,
    ]
    assert not table.prunes("verify", 3) and not table.prunes("verify", 64)
    assert table.guards("decode") and not table.guards("extend") and not table.prunes("extend", 100)
    with pytest.raises(ValueError, match="two decisions for one bucket"):
        GuardTable(decide([_timing(1, 0.5, tokens=4), _timing(1, 0.5, tokens=4)], 0.05))


def test_buckets_of_each_phase() -> None:
    cfg = PrunerConfig(policy="xshare", k0=1)
    configs = {"decode": cfg, "verify": cfg, "extend": cfg, "mixed": PrunerConfig()}
    buckets = plan_buckets(configs, batch_sizes=[1, 2, 4, 3], draft_tokens=4, prefill_tokens=20)
    assert [(b.phase, b.num_tokens, b.tokens_per_request) for b in buckets] == [
        ("decode", 1, 1),
        ("decode", 2, 1),
        ("decode", 3, 1),
        ("decode", 4, 1),
        ("verify", 4, 4),
        ("verify", 8, 4),
        ("verify", 12, 4),
        ("verify", 16, 4),
        ("extend", 1, 1),
        ("extend", 2, 1),
        ("extend", 4, 1),
        ("extend", 8, 1),
        ("extend", 16, 1),
        ("extend", 20, 1),
    ]
    assert [b.phase for b in plan_buckets(configs, batch_sizes=[1], draft_tokens=0, prefill_tokens=1)] == [
        "decode",
        "extend",
    ]
    assert powers_of_two(1) == [1] and powers_of_two(48) == [1, 2, 4, 8, 16, 32, 48]


def test_adaptive_speculation_times_verify_at_every_width() -> None:
    """--speculative-adaptive verifies with D = steps + 1 of each candidate step count: every width's
    token counts are timed, a count two widths reach once (at the larger D), and D = 1 (0 steps, a
    decode step) adds no verify bucket."""
    cfg = PrunerConfig(policy="xshare", k0=1)
    buckets = plan_buckets({"verify": cfg}, batch_sizes=[1, 2, 4], draft_tokens=[1, 2, 4], prefill_tokens=1)
    assert [(b.num_tokens, b.tokens_per_request) for b in buckets] == [(2, 2), (4, 4), (8, 4), (16, 4)]
    assert plan_buckets({"verify": cfg}, batch_sizes=[1, 2], draft_tokens=[1], prefill_tokens=1) == []


# ---------------------------------------------------------------------- the timing loop, with a fake clock
class _FakeRuntime:
    """What time_buckets reads of the plugin's runtime: scopes, the fault count, the metrics (and
    whether its calls run as the forwards the metrics sampling skips)."""

    def __init__(self, failing_tokens: int | None = None) -> None:
        import torch

        self.scope = None
        self.faults = 0
        self.metrics = torch.ones(2, 4, dtype=torch.int64)
        self.failing_tokens = failing_tokens
        self.device = torch.device("cpu")
        self.sampling_skipped = False

    @contextlib.contextmanager
    def unsampled(self):
        self.sampling_skipped = True
        try:
            yield
        finally:
            self.sampling_skipped = False

    def enter(self, scope):
        previous, self.scope = self.scope, scope
        return previous

    def leave(self, previous) -> None:
        self.scope = previous


class _FakeLayer:
    """A timed layer whose 'top-k' notes the scope it ran under (and fails where told to)."""

    def __init__(self, runtime: _FakeRuntime, calls: list) -> None:
        import torch

        self.runtime, self.calls = runtime, calls
        self.router_logits = torch.zeros(64, 4)
        self.hidden = torch.zeros(64, 4)

    def topk(self, states, logits):
        scope = self.runtime.scope
        pruned = scope.cfg is not None
        assert self.runtime.sampling_skipped  # timed as the forwards a sampling server mostly serves
        self.runtime.last = (scope.phase, logits.shape[0], pruned)
        self.calls.append(self.runtime.last)
        if pruned and logits.shape[0] == self.runtime.failing_tokens:
            self.runtime.faults += 1
        return None

    def experts(self, states, output) -> None:
        return None


class _FakeClock:
    """Seconds by (tokens, pruned): pruning halves the time above 8 tokens and doubles it below."""

    def __init__(self, runtime: _FakeRuntime) -> None:
        self.runtime = runtime
        self.timed = 0

    def time(self, work) -> float:
        work()
        self.timed += 1
        _, tokens, pruned = self.runtime.last
        base = 1e-3 * tokens
        return base * (0.5 if tokens > 8 else 2.0) if pruned else base


def _time(budget_s: float = 60.0, failing_tokens: int | None = None):

    from xshare_sglang.sglang_plugin import guard

    runtime = _FakeRuntime(failing_tokens)
    calls: list = []
    layer = _FakeLayer(runtime, calls)
    cfg = PrunerConfig(policy="xshare", k0=1)
    buckets = plan_buckets({"decode": cfg}, batch_sizes=[1, 4, 16, 64], draft_tokens=0, prefill_tokens=1)
    clock = _FakeClock(runtime)
    timings = guard.time_buckets(runtime, [layer], buckets, budget_s=budget_s, margin=0.05, clock=clock)
    return timings, calls, runtime, clock


def test_timing_rounds_alternate_variants_and_stop_once_settled() -> None:
    timings, calls, runtime, clock = _time()
    # warm-up (untimed) of every bucket and variant, then three rounds settle every clear bucket
    assert [len(t.unpruned_s) for t in timings] == [MIN_SAMPLES] * 4
    assert clock.timed == 2 * 4 * MIN_SAMPLES
    assert calls[:2] == [("decode", 1, False), ("decode", 1, True)]
    rounds = calls[8:]
    assert rounds[0][2] is False and rounds[1][2] is True  # bucket 1, round 0: unpruned first
    assert rounds[2][2] is True and rounds[3][2] is False  # bucket 4, round 0: pruned first
    assert [d.prune for d in decide(timings, 0.05)] == [False, False, True, True]
    assert int(runtime.metrics.sum()) == 0  # the timed calls are not reported as served traffic


def test_a_failing_selection_rules_its_bucket_out() -> None:
    timings, *_ = _time(failing_tokens=16)
    decisions = decide(timings, 0.05)
    assert [d.prune for d in decisions] == [False, False, False, True]
    assert decisions[2].reason == "the selection failed while it was timed"


def test_a_spent_budget_leaves_buckets_untimed_and_off() -> None:
    timings, calls, _, clock = _time(budget_s=0.0)
    assert clock.timed == 0 and len(calls) == 0
    assert not any(d.prune for d in decide(timings, 0.05))
