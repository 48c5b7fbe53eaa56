"""The model shapes the MoE-layer benchmark times (the shape table) and the pruning settings it
compares with the baseline on each: :class:`Shape`, :data:`MODELS`, :data:`SMOKE_MODELS`,
:func:`policy_grid` and :func:`policy_label`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ... import PrunerConfig


@dataclass(frozen=True)
class Shape:
    """One MoE layer as this process holds it.

    ``num_experts`` experts are routed over (the router's width); with ``num_ranks > 1`` this process
    is expert-parallel rank 0 and holds the ``num_experts // num_ranks`` experts ``[0, E/ranks)``:
    picks of other experts are another rank's work and are not computed here.
    """

    name: str
    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    num_ranks: int = 1
    scoring: str = "softmax"
    note: str = ""

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights in bf16: gate and up (w13, [2I, H]) plus down (w2, [H, I])."""
        return 3 * self.hidden * self.intermediate * 2

    @property
    def slot_flops(self) -> int:
        """FLOPs of one routed (token, expert) slot: gate/up ``2·H·2I`` plus down ``2·I·H``."""
        return 6 * self.hidden * self.intermediate


MODELS = {
    "qwen3-30b-a3b": Shape(
        "qwen3-30b-a3b", 128, 8, 2048, 768, note="Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, expert 768, bf16"
    ),
    "gpt-oss-120b": Shape(
        "gpt-oss-120b",
        128,
        4,
        2880,
        2880,
        note="GPT-OSS-120B: 128 experts, top-4, hidden 2880, expert 2880; bf16 stand-in for its MXFP4 weights, "
        "plain SwiGLU without its biases and clamp",
    ),
    "gpt-oss-20b": Shape(
        "gpt-oss-20b",
        32,
        4,
        2880,
        2880,
        note="GPT-OSS-20B: 32 experts, top-4, hidden 2880, expert 2880; bf16 stand-in for its MXFP4 weights, "
        "plain SwiGLU without its biases and clamp",
    ),
    "deepseek-v3-ep8": Shape(
        "deepseek-v3-ep8",
        256,
        8,
        7168,
        2048,
        num_ranks=8,
        scoring="sigmoid",
        note="DeepSeek-V3, one rank of 8-way expert parallelism: routing over 256 experts, top-8, 32 local experts, "
        "hidden 7168, expert 2048, bf16; sigmoid scores renormalized, no group-limited routing, no correction "
        "bias, no shared expert",
    ),
}
SMOKE_MODELS = {
    "tiny": Shape("tiny", 8, 2, 64, 32, note="smoke shape"),
    "tiny-ep": Shape("tiny-ep", 16, 4, 64, 32, num_ranks=4, scoring="sigmoid", note="smoke shape, EP rank 0 of 4"),
}


def policy_grid(shape: Shape, phase: str, smoke: bool) -> list[PrunerConfig]:
    """Pruning settings compared with the baseline; budgets in experts scale with E / 128."""
    k = shape.top_k

    def scaled(budget: int) -> int:
        return max(1, round(budget * shape.num_experts / 128))

    if phase == "decode":
        grid = [PrunerConfig(policy="xshare", k0=1, budget=scaled(b)) for b in (8, 16)]
        grid += [PrunerConfig(policy="moe-spec", max_experts=scaled(b)) for b in (16, 32, 64)]
        grid += [PrunerConfig(policy="lynx", alpha=2.0, beta=4)]
        if shape.num_ranks > 1:
            grid += [PrunerConfig(policy="xshare-ep", k0=1, rank_budget=b) for b in (4, 8)]
    else:
        grid = [PrunerConfig(policy="xshare-spec", k0=1, request_budget=b, budget=0) for b in (2, 4)]
        grid += [PrunerConfig(policy="moe-spec", max_experts=b, scope="request") for b in (k, 2 * k)]
        grid += [PrunerConfig(policy="moe-spec", max_experts=scaled(32))]
    if smoke:  # one setting per policy and scope
        seen, picked = set(), []
        for cfg in grid:
            if (cfg.policy, cfg.scope) not in seen:
                seen.add((cfg.policy, cfg.scope))
                picked.append(cfg)
        grid = picked
    return grid


def policy_label(cfg: PrunerConfig) -> str:
    params = cfg.policy_parameters()
    params.pop("ranking", None)
    if params.get("scope") == "batch":
        params.pop("scope")
    return " ".join(f"{k}={v}" for k, v in params.items())
