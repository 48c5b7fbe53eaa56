"""The scope of a speculative (EAGLE target-verify) forward: grouping, and the votes of draft nodes.

Grouping is static: request i owns rows ``[i*D, (i+1)*D)``, D being the verify input's
``draft_token_num`` (eager) or the graph runner's captured width (CUDA graphs); the real-token count
(``raw_bs * D`` on replay) already excludes padded requests.  D follows the step count in force under
``--speculative-adaptive`` (each step count has its own verify inputs and graphs, D = steps + 1); a
verify of D = 1 (0 steps) is a decode step and takes the decode phase's config.  Vote weights are built only when the
verify config sets ``depth_decay`` or ECHO cuts draft trees: from the positions (depth = position
minus the root's) and from the tree links (nodes the root cannot reach never vote).  In a CUDA
graph the weights are computed by recorded ops from the graph's static positions and a plugin
buffer of acceptable nodes, which the ``load_batch`` hook refills before each replay.
"""

from __future__ import annotations

import logging

import torch

from ..spec import acceptable_nodes, draft_depths, vote_weights
from .echo_runtime import get_echo_runtime
from .forward_phases import phase_of, pruned_phase
from .runtime import ForwardScope, PrunerRuntime

logger = logging.getLogger(__name__)

_warned_ragged = False


def _ragged(runtime: PrunerRuntime, phase: str | None) -> bool:
    """Warn once: per-request verify lengths (SGLang's ragged verify) break the fixed-D grouping."""
    global _warned_ragged
    if not _warned_ragged:
        _warned_ragged = True
        logger.warning(
            "moe-pruner: this server verifies ragged draft lengths per request; the pruner groups verify "
            "rows in fixed blocks of D, so %s forwards run unpruned",
            phase,
        )
    return True


def _weighted_votes(cfg) -> bool:
    """Draft nodes vote with weights: depth decay asked for, or ECHO cuts nodes out of the trees."""
    if cfg.depth_decay is not None:
        return True
    echo = get_echo_runtime()
    return echo is not None and echo.calibration is not None


def tree_acceptable(spec_info, num_requests: int, tokens_per_request: int) -> torch.Tensor | None:
    """Acceptable nodes of a verify input, shape [R*D] bool; None when it carries no tree links."""
    next_token = getattr(spec_info, "retrieve_next_token", None)
    next_sibling = getattr(spec_info, "retrieve_next_sibling", None)
    shape = (num_requests, tokens_per_request)
    if next_token is None or next_sibling is None:
        return None
    if tuple(next_token.shape) != shape or tuple(next_sibling.shape) != shape:
        raise ValueError(
            f"verify tree links of shape {tuple(next_token.shape)}, expected {shape} (requests x draft tokens)"
        )
    return acceptable_nodes(next_token, next_sibling).reshape(-1)


def _num_tokens(forward_batch) -> int | None:
    """Rows of the forward (real ones eagerly; the padded bucket in a graph capture)."""
    input_ids = getattr(forward_batch, "input_ids", None)
    return None if input_ids is None else int(input_ids.shape[0])


def eager_scope(runtime: PrunerRuntime, forward_batch) -> ForwardScope:
    """Scope of an eagerly run forward (vote weights are computed only if a layer call needs them)."""
    spec_info = forward_batch.spec_info
    tokens_per_request = 1
    if phase_of(forward_batch.forward_mode) == "verify":
        tokens_per_request = int(getattr(spec_info, "draft_token_num", 1) or 1)
    phase = pruned_phase(forward_batch.forward_mode, tokens_per_request)
    cfg = runtime.config_for(phase, _num_tokens(forward_batch))
    if phase != "verify":
        return ForwardScope(phase=phase, cfg=cfg)
    if getattr(spec_info, "ragged_verify_layout", None) is not None and _ragged(runtime, phase):
        return ForwardScope(phase=phase, tokens_per_request=tokens_per_request, cfg=None)
    scope = ForwardScope(phase=phase, tokens_per_request=tokens_per_request, cfg=cfg)
    if cfg is not None and _weighted_votes(cfg):
        positions, decay = forward_batch.positions, cfg.depth_decay

        def weights() -> torch.Tensor:
            depths = draft_depths(positions, tokens_per_request)
            acceptable = tree_acceptable(spec_info, depths.shape[0] // tokens_per_request, tokens_per_request)
            return vote_weights(depths, decay, acceptable)

        scope.weights_source = weights
    return scope


def graph_scope(runtime: PrunerRuntime, graph_runner, forward_batch) -> ForwardScope:
    """Scope of a decode/verify CUDA graph, published while it is warmed up and captured."""
    tokens_per_request = graph_runner.captured_req_width
    phase = pruned_phase(graph_runner.capture_forward_mode, tokens_per_request)
    cfg = runtime.config_for(phase, _num_tokens(forward_batch))
    scope = ForwardScope(
        phase=phase, tokens_per_request=tokens_per_request, num_valid=runtime.num_valid_buffer, cfg=cfg
    )
    if phase != "verify" or cfg is None:
        return scope
    if getattr(graph_runner, "ragged_verify_mode", False) and _ragged(runtime, phase):
        scope.cfg = None
        return scope
    if _weighted_votes(cfg):
        num_tokens = forward_batch.input_ids.shape[0]
        acceptable = runtime.acceptable_buffers.get(num_tokens)
        if acceptable is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"no acceptable-node buffer for a verify graph of {num_tokens} tokens")
            acceptable = torch.ones(num_tokens, dtype=torch.bool, device=forward_batch.input_ids.device)
            runtime.acceptable_buffers[num_tokens] = acceptable
        # recorded into the graph: replays recompute the weights from the refilled static inputs
        depths = draft_depths(forward_batch.positions[:num_tokens], tokens_per_request)
        scope.token_weights = vote_weights(depths, cfg.depth_decay, acceptable)
    return scope


def refill_graph_inputs(runtime: PrunerRuntime, graph_runner, forward_batch) -> None:
    """Before a replay: the real-token count, whether the graph was captured pruned, and the acceptable
    nodes of a verify graph with votes."""
    runtime.num_valid_buffer.fill_(graph_runner.raw_num_token)
    phase = pruned_phase(graph_runner.capture_forward_mode, graph_runner.captured_req_width)
    runtime.replay_pruned = runtime.graph_pruned.get((phase, graph_runner.bs * graph_runner.captured_req_width), False)
    if not runtime.acceptable_buffers or phase != "verify":
        return
    tokens_per_request = graph_runner.captured_req_width
    buffer = runtime.acceptable_buffers.get(graph_runner.bs * tokens_per_request)
    if buffer is None:
        return
    raw_tokens = graph_runner.raw_bs * tokens_per_request
    try:
        acceptable = tree_acceptable(forward_batch.spec_info, graph_runner.raw_bs, tokens_per_request)
    except Exception as exc:  # every node votes rather than a failed replay
        runtime.record_fault("the verify tree of a graph replay", exc)
        acceptable = None
    if acceptable is None:
        buffer.fill_(True)
    else:
        buffer[:raw_tokens].copy_(acceptable)
        buffer[raw_tokens:].fill_(True)
