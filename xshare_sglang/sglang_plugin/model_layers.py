"""Find the target model's MoE layers, check the config against them, and build the runtime.

Runs once per target ModelRunner, after the model is loaded and before CUDA graphs are captured.
Everything that needs the model is checked here, so that a bad combination stops the server at
start-up with a message instead of misbehaving while it serves.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch

from ..config import PHASES, PrunerConfig
from ..devices import canonical_device
from ..policies.call import RouterSpec
from ..policies.moe_spec import layer_redundancy, static_positions
from ..policies.rewrite import METRIC_COLUMNS
from .model_shape import check_layer_routing, check_ranking_layers
from .moe_backends import dropped_slots_filled
from .runtime import LayerState, PrunerRuntime
from .settings import PluginSettings

logger = logging.getLogger(__name__)

SUPPORTED_SCORING = ("softmax", "sigmoid")

#: Model-specific routing functions (``TopKConfig.custom_routing_function``) that score with a
#: sigmoid although their config keeps SGLang's default ``scoring_func="softmax"``.
SIGMOID_ROUTING = ("sglang.srt.models.llama4.Llama4MoE.custom_routing_function",)
#: Model-specific routing functions the pruner cannot act through (matched inside the function's
#: name), and why.
UNSUPPORTED_ROUTING = {
    "fused_moe_router": "is handed the gate weights instead of per-token router logits (Grok)",
    "sglang.srt.models.interns1pro.": "fills per-group quotas, so masked experts would silently drop slots",
}
#: TopK output formats whose routing runs inside the MoE kernel (or ``triton_kernels``' routing),
#: pruned through masked router logits by ``hooks/topk_forward_cuda``.
KERNEL_ROUTING_FORMATS = ("TRITON_KERNEL", "BYPASSED")


def kernel_routing_format(topk_config: Any) -> str | None:
    """The name of the layer's top-k output format when its routing runs inside the MoE kernel
    (:data:`KERNEL_ROUTING_FORMATS`), else None."""
    name = getattr(topk_config.output_format, "name", None)
    return name if name in KERNEL_ROUTING_FORMATS else None


def routing_function_name(function: Any) -> str:
    """``module.qualname`` of a routing function (through ``functools.partial``), else its repr."""
    while hasattr(function, "func") and callable(function.func):
        function = function.func
    module, name = getattr(function, "__module__", None), getattr(function, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(function)


def routing_scoring(topk_config: Any) -> str:
    """How the layer turns router logits into weights: ``softmax`` or ``sigmoid`` (or another
    ``scoring_func`` the pruner refuses)."""
    function = getattr(topk_config, "custom_routing_function", None)
    if function is not None and routing_function_name(function) in SIGMOID_ROUTING:
        return "sigmoid"
    return topk_config.scoring_func


class PrunerSetupError(RuntimeError):
    """The pruner was asked for but cannot run on this model or server configuration."""


class MoeLayer(NamedTuple):
    """One MoE layer of the model: SGLang's ``TopK`` and ``FusedMoE`` modules."""

    topk: Any
    num_experts: int  # logical routed experts: the router's width (shared slots, replicas excluded)
    experts: Any


def find_moe_layers(model: torch.nn.Module) -> list[MoeLayer]:
    """Every MoE layer of ``model``, by layer id, with its count of logical routed experts.

    The router scores the logical routed experts; ``FusedMoE.num_experts`` also counts the fused
    shared-expert slots and the redundant replicas of ``--ep-num-redundant-experts``, so the logical
    count comes from SGLang's expert-location metadata where the model has one, else from the
    ``FusedMoE`` module without its shared slots.  Layouts whose ids the pruner cannot map exactly
    are refused (:func:`logical_routed_experts`).
    """
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.topk import TopK

    topks: dict[int, Any] = {}
    experts: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, TopK) and not module.is_draft:
            topks[module.layer_id] = module
        elif isinstance(module, FusedMoE):
            experts[module.layer_id] = module
    missing = sorted(set(topks) - set(experts))
    if missing:
        raise PrunerSetupError(f"moe-pruner: no FusedMoE module found for the TopK of layers {missing}")
    return [
        MoeLayer(topks[layer_id], logical_routed_experts(topks[layer_id], experts[layer_id]), experts[layer_id])
        for layer_id in sorted(topks)
    ]


