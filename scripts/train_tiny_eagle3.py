"""Train an EAGLE-3 draft head for the shipped tiny Qwen3-MoE, on CPU, for SGLang's speculative decoding.

The head is SGLang's ``LlamaForCausalLMEagle3`` (``sglang/srt/models/llama_eagle3.py``, 0.5.23), written
here in plain torch with the same weights and the same forward: ``fc`` maps the target's three
auxiliary states (the inputs of its layers 1, 2 and 3: ``eagle_aux_hidden_state_layer_ids`` 0, 1, 2)
to one hidden state; one Llama decoder layer reads ``[input_layernorm(embedding of the next token),
hidden_norm(hidden)]`` (2H wide into q/k/v), adds attention and MLP to the hidden state; the final
norm and ``lm_head`` give the logits, and the un-normed sum is the hidden state of the next draft step.
The token embedding is the target's (SGLang shares it), frozen.

Training unrolls three draft steps with the masks SGLang's chain drafting sees (training-time test):
step 1 at position t reads the target's states at t and token t+1 and predicts token t+2; step k
reads step k-1's hidden state at t and token t+k, attends to step 1's keys of positions <= t and to
its own chain's keys, and predicts token t+k+1.  The loss is KL(target || draft) of each step against
the target's next-token distribution at that position (weights 1, 0.8, 0.64), plus a little
cross-entropy on the text.

At the end it measures, on the target's own greedy continuations of held-out prompts (what a greedy
speculative server verifies), the share of chains whose first j draft tokens are all accepted, for
j = 1..3, per domain, and writes into ``--out`` (default: the package's ``data/tiny_eagle3``) the
checkpoint (``config.json``, ``model.safetensors`` in bfloat16), the target's tokenizer files,
``training_log.json`` and ``MODEL_CARD.md``.

Usage::

    python scripts/train_tiny_eagle3.py --threads 1            # the shipped head (see its MODEL_CARD.md)
    python scripts/train_tiny_eagle3.py --minutes 1 --out /tmp/head   # a quick smoke run
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import math
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("train_tiny_eagle3")

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
TARGET_DIR = REPO / "xshare_sglang" / "data" / "tiny_moe"
DEFAULT_OUT = REPO / "xshare_sglang" / "data" / "tiny_eagle3"
DRAFT_STEPS = 3
STEP_WEIGHTS = (1.0, 0.8, 0.64)
sys.path.insert(0, str(REPO))


def load_script(name: str) -> ModuleType:
    """Import a sibling script as a module (its corpus, batching and draft-writing functions)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama's default (neox-style) rotary embedding of ``x`` [B, heads, T, d] at ``positions`` [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None, :, None] * inv  # [B, 1, T, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


