"""Fused-MoE block configurations for a pruned layer call.

SGLang picks the fused-MoE Triton configuration by the token count ``M`` of a layer call, from tables
tuned with the ``M * top_k`` slots spread evenly over all ``E`` experts.  A pruned call puts the same
slots on at most ``bound`` kept experts, so each kept expert sees about ``E / bound`` times the tokens
the table was tuned for.  This module decides, once per shape, which configuration such a call gets:

1. a file of ours keyed by (kept experts, M) (written by ``scripts/tune_pruned_moe.py`` into
   :data:`CONFIG_DIR`), when one exists for the shape and device and holds a kept count within a
   factor :data:`KEPT_TOLERANCE` of ``bound``;
2. else SGLang's own tuned table, looked up at the effective token count
   ``M_eff = ceil(M * E / bound)``: the count that gives each expert the same load under SGLang's
   even-spread assumption;
3. else (no tuned table: SGLang's default rule) SGLang's own choice at ``M``, unchanged.

The bound must not depend on the data (CUDA graphs capture the configuration), so it comes from the
policy's settings alone (:func:`keep_bound`); a policy without one keeps SGLang's choice.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

from ..config import PrunerConfig

logger = logging.getLogger(__name__)

#: Where our tuned files live: ``<CONFIG_DIR>/triton_<x_y_z>/<SGLang's file name minus .json>,pruned.json``.
CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "moe_configs")
#: A tuned kept count serves bounds within this factor of it (either way).
KEPT_TOLERANCE = 2.0


def keep_bound(cfg: PrunerConfig | None, num_tokens: int, tokens_per_request: int, num_experts: int) -> int | None:
    """The most experts ``cfg`` can keep in one layer call, from its settings alone.

    Parameters
    ----------
    cfg : PrunerConfig or None
        The config of the pruned phase (None: not pruned).
    num_tokens : int
        T, the rows of the call (in a CUDA graph: the captured bucket, padding included).
    tokens_per_request : int
        D: rows per request (1 outside speculative verify).
    num_experts : int
        E, the experts the router scores (all ranks).

    Returns
    -------
    int or None
        ``|keep| <= bound <= E``; None when the policy has no bound that does not depend on the data
        (``xshare-threshold``, ``lynx``, ``xshare-ep``'s rank rounds, calibrated ``moe-spec`` budgets)
        and no ``max_experts`` cap.
    """
    if cfg is None or cfg.policy == "none" or num_tokens <= 0:
        return None
    d = max(1, int(tokens_per_request))
    requests = -(-num_tokens // d)
    bound: int | None
    if cfg.policy == "moe-spec":
        if cfg.budget_allocation != "uniform":
            return None
        bound = cfg.max_experts * (requests if cfg.scope == "request" and d > 1 else 1)
    else:
        bound = {
            "oea": cfg.k0 * num_tokens,
            "xshare": cfg.k0 * num_tokens + cfg.budget,
            "xshare-spec": cfg.k0 * num_tokens + cfg.request_budget * requests + cfg.budget,
        }.get(cfg.policy)
        if cfg.max_experts is not None:
            bound = cfg.max_experts if bound is None else min(bound, cfg.max_experts)
    if bound is None:
        return None
    return max(1, min(int(bound), num_experts))


def effective_tokens(num_tokens: int, num_experts: int, bound: int) -> int:
    """``ceil(M * E / bound)``: the token count whose even spread over ``E`` experts loads each expert
    as ``num_tokens`` spread over ``bound`` kept experts does."""
    return -(-num_tokens * num_experts // max(1, min(bound, num_experts)))


def pruned_file_name(sglang_file_name: str) -> str:
    """Our file name for a shape: SGLang's (``E=..,N=..,device_name=..[,dtype=..].json``) plus
    ``,pruned``."""
    stem = sglang_file_name[: -len(".json")] if sglang_file_name.endswith(".json") else sglang_file_name
    return f"{stem},pruned.json"


def triton_folder(version: str | None = None) -> str:
    """``triton_3_6_0`` for Triton 3.6.0 (SGLang's folder naming); default: the installed Triton."""
    if version is None:
        import triton  # here, not at import: the plugin's hooks load without Triton until a layer runs

        version = triton.__version__
    return "triton_" + version.replace(".", "_")


def load_pruned_table(file_name: str, config_dir: str | None = None) -> dict[int, dict[int, dict]] | None:
    """Our tuned table for one shape: kept experts -> M -> Triton config; None when no file exists.

    ``config_dir`` defaults to :data:`CONFIG_DIR` (read at call time).

    The running Triton version's folder is read first, then the others, newest first (as SGLang
    does with its own tables).
    """
    config_dir = CONFIG_DIR if config_dir is None else config_dir
    if not os.path.isdir(config_dir):
        return None
    current = triton_folder()
    others = sorted(
        (d for d in os.listdir(config_dir) if d.startswith("triton_") and d != current),
        key=lambda d: tuple(int(x) for x in d.removeprefix("triton_").split("_") if x.isdigit()),
        reverse=True,
    )
    for folder in (current, *others):
        path = os.path.join(config_dir, folder, file_name)
        if os.path.exists(path):
            with open(path) as f:
                raw = json.load(f)
            logger.info("Pruned fused-MoE configs from %s", path)
            return {int(kept): {int(m): dict(c) for m, c in by_m.items()} for kept, by_m in raw.items()}
    return None


def pick_from_table(table: dict[int, dict[int, dict]], bound: int, num_tokens: int) -> dict | None:
    """The config of the kept count nearest ``bound`` (by ratio, within :data:`KEPT_TOLERANCE`), at the
    tuned M nearest ``num_tokens`` (SGLang's rule); None when no kept count is near enough."""
    if not table:
        return None
    kept = min(table, key=lambda k: (abs(math.log(k / bound)), -k))
    if max(kept, bound) > KEPT_TOLERANCE * min(kept, bound) or not table[kept]:
        return None
    by_m = table[kept]
    return dict(by_m[min(by_m, key=lambda m: abs(m - num_tokens))])


@dataclass(frozen=True)
class Choice:
    """What a pruned call of one shape gets.

    Attributes
    ----------
    source : str
        ``"pruned-table"`` (our tuned file), ``"scaled"`` (SGLang's table at :attr:`num_tokens`) or
        ``"sglang"`` (SGLang's own choice, untouched).
    num_tokens : int
        The M to hand SGLang's lookup (``M_eff`` for ``"scaled"``, else M).
    config : dict or None
        Our config (``"pruned-table"`` only); callers copy it.
    """

    source: str
    num_tokens: int
    config: dict[str, Any] | None = None


def choose(
    *,
    num_tokens: int,
    num_experts: int,
    bound: int | None,
    sglang_has_table: bool,
    pruned_table: dict[int, dict[int, dict]] | None,
) -> Choice:
    """The configuration rule of this module (see its docstring) for one shape.

    Parameters
    ----------
    num_tokens : int
        M, the call's rows.
    num_experts : int
        E, all experts the router scores (the per-expert load uses the global count, also under EP).
    bound : int or None
        :func:`keep_bound`; None or ``>= E`` leaves SGLang's choice.
    sglang_has_table : bool
        SGLang has a tuned file for this shape and device.
    pruned_table : dict or None
        :func:`load_pruned_table` for this shape and device.
    """
    if bound is None or bound >= num_experts or num_tokens <= 0:
        return Choice("sglang", num_tokens)
    if pruned_table:
        config = pick_from_table(pruned_table, bound, num_tokens)
        if config is not None:
            return Choice("pruned-table", num_tokens, config)
    if sglang_has_table:
        return Choice("scaled", effective_tokens(num_tokens, num_experts, bound))
    return Choice("sglang", num_tokens)
