"""Teacher-forced measures of one configuration against the unpruned model, with bootstrap intervals.

The demo (:mod:`.tiny_demo`), the quality study (:mod:`.quality`) and ``spec-eval`` (:mod:`.spec_eval`)
share them: :func:`teacher_forced_logprobs` reads windows of held-out text ``step_tokens`` at a time
under a configuration, :func:`token_measures` compares two runs position by position (the
:data:`METRICS`), and :func:`bootstrap_interval` gives a mean with its 95% percentile interval,
resampling whole windows.  This module imports none of those three, so each of them can import it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..config import PrunerConfig
from .tiny_model import RouterHook

logger = logging.getLogger(__name__)

METRICS = ("kl", "top1_agree", "nll_delta")


@dataclass(frozen=True)
class Interval:
    """A mean and its 95% percentile bootstrap interval ``[low, high]``."""

    mean: float
    low: float
    high: float

    def fmt(self, spec: str, scale: float = 1.0, sep: str = ", ") -> str:
        return f"{scale * self.mean:{spec}} [{scale * self.low:{spec}}{sep}{scale * self.high:{spec}}]"


@torch.no_grad()
def teacher_forced_logprobs(
    model, windows: torch.Tensor, cfg: PrunerConfig | None, *, requests: int, step_tokens: int
) -> tuple[torch.Tensor, list]:
    """Next-token log-probabilities of every window under ``cfg``, fed ``step_tokens`` tokens per forward.

    Parameters
    ----------
    windows : Tensor [W, S + 1]
        Token ids; position ``s`` predicts token ``s + 1``.
    cfg : PrunerConfig or None
        None: the model's own routing.
    requests : int
        Windows per batch (the last batch may be smaller).
    step_tokens : int
        Tokens each window feeds per forward: 1 (decode) or D (verify; S must be a multiple of D).

    Returns
    -------
    logprobs : Tensor [W, S, V] float32
    stats : list of CallStats
        The MoE layer calls of the forwards (decode, or verify when ``step_tokens`` > 1).
    """
    num_windows, length = windows.shape[0], windows.shape[1] - 1
    out = []
    stats = []
    for start in range(0, num_windows, requests):
        batch = windows[start : start + requests]
        past = None
        parts = []
        hook_tokens = step_tokens if step_tokens > 1 else 0
        with RouterHook(model, cfg, verify_tokens=hook_tokens) as hook:
            for pos in range(0, length, step_tokens):
                result = model(input_ids=batch[:, pos : pos + step_tokens], past_key_values=past, use_cache=True)
                past = result.past_key_values
                parts.append(result.logits.float().log_softmax(dim=-1))
        stats += [s for s in hook.stats if s.phase in ("decode", "verify")]
        out.append(torch.cat(parts, dim=1))
    return torch.cat(out, dim=0), stats


def token_measures(reference: torch.Tensor, pruned: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token measures of one configuration against the unpruned reference.

    Parameters
    ----------
    reference, pruned : Tensor [W, S, V]
        Next-token log-probabilities.
    targets : Tensor [W, S]
        The true next tokens.

    Returns
    -------
    dict of str to Tensor [W, S] float64
        ``kl``, ``top1_agree`` (0/1), ``nll_delta``.
    """
    ref, new = reference.double(), pruned.double()
    kl = (ref.exp() * (ref - new)).sum(-1).clamp_min(0.0)
    agree = (reference.argmax(-1) == pruned.argmax(-1)).double()
    index = targets.unsqueeze(-1)
    nll_delta = ref.gather(-1, index).squeeze(-1) - new.gather(-1, index).squeeze(-1)
    return {"kl": kl, "top1_agree": agree, "nll_delta": nll_delta}


def bootstrap_interval(values: torch.Tensor, resamples: int, generator: torch.Generator) -> Interval:
    """Mean of ``values`` [W, S] and its 95% percentile interval, resampling whole windows (rows)."""
    per_window = values.mean(dim=1)
    mean = float(per_window.mean())
    picks = torch.randint(0, per_window.numel(), (resamples, per_window.numel()), generator=generator)
    means = per_window[picks].mean(dim=1)
    low, high = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=means.dtype)).tolist()
    return Interval(mean, low, high)
