"""Trace reading, batch building, per-call metrics and the demo command, end to end."""

from __future__ import annotations

import json

import pytest
import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.cli import main
from xshare_sglang.policies.call import RoutingCall
from xshare_sglang.replay import BatchShape, bundled_trace_path, load_route_csv, segment_batches
from xshare_sglang.replay.metrics import evaluate_call

TINY = """# route_trace v1
# model=/x/tiny.gguf arch=t n_layer=2 n_expert=4 n_expert_used=2
# layer=0 expert_bytes=100 dense_bytes=1
# layer=1 expert_bytes=200 dense_bytes=1
turn,phase,step,layer,slot,expert,weight,residency,expert_bytes
0,0,0,0,0,3,0.6,0,0
0,0,0,0,1,1,0.4,0,0
0,1,1,0,0,2,0.75,0,0
0,1,1,0,1,0,0.25,0,0
0,1,1,1,0,1,0.5,0,0
0,1,1,1,1,3,0.5,0,0
0,1,2,0,0,0,0.9,0,0
0,1,2,0,1,2,0.1,0,0
"""


def test_reads_a_tiny_trace(tmp_path) -> None:
    path = tmp_path / "tiny.route.csv"
    path.write_text(TINY)
    trace = load_route_csv(path)
    assert (trace.name, trace.model, trace.num_layers, trace.num_experts, trace.top_k) == ("tiny", "tiny.gguf", 2, 4, 2)
    assert trace.expert_bytes == (100, 200)
    assert trace.ids.tolist() == [[[2, 0], [1, 3]], [[0, 2], [-1, -1]]]  # step 2 lacks layer 1
    logits = trace.logits(0)
    torch.testing.assert_close(torch.softmax(logits, dim=1), torch.tensor([[0.25, 0, 0.75, 0], [0.9, 0, 0.1, 0]]))
    assert load_route_csv(path, phase="prefill").ids.tolist() == [[[3, 1], [-1, -1]]]


def test_rejects_other_files(tmp_path) -> None:
    path = tmp_path / "x.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not a route_trace v1 file"):
        load_route_csv(path)


@pytest.mark.parametrize(("name", "layers", "tokens", "top_k"), [("gptoss", 36, 64, 2), ("gemma", 30, 128, 6)])
def test_bundled_traces(name, layers, tokens, top_k) -> None:
    trace = load_route_csv(bundled_trace_path(name))
    assert (trace.num_layers, trace.num_tokens, trace.top_k, trace.num_experts) == (layers, tokens, top_k, 128)
    assert (trace.ids >= 0).all()
    torch.testing.assert_close(trace.weights.sum(-1), torch.ones(tokens, layers), atol=1e-5, rtol=0)


def test_segment_batches() -> None:
    batches = segment_batches(10, BatchShape(2, 2))
    assert [b.tolist() for b in batches] == [[0, 1, 5, 6], [2, 3, 7, 8]]
    assert [b.tolist() for b in segment_batches(9, BatchShape(3, 1))] == [[0, 3, 6], [1, 4, 7], [2, 5, 8]]
    assert segment_batches(5, BatchShape(4, 2)) == []
    assert str(BatchShape.parse("4x4")) == "4x4"
    with pytest.raises(ValueError, match="RxD"):
        BatchShape.parse("4by4")


def test_evaluate_call_by_hand() -> None:
    """Two tokens of the tiny trace at layer 0: natural {2, 0} and {0, 2}; oea k0=1 keeps {2, 0}."""
    ids = torch.tensor([[2, 0], [0, 3]])
    weights = torch.tensor([[0.75, 0.25], [0.6, 0.4]])
    logits = torch.full((2, 4), float("-inf"))
    logits[0, 2], logits[0, 0] = torch.tensor(0.75).log(), torch.tensor(0.25).log()
    logits[1, 0], logits[1, 3] = torch.tensor(0.6).log(), torch.tensor(0.4).log()
    call = RoutingCall.of(logits, top_k=2)
    m = evaluate_call(call, ids, weights, PrunerConfig(policy="oea", k0=1))
    # keep {0, 2}; token 1 loses expert 3 (weight .4 of a total mass of 2)
    assert (m.activated, m.kept, m.top1_kept) == (2, 2, 1.0)
    assert m.retained_mass == pytest.approx(1.6 / 2)
    none = evaluate_call(call, ids, weights, PrunerConfig())
    assert (none.activated, none.kept, none.retained_mass) == (3, 4, 1.0)