def logical_routed_experts(topk: Any, experts: Any) -> int:
    """The experts a layer's router scores (the width of its router logits).

    Raises :class:`PrunerSetupError` for the expert layouts whose ids the pruner cannot map back
    to the router's experts: per-rank fused shared-expert slots (DeepEP-class all-to-all with
    shared-expert fusion), and fused shared experts next to redundant replicas.
    """
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    num_shared = int(getattr(experts, "num_fused_shared_experts", 0) or 0)
    if num_shared:
        from sglang.srt.layers.moe.utils import has_per_rank_fused_shared_slots

        if has_per_rank_fused_shared_slots(num_shared):
            raise PrunerSetupError(
                f"moe-pruner: layer {topk.layer_id} fuses its shared expert into per-rank expert slots "
                "(--moe-a2a-backend deepep/mooncake/mori/pplx/megamoe with shared-expert fusion), whose "
                "renumbered ids the pruner does not map; start with --disable-shared-experts-fusion, or "
                "without --moe-pruner"
            )
    physical_routed = experts.num_experts - num_shared
    meta = get_global_expert_location_metadata()
    if meta is None:
        logical = physical_routed
    else:
        logical = meta.num_logical_experts
        if physical_routed != meta.num_physical_experts:
            raise PrunerSetupError(
                f"moe-pruner: layer {topk.layer_id} holds {physical_routed} routed expert slots, but SGLang's "
                f"expert placement has {meta.num_physical_experts}; the pruner cannot map its expert ids"
            )
    if num_shared and physical_routed != logical:
        raise PrunerSetupError(
            f"moe-pruner: layer {topk.layer_id} fuses {num_shared} shared expert(s) next to "
            f"{physical_routed - logical} redundant replicas (--ep-num-redundant-experts), where SGLang's shared "
            "slot ids overlap the replicas; start with --disable-shared-experts-fusion or --ep-num-redundant-experts 0"
        )
    bias = getattr(topk.topk_config, "correction_bias", None)
    if isinstance(bias, torch.Tensor) and bias.dim() == 1 and bias.shape[0] != logical:
        raise PrunerSetupError(
            f"moe-pruner: layer {topk.layer_id} has a correction bias over {bias.shape[0]} experts, but "
            f"{logical} routed experts were found"
        )
    return logical


