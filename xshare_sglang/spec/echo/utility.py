"""The batch objective behind ECHO's reallocation (ECHO App. A.2-A.3, Theorem 2), for offline analysis.

With a fixed verification budget, a verify step costs about the same whatever the split, so the
batch does best by maximising the sum of expected accepted lengths ``sum_i f_i(K_i)``, where
``f_i(k)`` is request i's expected accepted length with k verified candidates.  Moving one
candidate from i to j changes the sum by ``Δ_j(K_j + 1) - Δ_i(K_i)`` (``Δ_i(k) = f_i(k) -
f_i(k - 1)``): positive exactly when j's next candidate is worth more than i's last one.  With
concave curves, serving the highest marginal gains first reaches the optimum, where no such exchange
is left.  These helpers let replay reports compare a schedule against that bound.
"""

from __future__ import annotations

from collections.abc import Sequence


def marginal_gain(curve: Sequence[float], k: int) -> float:
    """``Δ(k) = f(k) - f(k - 1)`` for ``1 <= k < len(curve)`` (``curve[k] = f(k)``)."""
    if not 1 <= k < len(curve):
        raise ValueError(f"marginal gain of candidate {k} is undefined on a curve of {len(curve)} points")
    return curve[k] - curve[k - 1]


def batch_objective(curves: Sequence[Sequence[float]], allocation: Sequence[int]) -> float:
    """``sum_i f_i(K_i)``."""
    if len(curves) != len(allocation):
        raise ValueError(f"{len(curves)} response curves for {len(allocation)} allocations")
    return sum(curve[k] for curve, k in zip(curves, allocation, strict=True))


def improving_exchange(curves: Sequence[Sequence[float]], allocation: Sequence[int]) -> tuple[int, int] | None:
    """A pair ``(i, j)`` with ``Δ_j(K_j + 1) > Δ_i(K_i)`` (give one of i's candidates to j), the
    largest improvement first; None when the allocation admits none."""
    best, pair = 0.0, None
    for i, (curve_i, k_i) in enumerate(zip(curves, allocation, strict=True)):
        if k_i < 1:
            continue
        loss = marginal_gain(curve_i, k_i)
        for j, (curve_j, k_j) in enumerate(zip(curves, allocation, strict=True)):
            if j == i or k_j + 1 >= len(curve_j):
                continue
            gain = marginal_gain(curve_j, k_j + 1) - loss
            if gain > best:
                best, pair = gain, (i, j)
    return pair


def greedy_allocation(curves: Sequence[Sequence[float]], k_max: int) -> list[int]:
    """Spend ``k_max`` candidates one at a time on the highest next marginal gain (ties: lower
    request index); optimal for concave curves.  Stops early when every curve is exhausted."""
    allocation = [0] * len(curves)
    for _ in range(k_max):
        options = [
            (marginal_gain(curve, k + 1), -i)
            for i, (curve, k) in enumerate(zip(curves, allocation, strict=True))
            if k + 1 < len(curve)
        ]
        if not options:
            break
        allocation[-max(options)[1]] += 1
    return allocation
