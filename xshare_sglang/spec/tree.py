"""Which draft nodes can still be accepted.

SGLang's EAGLE verify input links each request's tree by two arrays of local node indices:
``retrieve_next_token[r, i]`` (i's first child, -1 for none) and ``retrieve_next_sibling[r, i]``
(i's next sibling).  Tree verification walks these links from the root (node 0), so a node that no
chain of links reaches from the root - a branch cut from the tree, as ECHO's sparse gating does -
can never be accepted.

Every node has at most one incoming link, so "reachable from the root" is "the root is among its
link ancestors": pointer doubling answers it in ``ceil(log2 D)`` rounds of gathers, with static
shapes and no host synchronisation.
"""

from __future__ import annotations

import math

import torch


def acceptable_nodes(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """Nodes reachable from their request's root through first-child / next-sibling links.

    Parameters
    ----------
    next_token, next_sibling : Tensor, shape [R, D], integer
        Local node indices; values outside ``[0, D)`` (-1) mean "no link".

    Returns
    -------
    Tensor, shape [R, D], bool.  The root (column 0) is always acceptable.
    """
    if next_token.shape != next_sibling.shape or next_token.dim() != 2:
        raise ValueError(
            f"tree links must both be [R, D], got {tuple(next_token.shape)} and {tuple(next_sibling.shape)}"
        )
    num_requests, width = next_token.shape
    device = next_token.device
    nodes = torch.arange(width, device=device).expand(num_requests, width)
    # predecessor[r, j]: the node whose link points at j; column `width` collects the "no link"
    # writes, and a node without a predecessor points at itself.
    predecessor = torch.cat([nodes, nodes[:, :1]], dim=1).clone()
    for links in (next_token, next_sibling):
        target = links.to(torch.int64)
        target = torch.where((target > 0) & (target < width), target, width)
        predecessor.scatter_(1, target, nodes)
    predecessor = predecessor[:, :width]
    reached = (nodes == 0).clone()
    for _ in range(max(1, math.ceil(math.log2(max(width, 2)))) + 1):
        reached = reached | reached.gather(1, predecessor)
        predecessor = predecessor.gather(1, predecessor)
    return reached
