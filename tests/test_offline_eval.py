"""The xshare-trace format, batch builders, replay numbers by hand, cost model, sweeps and plots."""

from __future__ import annotations

import json
import math

import pytest
import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.cli import main
from xshare_sglang.replay import (
    BatchShape,
    LayerCall,
    Trace,
    TraceMeta,
    build_batches,
    load_route_csv,
    load_trace,
    mixed_load_batches,
    modeled_speedup,
    moe_read_seconds,
    replay_table,
    segment_batches,
    single_load_batches,
    sweep_configs,
    token_table,
    trace_from_route_csv,
)
from xshare_sglang.replay.batches import split_sequences
from xshare_sglang.replay.cost import H100, H200, qwen3_moe_expert_bytes
from xshare_sglang.replay.plot import pareto_front, plot_pareto

from .test_replay import TINY


def two_token_trace(extra_calls=()) -> Trace:
    """One step, one layer, two requests (sources a and b), E=4, top-2, 100 bytes per expert."""
    meta = TraceMeta("hand", 1, 4, 2, (100,), sources={0: "a", 1: "b"})
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0], [0.0, 0.0, 3.0, 1.0]])
    return Trace(meta, [LayerCall(0, 0, "decode", torch.tensor([0, 1]), logits=logits), *extra_calls], name="hand")


# ------------------------------------------------------------------------------------ format


def test_trace_round_trip(tmp_path) -> None:
    meta = TraceMeta("m", 2, 4, 2, (10, 20), scoring="sigmoid", renormalize=False, sources={0: "code", 7: "math"})
    calls = [
        LayerCall(0, 0, "decode", torch.tensor([0, 7]), logits=torch.randn(2, 4).half()),
        LayerCall(
            0,
            1,
            "decode",
            torch.tensor([0, 7]),
            topk_ids=torch.tensor([[1, 2], [3, -1]]),
            topk_weights=torch.tensor([[0.5, 0.25], [1.0, 0.0]]),
        ),
    ]
    path = Trace(meta, calls, name="x").save(tmp_path / "t.pt")
    back = load_trace(path)
    assert back.meta == meta and back.name == "t" and len(back.calls) == 2
    assert back.calls[0].logits.dtype == torch.float16 and torch.equal(back.calls[0].logits, calls[0].logits)
    assert torch.equal(back.calls[1].topk_ids, calls[1].topk_ids)
    assert torch.equal(back.calls[1].topk_weights, calls[1].topk_weights)
    assert back.meta.source_of(7) == "math" and back.meta.source_of(3) == "default"


def test_trace_rejects_other_files_and_versions(tmp_path) -> None:
    other = tmp_path / "other.pt"
    torch.save({"format": "something"}, other)
    with pytest.raises(ValueError, match="not an xshare-trace file"):
        load_trace(other)
    text = tmp_path / "text.pt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="not an xshare-trace file"):
        load_trace(text)
    path = two_token_trace().save(tmp_path / "v.pt")
    payload = torch.load(path, weights_only=True)
    payload["version"] = 2
    torch.save(payload, path)
    with pytest.raises(ValueError, match="version 2 is not supported"):
        load_trace(path)


def test_layer_call_validation() -> None:
    with pytest.raises(ValueError, match="either logits or topk_ids"):
        LayerCall(0, 0, "decode", torch.tensor([0]))
    with pytest.raises(ValueError, match="phase='prefill' is invalid"):
        LayerCall(0, 0, "prefill", torch.tensor([0]), logits=torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"must be \[T=2, E\]"):
        LayerCall(0, 0, "decode", torch.tensor([0, 1]), logits=torch.zeros(1, 4))
    with pytest.raises(ValueError, match="scoring='relu' is invalid"):
        TraceMeta("m", 1, 4, 2, (1,), scoring="relu")


def test_route_csv_converts_to_the_same_logits(tmp_path) -> None:
    path = tmp_path / "tiny.route.csv"
    path.write_text(TINY)
    route = load_route_csv(path)
    trace = trace_from_route_csv(route)
    saved = load_trace(trace.save(tmp_path / "tiny.pt"))
    table = token_table(saved)
    assert table.num_tokens == 2 and table.meta.expert_bytes == (100, 200)
    for layer in range(2):
        assert torch.equal(table.logits[layer], route.logits(layer))
    assert torch.equal(table.natural_ids, route.ids)
    ((name, sequences),) = table.sequences().items()
    assert name == "tiny" and len(sequences) == 1 and sequences[0].tolist() == [0, 1]


def test_token_table_natural_topk_from_logits_and_skips_partial_steps(caplog) -> None:
    partial = LayerCall(5, 0, "decode", torch.tensor([0]), logits=torch.zeros(1, 4))
    meta = TraceMeta("hand", 2, 4, 2, (1, 1))
    full = [LayerCall(1, layer, "decode", torch.tensor([0, 1]), logits=torch.eye(4)[:2] * 2) for layer in range(2)]
    table = token_table(Trace(meta, [*full, partial]))
    assert table.num_tokens == 2 and "skipped 1 decode steps" in caplog.text
    assert table.natural_ids[0, 0, 0] == 0 and table.natural_ids[1, 1, 0] == 1
    e2 = math.exp(2)
    assert table.natural_weights[0, 0, 0].item() == pytest.approx(e2 / (e2 + 1))
    with pytest.raises(ValueError, match="no verify calls"):
        token_table(Trace(meta, full), "verify")


