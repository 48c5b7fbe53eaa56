"""A loop-by-loop reading of DESIGN section 4, written apart from the package, for property tests.

Plain Python over lists: sets, sorted() with explicit keys, while loops, exact Fractions for LYNX.
The only thing shared with the package is the per-token score function (``token_scores``, called one
row at a time), whose values are tested separately against float64 formulas; everything that turns
scores into a keep mask or a routing is re-derived here.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from xshare_sglang.policies.scores import token_scores

NEG_INF = float("-inf")
FP32_MAX = 3.4028234663852886e38
ONE = 2**24  # DESIGN's fixed-point grid for scores


def clean(value: float) -> float:
    if math.isnan(value):
        return NEG_INF
    if value == math.inf:
        return FP32_MAX
    return value


def clean_rows(logits: torch.Tensor) -> list[list[float]]:
    return [[clean(v) for v in row] for row in logits.float().tolist()]


def by_value_desc(values: list) -> list[int]:
    """Indices, highest value first, ties to the lower index."""
    return sorted(range(len(values)), key=lambda e: (-values[e], e))


def top_candidates(row: list[float], k: int) -> list[int]:
    return [e for e in by_value_desc(row) if row[e] > NEG_INF][:k]


def score_rows(
    rows: list[list[float]], score: str, scoring: str, top_k: int, weights: list[float] | None = None
) -> list[list[int]]:
    """Fixed-point scores q (units of 2**-24), one token at a time, times the fixed-point weight
    floor(w * 2**24) and shifted back: (q * w_q) >> 24."""
    out = []
    for t, row in enumerate(rows):
        one_row = torch.tensor([row], dtype=torch.float32)
        scores = token_scores(one_row, score=score, scoring=scoring, top_k=top_k)[0].tolist()
        if weights is None:
            out.append(scores)
            continue
        w_q = math.floor(weights[t] * ONE)
        out.append([(q * w_q) >> 24 for q in scores])
    return out


def clean_weight(value: float) -> float:
    """A vote weight as the selection reads it: NaN counts 0, the rest is clamped to [0, 1]."""
    if math.isnan(value):
        return 0.0
    return float(np.float32(min(1.0, max(0.0, value))))


def greedy(start: set[int], agg: list[int], count: int) -> set[int]:
    chosen = set(start)
    outside = [e for e in range(len(agg)) if e not in chosen and agg[e] > 0]
    outside.sort(key=lambda e: (-agg[e], e))
    chosen.update(outside[:count])
    return chosen


def warm(rows: list[list[float]], tokens: list[int], k0: int) -> set[int]:
    chosen: set[int] = set()
    for t in tokens:
        chosen.update(top_candidates(rows[t], k0))
    return chosen


def sums(q: list[list[int]], tokens: list[int], num_experts: int) -> list[int]:
    return [sum(q[t][e] for t in tokens) for e in range(num_experts)]


def lynx_bin(value: float, row_max: float, alpha: float, beta: int) -> int:
    """ceil((value - row_max) * alpha), each step rounded to float32 as the package computes it."""
    with np.errstate(over="ignore", invalid="ignore"):
        top = np.float32(row_max) if row_max > NEG_INF else np.float32(0.0)
        scaled = (np.float32(value) - top) * np.float32(alpha)
    if math.isnan(scaled) or scaled == NEG_INF:
        return -beta
    return max(-beta, math.ceil(scaled))


def select(
    logits: torch.Tensor,
    cfg,
    *,
    top_k: int,
    tokens_per_request: int = 1,
    num_valid_tokens: int | None = None,
    expert_to_rank: list[int] | None = None,
    scoring: str = "softmax",
    layer_id: int | None = None,
    token_weights: list[float] | None = None,
) -> list[bool]:
    """Keep mask as a list of E bools, by the letter of DESIGN section 4.

    Vote weights (speculative verify): the batch size n counts every real row; only real rows with
    weight > 0 vote (warm-up, scores, LYNX picks), and their scores are multiplied by the weight.
    """
    num_tokens, num_experts = logits.shape
    if cfg.policy == "none":
        return [True] * num_experts
    rows = clean_rows(logits)
    n = num_tokens if num_valid_tokens is None else max(0, min(num_valid_tokens, num_tokens))
    # read as Python floats (a tensor element would keep float32 arithmetic in the products below)
    weights = None if token_weights is None else [clean_weight(float(w)) for w in token_weights]
    real = list(range(n))
    tokens = real if weights is None else [t for t in real if weights[t] > 0]
    q = score_rows(rows, cfg.effective_score, scoring, top_k, weights)
    agg = sums(q, tokens, num_experts)
    warm_set: set[int] = set()

    if cfg.policy in ("oea", "xshare", "xshare-threshold", "xshare-ep"):
        warm_set = warm(rows, tokens, cfg.k0)

    if cfg.policy == "oea":
        kept = set(warm_set)
    elif cfg.policy == "xshare":
        kept = greedy(warm_set, agg, cfg.budget)
    elif cfg.policy == "xshare-threshold":
        kept = set(warm_set)
        total = sum(agg)
        held = sum(agg[e] for e in kept)
        for e in sorted((e for e in range(num_experts) if e not in kept and agg[e] > 0), key=lambda e: (-agg[e], e)):
            # held < tau * total, with tau on the 2**-30 grid, in exact integers
            if not held * 2**30 < round(cfg.tau * 2**30) * total:
                break
            kept.add(e)
            held += agg[e]
    elif cfg.policy == "xshare-spec":
        union: set[int] = set()
        d = tokens_per_request
        for start in range(0, n, d):
            request = [t for t in tokens if start <= t < start + d]
            request_warm = warm(rows, request, cfg.k0)
            warm_set |= request_warm
            union |= greedy(request_warm, sums(q, request, num_experts), cfg.request_budget)
        kept = greedy(union, agg, cfg.budget)
    elif cfg.policy == "xshare-ep":
        ranks = max(expert_to_rank) + 1
        kept = set(warm_set)
        while len(kept) < cfg.rank_budget * ranks:
            added = 0
            for g in range(ranks):
                options = [e for e in range(num_experts) if expert_to_rank[e] == g and e not in kept and agg[e] > 0]
                if options:
                    kept.add(min(options, key=lambda e: (-agg[e], e)))
                    added += 1
            if added == 0:
                break
    elif cfg.policy == "moe-spec":
        if cfg.ranking == "static":
            counts = cfg.static_ranking.counts[layer_id if layer_id is not None else 0]
            values = list(counts)
        else:
            values = agg
        if cfg.scope == "request":
            kept = set()
            for start in range(0, n, tokens_per_request):
                request = [t for t in tokens if start <= t < start + tokens_per_request]
                if request:
                    kept |= set(by_value_desc(sums(q, request, num_experts))[: cfg.max_experts])
        else:
            kept = set(by_value_desc(values)[: cfg.max_experts]) if n > 0 else set()
    elif cfg.policy == "lynx":
        kept = set()
        if tokens:
            bins = []
            for t in tokens:
                row_max = max(rows[t])
                bins.append([lynx_bin(v, row_max, cfg.alpha, cfg.beta) for v in rows[t]])
            base = Fraction(n)
            s = []
            for e in range(num_experts):
                per_bin: dict[int, int] = {}
                for i in range(len(tokens)):
                    per_bin[bins[i][e]] = per_bin.get(bins[i][e], 0) + 1
                s.append(sum(count * base**b for b, count in per_bin.items()))
            for i, t in enumerate(tokens):
                options = [e for e in range(num_experts) if rows[t][e] > NEG_INF]
                options.sort(key=lambda e: (-bins[i][e], -s[e], -rows[t][e], e))
                kept.update(options[:top_k])
    else:
        raise AssertionError(cfg.policy)

    if cfg.max_experts is not None and cfg.policy != "moe-spec" and len(kept) > cfg.max_experts:
        kept = set(sorted(kept, key=lambda e: (e not in warm_set, -agg[e], e))[: cfg.max_experts])
    if cfg.min_tokens is not None and n < cfg.min_tokens:
        return [True] * num_experts
    if cfg.max_tokens is not None and n > cfg.max_tokens:
        return [True] * num_experts
    return [e in kept for e in range(num_experts)]


def route(
    logits: torch.Tensor,
    keep: list[bool],
    *,
    top_k: int,
    coverage: str,
    scoring: str,
    renormalize: bool,
    num_valid_tokens: int | None = None,
) -> tuple[list[list[int]], list[list[float]]]:
    """Routing inside the mask by the letter of DESIGN section 4, in float64."""
    rows = clean_rows(logits)
    n = len(rows) if num_valid_tokens is None else num_valid_tokens
    all_ids, all_weights = [], []
    for t, row in enumerate(rows):
        if t >= n:
            all_ids.append([-1] * top_k)
            all_weights.append([0.0] * top_k)
            continue
        if coverage == "substitution":
            allowed = [e for e in range(len(row)) if keep[e] and row[e] > NEG_INF]
        else:
            allowed = [e for e in range(len(row)) if row[e] > NEG_INF]
        chosen = top_candidates([row[e] if e in allowed else NEG_INF for e in range(len(row))], top_k)
        if scoring == "softmax":
            m = max((row[e] for e in allowed), default=0.0)
            denominator = sum(math.exp(row[e] - m) for e in allowed)
            weight = {e: math.exp(row[e] - m) / denominator for e in chosen}
        else:
            weight = {e: 1.0 / (1.0 + math.exp(-row[e])) if row[e] > -700 else 0.0 for e in chosen}
        if renormalize:
            total = sum(weight.values())
            weight = {e: (w / total if total > 0 else 0.0) for e, w in weight.items()}
        if coverage == "truncation":
            chosen = [e if keep[e] else -1 for e in chosen]
        ids = chosen + [-1] * (top_k - len(chosen))
        all_ids.append(ids)
        all_weights.append([weight[e] if e >= 0 else 0.0 for e in ids])
    return all_ids, all_weights
