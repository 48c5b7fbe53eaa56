"""Real tree speculative decoding with the tiny MoE target on CPU: SGLang's EAGLE tree, ECHO's budgets.

One *verify step* for a batch of requests:

1. **draft** (:func:`draft_tree`): SGLang's beam tree, step by step as ``select_top_k_tokens`` builds
   it (step 0: top-K after the context; step s: for each of the K beam paths the draft's top-K,
   ``beam score x probability`` over the K^2 children, the new beam their top-K), returned as the
   ``score_list`` / ``token_list`` / ``parents_list`` that ``organize_draft_results`` receives and
   as :class:`~xshare_sglang.spec.echo.DraftCandidates`.  No KV cache: every draft call recomputes
   the full sequences (the K paths of a request batched);
2. **node choice** (:func:`choose_nodes`): ``static`` (SGLang's best D - 1 path probabilities per
   request, or best ``k_max // R`` when the budget is smaller), ``echo`` (ECHO's schedule laid into
   SGLang's fixed D slots, slots outside the allocation *cut*: verified, never accepted, no expert
   vote) and ``echo-ragged`` (only ECHO's allocation is verified, no fixed layout);
3. **verify** (:func:`verify_forward`): one target forward over ``context + verified nodes`` per
   request with a 4D tree mask (a node sees the context, its ancestors and itself; position = root
   position + depth); the context's last token is the root;
4. **accept** (:func:`accept`): greedy, from the root along kept children matching the target's
   argmax, plus the bonus token, so the output is exactly the target's greedy decoding;
5. **experts** (:func:`activated_experts`): the router logits of the tree rows (root and verified
   nodes) laid out request-major with D rows per request and vote weights (1 kept, 0 cut or
   padding), the experts each verify policy would activate per layer call; the verify forward itself
   is never pruned.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..config import PrunerConfig
from ..policies import route_within, select_experts_mask
from ..spec.echo import (
    DraftCandidates,
    EchoCalibration,
    EchoLogRecord,
    allocate_nodes,
    echo_schedule,
    layer_confidence,
    static_slots,
    verify_slots,
)
from .tiny_model import hf_routing, routers

MODES = ("static", "echo", "echo-ragged")
NextProbs = Callable[[list[list[int]]], torch.Tensor]


# ------------------------------------------------------------------------------------- forwards


def _right_padded(seqs: Sequence[Sequence[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask


@torch.no_grad()
def last_logits(model, seqs: Sequence[Sequence[int]]) -> torch.Tensor:
    """Logits after the last token of every sequence (one right-padded batch), [n, V] float32."""
    ids, mask = _right_padded(seqs)
    hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    last = mask.sum(dim=1) - 1
    return model.get_output_embeddings()(hidden[torch.arange(len(seqs)), last]).float()


def model_probs(model) -> NextProbs:
    """``next_probs`` of a causal LM: softmax of its logits after each sequence."""
    return lambda seqs: torch.softmax(last_logits(model, seqs), dim=-1)


@torch.no_grad()
def greedy_reference(model, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """The target's own greedy continuation of every prompt (full recompute, no cache)."""
    seqs = [list(p) for p in prompts]
    for _ in range(new_tokens):
        for seq, token in zip(seqs, last_logits(model, seqs).argmax(dim=-1).tolist(), strict=True):
            seq.append(token)
    return [seq[len(p) :] for seq, p in zip(seqs, prompts, strict=True)]


# ---------------------------------------------------------------------------------------- draft


