"""The shipped tiny Qwen3-MoE model: it loads, its routers are the checkpoint's, the policy hook
reproduces unpruned decoding under ``none`` and keeps routing inside the mask otherwise, and the
demo runs end to end."""

from __future__ import annotations

import json
import math

import pytest
import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.cli import main
from xshare_sglang.replay import BatchShape, build_batches, load_trace, replay_table, token_table
from xshare_sglang.tiny.tiny_demo import DemoSettings, demo_prompts, greedy_generate, record_tiny_trace
from xshare_sglang.tiny.tiny_model import RouterHook, load_tiny_model, routers, tiny_model_dir

MODEL = tiny_model_dir()


@pytest.fixture(scope="module")
def tiny():
    return load_tiny_model()


@pytest.fixture(scope="module")
def prompts():
    return demo_prompts(MODEL, 2)[0]


def test_checkpoint_is_shipped_small_and_documented() -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "MODEL_CARD.md",
        "training_log.json",
        "loss_curve.png",
        "heldout_code.jsonl",
        "heldout_math.jsonl",
        "heldout_prose.jsonl",
    ):
        assert (MODEL / name).is_file(), name
    assert (MODEL / "model.safetensors").stat().st_size <= 20 * 2**20
    config = json.loads((MODEL / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    experts = config.get("num_experts", config.get("num_local_experts"))  # transformers 5 writes the latter
    assert (experts, config["num_experts_per_tok"], config["num_hidden_layers"]) == (32, 4, 4)
    log = json.loads((MODEL / "training_log.json").read_text())
    assert set(log["final"]["heldout_loss"]) == {"code", "math", "prose"}
    card = (MODEL / "MODEL_CARD.md").read_text()
    for domain, loss in log["final"]["heldout_loss"].items():
        assert f"| {domain} | {loss:.3f} | {math.exp(loss):.1f} |" in card


def test_router_logits_come_from_the_checkpoint(tiny, prompts) -> None:
    from safetensors.torch import load_file

    model, tokenizer = tiny
    stored = load_file(str(MODEL / "model.safetensors"))
    seen = []
    handles = [r.register_forward_hook(lambda m, i, o: seen.append((i[0], o[0]))) for r in routers(model)]
    try:
        with torch.no_grad():
            model(**tokenizer(prompts[:1], return_tensors="pt"))
    finally:
        for handle in handles:
            handle.remove()
    assert len(seen) == 4
    for layer, (hidden, logits) in enumerate(seen):
        weight = stored[f"model.layers.{layer}.mlp.gate.weight"].float()
        assert weight.shape == (32, 128)
        torch.testing.assert_close(logits, hidden.reshape(-1, 128) @ weight.T, rtol=1e-5, atol=1e-5)


def test_policy_none_reproduces_unpruned_decoding(tiny, prompts) -> None:
    model, tokenizer = tiny
    plain = greedy_generate(model, tokenizer, prompts, 12)
    with RouterHook(model, PrunerConfig()) as hook:
        hooked = greedy_generate(model, tokenizer, prompts, 12)
    assert torch.equal(plain, hooked)
    decode = hook.decode_stats()
    assert len(decode) == 11 * 4 and {s.rows for s in decode} == {len(prompts)}
    assert all(s.activated == s.natural_activated and s.kept == 32 for s in decode)
    assert [s.phase for s in hook.stats[:4]] == ["extend"] * 4  # the prefill is routed as the model does


def test_pruned_decoding_stays_inside_the_mask(tiny, prompts) -> None:
    """oea k0=1: every decode call reads only the union of its tokens' top-1 experts; moe-spec B=4
    reads at most 4 experts and changes some generated token."""
    model, tokenizer = tiny
    routed = []
    with RouterHook(model, PrunerConfig(policy="oea", k0=1)) as hook:
        # registered after the policy's hooks, so these see the routing the experts receive
        handles = [r.register_forward_hook(lambda m, i, o: routed.append((o[0], o[2]))) for r in routers(model)]
        try:
            greedy_generate(model, tokenizer, prompts, 8)
        finally:
            for handle in handles:
                handle.remove()
    decode = [(logits, ids) for logits, ids in routed if logits.shape[0] == len(prompts)]
    assert len(decode) == 7 * 4
    for logits, ids in decode:
        top1 = set(logits.argmax(dim=1).tolist())
        assert set(ids[ids < 32].tolist()) == top1
        assert (ids < 32).sum(dim=1).min() >= 1  # every token keeps its top-1
    assert sum(s.activated for s in hook.decode_stats()) < sum(s.natural_activated for s in hook.decode_stats())

    plain = greedy_generate(model, tokenizer, prompts, 12)
    with RouterHook(model, PrunerConfig(policy="moe-spec", max_experts=4)) as hook:
        pruned = greedy_generate(model, tokenizer, prompts, 12)
    assert all(s.activated <= 4 and s.kept == 4 for s in hook.decode_stats())
    assert not torch.equal(plain, pruned)


def test_recorded_trace_replays_by_domain(tmp_path) -> None:
    trace = record_tiny_trace(DemoSettings.quick(), prompts_per_domain=2)
    table = token_table(load_trace(trace.save(tmp_path / "tiny.pt")))
    by_source = table.sequences()
    assert list(by_source) == ["code", "math", "prose"]
    assert [len(s) for s in by_source.values()] == [2, 2, 2]
    assert table.num_tokens == 6 * (DemoSettings.quick().new_tokens - 1)
    assert table.meta.expert_bytes == (3 * 128 * 96 * 2,) * 4
    batches = build_batches(by_source, BatchShape(3, 1), "mixed", share=1 / 3)
    (none,) = replay_table(table, batches, [PrunerConfig()], scenario="mixed", shape=BatchShape(3, 1))
    assert none.activated == none.baseline_activated and 4 <= none.activated <= 12


@pytest.fixture
def torch_threads(monkeypatch):
    """The demo's thread setting, undone after the test; no ``OMP_NUM_THREADS`` unless the test sets it."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_demo_runs_torch_on_one_thread_unless_told(torch_threads, monkeypatch) -> None:
    """Two torch threads on a 2-core machine with one core busy took the demo 2.6 times as long as one."""
    from xshare_sglang.cli import _one_torch_thread

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    _one_torch_thread()
    assert torch.get_num_threads() == 2
    monkeypatch.delenv("OMP_NUM_THREADS")
    _one_torch_thread()
    assert torch.get_num_threads() == 1


def test_demo_quick_end_to_end(tmp_path, capsys, torch_threads) -> None:
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == 1
    printed = capsys.readouterr().out
    assert "tiny MoE decode, every policy" in printed
    rows = json.loads((tmp_path / "demo.json").read_text())
    none, xshare, moe_spec = rows
    assert none["policy"] == "none" and none["token_agreement"] == 1.0 and none["speedup"] == 1.0
    assert none["activated"] == none["baseline_activated"]
    assert moe_spec["kept"] == 12 and moe_spec["activated"] <= 12 and moe_spec["speedup"] > 1
    assert xshare["activated"] <= none["activated"]
    for row in rows:
        assert all(1 < ppl < 4096 for ppl in row["perplexity"].values())
    # teacher-forced measures: the unpruned run is its own reference, pruning costs something
    assert none["kl"]["high"] < 1e-6 and none["top1_agree"]["mean"] == 1.0
    for row in (xshare, moe_spec):
        assert 0 < row["kl"]["low"] <= row["kl"]["mean"] <= row["kl"]["high"]
        assert row["top1_agree"]["mean"] < 1.0
    # every column is explained under the table, the free-running agreement labelled secondary
    for column in ("experts:", "kl:", "top1_agree:", "nll_delta:", "speedup:", "greedy agree*: secondary"):
        assert column in printed
    assert (tmp_path / "demo_pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert load_trace(tmp_path / "tiny_moe.decode.trace.pt").meta.num_experts == 32