def expert_bytes_by_layer(model: torch.nn.Module) -> dict[int, int]:
    """Bytes of one routed expert's weights (and scales) per layer id, from each ``FusedMoE``
    module's per-expert parameters (first dimension = its local expert count); 0 when unknown."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    out = {}
    for module in model.modules():
        if isinstance(module, FusedMoE):
            local = getattr(module, "num_local_experts", None) or module.num_experts
            per_expert = [
                p.numel() * p.element_size()
                for p in module.parameters(recurse=False)
                if p.dim() and p.shape[0] == local
            ]
            out[module.layer_id] = sum(per_expert) // local if per_expert and local else 0
    return out


def check_model(cfg: PrunerConfig, layers: list[MoeLayer], *, ep_size: int) -> None:
    """Raise :class:`PrunerSetupError` for any config value this model cannot take.

    The checks that need only the routing shape (``k0`` against top-k, the calibration file's expert
    and layer counts) are those of :mod:`.model_shape`, which also run at launch on the model's
    ``config.json``.
    """
    from sglang.srt.layers.moe.topk import TopKOutputFormat

    if not layers:
        raise PrunerSetupError("moe-pruner: the model has no MoE layers (no SGLang TopK module found)")
    for topk, num_experts, _ in layers:
        config = topk.topk_config
        in_kernel = kernel_routing_format(config)
        if in_kernel is None and config.output_format not in (None, TopKOutputFormat.STANDARD):
            raise PrunerSetupError(
                f"moe-pruner: layer {topk.layer_id} hands SGLang's MoE kernel {config.output_format.name} "
                "top-k output, which the pruner does not act on. Start the server with --moe-runner-backend triton."
            )
        if in_kernel is not None and cfg.coverage != "substitution":
            backend = getattr(config.runner_backend, "value", config.runner_backend) or "auto"
            raise PrunerSetupError(
                f"moe-pruner: --moe-pruner-coverage {cfg.coverage} cannot act on layer {topk.layer_id}: with "
                f"--moe-runner-backend {backend} it is routed inside the MoE kernel ({in_kernel} top-k output), "
                "which leaves no step to drop picks after routing. Use --moe-pruner-coverage substitution, or "
                "start the server with --moe-runner-backend triton."
            )
        function = getattr(config, "custom_routing_function", None)
        name = routing_function_name(function) if function is not None else ""
        for marker, why in UNSUPPORTED_ROUTING.items():
            if marker in name:
                raise PrunerSetupError(
                    f"moe-pruner: layer {topk.layer_id} routes with the model's own function {name}, which "
                    f"{why}; serve this model without --moe-pruner"
                )
        scoring = routing_scoring(config)
        if scoring not in SUPPORTED_SCORING:
            raise PrunerSetupError(
                f"moe-pruner: layer {topk.layer_id} scores experts with {scoring!r}; "
                f"the pruner supports {', '.join(SUPPORTED_SCORING)}"
            )
        top_k = config.top_k - config.num_shared_topk_slots
        try:
            check_layer_routing(cfg, top_k=top_k, num_experts=num_experts)
        except ValueError as exc:
            raise PrunerSetupError(f"moe-pruner: {exc} (layer {topk.layer_id})") from None
    try:
        check_ranking_layers(cfg, last_moe_layer=max(layer.topk.layer_id for layer in layers))
    except ValueError as exc:
        raise PrunerSetupError(f"moe-pruner: {exc}") from None
    if cfg.policy == "xshare-ep" and ep_size <= 1:
        raise PrunerSetupError(
            "moe-pruner: policy xshare-ep balances experts over expert-parallel ranks, but this server "
            "runs with --ep-size 1; use --moe-pruner xshare, or start with --ep-size > 1"
        )


def expert_owner_of(layer_id: int, meta: Any = None) -> torch.Tensor | None:
    """Rank that holds each logical expert of a layer, shape [L] int32, or None without a placement.

    The lowest rank holding a replica, from the placement's physical-to-logical map: the same on every
    rank (SGLang's per-logical replica lists are reordered per rank and by rebalances), and refreshed
    in place after each rebalance (``hooks/eplb_update``).
    """
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    meta = get_global_expert_location_metadata() if meta is None else meta
    if meta is None:
        return None
    slots = meta.physical_to_logical_map_cpu[layer_id].long()
    rank = torch.arange(slots.numel()) // meta.num_local_physical_experts
    owner = torch.full((meta.num_logical_experts,), meta.ep_size, dtype=torch.long)
    owner.scatter_reduce_(0, slots, rank, reduce="amin")
    return owner.to(torch.int32)


def physical_to_logical(layer_id: int) -> torch.Tensor | None:
    """Logical expert of each physical expert slot of a layer (a view that SGLang's rebalances
    update in place), or None when there is no expert placement."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    meta = get_global_expert_location_metadata()
    return None if meta is None else meta.physical_to_logical_map[layer_id]


def fused_router(topk_config: Any, num_experts: int) -> tuple[RouterSpec | None, str]:
    """The layer's router as the fused kernels take it, or (None, why) when they cannot replace it.

    The fused path routes plain softmax / sigmoid routers, with a correction bias (sigmoid), groups
    and output scaling.  A custom routing function, fused shared-expert columns or a bias next to
    softmax keep SGLang's own router, inside masked logits.
    """
    if getattr(topk_config, "custom_routing_function", None) is not None:
        return None, "a custom routing function"
    if topk_config.num_shared_topk_slots:
        return None, "fused shared-expert slots"
    if topk_config.scoring_func not in ("softmax", "sigmoid"):
        return None, f"scoring {topk_config.scoring_func!r}"
    if topk_config.correction_bias is not None and topk_config.scoring_func != "sigmoid":
        return None, "a correction bias with softmax scoring"
    groups, topk_group = 1, 1
    if topk_config.use_grouped_topk:
        groups, topk_group = int(topk_config.num_expert_group or 1), int(topk_config.topk_group or 1)
    scale = topk_config.routed_scaling_factor if topk_config.apply_routed_scaling_factor_on_output else None
    try:
        router = RouterSpec(
            top_k=int(topk_config.top_k),
            scoring=topk_config.scoring_func,
            renormalize=bool(topk_config.renormalize),
            num_expert_group=groups,
            topk_group=topk_group,
            routed_scaling_factor=None if scale is None else float(scale),
        )
        router.check(num_experts, topk_config.correction_bias)
    except ValueError as exc:
        return None, str(exc)
    return router, ""


def make_layer_state(topk_config: Any, *, layer_id: int, row: int, num_experts: int, device) -> LayerState:
    """Per-layer state and buffers for one of SGLang's ``TopKConfig`` objects."""
    router, _ = fused_router(topk_config, num_experts)
    return LayerState(
        layer_id=layer_id,
        row=row,
        topk_config=topk_config,
        num_experts=num_experts,
        top_k=topk_config.top_k - topk_config.num_shared_topk_slots,
        scoring=routing_scoring(topk_config),
        keep=torch.ones(num_experts, dtype=torch.bool, device=device),
        router=router,
    )


def make_runtime(settings: PluginSettings, states: dict[int, LayerState], device) -> PrunerRuntime:
    """A runtime over the given layer states (keyed by ``id(topk_config)``)."""
    return PrunerRuntime(
        settings=settings,
        device=canonical_device(device),
        layers=states,
        num_valid_buffer=torch.zeros(1, dtype=torch.int32, device=device),
        metrics=torch.zeros(len(PHASES), len(states), len(METRIC_COLUMNS), dtype=torch.int64, device=device),
        request_metrics=(
            torch.zeros(len(states), 2, dtype=torch.int64, device=device)
            if settings.config_for("verify") is not None
            else None
        ),
        # sampled metrics: the gate starts open (the first pruned forward is sampled)
        metrics_gate=torch.ones(1, dtype=torch.int32, device=device) if settings.metrics_every > 1 else None,
        physical_to_logical=physical_to_logical,
    )


def build_runtime(
    settings: PluginSettings,
    model: torch.nn.Module,
    device: torch.device | str,
    *,
    ep_size: int = 1,
) -> PrunerRuntime:
    """Check ``settings`` against ``model`` and allocate every buffer the routing hooks use."""
    device = canonical_device(device)
    configs = {cfg for cfg in settings.phase_configs().values() if cfg.policy != "none"}
    layers = find_moe_layers(model)
    for phase, cfg in settings.phase_configs().items():
        if cfg.policy == "none":
            continue
        try:
            check_model(cfg, layers, ep_size=ep_size)
        except PrunerSetupError as exc:
            if cfg is settings.pruner:
                raise
            raise PrunerSetupError(f"{exc} [config of the {phase} phase]") from None
    needs_ranks = any(cfg.policy == "xshare-ep" for cfg in configs)
    states = {}
    fill_reasons = set()
    in_kernel: dict[str, list[int]] = {}
    for row, (topk, num_experts, experts) in enumerate(layers):
        expert_to_rank = expert_owner_of(topk.layer_id) if needs_ranks else None
        if expert_to_rank is not None:
            expert_to_rank = expert_to_rank.to(device)
        state = make_layer_state(
            topk.topk_config, layer_id=topk.layer_id, row=row, num_experts=num_experts, device=device
        )
        state.expert_to_rank = expert_to_rank
        states[id(topk.topk_config)] = state
        kernel_format = kernel_routing_format(topk.topk_config)
        if kernel_format is not None:  # SGLang routes the masked logits itself: nothing is dropped
            in_kernel.setdefault(kernel_format, []).append(topk.layer_id)
            continue
        state.fill_dropped, reason = dropped_slots_filled(experts)
        if state.fill_dropped:
            fill_reasons.add(reason)
    for reason in sorted(fill_reasons):
        logger.info("moe-pruner: dropped slots get a weight-0 expert instead of -1 (%s)", reason)
    for cfg in configs:
        # copy calibration tables to the device now: a first copy inside a forward would be a
        # host-to-device copy on the step path (and an error under CUDA-graph capture)
        if cfg.policy == "moe-spec" and cfg.ranking in ("static", "coactivation"):
            for topk, _, _ in layers:
                static_positions(cfg, topk.layer_id, device)
                if cfg.ranking == "coactivation":
                    layer_redundancy(cfg, topk.layer_id, device)
    for kernel_format, layer_ids in sorted(in_kernel.items()):
        logger.info(
            "moe-pruner: %d layers (%s top-k output) are routed inside the MoE kernel: pruned through masked "
            "router logits, which SGLang's own routing then takes (substitution coverage)",
            len(layer_ids),
            kernel_format,
        )
    unfused = sorted(
        {fused_router(t.topk_config, n)[1] for t, n, _ in layers if kernel_routing_format(t.topk_config) is None} - {""}
    )
    for reason in unfused:
        logger.info(
            "moe-pruner: layers with %s keep SGLang's router (masked logits, then a rewrite); the rest "
            "route in the fused selection kernel",
            reason,
        )
    return make_runtime(settings, states, device)
