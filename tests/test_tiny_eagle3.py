"""The shipped EAGLE-3 head of the tiny MoE (``data/tiny_eagle3``): an SGLang ``LlamaForCausalLMEagle3``
checkpoint with the target's tokenizer, whose card states its training log's acceptance, and whose
greedy acceptance by draft depth, recomputed here from the shipped weights on the target's own greedy
continuations, is what the log says (and far above an untrained head's)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from xshare_sglang.tiny.tiny_model import load_tiny_model, tiny_eagle3_dir, tiny_model_dir

HEAD = tiny_eagle3_dir()
TARGET = tiny_model_dir()
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "train_tiny_eagle3.py"
#: SGLang's names for the one-layer head (llama_eagle3.py's load_weights, 0.5.23)
LAYER = "model.layers.0."
WEIGHTS = {
    "model.embed_tokens.weight",
    "model.fc.weight",
    "model.norm.weight",
    "lm_head.weight",
    *(
        LAYER + name + ".weight"
        for name in (
            "hidden_norm",
            "input_layernorm",
            "post_attention_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ),
}


@pytest.fixture(scope="module")
def log() -> dict:
    return json.loads((HEAD / "training_log.json").read_text())


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("train_tiny_eagle3", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_checkpoint_is_sglangs_eagle3_head(log) -> None:
    from safetensors.torch import load_file

    config = json.loads((HEAD / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert (
        config["vocab_size"]
        == config["draft_vocab_size"]
        == json.loads((TARGET / "config.json").read_text())["vocab_size"]
    )
    weights = load_file(str(HEAD / "model.safetensors"))
    assert set(weights) == WEIGHTS and all(t.dtype == torch.bfloat16 for t in weights.values())
    assert (HEAD / "model.safetensors").stat().st_size < 4_000_000
    assert (HEAD / "tokenizer.json").read_bytes() == (TARGET / "tokenizer.json").read_bytes()
    card = (HEAD / "MODEL_CARD.md").read_text()
    for domain, shares in log["acceptance"].items():
        assert f"| {domain} | " + " | ".join(f"{s:.3f}" for s in shares) in card


def test_acceptance_by_depth_is_the_logged_one(log, script, tmp_path) -> None:
    """The shipped weights, recomputed: the share of chains accepted to depth 1, 2, 3 per domain equals
    the log's (one thread, as trained), falls with depth, and at depth 1 is far above the untrained test
    head's."""
    from safetensors.torch import load_file

    from xshare_sglang.testing.eagle_draft import make_tiny_eagle3_draft

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target, _ = load_tiny_model(TARGET)
        target = target.float().eval()
        sd = target.state_dict()
        head = script.Eagle3Head(
            log["config"], sd["model.embed_tokens.weight"], sd["model.norm.weight"], sd["lm_head.weight"]
        )

        def load(folder: Path) -> None:
            weights = load_file(str(folder / "model.safetensors"))
            with torch.no_grad():
                for name, tensor in head.state_dict_for_sglang().items():
                    tensor.copy_(weights[name].float())

        tm = script.load_script("train_tiny_moe")
        td = script.load_script("train_tiny_draft")
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(TARGET / "tokenizer.json"))
        heldout = {d: tm.token_stream(tokenizer, docs) for d, docs in td.load_heldout(TARGET, tm.DOMAINS).items()}
        domain = "math"
        prompts = td.windows(heldout[domain], 16, log["eval_prompts"])[:, :16]
        sequences = script.greedy_continuations(target, prompts, log["eval_new_tokens"])
        load(HEAD)
        shares = script.acceptance_by_depth(head, target, sequences, 16)
        assert shares == pytest.approx(log["acceptance"][domain], abs=0.01)
        assert shares[0] > shares[1] > shares[2] > 0
        load(make_tiny_eagle3_draft(tmp_path / "untrained", seed=0))
        untrained = script.acceptance_by_depth(head, target, sequences, 16)
        assert shares[0] > 2 * untrained[0], (shares, untrained)
    finally:
        torch.set_num_threads(threads)
