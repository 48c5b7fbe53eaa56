"""Expert parallelism on SGLang's CPU engine: other ranks' slots skipped, as SGLang's GPU runners skip them.

Under ``--ep-size N`` with the standard dispatcher, SGLang 0.5.23 maps each top-k id to this rank's
local expert and every other rank's expert to ``-1`` (``layers/moe/token_dispatcher/standard.py``,
``_map_topk_ids_to_local_experts``); its Triton and DeepGEMM runners skip those slots, and the ranks'
partial outputs are summed by the all-reduce after the layer.  The CPU engine's native MoE
(``layers/moe/fused_moe_native.py``, ``moe_forward_native``, called from
``UnquantizedFusedMoEMethod.forward_cpu``) indexes every slot, so an EP server on the CPU engine fails
at its first forward ("index -1 is out of bounds").

AROUND ``moe_forward_native``: when the ids hold a ``-1``, each such slot becomes a local expert its
row does not use, with weight 0 (a finite expert output times 0 adds exactly 0 to the token's sum),
then SGLang's function runs unchanged.  :func:`install` (called by ``sitecustomize.py`` beside this
module, in every process started with the stand-in folder on ``PYTHONPATH``) wraps the function as
its module is imported; torch is imported only when a call needs it.
Remove when SGLang's CPU MoE path skips ``-1`` slots itself.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

TARGET_MODULE = "sglang.srt.layers.moe.fused_moe_native"
TARGET_FUNCTION = "moe_forward_native"
#: The name of this wrapper's finder on ``sys.meta_path`` (installed once).
FINDER_NAME = "xshare-cpu-ep-slots"


def fill_skipped_slots(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_local_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)`` with every ``-1`` slot turned into a local expert of weight 0.

    Each row's fillers are the lowest local experts that row does not already use, so no row holds
    an expert twice (SGLang's CPU loop counts a row's experts with a scatter, which counts a repeated
    expert once and then loses its rows).

    Parameters
    ----------
    topk_weights : Tensor, shape [T, k]
    topk_ids : Tensor, shape [T, k], integer; ``-1`` marks a slot this rank does not serve, every
        other id is a local expert in ``[0, num_local_experts)``
    num_local_experts : int
        At least ``k``.

    Returns
    -------
    tuple of Tensor
        New tensors of the same shapes and dtypes; the inputs are not written.
    """
    import torch

    skipped = topk_ids < 0
    rows = topk_ids.shape[0]
    used = torch.zeros(rows, num_local_experts + 1, dtype=torch.int8, device=topk_ids.device)
    used.scatter_(1, torch.where(skipped, num_local_experts, topk_ids).long(), 1)
    free_first = torch.sort(used[:, :num_local_experts], dim=1, stable=True).indices
    place = (torch.cumsum(skipped.long(), dim=1) - 1).clamp_min(0)
    fillers = torch.gather(free_first, 1, place).to(topk_ids.dtype)
    return topk_weights.masked_fill(skipped, 0), torch.where(skipped, fillers, topk_ids)


def wrap(original):
    """``original`` (SGLang's ``moe_forward_native``) called with its ``-1`` slots filled."""
    if getattr(original, "_xshare_ep_slots", False):
        return original

    @functools.wraps(original)
    def moe_forward_native(layer, x, topk_output, moe_runner_config):
        topk_weights, topk_ids = topk_output.topk_weights, topk_output.topk_ids
        if topk_ids.numel() and bool((topk_ids < 0).any()):
            topk_weights, topk_ids = fill_skipped_slots(topk_weights, topk_ids, layer.w13_weight.shape[0])
            topk_output = topk_output._replace(topk_weights=topk_weights, topk_ids=topk_ids)
        return original(layer, x, topk_output, moe_runner_config)

    moe_forward_native._xshare_ep_slots = True
    return moe_forward_native


def patch_module(module) -> bool:
    """Wrap ``module``'s ``moe_forward_native``; False (and a warning) when it has none."""
    original = getattr(module, TARGET_FUNCTION, None)
    if original is None:
        logger.warning("CPU stand-in: %s has no %s to wrap", module.__name__, TARGET_FUNCTION)
        return False
    setattr(module, TARGET_FUNCTION, wrap(original))
    return True


def install() -> None:
    """Wrap the function right after its module executes (``xshare_sglang/testing/post_import.py``,
    loaded by path), or now if the module is already imported."""
    path = Path(__file__).resolve().parents[1] / "post_import.py"
    spec = importlib.util.spec_from_file_location("xshare_post_import", path)
    post_import = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(post_import)
    post_import.install(FINDER_NAME, {TARGET_MODULE: patch_module})
