"""AROUND ``sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config.try_get_optimal_moe_config``
(checked: fused_moe_triton_config.py:264, called by ``_prepare_fused_moe_run`` at fused_moe.py:474;
the registry also rebinds the name fused_moe.py imported; 0.5.23).

Why: SGLang picks the fused-MoE block configuration by the token count M, from tables tuned with the
slots spread over all E experts.  A pruned call puts the same slots on at most |keep| experts, each
seeing about E/|keep| times the tokens the configuration was tuned for; on an H200 looking SGLang's
table up at the effective count made the tightest budgets up to 1.5x faster
(docs/gpu/h200-2026-11-26-fa1eae1/config_experiment.md).
How: while a pruned forward of the target model runs (``runtime.scope.cfg`` set) and the call
holds no more experts than the target's MoE layers route over, take |keep| from the policy's bound
(:func:`~xshare_sglang.sglang_plugin.pruned_moe_config.keep_bound`: CUDA graphs capture the
configuration, so it cannot depend on the data) and either return our tuned config for
(M, |keep|), or call SGLang's lookup at ``M_eff = ceil(M * E / |keep|)``, or (no tuned table of
either kind, no bound, an override config) call it unchanged.  The decision is cached per (shape,
M, bound), each file of ours read once: per call only SGLang's own work remains.  Unpruned forwards
and other models' layers get SGLang's lookup untouched; a fault leaves the call on SGLang's choice
and is counted.
Remove when: SGLang's lookup takes the per-expert load (or the kept-expert count) into account.
"""

from __future__ import annotations

from ..pruned_moe_config import Choice, choose, keep_bound, load_pruned_table, pruned_file_name
from ..runtime import get_runtime

TARGET = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config.try_get_optimal_moe_config"
KIND = "around"

_NAMES = (
    "w1_shape",
    "w2_shape",
    "top_k",
    "dtype",
    "M",
    "is_marlin",
    "block_shape",
    "per_channel_quant",
    "return_down_config",
)
_cache: dict[tuple, Choice] = {}
_tables: dict[str, dict | None] = {}  # our tuned file per name, read once


def clear_cache() -> None:
    """Forget every decision and every file read (tests; a new device)."""
    _cache.clear()
    _tables.clear()


def hook(original, *args, **kwargs):
    runtime = get_runtime()
    scope = runtime.scope if runtime is not None else None
    if scope is None or scope.cfg is None or not runtime.layers:
        return original(*args, **kwargs)
    try:
        bound_args = dict(zip(_NAMES, args, strict=False))
        bound_args.update(kwargs)
        choice = _choice(runtime, scope, bound_args)
    except Exception as exc:  # SGLang's own choice rather than none
        runtime.record_fault("the fused-MoE config of a pruned layer", exc)
        return original(*args, **kwargs)
    if choice.source == "scaled":
        rest = {k: v for k, v in bound_args.items() if k != "M"}
        w1_shape, w2_shape, top_k, dtype = (rest.pop(k) for k in ("w1_shape", "w2_shape", "top_k", "dtype"))
        return original(w1_shape, w2_shape, top_k, dtype, choice.num_tokens, **rest)
    if choice.source == "pruned-table" and not _override_active():
        config = dict(choice.config)
        if bound_args.get("return_down_config", False):
            return config, (None, None)  # no tuned down-projection config: both GEMMs use this one
        return config
    return original(*args, **kwargs)


def _override_active() -> bool:
    from sglang.srt.layers.moe.moe_runner.triton_utils import get_config

    return bool(get_config())


def _choice(runtime, scope, bound_args: dict) -> Choice:
    w1_shape, w2_shape = tuple(bound_args["w1_shape"]), tuple(bound_args["w2_shape"])
    num_tokens = int(bound_args["M"])
    local_experts = int(w2_shape[0])
    global_experts = max(layer.num_experts for layer in runtime.layers.values())
    cfg = scope.cfg
    if (
        local_experts > global_experts  # not a layer of the target model (or fused shared experts)
        or bound_args.get("is_marlin", False)
        or (cfg.min_tokens is not None and num_tokens < cfg.min_tokens)
        or (cfg.max_tokens is not None and num_tokens > cfg.max_tokens)
    ):
        return Choice("sglang", num_tokens)
    bound = keep_bound(cfg, num_tokens, scope.tokens_per_request, global_experts)
    block_shape = bound_args.get("block_shape")
    key = (
        w1_shape,
        w2_shape,
        bound_args["top_k"],
        bound_args["dtype"],
        num_tokens,
        tuple(block_shape) if block_shape else None,
        bool(bound_args.get("per_channel_quant", False)),
        global_experts,
        bound,
    )
    choice = _cache.get(key)
    if choice is None:
        choice = _cache[key] = _decide(bound_args, num_tokens, global_experts, bound)
    return choice


def _decide(bound_args: dict, num_tokens: int, global_experts: int, bound: int | None) -> Choice:
    if bound is None or bound >= global_experts:
        return Choice("sglang", num_tokens)
    from sglang.srt.layers.moe.moe_runner.triton_utils import fused_moe_triton_config as sglang_config

    local_experts, _, n = bound_args["w2_shape"]
    dtype = bound_args["dtype"]
    block_shape = bound_args.get("block_shape")
    block_n, block_k = (block_shape[0], block_shape[1]) if block_shape else (0, 0)
    per_channel = bool(bound_args.get("per_channel_quant", False))
    sglang_table = sglang_config.get_moe_configs(
        local_experts, n, dtype, block_n, block_k, per_channel_quant=per_channel
    )
    file_name = pruned_file_name(
        sglang_config.get_config_file_name(local_experts, n, dtype, [block_n, block_k], per_channel)
    )
    if file_name not in _tables:
        _tables[file_name] = load_pruned_table(file_name)
    return choose(
        num_tokens=num_tokens,
        num_experts=global_experts,
        bound=bound,
        sglang_has_table=bool(sglang_table),
        pruned_table=_tables[file_name],
    )
