"""Masking router inputs with a keep mask: the step that hands the selection to SGLang's routing.

Pruned experts get ``MASKED_LOGIT``, a large finite negative value, in the router logits and in the
correction bias (DeepSeek-style biased routing picks by ``score + bias``, so masking the logits alone
would not exclude an expert).  It is -2**14: exact in float16, bfloat16 and float32, far below any
router logit, zero after softmax or sigmoid, and finite even when two masked values are added in
float16 (grouped routing sums the best two scores of a group).
"""

from __future__ import annotations

import torch

MASKED_LOGIT = -16384.0


def mask_router_inputs(
    logits: torch.Tensor,
    keep: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    bias_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked copies (or in-place masking) of router logits and correction bias.

    Parameters
    ----------
    logits : Tensor, shape [T, E]
    keep : Tensor, shape [E], bool
    bias : Tensor, shape [E], optional
        Correction bias added to scores before top-k (DeepSeek-V3 ``e_score_correction_bias``).
    out, bias_out : Tensor, optional
        Where to write; may be ``logits`` / ``bias`` themselves for in-place masking.

    Returns
    -------
    (masked logits [T, E], masked bias [E] or None), in the input dtypes
    """
    masked = torch.where(keep, logits, MASKED_LOGIT)  # one kernel (masked_fill of ~keep is three)
    if out is None:
        out = masked
    else:
        out.copy_(masked)
    if bias is None:
        return out, None
    masked_bias = torch.where(keep, bias, MASKED_LOGIT)
    if bias_out is None:
        bias_out = masked_bias
    else:
        bias_out.copy_(masked_bias)
    return out, bias_out