class Eagle3Head(nn.Module):
    """``LlamaForCausalLMEagle3`` with one decoder layer, parameter names as in its checkpoint."""

    def __init__(self, config: dict, embed: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        h, heads, kv, d = (
            config["hidden_size"],
            config["num_attention_heads"],
            config["num_key_value_heads"],
            config["head_dim"],
        )
        self.config, self.heads, self.kv_heads, self.head_dim = config, heads, kv, d
        self.eps, self.theta = config["rms_norm_eps"], config["rope_theta"]
        self.register_buffer("embed", embed.float().clone())  # the target's, frozen (SGLang shares it)
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(2 * h, heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, kv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, kv * d, bias=False)
        self.o_proj = nn.Linear(heads * d, h, bias=False)
        inter = config["intermediate_size"]
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.norm = nn.Parameter(norm.float().clone())
        self.lm_head = nn.Parameter(lm_head.float().clone())
        with torch.no_grad():
            eye = torch.zeros(h, 3 * h)
            eye[:, 2 * h :] = torch.eye(h)
            self.fc.weight.copy_(eye + 0.02 * torch.randn(h, 3 * h))  # start from the last aux state
            self.o_proj.weight.mul_(0.01)  # attention and MLP start nearly silent: the target's logit lens
            self.down_proj.weight.mul_(0.01)

    def qkv(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """Queries, keys, values [B, heads, T, d] of one draft step, and its residual input."""
        embeds = self.embed[tokens]
        x = torch.cat(
            [rms_norm(embeds, self.input_layernorm, self.eps), rms_norm(hidden, self.hidden_norm, self.eps)], -1
        )
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(q, positions, self.theta), rotate(k, positions, self.theta), v

    def finish(self, attn: torch.Tensor, residual: torch.Tensor):
        """Attention output [B, heads, T, d] -> (logits, next hidden state)."""
        b, _, t, _ = attn.shape
        hidden = self.o_proj(attn.transpose(1, 2).reshape(b, t, -1)) + residual
        mlp_in = rms_norm(hidden, self.post_attention_layernorm, self.eps)
        out = self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in)) + hidden
        return rms_norm(out, self.norm, self.eps) @ self.lm_head.T, out

    def unroll(self, aux: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Logits [B, T', V] of each draft step k = 1..steps at every chain start t (T' = T - steps).

        ``aux`` [B, T, 3H] are the target's auxiliary states, ``tokens`` [B, T + 1] the text; step k at
        t reads token t + k and predicts token t + k + 1.
        """
        b, t_all, _ = aux.shape
        t = t_all - steps
        positions = torch.arange(t)[None].expand(b, t)
        hidden = self.fc(aux[:, :t])
        keys, values, logits = [], [], []
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        diag = torch.eye(t, dtype=torch.bool)
        for k in range(1, steps + 1):
            q, key, value = self.qkv(hidden, tokens[:, k : k + t], positions + (k - 1))
            keys.append(key)
            values.append(value)
            # step 1's keys of positions <= t, then this chain's own keys of steps 2..k
            mask = torch.cat([causal] + [diag] * (k - 1), dim=1)
            rep = self.heads // self.kv_heads
            all_k = torch.cat(keys, 2).repeat_interleave(rep, 1)
            all_v = torch.cat(values, 2).repeat_interleave(rep, 1)
            attn = F.scaled_dot_product_attention(q, all_k, all_v, attn_mask=mask)
            step_logits, hidden = self.finish(attn, hidden)
            logits.append(step_logits)
        return logits

    def state_dict_for_sglang(self) -> dict[str, torch.Tensor]:
        layer = "model.layers.0."
        return {
            "model.embed_tokens.weight": self.embed,
            "model.fc.weight": self.fc.weight,
            layer + "hidden_norm.weight": self.hidden_norm,
            layer + "input_layernorm.weight": self.input_layernorm,
            layer + "post_attention_layernorm.weight": self.post_attention_layernorm,
            layer + "self_attn.q_proj.weight": self.q_proj.weight,
            layer + "self_attn.k_proj.weight": self.k_proj.weight,
            layer + "self_attn.v_proj.weight": self.v_proj.weight,
            layer + "self_attn.o_proj.weight": self.o_proj.weight,
            layer + "mlp.gate_proj.weight": self.gate_proj.weight,
            layer + "mlp.up_proj.weight": self.up_proj.weight,
            layer + "mlp.down_proj.weight": self.down_proj.weight,
            "model.norm.weight": self.norm,
            "lm_head.weight": self.lm_head,
        }


@torch.no_grad()
def target_pass(target, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's auxiliary states [B, T, 3H] (inputs of layers 1, 2, 3) and logits [B, T, V]."""
    out = target(input_ids=tokens, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[i].float() for i in (1, 2, 3)], -1)
    return aux, out.logits.float()


def step_losses(head: Eagle3Head, target, batch: torch.Tensor) -> list[torch.Tensor]:
    """KL(target || draft) of each unrolled step; ``batch`` [B, T + 1] of text."""
    aux, target_logits = target_pass(target, batch)
    t = batch.shape[1] - 1 - DRAFT_STEPS
    losses = []
    for k, logits in enumerate(head.unroll(aux[:, :-1], batch, DRAFT_STEPS), start=1):
        want = target_logits[:, k : k + t]
        losses.append(
            F.kl_div(
                F.log_softmax(logits, -1).flatten(0, 1),
                F.log_softmax(want, -1).flatten(0, 1),
                log_target=True,
                reduction="batchmean",
            )
        )
    return losses


