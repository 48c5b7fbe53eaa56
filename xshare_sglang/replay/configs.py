"""The policy settings the offline tools compare by default, and budget sweeps."""

from __future__ import annotations

import dataclasses

from ..config import PrunerConfig

DEFAULT_SHAPES = ("8x1", "32x1", "4x4", "8x4")
VERIFY_SHAPES = ("4x4", "4x8", "8x4", "8x8")


def default_configs(top_k: int, num_experts: int) -> list[PrunerConfig]:
    """One or two representative settings per policy, scaled to the trace's top-k."""
    return [
        PrunerConfig(policy="none"),
        PrunerConfig(policy="oea", k0=1),
        PrunerConfig(policy="xshare", k0=1, budget=top_k),
        PrunerConfig(policy="xshare", k0=1, budget=4 * top_k),
        PrunerConfig(policy="xshare-threshold", k0=1, tau=0.9),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=1, budget=0),
        PrunerConfig(policy="xshare-ep", k0=1, rank_budget=1),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 4 * top_k)),
        PrunerConfig(policy="lynx", alpha=2.0, beta=4),
    ]


def verify_configs(top_k: int, num_experts: int) -> list[PrunerConfig]:
    """Speculative-verify comparison: batch-level and per-request policies at similar sizes."""
    return [
        PrunerConfig(policy="none"),
        PrunerConfig(policy="xshare", k0=1, budget=top_k),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=1, budget=0),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=top_k, budget=0),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 4 * top_k)),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, top_k), scope="request"),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 2 * top_k), scope="request"),
    ]


SWEEPS = {
    "xshare": "budget",
    "xshare-spec": "request_budget",
    "xshare-ep": "rank_budget",
    "moe-spec": "max_experts",
    "oea": "k0",
    "xshare-threshold": "tau",
    "lynx": "beta",
}


def sweep_configs(policy: str, values: list[float], base: dict | None = None) -> list[PrunerConfig]:
    """One config per value of the policy's size knob (``SWEEPS``), the other fields from ``base``.

    Raises
    ------
    ValueError
        For a policy without a sweep, or a value the config rejects (the message names the field).
    """
    if policy not in SWEEPS:
        raise ValueError(f"--sweep policy {policy!r} is invalid: choose one of {', '.join(SWEEPS)}")
    knob = SWEEPS[policy]
    fields = {"policy": policy, "k0": 1, **(base or {})}
    if policy == "xshare-spec":
        fields.setdefault("budget", 0)
    out = []
    for value in values:
        typed = float(value) if knob == "tau" else int(value)
        out.append(PrunerConfig.load({**fields, knob: typed}))
    return out


def with_depth_decay(configs: list[PrunerConfig], depth_decay: float | None) -> list[PrunerConfig]:
    """The configs with ``depth_decay`` set where the policy takes it (not none, not lynx)."""
    if depth_decay is None:
        return configs
    return [
        cfg if cfg.policy in ("none", "lynx") else dataclasses.replace(cfg, depth_decay=depth_decay) for cfg in configs
    ]
