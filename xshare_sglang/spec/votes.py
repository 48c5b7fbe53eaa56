"""The weight of each draft node's routing vote in a verify batch.

A node at depth d votes with ``depth_decay ** d`` (the root, d = 0, with 1): deep nodes are less
likely to be accepted, so their experts matter less to the tokens that will be kept.  A node that
can never be accepted votes with 0, which the selection treats as "not a voter" and the routing
rewrite as "route nowhere" (its output is discarded by tree verification anyway).
"""

from __future__ import annotations

import torch


def vote_weights(
    depths: torch.Tensor, depth_decay: float | None, acceptable: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-row vote weights: a layer call's ``token_weights`` (:class:`~xshare_sglang.policies.RoutingCall`).

    Parameters
    ----------
    depths : Tensor, shape [T], integer
        Depth of each node (:func:`~xshare_sglang.spec.layout.draft_depths`).
    depth_decay : float or None
        In ``(0, 1]``; None weighs every node 1.
    acceptable : Tensor, shape [T], bool, optional
        False for nodes that can never be accepted (:func:`~xshare_sglang.spec.tree.acceptable_nodes`).

    Returns
    -------
    Tensor, shape [T], float32, in ``[0, 1]``.
    """
    if depth_decay is None:
        weights = torch.ones(depths.shape, dtype=torch.float32, device=depths.device)
    else:
        if not 0.0 < depth_decay <= 1.0:
            raise ValueError(f"depth_decay={depth_decay!r} is invalid: must lie in (0, 1]")
        weights = torch.pow(float(depth_decay), depths.to(torch.float64).clamp(min=0)).to(torch.float32)
        # a very deep node still votes, however little: float32 underflow must not make it a non-voter
        weights = weights.clamp(min=torch.finfo(torch.float32).tiny)
    if acceptable is not None:
        weights = weights * acceptable.reshape(weights.shape).to(weights.dtype)
    return weights
