"""The draft candidates of SGLang's EAGLE tree, their path scores and ECHO's layer confidence.

SGLang drafts ``S`` steps with a beam of ``K`` (``--speculative-num-steps``,
``--speculative-eagle-topk``).  Step 0 proposes K children of the root; every later step proposes K
children for each of the K beam nodes of the step before, the beam being the K best paths so far.
``organize_draft_results`` receives the steps' lists and flattens them into one candidate axis of
``N = K + (S - 1) * K * K`` entries per request:

* candidate ``n < K`` sits at depth 1, a child of the root;
* candidate ``n = K + (s - 1) K^2 + a K + b`` sits at depth ``s + 1``: the b-th proposal under beam
  slot a of step s - 1;
* its score is the product of draft probabilities along its path (the *path probability*; ECHO's
  path log-score, eq. 5, is its logarithm);
* its parent is ``parent_list[n // K]`` in the same candidate numbering, -1 being the root
  (``parent_list = cat(parents_list[:-1])``, SGLang's ``build_tree_kernel_efficient`` reads it so).

A child's path probability never exceeds its parent's (probabilities are at most 1), and a parent
always has a lower candidate index than its children.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def candidate_depths(num_steps: int, topk: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Depth (1-based) of every candidate, shape [N], int64."""
    if num_steps < 1 or topk < 1:
        raise ValueError(f"a draft tree needs num_steps >= 1 and topk >= 1, got {num_steps} and {topk}")
    later = torch.arange((num_steps - 1) * topk * topk, device=device) // (topk * topk) + 2
    return torch.cat([torch.ones(topk, dtype=torch.int64, device=device), later])


@dataclass(frozen=True)
class DraftCandidates:
    """Every node SGLang drafted for a batch, before any is chosen for verification.

    Attributes
    ----------
    scores : Tensor, shape [R, N], float
        Path probabilities.
    tokens : Tensor, shape [R, N], int64
        Draft token of every candidate.
    parents : Tensor, shape [R, N], int64
        Parent's candidate index, -1 for children of the root.
    num_steps, topk : int
        S and K.
    """

    scores: torch.Tensor
    tokens: torch.Tensor
    parents: torch.Tensor
    num_steps: int
    topk: int

    def __post_init__(self) -> None:
        expected = self.topk + (self.num_steps - 1) * self.topk * self.topk
        shapes = {tuple(t.shape) for t in (self.scores, self.tokens, self.parents)}
        if len(shapes) != 1 or self.scores.dim() != 2 or self.scores.shape[1] != expected:
            raise ValueError(
                f"draft candidates of {self.num_steps} steps x top-{self.topk} must all be [R, {expected}], "
                f"got scores {tuple(self.scores.shape)}, tokens {tuple(self.tokens.shape)}, "
                f"parents {tuple(self.parents.shape)}"
            )

    @property
    def num_requests(self) -> int:
        return self.scores.shape[0]

    @property
    def num_candidates(self) -> int:
        return self.scores.shape[1]

    def depths(self) -> torch.Tensor:
        """Shape [N], int64, 1-based."""
        return candidate_depths(self.num_steps, self.topk, self.scores.device)

    def rows(self, count: int) -> DraftCandidates:
        """The first ``count`` requests."""
        return DraftCandidates(
            self.scores[:count], self.tokens[:count], self.parents[:count], self.num_steps, self.topk
        )

    @classmethod
    def from_sglang(
        cls,
        score_list: Sequence[torch.Tensor],
        token_list: Sequence[torch.Tensor],
        parents_list: Sequence[torch.Tensor],
    ) -> DraftCandidates:
        """From the three lists ``organize_draft_results`` receives (one entry per draft step)."""
        if not score_list or not (len(score_list) == len(token_list) == len(parents_list)):
            raise ValueError("score_list, token_list and parents_list must be non-empty and one per draft step")
        num_steps = len(score_list)
        topk = token_list[0].shape[1]
        scores = torch.cat(list(score_list), dim=1).flatten(1)
        tokens = torch.cat(list(token_list), dim=1).to(torch.int64)
        if num_steps > 1:
            parent_list = torch.cat(list(parents_list[:-1]), dim=1).to(torch.int64)
            owner = torch.arange(scores.shape[1], device=scores.device) // topk
            parents = parent_list[:, owner]
        else:
            parents = torch.full_like(tokens, -1)
        return cls(scores, tokens, parents, num_steps, topk)


def layer_confidence(candidates: DraftCandidates) -> torch.Tensor:
    """ECHO's layer confidence ``c[i, d] = exp(max path log-score at depth d)`` (ECHO eq. 6).

    Returns
    -------
    Tensor, shape [R, S], float32: the highest path probability among request i's candidates at
    depth d (column d - 1); NaN scores count as 0.
    """
    scores = torch.nan_to_num(candidates.scores.to(torch.float32), nan=0.0)
    k, steps = candidates.topk, candidates.num_steps
    columns = [scores[:, :k].amax(dim=1)]
    for step in range(1, steps):
        start = k + (step - 1) * k * k
        columns.append(scores[:, start : start + k * k].amax(dim=1))
    return torch.stack(columns, dim=1)