@torch.no_grad()
def greedy_continuations(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The target's greedy continuation of each prompt row, [B, P + new_tokens]."""
    seq = prompts
    for _ in range(new_tokens):
        seq = torch.cat([seq, target(input_ids=seq).logits[:, -1:].argmax(-1)], 1)
    return seq


@torch.no_grad()
def acceptance_by_depth(head: Eagle3Head, target, sequences: torch.Tensor, prompt_len: int) -> list[float]:
    """On target-greedy sequences: per depth j, the share of chains started in the generated part whose
    first j draft tokens equal the target's (greedy verification accepts exactly those)."""
    aux, _ = target_pass(target, sequences)
    t = sequences.shape[1] - 1 - DRAFT_STEPS
    logits = head.unroll(aux[:, :-1], sequences, DRAFT_STEPS)
    start = max(0, prompt_len - 1)
    ok = torch.ones(sequences.shape[0], t - start, dtype=torch.bool)
    shares = []
    for k, step_logits in enumerate(logits, start=1):
        ok &= step_logits[:, start:].argmax(-1) == sequences[:, start + k + 1 : start + k + 1 + t - start]
        shares.append(float(ok.float().mean()))
    return shares


def eagle3_config(target_config: dict, head_config: dict) -> dict:
    """SGLang's config.json for the head (the untrained test head's, with this run's sizes)."""
    from xshare_sglang.testing.eagle_draft import tiny_eagle3_config

    config = tiny_eagle3_config(target_config)
    config.update(intermediate_size=head_config["intermediate_size"], torch_dtype="bfloat16")
    return config


def write_card(out: Path, log: dict) -> None:
    rows = "\n".join(
        f"| {d} | " + " | ".join(f"{s:.3f}" for s in log["acceptance"][d]) + f" | {sum(log['acceptance'][d]):.2f} |"
        for d in log["acceptance"]
    )
    text = f"""# Tiny EAGLE-3 head for the tiny Qwen3-MoE

An EAGLE-3 draft head (SGLang's `LlamaForCausalLMEagle3`, one decoder layer, hidden
{log["config"]["hidden_size"]}, {log["parameters"] / 1e6:.2f} M trained parameters) for the shipped tiny
Qwen3-MoE target (`xshare_sglang/data/tiny_moe`), trained on CPU by `scripts/train_tiny_eagle3.py` on the
target's own training corpus: {log["steps"]} steps of {log["batch_per_domain"]} windows of {log["seq_len"]}
tokens per domain, {log["train_seconds"] / 60:.1f} minutes on {log["threads"]} thread(s), seed {log["seed"]},
three draft steps unrolled (training-time test), KL to the target's next-token distributions.

Greedy acceptance on the target's own greedy continuations of held-out prompts ({log["eval_prompts"]}
prompts per domain, {log["eval_new_tokens"]} generated tokens each): the share of chains whose first j
draft tokens all match the target, and their sum (expected accepted draft tokens at 3 steps):

| domain | depth 1 | depth 2 | depth 3 | accepted at 3 steps |
|---|---|---|---|---|
{rows}

SGLang serving this head on the CPU engine reports its own accepted lengths at 1, 2 and 3 steps:
`python scripts/eagle_accept_length.py` (docs/spec-runs/eagle3_accept_length.jsonl).

Reproduce: `python scripts/train_tiny_eagle3.py --threads 1 --seed {log["seed"]} --steps {log["planned_steps"]}
--minutes {log["minutes"]:g}` (every logged step and evaluation: `training_log.json`).

For tests and CPU demonstrations of speculative serving, not for any real model.
"""
    (out / "MODEL_CARD.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--target", type=Path, default=TARGET_DIR, help="folder of the target model")
    tm = load_script("train_tiny_moe")
    tm.add_run_arguments(parser, steps=1200, minutes=10.0, batch_per_domain=4, threads=1)
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts per domain for acceptance")
    parser.add_argument("--eval-new-tokens", type=int, default=48)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from xshare_sglang.tiny.tiny_model import load_tiny_model

    td = load_script("train_tiny_draft")
    domains = tm.DOMAINS
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    target, _ = load_tiny_model(args.target)
    target = target.float().eval()
    for p in target.parameters():
        p.requires_grad_(False)
    target_config = json.loads((args.target / "config.json").read_text())
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    corpus = tm.collect_corpus(tm._eval_sets_dir(args.eval_sets), args.code_bytes)
    streams = {d: tm.token_stream(tokenizer, corpus[d]["train"]) for d in domains}
    heldout = {d: tm.token_stream(tokenizer, docs) for d, docs in td.load_heldout(args.target, domains).items()}

    head_config = {
        "hidden_size": target_config["hidden_size"],
        "num_attention_heads": target_config["num_attention_heads"],
        "num_key_value_heads": target_config["num_key_value_heads"],
        "head_dim": target_config["head_dim"],
        "intermediate_size": 2 * target_config["hidden_size"],
        "rms_norm_eps": target_config["rms_norm_eps"],
        "rope_theta": target_config.get("rope_parameters", {}).get("rope_theta", 10000.0),
    }
    sd = target.state_dict()
    head = Eagle3Head(head_config, sd["model.embed_tokens.weight"], sd["model.norm.weight"], sd["lm_head.weight"])
    trained = [p for p in head.parameters() if p.requires_grad]
    parameters = sum(p.numel() for p in trained)
    logger.info("EAGLE-3 head: %.3f M trained parameters", parameters / 1e6)
    optimizer = torch.optim.AdamW(trained, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, args.steps // 20)

    def forward(gen: torch.Generator):
        batch = tm.sample_batch(streams, args.batch_per_domain, args.seq_len, gen)
        losses = step_losses(head, target, batch)
        loss = sum(w * step for w, step in zip(STEP_WEIGHTS, losses, strict=True))
        return loss, losses[0], {"loss": loss, **{f"kl{k}": step for k, step in enumerate(losses, start=1)}}

    prompts = {d: td.windows(heldout[d], 16, args.eval_prompts)[:, :16] for d in domains}
    sequences = {d: greedy_continuations(target, prompts[d], args.eval_new_tokens) for d in domains}

    def evaluate(step: int) -> dict:
        shares = {d: acceptance_by_depth(head, target, sequences[d], 16) for d in domains}
        logger.info("acceptance by depth: %s", {d: [round(s, 3) for s in v] for d, v in shares.items()})
        return {"step": step, "acceptance": shares}

    gen = torch.Generator().manual_seed(args.seed)
    run = tm.run_training(trained, optimizer, args, warmup=warmup, gen=gen, forward=forward, evaluate=evaluate)
    weights = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in head.state_dict_for_sglang().items()}
    with torch.no_grad():  # measure the weights as shipped
        for name, t in head.state_dict_for_sglang().items():
            t.copy_(weights[name].float())
    final = {d: acceptance_by_depth(head, target, sequences[d], 16) for d in domains}
    save_file(weights, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps(eagle3_config(target_config, head_config), indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (args.target / name).is_file():
            shutil.copyfile(args.target / name, args.out / name)
    log = {
        **run.log,
        **tm.run_record(args, run, warmup=warmup, domains=domains, streams=streams, heldout=heldout),
        "config": head_config,
        "parameters": parameters,
        "draft_steps": DRAFT_STEPS,
        "step_weights": STEP_WEIGHTS,
        "eval_prompts": args.eval_prompts,
        "eval_new_tokens": args.eval_new_tokens,
        "acceptance": final,
    }
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1))
    write_card(args.out, log)
    for d in domains:
        print(f"{d:6s} acceptance by depth {[round(s, 3) for s in final[d]]}  expected accepted {sum(final[d]):.2f}")
    print(f"{run.steps_done} steps in {run.train_seconds / 60:.1f} min; wrote {args.out}")
    assert math.isfinite(run.recent[-1])


if __name__ == "__main__":
    main()
