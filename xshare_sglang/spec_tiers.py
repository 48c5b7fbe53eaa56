"""Expert-aware speculation tiers: which of SGLang's adaptive step counts beat no speculation.

SGLang's adaptive speculation (``--speculative-adaptive``) keeps, per batch-size bucket, a list of
candidate step counts and moves between them by the accepted length alone; its tiers know nothing of
what a verify step costs.  In a MoE target each extra draft token can pull in more distinct experts,
so a verify forward of D = steps + 1 tokens per request costs more than a decode step, by an amount
that depends on the batch and on how many experts the pruner lets it read.  This module decides, per
bucket, which candidates are worth running:

    tokens per second of a request at s steps  =  (1 + a(s)) / T(b, s)
    keep s > 0  <=>  (1 - margin) * (1 + a(s)) / T(b, s)  >  1 / T(b, 0)

where ``a(s)`` is the expected number of accepted draft tokens with s steps (a chain, EAGLE top-k 1:
the sum over depths j <= s of the observed share of requests whose j-th draft token was accepted,
pooled over every bucket, since draft quality does not depend on the batch), and ``T(b, s)`` the time
of one step for a batch of bucket b: measured where the server ran it, else the target forward of
b * (s + 1) rows plus the draft side (:class:`StepCosts`).  0 steps (no drafting) is kept where the
bucket has it; a bucket whose positive candidates all lose, and which cannot stop drafting, keeps its
best candidate alone.  Until every depth a bucket's candidates reach has :data:`MIN_OBSERVATIONS`,
and its costs are known, that bucket keeps SGLang's candidates.

Pure functions of the observations: the plugin (``sglang_plugin/adaptive_tiers.py``) feeds them and
applies the result to SGLang's slots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

#: Requests that must have drafted a depth before its acceptance counts.
MIN_OBSERVATIONS = 16


@dataclass
class AcceptanceByDepth:
    """Per draft depth j (1-based): how many requests drafted at least j tokens in a verify, and how
    many of those accepted at least j (a chain is accepted as a prefix)."""

    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    def observe(self, steps: int, accepted_per_request: Sequence[int]) -> None:
        """One verify of ``steps`` draft tokens per request; ``accepted_per_request`` holds each
        request's accepted draft tokens (0..steps; larger values are clamped)."""
        if steps <= 0 or not accepted_per_request:
            return
        while len(self.drafted) < steps:
            self.drafted.append(0)
            self.accepted.append(0)
        for count in accepted_per_request:
            count = max(0, min(int(count), steps))
            for depth in range(steps):
                self.drafted[depth] += 1
                self.accepted[depth] += depth < count

    def share(self, depth: int) -> float | None:
        """The observed share of requests that accepted their ``depth``-th draft token; None with
        fewer than :data:`MIN_OBSERVATIONS`."""
        if depth > len(self.drafted) or self.drafted[depth - 1] < MIN_OBSERVATIONS:
            return None
        return self.accepted[depth - 1] / self.drafted[depth - 1]

    def expected_accepted_at_most(self, steps: int) -> float | None:
        """An upper bound on a(steps) from the depths observed enough: their shares, and for deeper
        depths the last observed share again (a chain's share never grows with depth); None when
        depth 1 is not observed enough."""
        total, last = 0.0, None
        for depth in range(1, steps + 1):
            share = self.share(depth)
            if share is None:
                if last is None:
                    return None
                share = last
            total += share
            last = share
        return total

    def expected_accepted(self, steps: int) -> float | None:
        """a(steps): expected accepted draft tokens per request with ``steps`` steps; None until every
        depth up to ``steps`` is observed enough."""
        total = 0.0
        for depth in range(1, steps + 1):
            share = self.share(depth)
            if share is None:
                return None
            total += share
        return total