def _fast_topk(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``fast_topk`` on the last dimension."""
    return torch.max(values, dim=-1, keepdim=True) if k == 1 else torch.topk(values, k, dim=-1)


@dataclass
class DraftTree:
    """SGLang's draft lists of one batch (one entry per draft step) and the candidates they make."""

    score_list: list[torch.Tensor]
    token_list: list[torch.Tensor]
    parents_list: list[torch.Tensor]

    @property
    def candidates(self) -> DraftCandidates:
        return DraftCandidates.from_sglang(self.score_list, self.token_list, self.parents_list)


@torch.no_grad()
def draft_tree(next_probs: NextProbs, contexts: Sequence[Sequence[int]], num_steps: int, topk: int) -> DraftTree:
    """SGLang's EAGLE beam tree (``_select_top_k_tokens_first`` / ``_later``) over a real draft."""
    num_requests = len(contexts)
    topk_p, topk_index = _fast_topk(next_probs([list(c) for c in contexts]).float(), topk)
    score_list = [topk_p.unsqueeze(1)]
    token_list = [topk_index]
    parents_list = [torch.arange(-1, topk, dtype=torch.long).expand(num_requests, -1)]
    scores = topk_p
    paths = [[[t] for t in row] for row in topk_index.tolist()]  # beam paths, draft tokens only
    for step in range(1, num_steps):
        flat = [list(contexts[r]) + paths[r][a] for r in range(num_requests) for a in range(topk)]
        topk_p, topk_index = _fast_topk(next_probs(flat).float(), topk)
        expand = scores.unsqueeze(2) * topk_p.view(-1, topk, topk)
        beam_p, beam_index = _fast_topk(expand.flatten(start_dim=1), topk)
        children = topk_index.view(-1, topk * topk)
        score_list.append(expand)
        token_list.append(children)
        parents_list.append(beam_index + (topk * topk * (step - 1) + topk))
        beam_tokens = torch.gather(children, 1, beam_index).tolist()
        paths = [
            [paths[r][c // topk] + [beam_tokens[r][a]] for a, c in enumerate(beam_index[r].tolist())]
            for r in range(num_requests)
        ]
        scores = beam_p
    return DraftTree(score_list, token_list, parents_list)


# ------------------------------------------------------------------------------------ node choice


@dataclass(frozen=True)
class TreeNodes:
    """The draft nodes one request verifies: candidate indices (increasing) and which are kept."""

    index: torch.Tensor  # [n] int64
    kept: torch.Tensor  # [n] bool


def choose_nodes(
    candidates: DraftCandidates,
    mode: str,
    k_max: int,
    num_draft_tokens: int,
    *,
    calibration: EchoCalibration | None = None,
    default_width: int = 1,
    max_width: int | None = None,
) -> list[TreeNodes]:
    """The verified nodes of every request under ``mode`` (see the module doc) at batch budget ``k_max``."""
    num_requests = candidates.num_requests
    if mode == "static":
        per_request = max(0, min(num_draft_tokens - 1, k_max // max(num_requests, 1)))
        slots = static_slots(candidates, per_request + 1)
        return [TreeNodes(row, torch.ones_like(row, dtype=torch.bool)) for row in slots]
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: choose one of {', '.join(MODES)}")
    if calibration is None:
        raise ValueError(f"mode {mode} needs an ECHO calibration")
    gated, thresholds = calibration.gate_tensors()
    ragged = mode == "echo-ragged"
    allocation = echo_schedule(
        layer_confidence(candidates),
        gated,
        thresholds,
        k_max,
        default_width=default_width,
        max_width=max_width or candidates.topk,
        per_request_cap=candidates.num_candidates if ragged else num_draft_tokens - 1,
    )
    allocated = allocate_nodes(candidates, allocation.widths)
    if ragged:
        return [TreeNodes(row.nonzero().flatten(), torch.ones(int(row.sum()), dtype=torch.bool)) for row in allocated]
    slots, kept = verify_slots(candidates, allocated, num_draft_tokens)
    return [TreeNodes(slots[r], kept[r, 1:]) for r in range(num_requests)]


@dataclass(frozen=True)
class VerifyTree:
    """One request's verify tree: row 0 the root, row j >= 1 node j - 1."""

    tokens: list[int]  # [n] draft tokens
    parent: list[int]  # [n] parent row (0 = root), -1 when the parent is not verified
    depth: list[int]  # [n] 1-based
    kept: list[bool]  # [n] may be accepted and votes (kept and reachable from the root)


def build_tree(candidates: DraftCandidates, request: int, nodes: TreeNodes) -> VerifyTree:
    index = nodes.index.tolist()
    row_of = {c: j + 1 for j, c in enumerate(index)}
    depths = candidates.depths()
    tokens = candidates.tokens[request, nodes.index].tolist()
    parent = [0 if p < 0 else row_of.get(p, -1) for p in candidates.parents[request, nodes.index].tolist()]
    kept = list(map(bool, nodes.kept.tolist()))
    for j, p in enumerate(parent):  # parents come first: reachability in one pass
        kept[j] = kept[j] and p >= 0 and (p == 0 or kept[p - 1])
    return VerifyTree(tokens, parent, depths[nodes.index].tolist(), kept)


# ----------------------------------------------------------------------------------------- verify


@torch.no_grad()
def verify_forward(
    model,
    contexts: Sequence[Sequence[int]],
    trees: Sequence[VerifyTree],
    *,
    prune: PrunerConfig | None = None,
    votes: Sequence[torch.Tensor] | None = None,
    rows_per_request: int | None = None,
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """One target forward over every request's context and verify tree (4D tree mask).

    With ``prune``, every MoE layer routes the tree rows (root and nodes, the rows a server's verify
    forward holds) inside the keep mask the policy chooses from them, laid out request-major with
    ``rows_per_request`` rows per request (default: the widest tree) and vote weights ``votes``
    (``[R]`` tensors ``[1 + n]``; 0 for cut nodes).  Context rows keep the model's routing: in a
    server they would come from the KV cache.

    Returns the target's argmax at every tree row (``[R][1 + n]``) and the router logits of the
    tree rows per layer (``[L][R]`` tensors ``[1 + n, E]``).
    """
    lengths = [len(c) + len(t.tokens) for c, t in zip(contexts, trees, strict=True)]
    width = max(lengths)
    ids = torch.zeros((len(contexts), width), dtype=torch.long)
    positions = torch.zeros_like(ids)
    allowed = torch.eye(width, dtype=torch.bool).repeat(len(contexts), 1, 1)
    for b, (context, tree) in enumerate(zip(contexts, trees, strict=True)):
        n_ctx = len(context)
        ids[b, :n_ctx] = torch.as_tensor(list(context))
        ids[b, n_ctx : lengths[b]] = torch.as_tensor(tree.tokens, dtype=torch.long)
        positions[b, :n_ctx] = torch.arange(n_ctx)
        positions[b, n_ctx : lengths[b]] = n_ctx - 1 + torch.as_tensor(tree.depth, dtype=torch.long)
        allowed[b, :n_ctx, :n_ctx] = torch.ones(n_ctx, n_ctx, dtype=torch.bool).tril()
        for j, p in enumerate(tree.parent):
            row = n_ctx + j
            allowed[b, row, :n_ctx] = True
            while p > 0:  # ancestors (a missing parent, -1, or the root, 0, ends the chain)
                allowed[b, row, n_ctx + p - 1] = True
                p = tree.parent[p - 1]
    mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    rows = [torch.arange(len(c) - 1, lengths[b]) + b * width for b, c in enumerate(contexts)]
    captured: list[torch.Tensor] = []

    def hook(layer: int):
        def route(router, inputs, output):
            captured.append(output[0].detach())
            if prune is None:
                return None
            return _prune_tree_rows(router, layer, output, rows, prune, votes, rows_per_request)

        return route

    handles = [r.register_forward_hook(hook(layer)) for layer, r in enumerate(routers(model))]
    try:
        hidden = model.base_model(input_ids=ids, position_ids=positions, attention_mask=mask[:, None])
    finally:
        for handle in handles:
            handle.remove()
    argmax = []
    for b, context in enumerate(contexts):
        tree_hidden = hidden.last_hidden_state[b, len(context) - 1 : lengths[b]]
        argmax.append(model.get_output_embeddings()(tree_hidden).argmax(dim=-1).tolist())
    router_rows = [[layer[r].float() for r in rows] for layer in captured]
    return argmax, router_rows


def _prune_tree_rows(router, layer: int, output, rows, cfg: PrunerConfig, votes, rows_per_request):
    """The router's output with the tree rows routed inside the policy's keep mask."""
    logits, weights, ids = output
    tree_logits = [logits[r].float() for r in rows]
    if votes is None:
        votes = [torch.ones(r.numel()) for r in rows]
    layout, layout_votes, width = vote_layout(tree_logits, votes, rows_per_request)
    keep = select_experts_mask(
        layout, cfg, top_k=router.top_k, tokens_per_request=width, token_weights=layout_votes, layer_id=layer
    )
    flat = torch.cat(rows)
    tree_ids, tree_weights = hf_routing(router, logits[flat].float(), keep, cfg.coverage, weights.dtype)
    ids, weights = ids.clone(), weights.clone()
    ids[flat], weights[flat] = tree_ids.to(ids.dtype), tree_weights
    return logits, weights, ids


def accept(tree: VerifyTree, argmax: Sequence[int]) -> tuple[list[int], int]:
    """Greedy acceptance: the accepted draft tokens and the bonus token."""
    row, accepted = 0, []
    while True:
        target = argmax[row]
        child = next(
            (
                j + 1
                for j, (p, tok, kept) in enumerate(zip(tree.parent, tree.tokens, tree.kept, strict=True))
                if p == row and kept and tok == target
            ),
            None,
        )
        if child is None:
            return accepted, target
        accepted.append(target)
        row = child


# ---------------------------------------------------------------------------------------- experts


def vote_layout(
    rows: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], rows_per_request: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Request-major ``[R * D, E]`` logits and ``[R * D]`` vote weights, ragged requests zero-padded."""
    width = rows_per_request or max(r.shape[0] for r in rows)
    num_experts = rows[0].shape[1]
    logits = torch.zeros((len(rows), width, num_experts), dtype=torch.float32)
    votes = torch.zeros((len(rows), width), dtype=torch.float32)
    for b, (r, w) in enumerate(zip(rows, weights, strict=True)):
        logits[b, : r.shape[0]] = r
        votes[b, : r.shape[0]] = w
    return logits.flatten(0, 1), votes.flatten(), width


def activated_experts(
    logits: torch.Tensor, weights: torch.Tensor, cfg: PrunerConfig, *, top_k: int, tokens_per_request: int
) -> int:
    """Distinct experts the voting rows (weight > 0) are routed to under ``cfg`` in one layer call."""
    voting = weights > 0
    if cfg.policy == "none":
        return int(torch.unique(logits[voting].topk(top_k, dim=-1).indices).numel())
    keep = select_experts_mask(logits, cfg, top_k=top_k, tokens_per_request=tokens_per_request, token_weights=weights)
    ids, _ = route_within(logits, keep, top_k=top_k, coverage=cfg.coverage)
    ids = ids[voting]
    return int(torch.unique(ids[ids >= 0]).numel())


# --------------------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class SpecSettings:
    """The draft tree, the verify slots, ECHO's widths and the output length of one run.

    ``max_width`` None means the draft top-k.  Invalid values raise ``ValueError`` naming the
    ``spec-eval`` flag.
    """

    num_steps: int = 5
    topk: int = 4
    num_draft_tokens: int = 8
    new_tokens: int = 48
    default_width: int = 1
    max_width: int | None = None

    def __post_init__(self) -> None:
        if self.num_steps < 1 or self.topk < 1:
            raise ValueError(f"--num-steps {self.num_steps} and --topk {self.topk} must both be >= 1")
        candidates = self.topk + (self.num_steps - 1) * self.topk * self.topk
        if not 2 <= self.num_draft_tokens <= candidates + 1:
            raise ValueError(
                f"--draft-tokens {self.num_draft_tokens} must lie in [2, {candidates + 1}] for "
                f"--num-steps {self.num_steps} x --topk {self.topk}"
            )
        if self.new_tokens < 1:
            raise ValueError(f"--new-tokens {self.new_tokens} must be >= 1")
        if self.max_width is None:
            object.__setattr__(self, "max_width", self.topk)
        if self.default_width < 1 or self.max_width < 1:
            raise ValueError(f"--default-width {self.default_width} and --max-width {self.max_width} must both be >= 1")


@dataclass
class SpecRun:
    """Totals of one speculative generation (means are over request-steps or layer calls)."""

    mode: str
    k_max: int
    outputs: list[list[int]] = field(default_factory=list)
    steps: int = 0
    request_steps: int = 0
    accepted: int = 0
    tree_depth: int = 0
    kept_nodes: int = 0
    slots: int = 0
    layer_calls: int = 0
    activated: dict[str, int] = field(default_factory=dict)
    exact: bool | None = None
    accepted_by_request: list[int] = field(default_factory=list)  # accepted draft tokens per request

    @property
    def mat(self) -> float:
        return self.accepted / max(self.request_steps, 1)

    @property
    def utilization(self) -> float:
        return self.accepted / max(self.tree_depth, 1)

    def summary(self) -> dict:
        return {
            "mode": self.mode,
            "k_max": self.k_max,
            "mat": self.mat,
            "tokens_per_step": self.mat + 1,
            "utilization": self.utilization,
            "kept_nodes_per_step": self.kept_nodes / max(self.steps, 1),
            "slots_per_step": self.slots / max(self.steps, 1),
            "activated": {k: v / max(self.layer_calls, 1) for k, v in self.activated.items()},
            "steps": self.steps,
            "exact": self.exact,
        }


def policy_label(cfg: PrunerConfig) -> str:
    return " ".join([cfg.policy, *(f"{k}={v}" for k, v in cfg.policy_parameters().items())])


@torch.no_grad()
def speculative_generate(
    target,
    next_probs: NextProbs,
    prompts: Sequence[Sequence[int]],
    settings: SpecSettings,
    *,
    mode: str = "static",
    k_max: int | None = None,
    calibration: EchoCalibration | None = None,
    configs: Sequence[PrunerConfig] = (),
    log: Callable[[str], None] | None = None,
    verify_cfg: PrunerConfig | None = None,
) -> SpecRun:
    """Decode every prompt until each has ``settings.new_tokens`` tokens, all requests in one batch
    throughout (finished ones keep decoding, as in a full server); ``log`` receives one ECHO log
    line (JSON) per verify step.  With ``verify_cfg`` the target's verify forwards are pruned by
    that policy (see :func:`verify_forward`); the output is then the pruned model's, not the
    target's greedy decoding."""
    d = settings.num_draft_tokens
    k_max = (d - 1) * len(prompts) if k_max is None else k_max
    top_k = target.config.num_experts_per_tok
    run = SpecRun(mode, k_max, outputs=[[] for _ in prompts], activated={policy_label(c): 0 for c in configs})
    run.accepted_by_request = [0] * len(prompts)
    fixed = d if mode == "echo" else None
    contexts = [list(p) for p in prompts]
    while min(map(len, run.outputs)) < settings.new_tokens:
        draft = draft_tree(next_probs, contexts, settings.num_steps, settings.topk).candidates
        chosen = choose_nodes(
            draft,
            mode,
            k_max,
            d,
            calibration=calibration,
            default_width=settings.default_width,
            max_width=settings.max_width,
        )
        trees = [build_tree(draft, r, nodes) for r, nodes in enumerate(chosen)]
        weights = [torch.tensor([1.0] + [float(k) for k in t.kept]) for t in trees]
        argmax, router_rows = verify_forward(
            target, contexts, trees, prune=verify_cfg, votes=weights, rows_per_request=fixed
        )
        accepted_lengths = []
        for r, tree in enumerate(trees):
            accepted, bonus = accept(tree, argmax[r])
            run.accepted_by_request[r] += len(accepted)
            contexts[r] += [*accepted, bonus]
            run.outputs[r] += [*accepted, bonus]
            accepted_lengths.append(len(accepted))
            run.tree_depth += max((dep for dep, k in zip(tree.depth, tree.kept, strict=True) if k), default=0)
            run.kept_nodes += sum(tree.kept)
            run.slots += len(tree.tokens)
        run.steps += 1
        run.request_steps += len(trees)
        run.accepted += sum(accepted_lengths)
        if log is not None:
            record = EchoLogRecord(
                num_steps=settings.num_steps,
                topk=settings.topk,
                num_draft_tokens=d,
                confidence=layer_confidence(draft).tolist(),
                accepted=accepted_lengths,
            )
            log(record.to_json())
        for layer_rows in router_rows:
            logits, votes, width = vote_layout(layer_rows, weights, fixed)
            run.layer_calls += 1
            for cfg in configs:
                run.activated[policy_label(cfg)] += activated_experts(
                    logits, votes, cfg, top_k=top_k, tokens_per_request=width
                )
    return run
