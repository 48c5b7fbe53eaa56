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
        # the layer's output in the stream: a fixed function of its input and routing, scaled per layer
        block.topk.forward = lambda states, logits: logits.topk(2, dim=-1)
        scale = float(layer_id + 1)
        block.experts.forward = lambda states, routed, scale=scale: scale * states * routed.values.sum(-1, keepdim=True)
        decoder.mlp = block
        decoder.post_attention_layernorm = SimpleNamespace(weight=torch.full((HIDDEN,), 2.0))
        layers.append(decoder)
    inner.layers = layers
    model.model = inner
    return model


def _timed_layers(model, num_tokens, **source):
    from xshare_sglang.sglang_plugin.guard import timed_layers

    runtime = SimpleNamespace(device=torch.device("cpu"), enter=lambda scope: None, leave=lambda previous: None)
    return timed_layers(runtime, model, num_tokens, **{"trace_path": None, "calibration_counts": None, **source})


def _rms(states: torch.Tensor) -> torch.Tensor:
    return states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_the_stream_starts_from_rows_of_the_embedding_table() -> None:
    from xshare_sglang.sglang_plugin.guard import _hidden_states

    model = _model()
    rows = _hidden_states(model, 64, HIDDEN, torch.device("cpu"))
    table = model.model.embed_tokens.weight.detach()
    assert rows.dtype == torch.float32 and rows.shape == (64, HIDDEN)
    assert bool(((rows[:, None, :] - table[None]).abs().amax(-1).amin(-1) == 0).all())


def test_a_residual_stream_through_the_models_own_moe_layers(monkeypatch) -> None:
    """Layer 0 reads the embedding rows; layer 1 reads them plus layer 0's output; a layer reads the
    stream RMS-normalised times its post-attention norm's weight (2), through its own router."""
    from xshare_sglang.sglang_plugin import guard

    raw = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(guard, "_hidden_states", lambda model, num_tokens, width, device: raw[:num_tokens].clone())
    model = _model()
    (first, second), source = _timed_layers(model, 32)
    assert source == "the model's routers on a residual stream of its own MoE layers from embedding rows"
    assert (first.layer_id, second.layer_id) == (0, 1)
    gate0, gate1 = (decoder.mlp.gate for decoder in model.model.layers)
    with torch.no_grad():
        assert torch.allclose(first.hidden, 2.0 * _rms(raw), atol=1e-5)
        assert torch.allclose(first.router_logits, gate0(first.hidden), atol=1e-5)
        update = first.hidden * gate0(first.hidden).topk(2, dim=-1).values.sum(-1, keepdim=True)
        assert torch.allclose(second.hidden, 2.0 * _rms(raw + update), atol=1e-4)
        assert torch.allclose(second.router_logits, gate1(second.hidden), atol=1e-5)


def test_recorded_trace_rows_of_the_same_layer(tmp_path) -> None:
    meta = TraceMeta(model="m", num_layers=2, num_experts=NUM_EXPERTS, top_k=2, expert_bytes=(1, 1))
    recorded = {layer: torch.randn(5, NUM_EXPERTS) + 10 * layer for layer in range(2)}
    calls = [LayerCall(0, layer, "decode", torch.arange(5), logits=recorded[layer]) for layer in range(2)]
    path = Trace(meta, calls).save(tmp_path / "trace.pt")
    layers, source = _timed_layers(_model(), 40, trace_path=str(path))
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
    layers, source = _timed_layers(_model(), 6000, calibration_counts=counts)
    assert source == "draws from the calibration file's expert counts"
    first = torch.bincount(layers[0].router_logits.argmax(-1), minlength=NUM_EXPERTS) / 6000
    # Gumbel-max: the top pick follows counts / sum (80/150, 40/150, ...) within sampling noise
    assert torch.allclose(first[:4], torch.tensor([80, 40, 20, 10]) / 150, atol=0.02)
    assert float(first[4:].sum()) < 0.01  # never-seen experts keep only a small chance
    assert float((layers[1].router_logits.argmax(-1) == 7).float().mean()) > 0.95
