"""Expert-aware tiers for SGLang's adaptive speculation: ``--moe-pruner-guard auto`` with
``--speculative-adaptive``.

SGLang keeps, per batch-size bucket, the candidate step counts of its adaptive config
(``AdaptiveStepSlot.candidate_steps``, adaptive_spec_params.py:156, 0.5.23) and moves between them by
the accepted length.  With the guard on, this module narrows each bucket's candidates to the step
counts whose expected accepted tokens per second beat no speculation
(:func:`xshare_sglang.spec_tiers.choose_tiers`), from:

* the target's MoE stack per bucket and D = steps + 1, as the server runs it (pruned where the
  guard prunes that bucket, else unpruned), from the guard's start-up timings (a bucket of b requests
  at D is judged by the guard's bucket of b * D rows, scaled from the timed layers to all of them);
* the target forwards and the whole speculative steps (draft, verify, draft extend) measured while
  serving (wall clock on CPU; CUDA events on a GPU, read once complete, never waited for): a target
  forward's time outside the MoE stack is the measured forward minus the timed MoE stack, a draft
  forward's the step minus its target forward over steps + 1;
* the acceptance SGLang reports after each verify, per draft depth, pooled over buckets.

Every :data:`UPDATE_EVERY` verifies the tiers are chosen again; a change is logged with the rates it
rests on, applied to SGLang's slots (a bucket whose step count is no longer allowed moves to the
largest allowed one below it, else the smallest) and published as ``moe_pruner:speculative_steps``
and ``moe_pruner:spec_tier_allowed``.  Until the costs and acceptance a bucket needs are known, it
keeps SGLang's candidates.  Nothing here can stop a forward: a failure is counted as a fault and the
tiers stay as they were.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..break_even import GuardTable
from ..spec_tiers import AcceptanceByDepth, StepCosts, TierDecision, choose_tiers

logger = logging.getLogger(__name__)

#: Verifies between two decisions.
UPDATE_EVERY = 20
#: Weight of a new measurement in the running means of forward and draft-step times.
EMA_WEIGHT = 0.2


class _Clock:
    """Times forwards without waiting for the device: CPU wall clock, or CUDA events read once done."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.pending: list[tuple[Any, Any, Any]] = []  # (start event, end event, what it timed)

    def start(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started: Any, key: Any) -> list[tuple[Any, float]]:
        """Finish one timing; returns every (key, seconds) known now (CUDA: those whose events completed)."""
        if not self.cuda:
            return [(key, time.perf_counter() - started)]
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self.pending.append((started, end, key))
        done = []
        while self.pending and self.pending[0][1].query():
            start, end, done_key = self.pending.pop(0)
            done.append((done_key, start.elapsed_time(end) / 1000.0))
        return done


def _ema(previous: float | None, value: float) -> float:
    return value if previous is None else (1.0 - EMA_WEIGHT) * previous + EMA_WEIGHT * value


