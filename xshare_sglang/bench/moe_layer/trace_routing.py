"""Synthetic router logits for any (E, T, D) built from one shipped route trace:
:class:`TraceRouting` (per-layer expert popularity plus Gumbel noise, shared in part by the tokens
of one verify request).
"""

from __future__ import annotations

import math

import torch

from ...replay.route_csv import bundled_trace_path, load_route_csv


class TraceRouting:
    """Router logits for any (E, T, D) built from one shipped route trace.

    The traces list each decode token's top-k experts per layer, not full logits.  From a trace this
    keeps two things: each layer's expert popularity ``p_l(e)`` (decode picks of e at layer l, plus
    0.5, normalized) and how much consecutive tokens share experts (mean ``|S_t & S_t+1| / k`` at the
    same layer).  A row of logits for layer l is ``log p_l(e) + G(e)`` with ``G`` standard Gumbel
    noise: its top-k is then a draw of k experts without replacement, each pick in proportion to its
    popularity (the Gumbel-top-k trick), so independent rows stand for independent decode requests with
    the layer's measured skew.  In a verify batch the D tokens of one request share part of their noise,
    ``(1 - rho) G_token + rho G_request``, with ``rho`` fitted so that two such tokens share as many
    top-k experts as consecutive tokens of the trace do.  E = 128 (the traces' own) uses the layer's
    experts as they are; other E map them by a fixed (seeded) permutation: E < 128 takes a random subset
    of the layer's experts; E = 256 puts the layer's vector next to the one of the layer half the model
    away and permutes the 256.
    """

    def __init__(self, name: str, seed: int = 0) -> None:
        trace = load_route_csv(bundled_trace_path(name))
        self.name, self.model, self.source_top_k = name, trace.model, trace.top_k
        self.num_layers, self.source_experts = trace.num_layers, trace.num_experts
        ids = trace.ids  # [N, L, k], -1 where a layer was not recorded
        listed = torch.zeros(*ids.shape[:2], self.source_experts + 1, dtype=torch.bool)
        listed.scatter_(-1, torch.where(ids >= 0, ids, self.source_experts), True)
        listed = listed[..., : self.source_experts]  # [N, L, E]: expert listed by token t at layer l
        counts = listed.sum(0).double()
        self.popularity = (counts + 0.5) / (counts + 0.5).sum(-1, keepdim=True)
        self.sibling_overlap = float((listed[:-1] & listed[1:]).sum(-1).double().mean() / self.source_top_k)
        self.seed = seed
        self.rho = self._fit_rho()

    def log_popularity(self, layer: int, num_experts: int) -> torch.Tensor:
        """``log p`` over ``num_experts`` experts for one source layer, float64 [E]."""
        gen = torch.Generator().manual_seed(self.seed + 7919)
        src = self.source_experts
        if num_experts == src:
            p = self.popularity[layer % self.num_layers]
        elif num_experts < src:
            p = self.popularity[layer % self.num_layers][torch.randperm(src, generator=gen)[:num_experts]]
        else:
            reps = -(-num_experts // src)
            parts = [self.popularity[(layer + r * self.num_layers // reps) % self.num_layers] for r in range(reps)]
            p = torch.cat(parts)[torch.randperm(reps * src, generator=gen)][:num_experts]
        return torch.log(p / p.sum())

    def logits(self, layer: int, num_tokens: int, num_experts: int, tokens_per_request: int, gen) -> torch.Tensor:
        """Router logits [T, E], float32, on the CPU."""
        logp = self.log_popularity(layer, num_experts).float()
        noise = _gumbel((num_tokens, num_experts), gen)
        if tokens_per_request > 1:
            requests = -(-num_tokens // tokens_per_request)
            shared = _gumbel((requests, num_experts), gen).repeat_interleave(tokens_per_request, 0)[:num_tokens]
            noise = (1.0 - self.rho) * noise + self.rho * shared
        return logp + noise

    def _fit_rho(self) -> float:
        """The sibling noise share whose top-k overlap matches the trace's consecutive tokens."""
        gen = torch.Generator().manual_seed(self.seed + 104729)
        k, pairs = self.source_top_k, 64
        best, best_gap = 0.0, math.inf
        layers = range(self.num_layers)
        base = torch.stack([self.log_popularity(layer, self.source_experts).float() for layer in layers])
        tok_a = _gumbel((len(layers), pairs, self.source_experts), gen)
        tok_b = _gumbel((len(layers), pairs, self.source_experts), gen)
        shared = _gumbel((len(layers), pairs, self.source_experts), gen)
        for step in range(21):
            rho = step / 20
            za = base[:, None] + (1 - rho) * tok_a + rho * shared
            zb = base[:, None] + (1 - rho) * tok_b + rho * shared
            ma = torch.zeros_like(za, dtype=torch.bool).scatter_(-1, za.topk(k, -1).indices, True)
            mb = torch.zeros_like(zb, dtype=torch.bool).scatter_(-1, zb.topk(k, -1).indices, True)
            gap = abs(float((ma & mb).sum(-1).float().mean()) / k - self.sibling_overlap)
            if gap < best_gap:
                best, best_gap = rho, gap
        return best


def _gumbel(shape, gen) -> torch.Tensor:
    u = torch.rand(shape, generator=gen).clamp(1e-10, 1 - 1e-7)
    return -torch.log(-torch.log(u))