def test_replay_command(tmp_path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert main(["replay", "--trace", "gptoss", "--shapes", "8x1,4x4", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gptoss, single-load, 8 requests x 1 tokens" in printed
    assert "gptoss, speculative single-load, 4 requests x 4 tokens" in printed
    rows = json.loads(out.read_text())
    by_key = {(r["shape"], r["policy"], r["params"]): r for r in rows}
    trace = load_route_csv(bundled_trace_path("gptoss"))
    for shape in ("8x1", "4x4"):
        batches = segment_batches(trace.num_tokens, BatchShape.parse(shape))
        union = [len(set(trace.ids[b, layer].flatten().tolist())) for layer in range(36) for b in batches]
        none = by_key[(shape, "none", "")]
        assert none["activated"] == pytest.approx(sum(union) / len(union))
        assert (none["kept"], none["retained_mass"], none["layer_calls"]) == (128, 1.0, len(union))
        oea = by_key[(shape, "oea", "k0=1")]
        assert oea["top1_kept"] == 1.0 and oea["activated"] < none["activated"]
        assert by_key[(shape, "moe-spec", "max_experts=8 ranking=router scope=batch")]["kept"] == 8


def test_replay_reads_config_list(tmp_path, capsys) -> None:
    configs = tmp_path / "configs.json"
    configs.write_text(json.dumps([{"policy": "xshare", "k0": 1, "budget": 3}]))
    out = tmp_path / "rows.json"
    assert main(["replay", "--trace", "gptoss", "--shapes", "8x1", "--configs", str(configs), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["params"]) for r in rows] == [("xshare", "k0=1 budget=3")]


def test_replay_reports_bad_shape() -> None:
    with pytest.raises(SystemExit) as info:
        main(["replay", "--shapes", "8"])
    assert info.value.code == 2


def test_verify_command(tmp_path, capsys) -> None:
    """Verify batches: moe-spec's batch scope keeps exactly B; its request scope keeps between B and
    R x B; xshare-spec keeps every token's top-1; depth decay changes the batch-level votes."""
    out = tmp_path / "rows.json"
    assert main(["verify", "--trace", "gptoss", "--shapes", "4x4", "--json", str(out)]) == 0
    assert "gptoss, speculative single-load, 4 requests x 4 tokens" in capsys.readouterr().out
    rows = {(r["policy"], r["params"]): r for r in json.loads(out.read_text())}
    assert rows[("moe-spec", "max_experts=8 ranking=router scope=batch")]["kept"] == 8
    request = rows[("moe-spec", "max_experts=2 ranking=router scope=request")]["kept"]
    assert 2 < request <= 4 * 2
    assert rows[("xshare-spec", "k0=1 request_budget=1 budget=0")]["top1_kept"] == 1.0
    decayed = tmp_path / "decayed.json"
    assert main(["verify", "--trace", "gptoss", "--shapes", "4x4", "--depth-decay", "0.5", "--json", str(decayed)]) == 0
    weighted = {(r["policy"], r["params"]): r for r in json.loads(decayed.read_text())}
    assert weighted[("none", "")] == rows[("none", "")]
    plain = rows[("moe-spec", "max_experts=8 ranking=router scope=batch")]
    changed = weighted[("moe-spec", "max_experts=8 ranking=router scope=batch depth_decay=0.5")]
    assert changed["kept"] == 8 and changed["retained_mass"] != plain["retained_mass"]


def test_chain_vote_weights() -> None:
    from xshare_sglang.replay.engine import chain_vote_weights

    assert chain_vote_weights(BatchShape(2, 3), 0.5).tolist() == [1.0, 0.5, 0.25, 1.0, 0.5, 0.25]
    assert chain_vote_weights(BatchShape(2, 3), None) is None
    assert chain_vote_weights(BatchShape(8, 1), 0.5) is None
