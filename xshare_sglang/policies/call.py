"""What one MoE layer call routes with: the model's router (:class:`RouterSpec`) and the call's own
inputs (:class:`RoutingCall`).

A :class:`RoutingCall` is built, and its shapes checked, once where a layer call enters (the plugin's
routing hook, an offline tool, a public function such as ``select_experts_mask``); the selection, the
routing and the kernels' wrappers take it as it is and check nothing again.  Whether a
``PrunerConfig`` suits the model is a separate check, :meth:`RoutingCall.check_config`, which a
config remembers per model shape, so the server pays for it once at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import PrunerConfig
from .scores import SCORINGS


def check_routing_args(logits: torch.Tensor, top_k: int, scoring: str) -> None:
    """Validate the arguments shared by selection and routing; raise ``ValueError`` naming them."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a 2-D tensor [num_tokens, num_experts], got {shape}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    num_experts = logits.shape[1]
    if num_experts < 1:
        raise ValueError("logits must have at least one expert column")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k!r} is invalid: must be an integer in [1, {num_experts}]")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring={scoring!r} is invalid: choose one of {', '.join(SCORINGS)}")


@dataclass(frozen=True)
class RouterSpec:
    """How a model routes its tokens: the parts of SGLang's ``TopKConfig`` that routing reads.

    Attributes
    ----------
    top_k : int
        Routed experts per token.
    scoring : {"softmax", "sigmoid"}
    renormalize : bool
        Whether the weights of a token's picks are divided by their sum.
    num_expert_group : int
        G; 1 means no grouping.  E must be a multiple of G.
    topk_group : int
        Groups a token may pick from (1 <= topk_group <= G).
    routed_scaling_factor : float or None
        Multiplies every routed weight (SGLang: only when ``apply_routed_scaling_factor_on_output``).
    """

    top_k: int
    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float | None = None

    def __post_init__(self) -> None:
        for name in ("top_k", "num_expert_group", "topk_group"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RouterSpec.{name}={value!r} is invalid: must be an integer >= 1")
        if self.scoring not in SCORINGS:
            raise ValueError(f"RouterSpec.scoring={self.scoring!r} is invalid: choose one of {', '.join(SCORINGS)}")
        if not isinstance(self.renormalize, bool):
            raise ValueError(f"RouterSpec.renormalize={self.renormalize!r} is invalid: must be True or False")
        if self.topk_group > self.num_expert_group:
            raise ValueError(
                f"RouterSpec.topk_group={self.topk_group} is invalid: must be <= num_expert_group="
                f"{self.num_expert_group}"
            )
        factor = self.routed_scaling_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0):
            raise ValueError(f"RouterSpec.routed_scaling_factor={factor!r} is invalid: must be None or a number > 0")

    @property
    def grouped(self) -> bool:
        return self.num_expert_group > 1

    def check(self, num_experts: int, correction_bias: torch.Tensor | None) -> None:
        """Raise ``ValueError`` when this router cannot route ``num_experts`` experts (with this bias)."""
        if self.top_k > num_experts:
            raise ValueError(f"top_k={self.top_k} is invalid: must be an integer in [1, {num_experts}]")
        if num_experts % self.num_expert_group:
            raise ValueError(f"num_expert_group={self.num_expert_group} does not divide the {num_experts} experts")
        if self.grouped and self.top_k > self.topk_group * (num_experts // self.num_expert_group):
            raise ValueError(
                f"top_k={self.top_k} exceeds the {self.topk_group} groups of "
                f"{num_experts // self.num_expert_group} experts a token may pick from"
            )
        if correction_bias is not None:
            if self.scoring != "sigmoid":
                raise ValueError("a correction bias needs scoring='sigmoid' (the key is sigmoid(logit) + bias)")
            if not isinstance(correction_bias, torch.Tensor) or correction_bias.shape != (num_experts,):
                shape = tuple(correction_bias.shape) if isinstance(correction_bias, torch.Tensor) else correction_bias
                raise ValueError(f"correction_bias must be a tensor of shape ({num_experts},), got {shape}")


@dataclass(frozen=True)
class RoutingCall:
    """One MoE layer call's routing inputs, checked on construction.

    Parameters
    ----------
    logits : Tensor, shape [T, E], float32 / bfloat16 / float16
        Router logits; rows at or after ``num_valid_tokens`` are padding.
    router : RouterSpec
        The model's router.
    tokens_per_request : int
        D: request r owns rows ``[r*D, (r+1)*D)`` (speculative verify; 1 otherwise).
    num_valid_tokens : int or one-element Tensor, optional
        Real tokens (the first rows); None: all T.  A device tensor is read on the device, so a
        CUDA graph can refill it before each replay.
    expert_to_rank : Tensor, shape [E], integer, optional
        Rank that holds each expert (ids ``0..G-1``); required by ``xshare-ep``.
    layer_id : int, optional
        The model's layer index; read by ``moe-spec`` with a calibration file of several layers.
    token_weights : Tensor, shape [T], float, optional
        Vote weight of each row, in [0, 1] (above 1 counts as 1; NaN and <= 0 as 0).  A real row of
        weight 0 does not vote and routes nowhere; the others' scores are scaled by their weight.
    correction_bias : Tensor, shape [E], optional
        The router's correction bias (sigmoid scoring): chooses experts, does not weigh them.

    Raises
    ------
    ValueError
        Naming the argument whose shape, type or device does not fit.
    """

    logits: torch.Tensor
    router: RouterSpec
    tokens_per_request: int = 1
    num_valid_tokens: int | torch.Tensor | None = None
    expert_to_rank: torch.Tensor | None = None
    layer_id: int | None = None
    token_weights: torch.Tensor | None = None
    correction_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.router, RouterSpec):
            raise ValueError(f"router must be a RouterSpec, got {type(self.router).__name__}")
        logits = self.logits
        check_routing_args(logits, self.router.top_k, self.router.scoring)
        num_tokens, num_experts = logits.shape
        self.router.check(num_experts, self.correction_bias)
        tokens_per_request = self.tokens_per_request
        if isinstance(tokens_per_request, bool) or not isinstance(tokens_per_request, int) or tokens_per_request < 1:
            raise ValueError(f"tokens_per_request={tokens_per_request!r} is invalid: must be an integer >= 1")
        weights = self.token_weights
        if weights is not None:
            if not isinstance(weights, torch.Tensor) or weights.shape != (num_tokens,):
                shape = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
                raise ValueError(f"token_weights must be a tensor of shape ({num_tokens},), got {shape}")
            if not weights.is_floating_point():
                raise ValueError(f"token_weights must be floating point, got {weights.dtype}")
        ranks = self.expert_to_rank
        if ranks is not None and (not isinstance(ranks, torch.Tensor) or ranks.shape != (num_experts,)):
            shape = tuple(ranks.shape) if isinstance(ranks, torch.Tensor) else type(ranks).__name__
            raise ValueError(f"expert_to_rank must have shape ({num_experts},), got {shape}")
        for name in ("token_weights", "correction_bias", "expert_to_rank"):
            tensor = getattr(self, name)
            if tensor is not None and tensor.device != logits.device:
                raise ValueError(f"{name} is on {tensor.device}, the logits on {logits.device}")

    @classmethod
    def of(
        cls,
        logits: torch.Tensor,
        *,
        top_k: int,
        scoring: str = "softmax",
        tokens_per_request: int = 1,
        num_valid_tokens: int | torch.Tensor | None = None,
        expert_to_rank: torch.Tensor | None = None,
        layer_id: int | None = None,
        token_weights: torch.Tensor | None = None,
    ) -> RoutingCall:
        """A call of a plain router (``top_k`` and ``scoring`` only), as selection alone needs it."""
        return cls(
            logits,
            RouterSpec(top_k, scoring),
            tokens_per_request=tokens_per_request,
            num_valid_tokens=num_valid_tokens,
            expert_to_rank=expert_to_rank,
            layer_id=layer_id,
            token_weights=token_weights,
        )

    @property
    def num_tokens(self) -> int:
        return self.logits.shape[0]

    @property
    def num_experts(self) -> int:
        return self.logits.shape[1]

    @property
    def top_k(self) -> int:
        return self.router.top_k

    @property
    def scoring(self) -> str:
        return self.router.scoring

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def check_config(self, cfg: PrunerConfig) -> None:
        """Raise ``ValueError`` unless ``cfg`` can prune this call's model.

        ``k0`` against top-k and the calibration file against E (remembered by ``cfg`` per model
        shape); ``xshare-ep`` needs :attr:`expert_to_rank`.
        """
        if not isinstance(cfg, PrunerConfig):
            raise ValueError(f"cfg must be a PrunerConfig, got {type(cfg).__name__}")
        if cfg.policy == "none":
            return
        cfg.validate_for_model(
            top_k=self.top_k, num_experts=self.num_experts if cfg.static_ranking is not None else None
        )
        if cfg.policy == "xshare-ep" and self.expert_to_rank is None:
            raise ValueError("policy 'xshare-ep' needs expert_to_rank: the rank holding each expert")
