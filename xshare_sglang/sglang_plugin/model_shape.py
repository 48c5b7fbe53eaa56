"""The routing shape of the served model, and the checks of a pruner config against it.

Two moments know the model.  At launch, before SGLang spawns any process, the model's ``config.json``
gives its routed top-k and, for the architectures listed in :data:`ROUTED_EXPERTS_KEY`, its router
width and last MoE layer (:func:`launch_refusal`).  At model load, SGLang's own ``TopK`` and
``FusedMoE`` modules give the same numbers exactly (``model_layers.check_model``).  Both call the
checks below, which take plain numbers and raise :class:`~xshare_sglang.errors.ConfigError` blaming
the setting at fault, so that a refusal reads the same at either moment.  What only the loaded model
shows (the routing kernel's output format, a custom routing function, the scoring function, the
expert placement) stays a model-load check.

A configuration that cannot be read without the network (a Hugging Face id not in the local cache,
a remote or object-store URL, a GGUF file, ModelScope) is not checked at launch; the model-load
check still is.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from ..config import PrunerConfig
from ..errors import ConfigError, invalid
from .settings import PluginSettings

logger = logging.getLogger(__name__)

#: Config keys that hold the routed experts per token, in the order they are tried (a per-layer list
#: counts by its smallest entry).
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "experts_per_token", "moe_k")
#: Sub-configs that hold the language model of a multimodal checkpoint, tried after the top level.
TEXT_CONFIG_KEYS = ("text_config", "llm_config", "language_config", "thinker_config")
#: Architectures whose router width SGLang 0.5.23 takes from this config key, and whose MoE layers
#: are every layer (``DeepseekV2/V3``: every ``moe_layer_freq``-th layer from ``first_k_dense_replace``).
ROUTED_EXPERTS_KEY = {
    "Qwen2MoeForCausalLM": "num_experts",
    "Qwen3MoeForCausalLM": "num_experts",
    "MixtralForCausalLM": "num_local_experts",
    "GptOssForCausalLM": "num_local_experts",
    "DeepseekV2ForCausalLM": "n_routed_experts",
    "DeepseekV3ForCausalLM": "n_routed_experts",
}
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def check_layer_routing(cfg: PrunerConfig, *, top_k: int, num_experts: int | None = None) -> None:
    """Check ``cfg`` against one MoE layer's routed top-k and router width.

    Parameters
    ----------
    cfg : PrunerConfig
    top_k : int
        Routed experts per token (shared-expert slots excluded).
    num_experts : int, optional
        Experts the router scores; None when unknown (the calibration file's width is then not checked).

    Raises
    ------
    ConfigError
        ``k0`` above ``top_k`` for a warm-up policy, or a calibration file ranking another number of
        experts.
    """
    cfg.validate_for_model(top_k=top_k, num_experts=num_experts)


def check_ranking_layers(cfg: PrunerConfig, *, last_moe_layer: int) -> None:
    """Check that ``cfg``'s calibration file has a row for every MoE layer id up to ``last_moe_layer``.

    Raises
    ------
    ConfigError
        Blaming ``static_ranking_path`` when the file has too few layers (rows are indexed by layer id).
    """
    ranking = cfg.static_ranking
    if ranking is not None and last_moe_layer >= ranking.num_layers:
        raise invalid(
            "PrunerConfig",
            "static_ranking_path",
            cfg.static_ranking_path,
            f"the file has {ranking.num_layers} layers, but the model has MoE layer {last_moe_layer} "
            "(rows are indexed by layer id)",
        )


@dataclasses.dataclass(frozen=True)
class RoutingShape:
    """What a model's config says about its routing.

    Attributes
    ----------
    top_k : int
        Routed experts per token (the smallest over layers when the config gives one per layer).
    num_experts : int or None
        Experts each router scores; None when the architecture is not one this module knows.
    last_moe_layer : int or None
        Id of the last MoE layer; None when the architecture is not one this module knows.
    """

    top_k: int
    num_experts: int | None = None
    last_moe_layer: int | None = None


def _get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _positive_int(value: Any) -> int | None:
    if isinstance(value, (list, tuple)):
        values = [_positive_int(item) for item in value]
        return min(values) if values and None not in values else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return None
    return value


def routing_shape(config: Any) -> RoutingShape | None:
    """The routing shape a model config states; None when it names no routed top-k.

    Parameters
    ----------
    config : transformers.PretrainedConfig or mapping
        The model's config as SGLang reads it (overrides applied); keys are looked up as attributes,
        so a config class's aliases (``num_experts`` for ``num_local_experts``) count.
    """
    layers = [config, *(sub for key in TEXT_CONFIG_KEYS if (sub := _get(config, key)) is not None)]
    text = top_k = None
    for candidate in layers:
        for key in TOP_K_KEYS:
            top_k = _positive_int(_get(candidate, key))
            if top_k is not None:
                text = candidate
                break
        if top_k is not None:
            break
    if top_k is None:
        return None
    architectures = _get(config, "architectures") or ()
    architecture = architectures[0] if isinstance(architectures, (list, tuple)) and architectures else None
    if text is not config or architecture not in ROUTED_EXPERTS_KEY:
        return RoutingShape(top_k=top_k)
    num_experts = _positive_int(_get(config, ROUTED_EXPERTS_KEY[architecture]))
    num_layers = _positive_int(_get(config, "num_hidden_layers"))
    last = None
    if num_layers is not None:
        if architecture in _DEEPSEEK:
            first = _get(config, "first_k_dense_replace") or 0
            every = _get(config, "moe_layer_freq") or 1
            if isinstance(first, int) and isinstance(every, int) and every >= 1:
                moe = [i for i in range(first, num_layers) if i % every == 0]
                last = moe[-1] if moe else None
        else:
            last = num_layers - 1
    return RoutingShape(top_k=top_k, num_experts=num_experts, last_moe_layer=last)


def local_model_folder(model_path: str, *, revision: str | None = None, download_dir: str | None = None) -> str | None:
    """The local folder holding ``model_path``'s ``config.json``, found without the network.

    A local folder is taken as it is; a Hugging Face id is looked up in the local Hugging Face cache
    (``download_dir`` first, then the default cache).  None for anything else.
    """
    if os.path.isdir(model_path):
        return model_path if os.path.isfile(os.path.join(model_path, "config.json")) else None
    if os.path.exists(model_path) or "://" in model_path:
        return None  # a GGUF file, a remote or object-store URL: SGLang resolves those itself
    if os.environ.get("SGLANG_USE_MODELSCOPE", "").lower() in ("1", "true", "yes"):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for cache_dir in (download_dir, None) if download_dir else (None,):
        try:
            found = try_to_load_from_cache(model_path, "config.json", cache_dir=cache_dir, revision=revision)
        except Exception as exc:  # not a valid repository id
            logger.debug("moe-pruner: %s is not a cached Hugging Face model (%s)", model_path, exc)
            return None
        if isinstance(found, str):
            return os.path.dirname(found)
    return None


def read_model_config(server_args: Any) -> Any | None:
    """The target model's config, read as SGLang reads it, from local files only; None when it
    cannot be read that way (the reason is logged at debug level).

    Parameters
    ----------
    server_args : sglang.srt.server_args.ServerArgs
        The arguments as typed: ``model_path``, ``revision``, ``download_dir``,
        ``trust_remote_code`` and ``json_model_override_args`` are read.
    """
    model_path = getattr(server_args, "model_path", None)
    if not model_path:
        return None
    if getattr(server_args, "decrypted_config_file", None):
        logger.debug("moe-pruner: the model config is encrypted; checked at model load only")
        return None
    folder = local_model_folder(
        str(model_path),
        revision=getattr(server_args, "revision", None),
        download_dir=getattr(server_args, "download_dir", None),
    )
    if folder is None:
        logger.debug("moe-pruner: no local config.json for %s; the config is checked at model load", model_path)
        return None
    try:
        overrides = json.loads(getattr(server_args, "json_model_override_args", None) or "{}")
        from sglang.srt.utils.hf_transformers_utils import get_config

        return get_config(
            folder,
            trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)),
            model_override_args=overrides or None,
        )
    except Exception as exc:  # an unreadable config is SGLang's to report, at model load
        logger.debug("moe-pruner: the config of %s could not be read at launch: %s", model_path, exc)
        return None


def shape_refusal(
    settings: PluginSettings,
    shape: RoutingShape,
    blame: Callable[[str], tuple[str, bool]],
    model: str,
) -> str | None:
    """Why ``settings`` cannot prune a model of this shape, as one line naming the flag; None if they can.

    Parameters
    ----------
    settings : PluginSettings
    shape : RoutingShape
    blame : callable
        Maps a dotted setting (``"k0"``, ``"verify.k0"``) to ``(flag or variable, exact)``, as
        :meth:`~xshare_sglang.sglang_plugin.flag_merge.TypedSettings.blame` does.
    model : str
        The model as the operator named it, for the message.
    """
    checked: set[int] = set()
    for phase, cfg in settings.phase_configs().items():
        if cfg.policy == "none" or id(cfg) in checked:
            continue
        checked.add(id(cfg))
        try:
            check_layer_routing(cfg, top_k=shape.top_k, num_experts=shape.num_experts)
            if shape.last_moe_layer is not None:
                check_ranking_layers(cfg, last_moe_layer=shape.last_moe_layer)
        except ConfigError as exc:
            own = cfg is settings.pruner
            setting = exc.setting
            if not own and setting in settings.phase_overrides.get(phase, {}):
                setting = f"{phase}.{setting}"
            source, exact = blame(setting)
            where = "" if own else f" [config of the {phase} phase]"
            return f"{exc.named(source, exact=exact)}{where} (from the config.json of {model})"
    return None


def launch_refusal(server_args: Any, settings: PluginSettings, blame: Callable[[str], tuple[str, bool]]) -> str | None:
    """The launch-time check against the model's ``config.json``: a one-line reason, or None when
    the settings fit the model or its config cannot be read from local files."""
    if not settings.enabled:
        return None
    config = read_model_config(server_args)
    if config is None:
        return None
    shape = routing_shape(config)
    if shape is None:
        logger.debug("moe-pruner: the config of %s names no routed top-k", server_args.model_path)
        return None
    reason = shape_refusal(settings, shape, blame, str(server_args.model_path))
    if reason is None:
        ep_size = int(getattr(server_args, "ep_size", 1) or 1)
        reason = rank_budget_refusal(settings, shape, ep_size, blame, str(server_args.model_path))
    return reason


def rank_budget_refusal(
    settings: PluginSettings,
    shape: RoutingShape,
    ep_size: int,
    blame: Callable[[str], tuple[str, bool]],
    model: str,
) -> str | None:
    """Why ``xshare-ep``'s rank budget cannot be met on this expert layout, as one line naming the flag;
    None when it can (or no phase runs ``xshare-ep``).

    A rank holds ``num_experts // ep_size`` experts: a budget above that would have every rank keep all
    its activated experts, which prunes nothing while the flag says otherwise.
    """
    if shape.num_experts is None or ep_size <= 1:
        return None
    per_rank = shape.num_experts // ep_size
    for phase, cfg in settings.phase_configs().items():
        if cfg.policy != "xshare-ep" or cfg.rank_budget <= per_rank:
            continue
        own = cfg is settings.pruner
        overridden = "rank_budget" in settings.phase_overrides.get(phase, {})
        setting = f"{phase}.rank_budget" if not own and overridden else "rank_budget"
        source, _ = blame(setting)
        where = "" if own else f" [config of the {phase} phase]"
        return (
            f"{source} {cfg.rank_budget}{where} is more than the {per_rank} experts each expert-parallel rank "
            f"holds ({shape.num_experts} experts in the config.json of {model} over --ep-size {ep_size}): every "
            f"rank would keep all its activated experts. Use a rank budget of at most {per_rank}"
        )
    return None
