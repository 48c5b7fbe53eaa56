"""Turn ECHO's per-depth grants into draft nodes of SGLang's candidate tree.

:func:`allocate_nodes` picks, depth by depth, a request's granted number of candidates among those
whose parent it already holds, best path probability first (ties: lower candidate index), so the
chosen set is always a tree hanging from the root.  A grant larger than what the tree offers at that
depth is served with what there is.

SGLang's verify layout has exactly D - 1 draft slots per request.  :func:`verify_slots` fills them
with the allocated nodes first and the best remaining candidates after; the latter are *cut*: the
verify tree is relinked so that no walk from the root reaches them (:func:`cut_tree`), they are
never accepted and they cast no routing vote.  Because a child never scores above its parent and
parents have lower indices, "best remaining" is itself closed under parents, so SGLang's tree
builder always sees a consistent tree.
"""

from __future__ import annotations

import math

import torch

from .candidates import DraftCandidates


def _rank_desc(keys: torch.Tensor) -> torch.Tensor:
    """Rank of every entry of each row, highest key first, ties to the lower column; shape of keys."""
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(1, order, torch.arange(keys.shape[1], device=keys.device).expand_as(order).contiguous())
    return ranks


def allocate_nodes(candidates: DraftCandidates, widths: torch.Tensor) -> torch.Tensor:
    """The candidates a request verifies under ECHO's grants.

    Parameters
    ----------
    candidates : DraftCandidates
        R requests x N candidates.
    widths : Tensor, shape [R, S], integer
        Nodes granted per depth (:class:`~xshare_sglang.spec.echo.schedule.EchoAllocation`).

    Returns
    -------
    Tensor, shape [R, N], bool.
    """
    num_requests, num_candidates = candidates.scores.shape
    if tuple(widths.shape) != (num_requests, candidates.num_steps):
        raise ValueError(f"widths must be [{num_requests}, {candidates.num_steps}], got {tuple(widths.shape)}")
    device = candidates.scores.device
    # column N stands for the root, which every request holds
    held = torch.zeros((num_requests, num_candidates + 1), dtype=torch.bool, device=device)
    held[:, num_candidates].fill_(True)  # a fill: writing a Python value by indexing copies it from the host
    parents = torch.where(candidates.parents < 0, num_candidates, candidates.parents)
    scores = torch.nan_to_num(candidates.scores.to(torch.float32), nan=0.0)
    k = candidates.topk
    for step in range(candidates.num_steps):
        start = 0 if step == 0 else k + (step - 1) * k * k
        stop = k if step == 0 else start + k * k
        eligible = held.gather(1, parents[:, start:stop])
        keys = torch.where(eligible, scores[:, start:stop], -1.0)
        chosen = eligible & (_rank_desc(keys) < widths[:, step : step + 1].to(device))
        held[:, start:stop] = chosen
    return held[:, :num_candidates]


def verify_slots(
    candidates: DraftCandidates, allocated: torch.Tensor, num_draft_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The D - 1 candidates that fill each request's verify slots, allocated ones first.

    Parameters
    ----------
    candidates : DraftCandidates
    allocated : Tensor, shape [R, N], bool
        From :func:`allocate_nodes`; at most D - 1 per request.
    num_draft_tokens : int
        D, the root included.

    Returns
    -------
    top_scores_index : Tensor, shape [R, D - 1], int64
        Candidate indices in increasing order (what ``organize_draft_results`` returns).
    kept : Tensor, shape [R, D], bool
        Per verify node (column 0 = the root, column j = ``top_scores_index[:, j - 1]``): allocated,
        i.e. not cut.
    """
    slots = num_draft_tokens - 1
    if not 0 <= slots <= candidates.num_candidates:
        raise ValueError(f"{num_draft_tokens} draft tokens do not fit {candidates.num_candidates} candidates")
    scores = torch.nan_to_num(candidates.scores.to(torch.float32), nan=0.0).clamp(0.0, 1.0)
    keys = torch.where(allocated, scores + 2.0, scores)
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices
    chosen = torch.sort(order[:, :slots], dim=1).values
    kept = torch.cat([torch.ones_like(allocated[:, :1]), allocated.gather(1, chosen)], dim=1)
    return chosen, kept


def static_slots(candidates: DraftCandidates, num_draft_tokens: int) -> torch.Tensor:
    """SGLang's own choice: the D - 1 best candidates by path probability, indices increasing; [R, D - 1]."""
    nothing = torch.zeros_like(candidates.scores, dtype=torch.bool)
    return verify_slots(candidates, nothing, num_draft_tokens)[0]


def cut_tree(
    next_token: torch.Tensor, next_sibling: torch.Tensor, kept: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Relink a verify tree so that only ``kept`` nodes are reachable from the root.

    Every link that pointed at a cut node is moved along that node's sibling chain to the first kept
    sibling (or to -1).  Kept nodes must be closed under parents (a cut node's children are cut).

    Parameters
    ----------
    next_token, next_sibling : Tensor, shape [R, D], integer
        SGLang's ``retrieve_next_token`` / ``retrieve_next_sibling`` (local indices, -1 = none).
    kept : Tensor, shape [R, D], bool

    Returns
    -------
    (next_token, next_sibling), new tensors of the input dtype; cut nodes have no links.
    """
    if next_token.shape != next_sibling.shape or next_token.shape != kept.shape or next_token.dim() != 2:
        raise ValueError(
            f"tree links and kept nodes must all be [R, D], got {tuple(next_token.shape)}, "
            f"{tuple(next_sibling.shape)}, {tuple(kept.shape)}"
        )
    num_requests, width = next_token.shape
    sink = width  # column `width` stands for "no node"

    def as_index(links: torch.Tensor) -> torch.Tensor:
        links = links.to(torch.int64)
        return torch.where((links >= 0) & (links < width), links, sink)

    siblings = as_index(next_sibling)
    nodes = torch.arange(width, device=kept.device).expand(num_requests, width)
    # skip[j]: first kept node on j's sibling chain starting at j itself (sink when there is none)
    skip = torch.where(kept, nodes, siblings)
    skip = torch.cat([skip, torch.full_like(skip[:, :1], sink)], dim=1)
    for _ in range(max(1, math.ceil(math.log2(width + 1))) + 1):
        skip = skip.gather(1, skip)
    new_token = skip.gather(1, as_index(next_token))
    new_sibling = skip.gather(1, siblings)
    new_token = torch.where(kept & (new_token < sink), new_token, -1)
    new_sibling = torch.where(kept & (new_sibling < sink), new_sibling, -1)
    return new_token.to(next_token.dtype), new_sibling.to(next_sibling.dtype)
