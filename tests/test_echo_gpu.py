"""ECHO on a GPU: the candidate stash replays inside a CUDA graph (as in SGLang's draft graph), and a
whole scheduling step runs on the device without a host synchronisation."""

from __future__ import annotations

import pytest
import torch

from xshare_sglang.spec.echo import DraftCandidates, EchoCalibration, allocate_nodes, cut_tree, layer_confidence
from xshare_sglang.spec.echo.settings import EchoSettings

pytestmark = pytest.mark.gpu

STEPS, TOPK, DRAFT_TOKENS = 4, 4, 12


def _lists(batch: int, seed: int, device: str = "cuda"):
    """Draft lists in SGLang's layout (see tests/sglang_helpers.sglang_draft), built with torch only."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    scores = torch.rand(batch, 1, TOPK, generator=gen).sort(dim=-1, descending=True).values
    score_list, token_list = [scores], [torch.randint(0, 1000, (batch, TOPK), generator=gen)]
    parents_list = [torch.arange(-1, TOPK).expand(batch, -1)]
    beam = scores.reshape(batch, TOPK)
    for step in range(1, STEPS):
        expand = beam[:, :, None] * torch.rand(batch, TOPK, TOPK, generator=gen)
        best = expand.flatten(1).topk(TOPK, dim=1)
        score_list.append(expand)
        token_list.append(torch.randint(0, 1000, (batch, TOPK * TOPK), generator=gen))
        parents_list.append(best.indices + TOPK * TOPK * (step - 1) + TOPK)
        beam = best.values
    move = lambda items: [t.to(device) for t in items]  # noqa: E731
    return move(score_list), move(token_list), move(parents_list)


def test_stash_replays_in_a_cuda_graph(tmp_path) -> None:
    from xshare_sglang.sglang_plugin.echo_runtime import EchoRuntime

    runtime = EchoRuntime(EchoSettings(log_dir=str(tmp_path)))
    batch = 6
    runtime.reserve(batch, STEPS, TOPK, "cuda")
    static = _lists(batch, seed=0)
    runtime.stash(*static)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        runtime.stash(*static)
    assert runtime.faults == 0
    for seed in range(1, 4):
        fresh = _lists(batch, seed=seed)
        for dst, src in zip((t for group in static for t in group), (t for group in fresh for t in group), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        got = runtime.candidates(batch, STEPS, TOPK)
        want = DraftCandidates.from_sglang(*fresh)
        assert torch.equal(got.scores, want.scores.float()) and torch.equal(got.parents, want.parents)


def warm_scheduler(tmp_path, batch: int, device: str):
    """A calibrated ECHO runtime with its buffers reserved and one scheduling step run (the warm-up a
    server does before capture); returns it, the top-scores index of a step, and the stashed lists."""
    from xshare_sglang.sglang_plugin.echo_runtime import EchoRuntime

    path = tmp_path / "c.json"
    EchoCalibration(num_steps=STEPS, topk=TOPK, num_draft_tokens=DRAFT_TOKENS, gates={1: 0.5, STEPS: 0.05}).save(path)
    runtime = EchoRuntime(EchoSettings(calibration=str(path), budget=5.0))
    runtime.reserve(batch, STEPS, TOPK, device)
    lists = _lists(batch, seed=7, device=device)
    runtime.stash(*lists)
    index = torch.zeros(batch, DRAFT_TOKENS - 1, dtype=torch.int64, device=device)
    runtime.plan(batch, num_steps=STEPS, topk=TOPK, num_draft_tokens=DRAFT_TOKENS, top_scores_index=index)
    return runtime, index, lists


def test_a_scheduling_step_never_synchronises(tmp_path) -> None:
    batch = 8
    runtime, index, lists = warm_scheduler(tmp_path, batch, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        plan = runtime.plan(batch, num_steps=STEPS, topk=TOPK, num_draft_tokens=DRAFT_TOKENS, top_scores_index=index)
        links = torch.full((batch, DRAFT_TOKENS), -1, dtype=torch.int64, device="cuda")
        cut_tree(links, links.clone(), plan.kept)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    candidates = DraftCandidates.from_sglang(*[[t.cpu() for t in group] for group in lists])
    assert torch.equal(plan.confidence.cpu(), layer_confidence(candidates))
    assert int(plan.kept[:, 1:].sum()) <= 5 * batch
    assert plan.kept.shape == (batch, DRAFT_TOKENS)
    assert allocate_nodes(candidates, torch.ones(batch, STEPS, dtype=torch.int64)).sum(dim=1).le(STEPS).all()
