"""Per-token quantities every policy is built from: clean logits, token orderings, scores, aggregates.

Numerical contract (the Triton kernels reproduce it):

* Logits are read as float32.  NaN becomes ``-inf``; ``+inf`` becomes the largest finite float32.
  An expert whose logit is ``-inf`` is not a candidate for that token: no warm-up, no pick, no score.
* Orderings are "higher value first, ties to the lower expert index" (a stable descending sort).
* Scores are computed in float64 from the float32 logits (softmax as ``exp(l - max) / sum``, sigmoid
  as ``1 / (1 + exp(-l))``) and lie in ``[0, 1]``.  Before they are summed they are put on a
  fixed-point grid: ``q = floor(score * 2**24)`` as int64.  Aggregates are int64 sums of ``q``: exact
  and independent of summation order, and an expert's aggregate is "> 0" exactly when some token
  gives it a score of at least ``2**-24``.  Two implementations whose float64 scores differ by a
  rounding error (another summation order, another ``exp``) agree on ``q`` unless the error straddles
  a grid step, which happens with probability about ``2**-29`` per score.
"""

from __future__ import annotations

import torch

SCORE_FRACTION_BITS = 24
#: Fixed-point value of a score of 1.0.
SCORE_ONE = 1 << SCORE_FRACTION_BITS
SCORINGS: tuple[str, ...] = ("softmax", "sigmoid")

_FP32_MAX = torch.finfo(torch.float32).max


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """Float32 copy of ``logits`` with NaN -> ``-inf`` and ``+inf`` -> the largest finite float32.

    Parameters
    ----------
    logits : Tensor, shape [T, E] (any leading shape), float32 / bfloat16 / float16

    Returns
    -------
    Tensor, same shape, float32 (a new tensor; the input is not modified)
    """
    return torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=_FP32_MAX, neginf=float("-inf"))


def valid_token_mask(
    num_tokens: int, num_valid_tokens: int | torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """Which rows are real tokens: the first ``num_valid_tokens`` of ``num_tokens``.

    ``num_valid_tokens`` may be a Python int or a one-element device tensor (read on the device,
    no host sync).  ``None`` means every row is real.

    Returns
    -------
    Tensor, shape [T], bool
    """
    rows = torch.arange(num_tokens, device=device)
    if num_valid_tokens is None:
        return torch.ones(num_tokens, dtype=torch.bool, device=device)
    if isinstance(num_valid_tokens, torch.Tensor):
        return rows < num_valid_tokens.to(device=device).reshape(())
    return rows < int(num_valid_tokens)


def sanitize_token_weights(token_weights: torch.Tensor) -> torch.Tensor:
    """Float64 vote weights clamped to [0, 1]; NaN becomes 0 (the row does not vote).

    Parameters
    ----------
    token_weights : Tensor, shape [T], float

    Returns
    -------
    Tensor, shape [T], float64 (a new tensor)
    """
    return torch.nan_to_num(token_weights.to(torch.float64), nan=0.0).clamp(0.0, 1.0)


def descending_order(values: torch.Tensor) -> torch.Tensor:
    """Indices that sort the last dimension high-to-low, ties to the lower index.

    Returns
    -------
    Tensor, same shape as ``values``, int64
    """
    return torch.sort(values, dim=-1, descending=True, stable=True).indices


def positions_in_order(order: torch.Tensor) -> torch.Tensor:
    """Inverse permutation of ``order`` along the last dimension: ``pos[..., order[..., i]] = i``."""
    ranks = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, ranks)


