"""Per-token quantities every policy is built from: clean logits, token orderings, scores, aggregates.

Numerical contract (the Triton kernels reproduce it bit for bit; nothing is computed in float64):

* Logits are read as float32.  NaN becomes ``-inf``; ``+inf`` becomes the largest finite float32.
  An expert whose logit is ``-inf`` is not a candidate for that token: no warm-up, no pick, no score.
* Orderings are "higher value first, ties to the lower expert index" (a stable descending sort).
* Scores are fixed-point integers in units of ``2**-24`` (:data:`SCORE_ONE` is 1.0), built from
  float32 steps that every IEEE-754 implementation rounds the same way:

  - ``exp`` is :func:`exp32`, a fixed sequence of float32 multiplies and adds (range reduction by
    ``ln 2`` and a degree-6 polynomial), so the kernels and this module get the same bits; the
    library ``exp`` functions of torch, numpy and CUDA differ in the last bit, and a last bit is
    enough to move a value across a grid step;
  - softmax over members: ``u = floor(exp32(l - max) * 2**30)``, then ``q = (u * 2**24) // sum(u)``
    in integers, so the division is exact and independent of summation order;
  - sigmoid: ``s = 1 / (1 + exp32(-l))`` (float32 division, correctly rounded), ``q = floor(s * 2**24)``;
    with ``score="topk"`` the members' ``floor(s * 2**30)`` are renormalized like softmax;
  - a vote weight ``w`` in [0, 1] multiplies in fixed point: ``(q * floor(w * 2**24)) >> 24``.

  Aggregates are int64 sums of ``q``: exact and independent of summation order, and an expert's
  aggregate is "> 0" exactly when some token gives it a score of at least ``2**-24``.
"""

from __future__ import annotations

import struct

import torch

SCORE_FRACTION_BITS = 24
#: Fixed-point value of a score of 1.0.
SCORE_ONE = 1 << SCORE_FRACTION_BITS
#: Finer grid of the values a row is renormalized from (softmax terms, top-k sigmoids): 2**-30.
UNIT_FRACTION_BITS = 30
SCORINGS: tuple[str, ...] = ("softmax", "sigmoid")

_FP32_MAX = torch.finfo(torch.float32).max

# exp32: float32 constants (each written with the exact value it has in float32)
_EXP_LOW = -87.0
_EXP_HIGH = 88.0
_LOG2E = 1.4426950216293335
_LN2_HIGH = 0.693359375  # 9 significant bits: n * _LN2_HIGH is exact for |n| < 2**15
_LN2_LOW = -0.00021219444170128554
_EXP_POLY = (
    0.00019875691214110702,
    0.001398199936375022,
    0.008333452045917511,
    0.04166579619050026,
    0.1666666567325592,
    0.5,
)


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
    """Float32 vote weights clamped to [0, 1]; NaN becomes 0 (the row does not vote).

    Parameters
    ----------
    token_weights : Tensor, shape [T], float

    Returns
    -------
    Tensor, shape [T], float32 (a new tensor)
    """
    return torch.nan_to_num(token_weights.to(torch.float32), nan=0.0).clamp(0.0, 1.0)


def fixed_point_weights(token_weights: torch.Tensor) -> torch.Tensor:
    """``floor(w * 2**24)`` of sanitized vote weights, int64 [T] (exact: a power-of-two scale)."""
    return torch.floor(token_weights * float(SCORE_ONE)).to(torch.int64)


def weigh_scores(quantized: torch.Tensor, fixed_weights: torch.Tensor) -> torch.Tensor:
    """Fixed-point scores [T, E] times fixed-point row weights [T]: ``(q * w) >> 24``, int64."""
    return (quantized * fixed_weights[:, None]) >> SCORE_FRACTION_BITS


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


def exp32(x: torch.Tensor) -> torch.Tensor:
    """``exp`` of a float32 tensor, the same bits wherever IEEE-754 float32 arithmetic runs.

    Range reduction ``x = n ln2 + r`` (``ln 2`` split in two parts, Cody and Waite), a degree-6
    polynomial for ``exp(r)`` (the coefficients of Cephes' ``expf``), and ``2**n`` as two exact
    power-of-two factors.  Every step is one rounded float32 multiply or add, done in the same order
    here and in the kernels (which launch without fused multiply-add), so both get identical bits.
    About 1 ulp from the true value; ``exp32(0) == 1`` exactly; below -87 the result is 0, above 88
    it is ``inf``.

    Parameters
    ----------
    x : Tensor, float32

    Returns
    -------
    Tensor, same shape, float32
    """
    x = x.to(torch.float32)
    xc = x.clamp(_EXP_LOW, _EXP_HIGH)
    n = torch.floor(xc * _LOG2E + 0.5)
    r = (xc - n * _LN2_HIGH) - n * _LN2_LOW
    poly = r * _EXP_POLY[0] + _EXP_POLY[1]
    for c in _EXP_POLY[2:]:
        poly = poly * r + c
    y = (poly * (r * r) + r) + 1.0
    ni = n.to(torch.int32)
    half = ni >> 1
    first = ((half + 127) << 23).view(torch.float32)
    second = ((ni - half + 127) << 23).view(torch.float32)
    y = (y * first) * second
    return torch.where(x < _EXP_LOW, 0.0, torch.where(x > _EXP_HIGH, float("inf"), y))


def sigmoid32(x: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp32(-x))`` in float32 (correctly rounded division): 0 below -88, 1 above 87."""
    return torch.reciprocal(1.0 + exp32(-x.to(torch.float32)))


def _grid(values: torch.Tensor, bits: int = SCORE_FRACTION_BITS) -> torch.Tensor:
    """``floor(v * 2**bits)`` of float32 values in [0, 1], int64 (the scaling is exact)."""
    return torch.floor(values * float(1 << bits)).to(torch.int64)


def _renormalize_fixed(units: torch.Tensor) -> torch.Tensor:
    """``(u * 2**24) // sum(u)`` per row (0 on a row summing to 0), int64."""
    total = units.sum(dim=-1, keepdim=True)
    return torch.where(total > 0, (units << SCORE_FRACTION_BITS) // total.clamp(min=1), 0)


def token_scores(logits: torch.Tensor, *, score: str, scoring: str, top_k: int) -> torch.Tensor:
    """Per-token expert scores ``g[t, e]`` in fixed point: ``q / 2**24`` lies in ``[0, 1]``.

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
    Tensor, shape [T, E], int64, in ``[0, 2**24]``
    """
    members = logits > float("-inf")
    if score == "topk":
        members = top_by_logit(logits, top_k)
    if scoring == "softmax":
        masked = torch.where(members, logits, float("-inf"))
        row_max = masked.amax(dim=-1, keepdim=True)
        row_max = torch.where(row_max > float("-inf"), row_max, 0.0)
        units = torch.where(members, _grid(exp32(masked - row_max), UNIT_FRACTION_BITS), 0)
        return _renormalize_fixed(units)
    if score == "probs":
        return torch.where(members, _grid(sigmoid32(logits)), 0)
    return _renormalize_fixed(torch.where(members, _grid(sigmoid32(logits), UNIT_FRACTION_BITS), 0))


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


def float32_value(value: float) -> float:
    """The float32 nearest to ``value``, as a Python float (what a kernel receives for it).

    Rounded on the host (``struct``), so that no tensor is made per call.
    """
    return struct.unpack("f", struct.pack("f", value))[0]