# ----------------------------------------------------------------------------------- batches


def test_single_load_matches_the_segment_cut() -> None:
    for n, shape in [(10, BatchShape(2, 2)), (9, BatchShape(3, 1)), (64, BatchShape(8, 4)), (5, BatchShape(4, 2))]:
        built = single_load_batches({"s": [torch.arange(n)]}, shape)
        assert [b.tolist() for b in built] == [b.tolist() for b in segment_batches(n, shape)]


def test_split_sequences() -> None:
    pieces = split_sequences([torch.arange(10)], 3)
    assert [p.tolist() for p in pieces] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    many = [torch.arange(4), torch.arange(4, 8)]
    assert split_sequences(many, 2) == many


def test_single_load_groups_requests_of_one_source() -> None:
    by_source = {"a": [torch.arange(0, 4), torch.arange(4, 8)], "b": [torch.arange(8, 12), torch.arange(12, 16)]}
    batches = single_load_batches(by_source, BatchShape(2, 2))
    assert [b.tolist() for b in batches] == [[0, 1, 4, 5], [2, 3, 6, 7], [8, 9, 12, 13], [10, 11, 14, 15]]


def test_mixed_load_proportions() -> None:
    """R=4, share 1/4: one request from the focus source, three from the others in turn."""
    by_source = {name: [torch.arange(4) + 16 * i + 4 * j for j in range(4)] for i, name in enumerate("abc")}
    source_of = {int(t): name for name, seqs in by_source.items() for s in seqs for t in s}
    batches = mixed_load_batches(by_source, BatchShape(4, 1), share=0.25)
    assert batches[0].tolist() == [0, 16, 32, 20]  # a0 | b0 c0 b1
    assert len(batches) == 3 * 2 * 4  # 3 focus sources x 2 groups x 4 offsets
    for index, batch in enumerate(batches):
        focus = "abc"[index // 8]
        sources = [source_of[int(t)] for t in batch]
        assert sources[0] == focus and focus not in sources[1:]
    halves = mixed_load_batches(by_source, BatchShape(4, 2), share=0.5)
    assert all(len(b) == 8 for b in halves)
    first = [source_of[int(t)] for t in halves[0]]
    assert first[:4] == ["a"] * 4 and "a" not in first[4:]


def test_mixed_load_errors() -> None:
    with pytest.raises(ValueError, match="two or more sources"):
        mixed_load_batches({"a": [torch.arange(8)]}, BatchShape(4, 1))
    with pytest.raises(ValueError, match=r"share=1\.0 is invalid"):
        mixed_load_batches({"a": [torch.arange(8)], "b": [torch.arange(8)]}, BatchShape(4, 1), share=1.0)
    with pytest.raises(ValueError, match="scenario='both' is invalid"):
        build_batches({"a": [torch.arange(8)]}, BatchShape(4, 1), "both")


# ------------------------------------------------------------------------------------ replay


def test_replay_by_hand() -> None:
    """Natural top-2: token 0 -> {0, 1}, token 1 -> {2, 3}: 4 experts activated.  oea k0=1 keeps
    {0, 2}; token 0 keeps softmax weight e^3/(e^3+e^2) of its top-2, token 1 e^3/(e^3+e)."""
    table = token_table(two_token_trace())
    batches = build_batches(table.sequences(), BatchShape(2, 1), "mixed", share=0.5)
    assert [b.tolist() for b in batches] == [[0, 1], [1, 0]]
    configs = [PrunerConfig(), PrunerConfig(policy="oea", k0=1)]
    none, oea = replay_table(table, batches[:1], configs, scenario="mixed", shape=BatchShape(2, 1))
    assert (none.activated, none.kept, none.retained_mass, none.speedup) == (4, 4, 1.0, 1.0)
    keep0 = math.exp(3) / (math.exp(3) + math.exp(2))
    keep1 = math.exp(3) / (math.exp(3) + math.exp(1))
    assert (oea.activated, oea.kept, oea.top1_kept, oea.baseline_activated) == (2, 2, 1.0, 4)
    assert oea.retained_mass == pytest.approx((keep0 + keep1) / 2)
    assert oea.speedup == pytest.approx(2.0)
    assert oea.modeled_us["H100 SXM"] == pytest.approx(2 * 100 / 3.35e12 * 1e6)
    assert oea.modeled_us["H200"] == pytest.approx(2 * 100 / 4.8e12 * 1e6)
    assert replay_table(table, [], configs, scenario="single", shape=BatchShape(2, 1)) == []


def test_replay_without_expert_sizes_counts_experts() -> None:
    trace = two_token_trace()
    trace.meta = TraceMeta("hand", 1, 4, 2, (0,), sources={0: "a", 1: "b"})
    table = token_table(trace)
    (row,) = replay_table(
        table, [torch.tensor([0, 1])], [PrunerConfig(policy="oea", k0=1)], scenario="single", shape=BatchShape(2, 1)
    )
    assert row.speedup == pytest.approx(2.0) and row.modeled_us == {}


def test_cost_model_arithmetic() -> None:
    assert moe_read_seconds(10, 1_000_000, H100) == pytest.approx(10e6 / 3.35e12)
    assert moe_read_seconds(10, 1_000_000, H200) == pytest.approx(10e6 / 4.8e12)
    assert modeled_speedup(300, 100) == 3.0 and modeled_speedup(0, 0) == 1.0
    # Qwen3-30B-A3B: hidden 2048, expert intermediate 768, bf16
    assert qwen3_moe_expert_bytes(2048, 768) == 3 * 2048 * 768 * 2
    with pytest.raises(ValueError):
        moe_read_seconds(-1, 1, H100)


def test_sweep_configs() -> None:
    swept = sweep_configs("xshare", [2, 4.0])
    assert [(c.policy, c.k0, c.budget) for c in swept] == [("xshare", 1, 2), ("xshare", 1, 4)]
    assert [c.tau for c in sweep_configs("xshare-threshold", [0.5, 0.8])] == [0.5, 0.8]
    assert [c.request_budget for c in sweep_configs("xshare-spec", [1, 3])] == [1, 3]
    with pytest.raises(ValueError, match="--sweep policy 'nope' is invalid"):
        sweep_configs("nope", [1])


def test_pareto_front_and_plot(tmp_path) -> None:
    points = [(50.0, 3.0), (90.0, 1.5), (60.0, 1.0), (100.0, 1.0), (90.0, 1.2)]
    assert pareto_front(points) == [0, 1, 3]
    panel = [
        {"label": "a x", "retained_mass": 0.5, "speedup": 3.0},
        {"label": "b", "retained_mass": 1.0, "speedup": 1.0},
    ]
    path = plot_pareto({"p1": panel, "p2": panel}, tmp_path / "p.png", "t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_command_sweep_mixed_and_plots(tmp_path, capsys) -> None:
    trace = two_token_trace()
    calls = [LayerCall(s, 0, "decode", torch.tensor([0, 1]), logits=torch.randn(2, 4)) for s in range(1, 8)]
    trace.calls += calls
    path = trace.save(tmp_path / "hand.pt")
    out = tmp_path / "rows.json"
    argv = ["replay", "--trace", str(path), "--scenario", "single,mixed", "--shapes", "2x1,2x2", "--sweep", "oea"]
    assert main([*argv, "--values", "1,2", "--plot-dir", str(tmp_path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "hand, mixed-load, 2 requests x 1 tokens" in printed and "speculative mixed-load" in printed
    rows = json.loads(out.read_text())
    assert {(r["scenario"], r["shape"], r["params"]) for r in rows} >= {("mixed", "2x2", "k0=2"), ("single", "2x1", "")}
    assert (tmp_path / "hand_mixed.png").exists() and (tmp_path / "hand_single.png").exists()
    # one request per source: single-load batches of 2 requests cut each request into two pieces
    single = [r for r in rows if r["scenario"] == "single" and r["shape"] == "2x1"]
    assert single[0]["layer_calls"] == 2 * 4


def test_replay_command_errors(tmp_path) -> None:
    for argv in (
        ["replay", "--trace", str(tmp_path / "missing.pt")],
        ["replay", "--sweep", "xshare", "--values", "a,b"],
        ["replay", "--sweep", "xshare", "--values", "2", "--configs", "x.json"],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2


def test_trace_folder_reads_as_one_trace(tmp_path) -> None:
    from xshare_sglang.replay.trace import load_trace_dir

    folder = tmp_path / "run"
    folder.mkdir()
    two_token_trace().save(folder / "a.pt")
    two_token_trace().save(folder / "b.pt")
    merged = load_trace_dir(folder)
    assert [c.step for c in merged.calls] == [0, 1] and merged.name == "run"
    assert token_table(merged).num_tokens == 4
    other = two_token_trace()
    other.meta = TraceMeta("other", 1, 4, 2, (100,))
    other.save(folder / "c.pt")
    with pytest.raises(ValueError, match="describes another model"):
        load_trace_dir(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no xshare-trace files"):
        load_trace_dir(tmp_path / "empty")


def test_convert_command(tmp_path, capsys) -> None:
    source = tmp_path / "tiny.route.csv"
    source.write_text(TINY)
    out = tmp_path / "tiny.pt"
    assert main(["convert", str(source), str(out)]) == 0
    assert "4 layer calls" in capsys.readouterr().out
    converted = token_table(load_trace(out))
    assert torch.equal(converted.natural_ids, load_route_csv(source).ids)
    with pytest.raises(SystemExit):
        main(["convert", str(source), str(out), "--phase", "warmup"])
