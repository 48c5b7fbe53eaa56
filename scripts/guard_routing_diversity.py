"""How diversely a shipped tiny model routes the start-up guard's inputs, against real hidden states.

For each MoE layer, the distinct experts that the top-k of 16 tokens reaches (more distinct experts:
more expert reads for an unpruned layer, and more for pruning to save) when the layer's router reads:

* ``real``: the model's hidden states at the last position of 16 random-token prompts (a decode batch);
* ``embedding rows``: rows of the embedding table, RMS-normalised (the guard's first input source,
  replaced because it routes far less diversely);
* ``stream``: the guard's input, a residual stream from embedding rows through the model's own MoE
  layers, attention skipped.

Runs on CPU in seconds, with transformers' Qwen3-MoE (the project's reference), not SGLang::

    python scripts/guard_routing_diversity.py --model e128
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from xshare_sglang.tiny.tiny_model import load_tiny_model, model_dir_arg


def _distinct(logits: torch.Tensor, top_k: int) -> int:
    return torch.unique(logits.topk(top_k, dim=-1).indices).numel()


def _logits(gate, states: torch.Tensor) -> torch.Tensor:
    out = gate(states)
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="e128", help="a shipped model (tiny, e128) or a checkpoint folder")
    parser.add_argument("--tokens", type=int, default=16, help="tokens of the batch")
    parser.add_argument("--prompt-len", type=int, default=64, help="length of the random-token prompts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    model, _ = load_tiny_model(model_dir_arg(args.model))
    config, layers = model.config, model.model.layers
    top_k, vocab = config.num_experts_per_tok, config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    inputs: dict[int, torch.Tensor] = {}

    def keep_input(row: int):
        def hook(module, args, output) -> None:
            inputs[row] = args[0].detach()

        return hook

    hooks = [layer.mlp.gate.register_forward_hook(keep_input(row)) for row, layer in enumerate(layers)]
    model(torch.randint(0, vocab, (args.tokens, args.prompt_len), generator=gen))
    for hook in hooks:
        hook.remove()
    embed = model.model.embed_tokens(torch.randint(0, vocab, (args.tokens,), generator=gen))
    stream = embed.clone()
    print(f"{args.model}: top-{top_k} of {config.num_experts} experts, {args.tokens} tokens")
    print("layer | real | embedding rows | stream")
    for row, layer in enumerate(layers):
        real = inputs[row].reshape(args.tokens, args.prompt_len, -1)[:, -1]
        raw = layer.post_attention_layernorm(embed)
        streamed = layer.post_attention_layernorm(stream)
        counts = [_distinct(_logits(layer.mlp.gate, states), top_k) for states in (real, raw, streamed)]
        print(f"{row} | {counts[0]} | {counts[1]} | {counts[2]}")
        update = layer.mlp(streamed[None])
        stream = stream + (update[0] if isinstance(update, tuple) else update)[0]
    return 0


if __name__ == "__main__":
    sys.exit(main())
