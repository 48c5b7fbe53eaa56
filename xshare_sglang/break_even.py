"""Where pruning pays: the start-up guard's decision, a pure function of a timing table.

Pruning trades the selection's cost for fewer expert reads.  The guard (``--moe-pruner-guard auto``)
times the model's MoE layers at start-up, unpruned and pruned, for every real-token bucket the server
will run, and keeps pruning only in the buckets where the pruned layers are faster by a margin:

    prune the bucket  <=>  median(pruned) < (1 - margin) * median(unpruned)

Medians make one slow outlier (a page fault, another process) unable to flip a clear decision; the
strict inequality sends ties, and buckets with too few samples to judge, to "off": an operator who
turns the guard on is promised never to be slower, not the most pruning.  Timing may stop early once
every bucket is :func:`settled`: its median ratio clears the margin line by a cushion either way.

While serving, a forward of ``n`` real tokens is judged by the smallest timed bucket of its phase
that holds ``n`` tokens (the CUDA-graph bucket it is padded to), or by the largest bucket when ``n``
exceeds them all.  A phase the guard did not time is not pruned.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

#: Fewest timings of each kind a bucket needs before it may be pruned.
MIN_SAMPLES = 3
#: The share of the unpruned time pruning must save, unless the operator sets another.
DEFAULT_MARGIN = 0.05


@dataclass(frozen=True)
class BucketTiming:
    """The timings of one bucket: seconds per pass over the timed MoE layers.

    Attributes
    ----------
    phase : str
        The forward phase (``decode``, ``verify``, ``extend``, ``mixed``).
    num_tokens : int
        Tokens of the bucket (the padded size of its CUDA graph, or a power of two).
    unpruned_s, pruned_s : tuple of float
        One entry per timed pass, without and with the configured policy (selection included).
    note : str
        Why the bucket cannot be judged (e.g. the selection failed while it was timed); "" if none.
    """

    phase: str
    num_tokens: int
    unpruned_s: tuple[float, ...] = ()
    pruned_s: tuple[float, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class BucketDecision:
    """The guard's decision for one bucket, and the medians it rests on (None: not timed)."""

    phase: str
    num_tokens: int
    unpruned_s: float | None
    pruned_s: float | None
    prune: bool
    reason: str

    @property
    def speedup(self) -> float | None:
        """Unpruned over pruned median time; None when either is missing or zero."""
        if self.unpruned_s is None or not self.pruned_s:
            return None
        return self.unpruned_s / self.pruned_s


def _median(samples: Sequence[float]) -> float | None:
    return statistics.median(samples) if samples else None


def decide(
    timings: Iterable[BucketTiming], margin: float, *, min_samples: int = MIN_SAMPLES
) -> tuple[BucketDecision, ...]:
    """Decide every bucket: prune only where the pruned median beats the unpruned one by ``margin``.

    Parameters
    ----------
    timings : iterable of BucketTiming
    margin : float
        In [0, 1): the share of the unpruned time pruning must save.
    min_samples : int
        A bucket with fewer timings of either kind is not pruned.

    Returns
    -------
    tuple of BucketDecision
        In the order of ``timings``.
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin={margin!r} is invalid: must lie in [0, 1)")
    decisions = []
    for timing in timings:
        unpruned, pruned = _median(timing.unpruned_s), _median(timing.pruned_s)
        if timing.note:
            prune, reason = False, timing.note
        elif min(len(timing.unpruned_s), len(timing.pruned_s)) < min_samples:
            prune = False
            reason = f"{min(len(timing.unpruned_s), len(timing.pruned_s))} timings, {min_samples} needed"
        elif pruned < (1.0 - margin) * unpruned:
            prune, reason = True, f"pruned {unpruned / pruned:.2f}x faster"
        else:
            prune = False
            ratio = unpruned / pruned if pruned > 0 else float("inf")
            reason = f"pruned {ratio:.2f}x, not {1.0 / (1.0 - margin):.2f}x faster"
        decisions.append(BucketDecision(timing.phase, timing.num_tokens, unpruned, pruned, prune, reason))
    return tuple(decisions)


#: A bucket is settled once its median ratio clears the margin line by this share either way.
SETTLED_CUSHION = 0.1


def settled(timing: BucketTiming, margin: float, *, min_samples: int = MIN_SAMPLES) -> bool:
    """Whether more timings are not needed: the bucket is ruled out, or it has ``min_samples`` of each
    kind and its pruned/unpruned median ratio lies more than :data:`SETTLED_CUSHION` away from the
    margin line ``1 - margin`` (a decision that noise of that size could not flip)."""
    if timing.note:
        return True
    if min(len(timing.unpruned_s), len(timing.pruned_s)) < min_samples:
        return False
    ratio = statistics.median(timing.pruned_s) / statistics.median(timing.unpruned_s)
    line = 1.0 - margin
    return ratio < line * (1.0 - SETTLED_CUSHION) or ratio > line * (1.0 + SETTLED_CUSHION)


@dataclass(frozen=True)
class GuardTable:
    """The decisions the server applies while it serves.

    Attributes
    ----------
    decisions : tuple of BucketDecision
    seconds : float
        Start-up time the guard took.
    source : str
        Where the timed layers' router logits came from (for the log).
    timed_layers : int
        MoE layers each timed pass went over (0 where not recorded): the pass times are that many
        layers' worth.
    """

    decisions: tuple[BucketDecision, ...]
    seconds: float = 0.0
    source: str = ""
    timed_layers: int = 0  # MoE layers each timed pass went over (0: not recorded)
    _buckets: dict[str, tuple[list[int], list[bool]]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        by_phase: dict[str, list[BucketDecision]] = {}
        for decision in self.decisions:
            by_phase.setdefault(decision.phase, []).append(decision)
        for phase, rows in by_phase.items():
            rows.sort(key=lambda row: row.num_tokens)
            tokens = [row.num_tokens for row in rows]
            if len(set(tokens)) != len(tokens):
                raise ValueError(f"phase {phase!r} has two decisions for one bucket: {tokens}")
            self._buckets[phase] = (tokens, [row.prune for row in rows])

    def guards(self, phase: str | None) -> bool:
        """Whether the guard timed this phase (a phase it did not time is never pruned)."""
        return phase in self._buckets

    def decision_for(self, phase: str | None, num_tokens: int) -> BucketDecision | None:
        """The decision a forward of ``num_tokens`` tokens in ``phase`` is judged by (the smallest timed
        bucket that holds it, or the largest); None for a phase the guard did not time."""
        rows = sorted((d for d in self.decisions if d.phase == phase), key=lambda d: d.num_tokens)
        if not rows:
            return None
        index = bisect.bisect_left([d.num_tokens for d in rows], num_tokens)
        return rows[min(index, len(rows) - 1)]

    def prunes(self, phase: str | None, num_tokens: int) -> bool:
        """Whether a forward of ``num_tokens`` real (or padded) tokens in ``phase`` is pruned."""
        if phase not in self._buckets:
            return False
        tokens, prune = self._buckets[phase]
        index = bisect.bisect_left(tokens, num_tokens)
        return prune[min(index, len(tokens) - 1)]
