"""The shipped tiny Qwen3-MoE model, and a hook that applies a policy inside its MoE layers.

The model is Hugging Face's own ``Qwen3MoeForCausalLM`` (trained by ``scripts/train_tiny_moe.py``,
see ``data/tiny_moe/MODEL_CARD.md``).  :class:`RouterHook` puts a forward hook on every router
(``Qwen3MoeTopKRouter``) and replaces its top-k ids and weights with the policy's routing, computed by
:func:`~xshare_sglang.select_experts_mask` and :func:`~xshare_sglang.route_within` — the same functions
the SGLang plugin uses — so no model code is copied or changed.  It can also record every router
call as an ``xshare-trace``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from ..config import PrunerConfig
from ..policies import route_within, select_experts_mask
from ..replay.trace import LayerCall, Trace, TraceMeta

logger = logging.getLogger(__name__)

DOMAINS = ("code", "math", "prose")


#: The shipped tiny models by name: the demo model (32 experts, top-4) and one routed like Qwen3-MoE
#: (128 experts, top-8).
SHIPPED_MODELS = {"tiny": "tiny_moe", "e128": "tiny_moe_e128"}


def tiny_model_dir(name: str = "tiny") -> Path:
    """Folder of a tiny model shipped in the package (``name`` in :data:`SHIPPED_MODELS`)."""
    return Path(str(resources.files("xshare_sglang") / "data" / SHIPPED_MODELS[name]))


def tiny_eagle3_dir() -> Path:
    """Folder of the shipped EAGLE-3 draft head of the tiny model (``scripts/train_tiny_eagle3.py``;
    SGLang's ``--speculative-algorithm EAGLE3 --speculative-draft-model-path``)."""
    return Path(str(resources.files("xshare_sglang") / "data" / "tiny_eagle3"))


def model_dir_arg(value: str | None) -> Path:
    """``--model``: a shipped model's name (tiny, e128) or a checkpoint folder; the demo model by default."""
    if value is None:
        return tiny_model_dir()
    if value in SHIPPED_MODELS:
        return tiny_model_dir(value)
    return Path(value)


def load_tiny_model(path: str | Path | None = None):
    """Load the tiny model (float32, eval mode, HF's reference expert loop) and its tokenizer.

    Returns
    -------
    model : transformers.Qwen3MoeForCausalLM
    tokenizer : transformers.PreTrainedTokenizerFast
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path) if path else tiny_model_dir()
    if not (path / "config.json").exists():
        raise ValueError(f"no model in {path}: expected config.json, model.safetensors and tokenizer.json")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager")
    model.eval()
    model.generation_config.eos_token_id = None  # decode a fixed number of tokens
    model.generation_config.pad_token_id = model.config.eos_token_id
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def untie_lm_head(model) -> None:
    """Give the LM head its own copy of the input embeddings and mark the config untied.

    The tiny models are trained with tied embeddings, but SGLang 0.5.23's ``Qwen3MoeForCausalLM``
    never ties its ``lm_head`` to the embeddings: served from a tied checkpoint (no
    ``lm_head.weight``), it would predict with an uninitialised head.  Saving the head explicitly
    makes the checkpoint load identically in transformers and in SGLang.
    """
    head = model.get_output_embeddings()
    head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False
    text_config = getattr(model.config, "get_text_config", lambda: model.config)()
    text_config.tie_word_embeddings = False


def expert_bytes(model, bytes_per_param: int = 2) -> int:
    """Bytes of one expert's weights as stored (bf16): gate, up and down projections."""
    cfg = model.config
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * bytes_per_param


def routers(model) -> list[torch.nn.Module]:
    """The router module of every MoE layer, in layer order."""
    found = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not found:
        raise ValueError(f"{type(model).__name__} has no top-k router modules to hook")
    return found


def hf_routing(router, scores: torch.Tensor, keep: torch.Tensor, coverage: str, dtype: torch.dtype):
    """Ids and weights of rows ``scores`` [T, E] routed inside ``keep`` [E], in the layout the
    transformers router returns (int64 ids [T, k], a dropped slot as the out-of-range index E, which
    transformers' reference expert loop skips; weights [T, k] in ``dtype``)."""
    ids, weights = route_within(scores, keep, top_k=router.top_k, coverage=coverage, renormalize=router.norm_topk_prob)
    ids = ids.long()
    ids = torch.where(ids >= 0, ids, torch.full_like(ids, router.num_experts))
    return ids, weights.to(dtype)


@dataclass
class CallStats:
    """One hooked router call."""

    layer: int
    phase: str
    rows: int
    natural_activated: int
    activated: int
    kept: int
    retained_mass: float
    entropy: float = 0.0  # mean over rows of the router's softmax entropy, nats


@dataclass
class RouterHook:
    """Apply ``cfg`` to the model's routers, record statistics and, optionally, a trace.

    Each forward of the model sets ``phase``: ``"decode"`` when it feeds one token per sequence,
    ``"verify"`` when it feeds exactly ``verify_tokens`` (> 1) tokens per sequence (a speculative
    verify batch: each sequence's tokens form one request of the selection), ``"extend"`` (prefill)
    otherwise; decode forwards are numbered by ``step``.  Calls whose phase is not in ``cfg.phases``
    keep the model's routing.  Use as a context manager.

    Attributes
    ----------
    verify_tokens : int
        D of verify forwards; 0 (default) treats every multi-token forward as prefill.
    request_ids : Tensor [B], optional
        Request of each row in decode calls (recorded in the trace).
    stats : list of CallStats
    """

    model: torch.nn.Module
    cfg: PrunerConfig | None = None
    record: bool = False
    phase: str = "extend"
    step: int = 0
    verify_tokens: int = 0
    request_ids: torch.Tensor | None = None
    sources: dict[int, str] = field(default_factory=dict)
    stats: list[CallStats] = field(default_factory=list)
    calls: list[LayerCall] = field(default_factory=list)
    _handles: list = field(default_factory=list)

    def __enter__(self) -> RouterHook:
        self._handles.append(self.model.register_forward_pre_hook(self._set_phase, with_kwargs=True))
        for layer, router in enumerate(routers(self.model)):
            self._handles.append(router.register_forward_hook(self._make_hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _set_phase(self, module, args, kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError("RouterHook needs the model called with input_ids")
        decode = input_ids.shape[1] == 1
        if decode and self.phase == "decode":
            self.step += 1
        if decode:
            self.phase = "decode"
        elif self.verify_tokens > 1 and input_ids.shape[1] == self.verify_tokens:
            self.phase = "verify"
        else:
            self.phase = "extend"

    def _make_hook(self, layer: int):
        def hook(module, inputs, output):
            return self._route(module, layer, output)

        return hook

    def _route(self, router, layer: int, output):
        logits, weights, ids = output
        top_k, num_experts = router.top_k, router.num_experts
        scores = logits.float()
        natural = ids
        if self.record and self.phase == "decode":
            rows = torch.arange(logits.shape[0]) if self.request_ids is None else self.request_ids
            self.calls.append(LayerCall(self.step, layer, "decode", rows.clone(), logits=scores.detach().clone()))
        if self.cfg is None or self.phase not in self.cfg.phases:
            routed_ids, routed_weights, keep = ids, weights, torch.ones(num_experts, dtype=torch.bool)
        else:
            per_request = self.verify_tokens if self.phase == "verify" else 1
            keep = select_experts_mask(scores, self.cfg, top_k=top_k, tokens_per_request=per_request, layer_id=layer)
            routed_ids, routed_weights = hf_routing(router, scores, keep, self.cfg.coverage, weights.dtype)
        used = routed_ids[routed_ids < num_experts]
        natural_mass = weights.float().sum()
        kept_mass = (weights.float() * keep[natural]).sum()
        self.stats.append(
            CallStats(
                layer=layer,
                phase=self.phase,
                rows=logits.shape[0],
                natural_activated=int(torch.unique(natural).numel()),
                activated=int(torch.unique(used).numel()),
                kept=int(keep.sum()),
                retained_mass=float(kept_mass / natural_mass) if natural_mass > 0 else 1.0,
                entropy=float(-(scores.softmax(-1) * scores.log_softmax(-1)).sum(-1).mean()) if len(scores) else 0.0,
            )
        )
        return logits, routed_weights, routed_ids

    def trace(self, name: str = "tiny-moe") -> Trace:
        """The recorded decode calls as an ``xshare-trace``."""
        cfg = self.model.config
        meta = TraceMeta(
            model=str(getattr(cfg, "_name_or_path", "") or "tiny-qwen3-moe"),
            num_layers=len(routers(self.model)),
            num_experts=cfg.num_experts,
            top_k=cfg.num_experts_per_tok,
            expert_bytes=(expert_bytes(self.model),) * len(routers(self.model)),
            scoring="softmax",
            renormalize=bool(cfg.norm_topk_prob),
            sources=dict(self.sources),
        )
        return Trace(meta, list(self.calls), name=name)

    def decode_stats(self) -> list[CallStats]:
        return [s for s in self.stats if s.phase == "decode"]
