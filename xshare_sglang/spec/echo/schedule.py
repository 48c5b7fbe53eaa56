"""ECHO's elastic budget scheduler (ECHO paper, Alg. 1) as one pure function over a batch.

The batch shares one verification budget ``k_max`` (draft nodes, roots excluded).  Depth by depth,
from the first draft depth down, every request still *active* asks for ``default_width`` nodes at
that depth.  At a *gated* depth (a calibrated sweet spot) it must first pass its gate, ``c[i, d] >
threshold[d]``; a request that fails is *truncated* there and asks for nothing more in phase 1.
Requests are served in index order while budget remains (Priority 1: depth for confident requests).
What is left then widens the truncated requests at their truncation depth, ``max_width`` nodes each,
again in index order (Priority 2).

Conventions (the paper leaves them open; these are ours, stated once):

* depth ``d`` counts draft levels from 1 (the root, the last accepted token, is always verified and
  is not part of the budget); arrays of depths are 0-based columns, column ``j`` is depth ``j + 1``;
* a grant never exceeds what is left: the last request served at a depth may get fewer than
  ``default_width`` nodes, and nobody after it gets any;
* ``per_request_cap`` bounds each request's nodes (SGLang's fixed layout has room for D - 1); a
  request that reaches it stops asking, as does one that reaches the last drafted depth;
* a request truncated at depth d keeps its nodes above d and gets its width at depth d itself: the
  depth whose candidates the gate judged unlikely, where more candidates raise the chance that one
  of them is the target's token (ECHO Theorem 1);
* requests past ``num_valid_requests`` (CUDA-graph padding) get nothing.

Everything is tensor work with a static loop over depths, so it can run inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class EchoAllocation:
    """What the scheduler granted.

    Attributes
    ----------
    widths : Tensor, shape [R, S], int64
        Draft nodes granted to request i at depth j + 1.
    truncated : Tensor, shape [R], bool
        Failed a gate.
    truncation_depth : Tensor, shape [R], int64
        The (1-based) depth whose gate it failed; 0 for requests never truncated.
    """

    widths: torch.Tensor
    truncated: torch.Tensor
    truncation_depth: torch.Tensor

    @property
    def nodes_per_request(self) -> torch.Tensor:
        """Shape [R], int64."""
        return self.widths.sum(dim=1)

    @property
    def depth_reached(self) -> torch.Tensor:
        """Deepest depth with a granted node, shape [R], int64 (0 = root only)."""
        depths = torch.arange(1, self.widths.shape[1] + 1, device=self.widths.device)
        return torch.where(self.widths > 0, depths, 0).amax(dim=1) if self.widths.numel() else self.truncation_depth


def _serve(requests: torch.Tensor, asks: torch.Tensor, budget: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Serve ``asks`` of the ``requests`` in index order out of ``budget``; returns (grants, budget left)."""
    asks = torch.where(requests, asks, 0)
    before = torch.cumsum(asks, dim=0) - asks
    grants = torch.minimum(asks, (budget - before).clamp(min=0))
    return grants, budget - grants.sum()


def echo_schedule(
    confidence: torch.Tensor,
    gated: torch.Tensor,
    thresholds: torch.Tensor,
    k_max: int | torch.Tensor,
    *,
    default_width: int = 1,
    max_width: int = 4,
    per_request_cap: int | None = None,
    num_valid_requests: int | torch.Tensor | None = None,
) -> EchoAllocation:
    """Split a verification budget between the requests of a batch (ECHO Alg. 1).

    Parameters
    ----------
    confidence : Tensor, shape [R, S], float
        ``c[i, d]``: the highest path probability among request i's draft candidates at depth d
        (:func:`~xshare_sglang.spec.echo.candidates.layer_confidence`).
    gated : Tensor, shape [S], bool
        The depths where a gate is checked (the calibrated sweet spots).
    thresholds : Tensor, shape [S], float
        The gate of each gated depth (ignored elsewhere): pass when ``c > threshold``.
    k_max : int or 0-d Tensor
        Draft nodes the whole batch may verify.
    default_width : int
        Nodes a passing request gets per depth (>= 1).
    max_width : int
        Nodes a truncated request gets at its truncation depth (>= 1).
    per_request_cap : int, optional
        At most this many nodes per request.
    num_valid_requests : int or 0-d Tensor, optional
        Only the first this many requests are real.

    Returns
    -------
    EchoAllocation
    """
    if confidence.dim() != 2:
        raise ValueError(f"confidence must be [requests, depths], got shape {tuple(confidence.shape)}")
    num_requests, num_depths = confidence.shape
    if gated.shape != (num_depths,) or thresholds.shape != (num_depths,):
        raise ValueError(
            f"gated and thresholds must be [{num_depths}] (one per depth), got {tuple(gated.shape)} "
            f"and {tuple(thresholds.shape)}"
        )
    if default_width < 1 or max_width < 1:
        raise ValueError(f"default_width={default_width} and max_width={max_width} must both be >= 1")
    if per_request_cap is not None and per_request_cap < 0:
        raise ValueError(f"per_request_cap={per_request_cap} must be >= 0")
    device = confidence.device
    rows = torch.arange(num_requests, device=device)
    valid = rows < (num_requests if num_valid_requests is None else num_valid_requests)
    cap = torch.full((num_requests,), per_request_cap if per_request_cap is not None else 1 << 40, device=device)
    if isinstance(k_max, torch.Tensor):
        budget = k_max.to(device=device, dtype=torch.int64).clamp(min=0).reshape(())
    else:  # a fill, not a copy of a host value: nothing waits for the host, under capture too
        budget = torch.full((), max(int(k_max), 0), dtype=torch.int64, device=device)
    widths = torch.zeros((num_requests, num_depths), dtype=torch.int64, device=device)
    used = torch.zeros(num_requests, dtype=torch.int64, device=device)
    active = valid & (cap > 0)
    truncation_depth = torch.zeros(num_requests, dtype=torch.int64, device=device)
    gated = gated.to(device=device, dtype=torch.bool)
    thresholds = thresholds.to(device=device, dtype=confidence.dtype)
    # Phase 1: depth for the requests that keep passing their gates.
    for column in range(num_depths):
        passes = (confidence[:, column] > thresholds[column]) | ~gated[column]
        failing = active & ~passes
        truncation_depth = torch.where(failing, column + 1, truncation_depth)
        active = active & passes
        asks = torch.minimum(torch.full_like(used, default_width), cap - used)
        grants, budget = _serve(active, asks, budget)
        widths[:, column] = grants
        used = used + grants
        # served short (the budget ran out) or full: no further depth for this request
        active = active & (grants == asks) & (used < cap)
    # Phase 2: width at the truncation depth, with what is left.
    truncated = truncation_depth > 0
    asks = torch.minimum(torch.full_like(used, max_width), cap - used)
    grants, budget = _serve(truncated, asks, budget)
    column = (truncation_depth - 1).clamp(min=0)
    widths.scatter_add_(1, column[:, None], grants[:, None])
    return EchoAllocation(widths=widths, truncated=truncated, truncation_depth=truncation_depth)
