"""Case building: the inputs of one (model, phase, T) (:class:`Case`, :func:`build_case`: rotated
hidden states, trace logits, the baseline's routing) and the server's pruned routing over them
(:class:`PrunedLayer`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ... import PrunerConfig, route_within
from ...kernels import SelectionWorkspace, prune_route
from ...policies.api import select
from ...policies.call import RouterSpec, RoutingCall
from ..common import sync
from .reference import _same_routing, activated_experts, route_topk, routed_slots
from .shapes import Shape
from .trace_routing import TraceRouting


@dataclass
class Case:
    """Inputs of one (model, phase, T): rotated hidden states and logits, and the baseline's routing."""

    shape: Shape
    phase: str
    tokens: int
    tokens_per_request: int
    xs: list
    logits: list
    num_valid: torch.Tensor
    expert_to_rank: torch.Tensor | None
    baseline_routes: list
    baseline_counts: list[int]

    @property
    def baseline_activated(self) -> float:
        return statistics.mean(self.baseline_counts)

    @property
    def baseline_slots(self) -> float:
        """This rank's routed slots of the baseline, mean over the inputs."""
        return statistics.mean(routed_slots(ids, 0, self.shape.local_experts) for ids, _ in self.baseline_routes)


def build_case(shape, phase, tokens, draft, source: TraceRouting, rotate, device, dtype, gen, cpu_gen) -> Case:
    per_request = draft if phase == "verify" else 1
    xs, logits = [], []
    for i in range(rotate):
        layer = (i * source.num_layers) // rotate
        xs.append(torch.randn(tokens, shape.hidden, generator=gen, device=device).to(dtype))
        z = source.logits(layer, tokens, shape.num_experts, per_request, cpu_gen)
        logits.append(z.to(torch.bfloat16).to(device))
    routes = [route_topk(z, shape.top_k, shape.scoring) for z in logits]
    ranks = None
    if shape.num_ranks > 1:
        ranks = (torch.arange(shape.num_experts, device=device) // shape.local_experts).to(torch.int32)
    counts = [activated_experts(ids, 0, shape.local_experts) for ids, _ in routes]
    return Case(
        shape,
        phase,
        tokens,
        per_request,
        xs,
        logits,
        torch.tensor([tokens], device=device, dtype=torch.int32),
        ranks,
        routes,
        counts,
    )


class PrunedLayer:
    """The server's pruned routing for one config: the fused selection kernel in place of the top-k."""

    def __init__(self, case: Case, cfg: PrunerConfig, workspace: SelectionWorkspace) -> None:
        self.case, self.cfg, self.workspace = case, cfg, workspace
        device = case.logits[0].device
        self.keep = torch.empty(case.shape.num_experts, dtype=torch.bool, device=device)
        router = RouterSpec(case.shape.top_k, case.shape.scoring)
        # one call per input, built (and checked) once, as the server builds one per layer call
        self.calls = [
            RoutingCall(
                logits,
                router,
                tokens_per_request=case.tokens_per_request,
                num_valid_tokens=case.num_valid,
                expert_to_rank=case.expert_to_rank,
            )
            for logits in case.logits
        ]
        # routing buffers the selection-only graph writes (same work as in the layer)
        self.scratch = [(ids.clone(), w.clone()) for ids, w in case.baseline_routes]

    def _prune_route(self, j: int, ids: torch.Tensor | None = None, w: torch.Tensor | None = None):
        return prune_route(
            self.calls[j], self.cfg, keep_out=self.keep, ids_out=ids, weights_out=w, workspace=self.workspace
        )

    def route(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        routed = self._prune_route(j)
        return routed.topk_ids, routed.topk_weights

    def selection_only(self, j: int) -> None:
        ids, w = self.scratch[j]
        self._prune_route(j, ids, w)

    def check(self, j: int) -> dict:
        """Kernel mask vs reference, routing vs route_within, on input j (eager)."""
        logits = self.case.logits[j]
        keep_ref = select(self.calls[j], self.cfg)[0]
        ids, w = self.route(j)
        sync()
        masks_equal = bool(torch.equal(self.keep, keep_ref))
        ref_ids, ref_w = route_within(
            logits, keep_ref, top_k=self.case.shape.top_k, coverage=self.cfg.coverage, scoring=self.case.shape.scoring
        )
        routing_equal = _same_routing(logits, ids, w, ref_ids, ref_w)
        return {
            "masks_equal": masks_equal,
            "routing_equal": routing_equal,
            "kept": int(keep_ref.sum()),
            "ids": ids.clone(),
            "w": w.clone(),
        }