class AdaptiveTiers:
    """The tiers of one scheduler's ``AdaptiveSpeculativeParams`` (``params``), narrowed by cost."""

    def __init__(self, params: Any, guard: GuardTable, *, num_layers: int, margin: float, device) -> None:
        self.params = params
        self.margin = margin
        self.candidates = {int(b): tuple(slot.candidate_steps) for b, slot in params._slots.items()}
        self.acceptance = AcceptanceByDepth()
        self.costs = StepCosts(moe_s=moe_stack_seconds(guard, self.candidates, num_layers))
        self.decisions: dict[int, TierDecision] = {}
        self.clock = _Clock(device)
        self.verifies = 0

    # ------------------------------------------------------------------ observations
    def bucket_of(self, batch_size: int) -> int:
        """SGLang's bucket for a batch: padded to its CUDA-graph size, then the closest config key below."""
        params = self.params
        return int(params._find_closest_bs(params._pad_to_cuda_graph_bs(batch_size)))

    def measured(self, timings: list[tuple[Any, float]]) -> None:
        """Add completed timings: ``("target", bucket, D)`` forwards and ``("step", bucket, steps)``
        whole speculative steps."""
        for (kind, bucket, size), seconds in timings:
            table = self.costs.target_s if kind == "target" else self.costs.step_s_measured
            table[(bucket, size)] = _ema(table.get((bucket, size)), seconds)

    def on_verify(self, batch_size: int, steps: int, accepted_per_request: list[int]) -> bool:
        """One verify of ``steps`` steps: record its acceptance; every :data:`UPDATE_EVERY` verifies
        choose the tiers again.  True when a bucket's tiers changed."""
        self.acceptance.observe(steps, accepted_per_request)
        self.verifies += 1
        if self.verifies % UPDATE_EVERY:
            return False
        return self.update()

    # ------------------------------------------------------------------ decisions
    def update(self) -> bool:
        """Choose the tiers from what is known now, apply and log the buckets that changed."""
        decisions = choose_tiers(self.candidates, self.costs, self.acceptance, self.margin)
        changed = [b for b, d in decisions.items() if b not in self.decisions or self.decisions[b].allowed != d.allowed]
        self.decisions = decisions
        for bucket in changed:
            decision = decisions[bucket]
            slot = self.params._slots[bucket]
            slot.candidate_steps = list(decision.allowed)
            if slot.current_steps not in decision.allowed:
                below = [s for s in decision.allowed if s < slot.current_steps]
                slot.current_steps = max(below) if below else min(decision.allowed)
            logger.info(
                "moe-pruner tiers: batch bucket %d: steps %s of %s (%s); tokens/s per request %s",
                bucket,
                list(decision.allowed),
                list(decision.candidates),
                decision.reason,
                {s: None if r is None else round(r, 3) for s, r in decision.rates.items()},
            )
        return bool(changed)

    def table(self) -> str:
        """The start-up MoE-stack costs, one line per bucket, for the log."""
        lines = []
        for bucket, steps_list in sorted(self.candidates.items()):
            parts = []
            for steps in steps_list:
                moe = self.costs.moe_s.get((bucket, steps + 1))
                parts.append(f"{steps} steps {'not timed' if moe is None else f'{moe * 1e3:.3f} ms'}")
            lines.append(f"batch bucket {bucket}: " + ", ".join(parts))
        return "; ".join(lines)


def moe_stack_seconds(
    guard: GuardTable, candidates: dict[int, tuple[int, ...]], num_layers: int
) -> dict[tuple[int, int], float]:
    """The served MoE stack per (bucket, D), D = 1 (no speculation) included, from the guard's
    decisions: the decision of the phase
    (decode for D = 1, verify above) at bucket * D rows, pruned median where it prunes, unpruned
    otherwise; a phase the guard did not time (its policy is none) takes the unpruned median of any
    timed phase at as many rows (the unpruned MoE stack depends on the rows alone).  Scaled from the
    timed layers to ``num_layers``."""
    scale = num_layers / guard.timed_layers if guard.timed_layers else 1.0
    out = {}
    for bucket, steps_list in candidates.items():
        for steps in {0, *steps_list}:  # 0 steps: the baseline every step count is judged against
            d = steps + 1
            rows = bucket * d
            decision = guard.decision_for("decode" if d == 1 else "verify", rows)
            seconds = None
            if decision is not None:
                seconds = decision.pruned_s if decision.prune else decision.unpruned_s
            else:
                others = [guard.decision_for(phase, rows) for phase in ("verify", "decode")]
                seconds = next((o.unpruned_s for o in others if o is not None and o.unpruned_s is not None), None)
            if seconds is not None:
                out[(bucket, d)] = seconds * scale
    return out


def start_tiers(runtime) -> None:
    """Build ``runtime.tiers`` for SGLang's adaptive params once the guard has timed (logged)."""
    settings = runtime.settings
    tiers = AdaptiveTiers(
        runtime.adaptive,
        runtime.guard,
        num_layers=len(runtime.layers),
        margin=settings.guard_margin,
        device=runtime.device,
    )
    runtime.tiers = tiers
    tiers.update()  # SGLang's candidates while nothing is known: the gauges start from them
    if runtime.reporter is not None:
        runtime.reporter.export_tiers(tiers.decisions)
    logger.info(
        "moe-pruner tiers: expert-aware --speculative-adaptive tiers on (margin %.2f); the MoE stack per step: %s",
        settings.guard_margin,
        tiers.table(),
    )
