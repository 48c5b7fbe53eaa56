"""A tiny EAGLE-3 draft head for the shipped tiny Qwen3-MoE model: test data made on demand.

:func:`make_tiny_eagle3_draft` writes an SGLang ``LlamaForCausalLMEagle3`` checkpoint (one Llama decoder
layer, hidden 128, the target's vocabulary of 4096) that reads the target's auxiliary hidden states
after its layers 0, 1 and 2 (``eagle_config.eagle_aux_hidden_state_layer_ids``; SGLang's
``Qwen3MoeForCausalLM.set_eagle3_layers_to_capture`` adds one to each id and captures the input of
that layer).  The head is untrained: its weights are seeded random, except that ``fc`` passes the last
auxiliary state through, the layer's attention and MLP outputs are scaled down, and the final norm and
``lm_head`` are the target's.  So the first draft token is roughly the target's "logit lens" after
three of its four layers: some drafts get accepted, which exercises acceptance as well as rejection.
The point is SGLang's EAGLE-3 code path, not speed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

#: Target layers whose outputs the draft reads (SGLang captures the input of layer id + 1).
AUX_LAYER_IDS = (0, 1, 2)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def tiny_eagle3_config(target: dict) -> dict:
    """The draft's ``config.json`` for the target config ``target``."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target["hidden_size"],
        "target_hidden_size": target["hidden_size"],
        "intermediate_size": 2 * target["hidden_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": target["rms_norm_eps"],
        "max_position_embeddings": target["max_position_embeddings"],
        "rope_theta": target.get("rope_parameters", {}).get("rope_theta", 10000.0),
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": target["vocab_size"],
        "tie_word_embeddings": False,
        "eos_token_id": target.get("eos_token_id"),
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS), "use_aux_hidden_state": True},
    }


def make_tiny_eagle3_draft(out_dir: str | Path, seed: int = 0, target_dir: str | Path | None = None) -> Path:
    """Write the tiny EAGLE-3 draft for ``target_dir`` (default: the shipped tiny MoE) to ``out_dir``."""
    from safetensors.torch import load_file, save_file

    from ..tiny.tiny_model import tiny_model_dir

    target_dir = Path(target_dir) if target_dir is not None else Path(tiny_model_dir())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((target_dir / "config.json").read_text())
    config = tiny_eagle3_config(target_config)
    target = load_file(str(target_dir / "model.safetensors"))

    hidden, heads, kv_heads, head_dim = (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["head_dim"],
    )
    inter, n_aux = config["intermediate_size"], len(AUX_LAYER_IDS)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    fc = rand(hidden, hidden * n_aux)
    fc[:, (n_aux - 1) * hidden :] = torch.eye(hidden)  # pass the last aux state through
    layer = "model.layers.0."
    weights = {
        "model.embed_tokens.weight": target["model.embed_tokens.weight"].float(),  # SGLang shares the target's
        "model.fc.weight": fc,
        layer + "hidden_norm.weight": torch.ones(hidden),
        layer + "input_layernorm.weight": torch.ones(hidden),
        layer + "post_attention_layernorm.weight": torch.ones(hidden),
        layer + "self_attn.q_proj.weight": rand(heads * head_dim, 2 * hidden),
        layer + "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * hidden),
        layer + "self_attn.o_proj.weight": rand(hidden, heads * head_dim, scale=0.002),
        layer + "mlp.gate_proj.weight": rand(inter, hidden),
        layer + "mlp.up_proj.weight": rand(inter, hidden),
        layer + "mlp.down_proj.weight": rand(hidden, inter, scale=0.002),
        "model.norm.weight": target["model.norm.weight"].float(),
        "lm_head.weight": target["lm_head.weight"].float(),
    }
    save_file({name: t.contiguous() for name, t in weights.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out / name)
    return out
