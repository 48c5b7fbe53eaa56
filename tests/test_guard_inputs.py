"""The router logits the start-up guard times with, from each of its three sources: a recorded trace,
the calibration file's counts, the model's own routers on embedding rows.  SGLang's ``TopK`` and
``FusedMoE`` classes are real (their constructors bypassed, see ``sglang_helpers``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.sglang_helpers import stand_in_experts, stand_in_topk
from xshare_sglang.replay.trace import LayerCall, Trace, TraceMeta

pytestmark = [pytest.mark.sglang, pytest.mark.break_even]

NUM_EXPERTS, HIDDEN = 8, 16


def _model(num_layers: int = 2) -> torch.nn.Module:
    from sglang.srt.layers.moe.topk import TopKConfig

    model = torch.nn.Module()
    model.config = SimpleNamespace(hidden_size=HIDDEN)
    inner = torch.nn.Module()
    inner.embed_tokens = torch.nn.Embedding(50, HIDDEN)
    layers = torch.nn.ModuleList()
    for layer_id in range(num_layers):
        decoder, block = torch.nn.Module(), torch.nn.Module()
        block.gate = torch.nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)
        block.topk = stand_in_topk(TopKConfig(top_k=2, renormalize=True), layer_id=layer_id)
        block.experts = stand_in_experts(layer_id=layer_id, num_experts=NUM_EXPERTS)
        decoder.mlp = block
        decoder.post_attention_layernorm = SimpleNamespace(weight=torch.full((HIDDEN,), 2.0))
        layers.append(decoder)
    inner.layers = layers
    model.model = inner
    return model


def _timed_layers(model, num_tokens, **source):
    from xshare_sglang.sglang_plugin.guard import timed_layers

    runtime = SimpleNamespace(device=torch.device("cpu"))
    return timed_layers(runtime, model, num_tokens, **{"trace_path": None, "calibration_counts": None, **source})


def test_embedding_rows_through_each_layers_own_router() -> None:
    model = _model()
    layers, hidden, source = _timed_layers(model, 32)
    assert source == "the model's routers on hidden states drawn from its embeddings"
    assert [layer.layer_id for layer in layers] == [0, 1] and hidden.shape == (32, HIDDEN)
    rows = hidden / 2.0  # the post-attention norm's weight, 2
    assert torch.allclose(rows.pow(2).mean(-1), torch.ones(32), atol=1e-4)  # unit RMS before the weight
    table = model.model.embed_tokens.weight
    assert all(
        bool((table / table.pow(2).mean(-1, keepdim=True).sqrt() - row).abs().amax(-1).min() < 1e-4) for row in rows
    )
    for layer, decoder in zip(layers, model.model.layers, strict=True):
        assert torch.allclose(layer.router_logits, decoder.mlp.gate(hidden), atol=1e-5)


def test_recorded_trace_rows_of_the_same_layer(tmp_path) -> None:
    meta = TraceMeta(model="m", num_layers=2, num_experts=NUM_EXPERTS, top_k=2, expert_bytes=(1, 1))
    recorded = {layer: torch.randn(5, NUM_EXPERTS) + 10 * layer for layer in range(2)}
    calls = [LayerCall(0, layer, "decode", torch.arange(5), logits=recorded[layer]) for layer in range(2)]
    path = Trace(meta, calls).save(tmp_path / "trace.pt")
    layers, _, source = _timed_layers(_model(), 40, trace_path=str(path))
    assert source == f"router logits recorded in {path}"
    for layer in layers:
        drawn = layer.router_logits
        assert drawn.shape == (40, NUM_EXPERTS)
        assert all(any(torch.equal(row, want) for want in recorded[layer.layer_id]) for row in drawn)


def test_a_trace_of_another_model_is_refused(tmp_path) -> None:
    from xshare_sglang.sglang_plugin.model_layers import PrunerSetupError

    meta = TraceMeta(model="m", num_layers=1, num_experts=NUM_EXPERTS, top_k=2, expert_bytes=(1,))
    path = Trace(meta, [LayerCall(0, 0, "decode", torch.arange(3), logits=torch.randn(3, NUM_EXPERTS))]).save(
        tmp_path / "one-layer.pt"
    )
    with pytest.raises(PrunerSetupError, match="holds no router logits of MoE layer 1"):
        _timed_layers(_model(), 8, trace_path=str(path))


def test_calibration_counts_set_how_often_each_expert_is_picked() -> None:
    counts = [[80.0, 40.0, 20.0, 10.0, 0.0, 0.0, 0.0, 0.0], [0.0] * 7 + [5.0]]
    layers, _, source = _timed_layers(_model(), 6000, calibration_counts=counts)
    assert source == "draws from the calibration file's expert counts"
    first = torch.bincount(layers[0].router_logits.argmax(-1), minlength=NUM_EXPERTS) / 6000
    # Gumbel-max: the top pick follows counts / sum (80/150, 40/150, ...) within sampling noise
    assert torch.allclose(first[:4], torch.tensor([80, 40, 20, 10]) / 150, atol=0.02)
    assert float(first[4:].sum()) < 0.01  # never-seen experts keep only a small chance
    assert float((layers[1].router_logits.argmax(-1) == 7).float().mean()) > 0.95