@dataclass
class StepCosts:
    """What one speculative step costs, per batch-size bucket: the target's verify (or, at 0 steps,
    decode) forward of D = steps + 1 tokens per request, and the draft side, which runs ``steps``
    draft decode steps and one draft extend: about steps + 1 draft forwards.

    Attributes
    ----------
    moe_s : dict of (bucket, D) to float
        The target's MoE stack for a forward of bucket * D rows, as served (pruned where the server
        prunes it), timed at start-up; missing where not timed.
    target_s : dict of (bucket, D) to float
        Measured target forwards (running means), where the server has run them.
    step_s_measured : dict of (bucket, steps) to float
        Measured whole steps (draft, verify, draft extend), where the server has run them.
    """

    moe_s: dict[tuple[int, int], float] = field(default_factory=dict)
    target_s: dict[tuple[int, int], float] = field(default_factory=dict)
    step_s_measured: dict[tuple[int, int], float] = field(default_factory=dict)

    def fixed_s(self, bucket: int) -> float:
        """The bucket's target forward time outside the timed MoE stack (attention, dense layers, the
        lm head): the mean of measured forward minus MoE stack over the D values with both; 0 if none."""
        rests = [
            seconds - self.moe_s[(b, d)]
            for (b, d), seconds in self.target_s.items()
            if b == bucket and (b, d) in self.moe_s
        ]
        return max(0.0, sum(rests) / len(rests)) if rests else 0.0

    def target_forward_s(self, bucket: int, d: int) -> float | None:
        """The target forward of D tokens per request: measured, else the fixed part plus the timed
        MoE stack; None where neither is known."""
        measured = self.target_s.get((bucket, d))
        if measured is not None:
            return measured
        moe = self.moe_s.get((bucket, d))
        return None if moe is None else self.fixed_s(bucket) + moe

    def draft_forward_s(self, bucket: int) -> float:
        """One draft forward: (measured step - measured target forward) / (steps + 1), averaged over
        this bucket's measured steps, else over every bucket's; 0 if none."""

        def shares(only: int | None) -> list[float]:
            out = []
            for (b, steps), seconds in self.step_s_measured.items():
                target = self.target_s.get((b, steps + 1))
                if target is not None and (only is None or b == only):
                    out.append(max(0.0, seconds - target) / (steps + 1))
            return out

        values = shares(bucket) or shares(None)
        return sum(values) / len(values) if values else 0.0

    def step_s(self, bucket: int, steps: int) -> float | None:
        """T(bucket, steps): the measured step where there is one, else the target forward of
        D = steps + 1 plus steps + 1 draft forwards.  None where the target forward is not known."""
        measured = self.step_s_measured.get((bucket, steps))
        if measured is not None:
            return measured
        target = self.target_forward_s(bucket, steps + 1)
        return None if target is None else target + (steps + 1) * self.draft_forward_s(bucket)


@dataclass(frozen=True)
class TierDecision:
    """One bucket's tiers: SGLang's candidates, the ones kept, and the expected rates they rest on
    (tokens per second per request; None where a cost or an acceptance is not known yet)."""

    batch_size: int
    candidates: tuple[int, ...]
    allowed: tuple[int, ...]
    rates: Mapping[int, float | None]
    reason: str


def choose_tiers(
    candidates: Mapping[int, Sequence[int]],
    costs: StepCosts,
    acceptance: AcceptanceByDepth,
    margin: float,
) -> dict[int, TierDecision]:
    """Per bucket, the candidate step counts that beat no speculation by ``margin`` (see the module).

    A positive step count is dropped once even the upper bound of its acceptance
    (:meth:`AcceptanceByDepth.expected_accepted_at_most`) loses; it is kept when its exact rate wins,
    or while its cost or acceptance is not known well enough to tell.  ``rates`` hold the exact rates
    (None where not known).
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin!r} is invalid: must lie in [0, 1)")
    decisions = {}
    for bucket, steps_list in sorted(candidates.items()):
        steps_list = tuple(sorted(set(steps_list)))
        baseline_s = costs.step_s(bucket, 0)
        rates: dict[int, float | None] = {}
        kept, lost, open_ = [], [], []
        for steps in steps_list:
            step_s = costs.step_s(bucket, steps)
            if steps == 0:
                rates[0] = None if not step_s else 1.0 / step_s
                continue
            exact = acceptance.expected_accepted(steps)
            bound = acceptance.expected_accepted_at_most(steps)
            rates[steps] = None if not step_s or exact is None else (1 + exact) / step_s
            if not step_s or not baseline_s or bound is None:
                open_.append(steps)
            elif (1.0 - margin) * (1 + bound) / step_s <= 1.0 / baseline_s:
                lost.append(steps)
            elif rates[steps] is not None and (1.0 - margin) * rates[steps] > 1.0 / baseline_s:
                kept.append(steps)
            else:
                open_.append(steps)
        positive = sorted(kept + open_)
        if not lost:
            reason = "no step count ruled out" if not open_ else "not known yet: SGLang's tiers"
            allowed = steps_list
        elif positive or 0 in steps_list:
            allowed = tuple(([0] if 0 in steps_list else []) + positive)
            reason = f"steps {lost} do not beat no speculation"
        else:
            best = max(lost, key=lambda s: -1.0 if rates[s] is None else rates[s])
            allowed = (best,)
            reason = "no step count beats no speculation, and the bucket cannot stop drafting"
        decisions[bucket] = TierDecision(bucket, steps_list, allowed, rates, reason)
    return decisions
