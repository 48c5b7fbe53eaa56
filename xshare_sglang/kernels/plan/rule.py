"""The policy's set rule for one call: which rule, its count, and whether the [E, E] order is compiled."""

from __future__ import annotations

from ...config import PrunerConfig
from .spec import Mode, SetRule

_POLICY_MODES = {
    "none": Mode.ALL,
    "oea": Mode.WARM,
    "xshare": Mode.GREEDY_WARM,
    "xshare-spec": Mode.GREEDY_BASE,
    "xshare-threshold": Mode.THRESHOLD,
    "xshare-ep": Mode.RANK_ROUNDS,
    "lynx": Mode.GIVEN,
}
_RANKING_MODES = {"static": Mode.STATIC, "coactivation": Mode.COACT, "coverage": Mode.COVERAGE}


def set_rule(cfg: PrunerConfig, num_tokens: int, num_experts: int, top_k: int, layer_id: int | None) -> SetRule:
    """The selection's rule for one call of ``cfg``.

    The coverage ranking of one row is the router ranking's top count: each gain is the row's score
    times its one uncovered share, so the greedy keeps experts in the order (score desc, index asc).
    ``order`` is off when the launch's rows settle the order's answer: with top-k scores at most
    ``T x top_k`` experts have an aggregate, so a greedy budget that large (or zero) takes all (or
    none) of them, and the top count takes every scored expert, then the rest in index order.
    """
    policy = cfg.policy
    static = policy == "moe-spec" and cfg.ranking == "static"
    coact = policy == "moe-spec" and cfg.ranking == "coactivation"
    coverage = policy == "moe-spec" and cfg.ranking == "coverage"
    request_top = policy == "moe-spec" and cfg.scope == "request"
    layer_budget = cfg.layer_budget(layer_id) if policy == "moe-spec" else 0
    if request_top:
        mode, count = Mode.GIVEN, 0
    elif policy == "moe-spec":
        mode = _RANKING_MODES.get(cfg.ranking, Mode.TOP_AGG)
        count = min(layer_budget, num_experts) if (coact or coverage) else layer_budget
    else:
        mode, count = _POLICY_MODES[policy], (cfg.budget if policy != "none" else 0)
    if coverage and num_tokens == 1:
        mode = Mode.TOP_AGG
    count = min(count, num_experts + 1)
    fits = cfg.effective_score == "topk" and num_tokens * top_k <= count
    takes_all = (mode in (Mode.GREEDY_WARM, Mode.GREEDY_BASE) and (count <= 0 or fits)) or (
        mode == Mode.TOP_AGG and fits
    )
    return SetRule(
        mode=mode,
        count=count,
        order=not takes_all,
        k0=cfg.k0 if policy not in ("moe-spec", "lynx", "none") else 0,
        request_budget=min(layer_budget if request_top else cfg.request_budget, num_experts),
        has_cap=cfg.max_experts is not None and policy not in ("moe-spec", "none"),
        rule_scores=policy not in ("oea", "lynx", "none") and not static,
        request_top=request_top,
        static=static,
        coactivation=coact,
    )