def top_by_logit(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Membership of each token's top-``k`` candidate experts by logit.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32, sanitized
    k : int
        ``0 <= k``; values above E mean "all candidates".

    Returns
    -------
    Tensor, shape [T, E], bool.  ``-inf`` experts are never members.
    """
    num_experts = logits.shape[-1]
    k = min(k, num_experts)
    member = torch.zeros_like(logits, dtype=torch.bool)
    if k > 0:
        top = descending_order(logits)[..., :k]
        member.scatter_(-1, top, True)
    return member & (logits > float("-inf"))


def normalize_rows(weights: torch.Tensor) -> torch.Tensor:
    """Divide each row by its sum; rows summing to zero stay zero (never NaN)."""
    total = weights.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, weights / torch.where(total > 0, total, 1.0), 0.0)


def softmax_over(logits: torch.Tensor, members: torch.Tensor) -> torch.Tensor:
    """Softmax of each row over the experts in ``members`` only; zero elsewhere and on empty rows."""
    masked = torch.where(members, logits, float("-inf"))
    row_max = masked.amax(dim=-1, keepdim=True)
    row_max = torch.where(row_max > float("-inf"), row_max, 0.0)
    return normalize_rows(torch.where(members, torch.exp(masked - row_max), 0.0))


def scoring_weights(logits: torch.Tensor, members: torch.Tensor, scoring: str) -> torch.Tensor:
    """The model's scoring function evaluated over ``members`` only; zero elsewhere.

    Softmax normalizes over the members (what masking the other logits produces); sigmoid
    (``1 / (1 + exp(-l))``) scores each expert on its own.  Computed in the dtype of ``logits``.

    Parameters
    ----------
    logits : Tensor, shape [..., E], float, sanitized
    members : Tensor, broadcastable to ``logits``, bool
    scoring : {"softmax", "sigmoid"}
    """
    if scoring == "softmax":
        return softmax_over(logits.expand(torch.broadcast_shapes(logits.shape, members.shape)), members)
    return torch.where(members, 1.0 / (1.0 + torch.exp(-logits)), 0.0)


def token_scores(logits: torch.Tensor, *, score: str, scoring: str, top_k: int) -> torch.Tensor:
    """Per-token expert scores ``g[t, e]`` in ``[0, 1]``, in float64.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32, sanitized
    score : {"topk", "probs"}
        ``"topk"``: the token's natural top-``top_k`` experts, weights renormalized over them, zero
        elsewhere (XShare section 2).  ``"probs"``: the model's scoring function over all experts
        (MoE-Spec eq. 5).
    scoring : {"softmax", "sigmoid"}
        The model's scoring function.
    top_k : int

    Returns
    -------
    Tensor, shape [T, E], float64
    """
    wide = logits.to(torch.float64)
    candidates = logits > float("-inf")
    if score == "probs":
        return scoring_weights(wide, candidates, scoring)
    weights = scoring_weights(wide, top_by_logit(logits, top_k), scoring)
    return weights if scoring == "softmax" else normalize_rows(weights)


def quantize_scores(scores: torch.Tensor) -> torch.Tensor:
    """Fixed-point scores ``floor(scores * 2**24)``, int64 (the scaling is exact: a power of two)."""
    return (scores * float(SCORE_ONE)).to(torch.int64)


def aggregate(quantized: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sum of fixed-point scores over the valid tokens.

    Parameters
    ----------
    quantized : Tensor, shape [T, E], int64
    valid : Tensor, shape [T], bool

    Returns
    -------
    Tensor, shape [E], int64
    """
    return torch.where(valid[:, None], quantized, 0).sum(dim=0)


def per_request_sums(rows: torch.Tensor, tokens_per_request: int) -> torch.Tensor:
    """Sum rows over each request's block of ``tokens_per_request`` consecutive rows.

    Parameters
    ----------
    rows : Tensor, shape [T, C], integer
    tokens_per_request : int
        D; a last, shorter block is a request of its own.

    Returns
    -------
    Tensor, shape [ceil(T / D), C], int64
    """
    num_tokens, width = rows.shape
    num_requests = -(-num_tokens // tokens_per_request)
    padded = torch.nn.functional.pad(rows.to(torch.int64), (0, 0, 0, num_requests * tokens_per_request - num_tokens))
    return padded.view(num_requests, tokens_per_request, width).sum(dim=1)
