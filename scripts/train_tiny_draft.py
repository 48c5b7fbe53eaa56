"""Distil a tiny dense draft model from the shipped tiny Qwen3-MoE, on CPU, for speculative decoding.

The draft is Hugging Face's own ``Qwen3ForCausalLM`` (one dense decoder layer, no custom modelling
code) with the target's tokenizer, trained on the target's training corpus (the same ``code`` /
``math`` / ``prose`` documents, gathered by ``scripts/train_tiny_moe.py``'s own functions) to match
the target's next-token distributions: the loss is KL(target || draft) per position, plus a small
weight of plain cross-entropy on the text.

At the end it measures, per domain on the held-out texts shipped with the target
(``data/tiny_moe/heldout_*.jsonl``): the draft's held-out loss, the greedy top-1 agreement of draft and
target (the share of positions where both argmaxes are the same token: the per-token acceptance
rate of greedy speculative decoding), the mean target probability of the draft's argmax token and
``1 - TV(target, draft)`` (the per-token acceptance probability of speculative sampling at
temperature 1).  It writes into ``--out`` (default: the package's ``data/tiny_draft``) the bf16
checkpoint, a byte-for-byte copy of the target's tokenizer files, ``training_log.json`` and
``MODEL_CARD.md`` with this run's numbers.

Usage::

    python scripts/train_tiny_draft.py --threads 1    # ~12 minutes on a shared 2-core machine
    python scripts/train_tiny_draft.py --minutes 1 --out /tmp/draft   # a quick smoke run

The target's eager expert loop is many small ops: on cores that other work shares, two threads
contend and can run a step tens of times slower than one; ``--threads 1`` is the safe choice there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F

logger = logging.getLogger("train_tiny_draft")

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
TARGET_DIR = REPO / "xshare_sglang" / "data" / "tiny_moe"
DEFAULT_OUT = REPO / "xshare_sglang" / "data" / "tiny_draft"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

DRAFT_CONFIG = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=1024,
    rope_theta=10000.0,
    tie_word_embeddings=True,
)


def load_target_trainer() -> ModuleType:
    """Import ``scripts/train_tiny_moe.py`` as a module, for its corpus and batching functions.

    Returns
    -------
    module
        The script's module (``collect_corpus``, ``token_stream``, ``sample_batch``, ``DOMAINS``, ...).
    """
    spec = importlib.util.spec_from_file_location("train_tiny_moe", SCRIPTS / "train_tiny_moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def load_heldout(target_dir: Path, domains: tuple[str, ...]) -> dict[str, list[str]]:
    """The held-out documents shipped next to the target, per domain.

    Parameters
    ----------
    target_dir : Path
        Folder of the target model, with ``heldout_<domain>.jsonl`` files of ``{"text": ...}`` lines.
    domains : tuple of str

    Returns
    -------
    dict
        Domain -> list of documents.
    """
    return {
        d: [json.loads(line)["text"] for line in (target_dir / f"heldout_{d}.jsonl").read_text().splitlines() if line]
        for d in domains
    }


def windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows of ``seq_len + 1`` tokens (inputs and next-token labels) from a stream.

    Parameters
    ----------
    stream : Tensor [N]
    seq_len : int
    max_windows : int

    Returns
    -------
    Tensor [W, seq_len + 1]
    """
    count = min((len(stream) - 1) // seq_len, max_windows)
    return torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(count)])


def distillation_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(target softmax || draft softmax), in nats.

    Parameters
    ----------
    draft_logits, target_logits : Tensor [..., V]

    Returns
    -------
    Tensor
        Scalar.
    """
    log_q = F.log_softmax(draft_logits.float(), dim=-1).reshape(-1, draft_logits.shape[-1])
    log_p = F.log_softmax(target_logits.float(), dim=-1).reshape(-1, target_logits.shape[-1])
    return F.kl_div(log_q, log_p, log_target=True, reduction="batchmean")


@torch.no_grad()
def compare(draft, target, chunk: torch.Tensor, batch: int = 16) -> dict[str, float]:
    """Held-out numbers of a draft against its target over windows of text.

    Parameters
    ----------
    draft, target : causal LMs
        Called as ``model(input_ids=...)``; both are put in eval mode and left there.
    chunk : Tensor [W, L + 1]
        Windows of token ids; the first ``L`` are inputs, the last ``L`` the next-token labels.
    batch : int
        Windows per forward.

    Returns
    -------
    dict
        ``draft_loss`` and ``target_loss`` (mean next-token cross-entropy, nats/token), ``agreement``
        (share of positions where draft and target argmax agree), ``target_prob_of_draft_top1`` (mean
        target probability of the draft's argmax token), ``kl`` (mean KL(target || draft)) and
        ``sampling_acceptance`` (mean of ``sum_x min(p_target(x), p_draft(x))``), plus ``positions``.
    """
    draft.eval()
    target.eval()
    sums = dict.fromkeys(
        ("draft_loss", "target_loss", "agreement", "target_prob_of_draft_top1", "kl", "sampling_acceptance"), 0.0
    )
    positions = 0
    for i in range(0, len(chunk), batch):
        rows = chunk[i : i + batch]
        inputs, labels = rows[:, :-1], rows[:, 1:].reshape(-1)
        log_q = F.log_softmax(draft(input_ids=inputs).logits.float(), dim=-1).reshape(labels.numel(), -1)
        log_p = F.log_softmax(target(input_ids=inputs).logits.float(), dim=-1).reshape(labels.numel(), -1)
        p, q = log_p.exp(), log_q.exp()
        draft_top1 = log_q.argmax(-1)
        sums["draft_loss"] += float(F.nll_loss(log_q, labels, reduction="sum"))
        sums["target_loss"] += float(F.nll_loss(log_p, labels, reduction="sum"))
        sums["agreement"] += float((draft_top1 == log_p.argmax(-1)).sum())
        sums["target_prob_of_draft_top1"] += float(p.gather(1, draft_top1[:, None]).sum())
        sums["kl"] += float((p * (log_p - log_q)).sum())
        sums["sampling_acceptance"] += float(torch.minimum(p, q).sum())
        positions += labels.numel()
    result = {name: value / max(positions, 1) for name, value in sums.items()}
    result["positions"] = positions
    return result


def matmul_flops_per_token(config) -> int:
    """Multiply-add FLOPs per token of a decoder's weight matmuls (attention scores excluded).

    Counts the attention projections, the MLP (the routed experts and router only, for an MoE) and
    the LM head; works for ``Qwen3Config`` and ``Qwen3MoeConfig``.

    Parameters
    ----------
    config : transformers.PretrainedConfig

    Returns
    -------
    int
    """
    h, heads, kv, hd = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    attention = h * heads * hd * 2 + h * kv * hd * 2
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        mlp = 3 * h * config.moe_intermediate_size * config.num_experts_per_tok + h * experts
    else:
        mlp = 3 * h * config.intermediate_size
    return 2 * (config.num_hidden_layers * (attention + mlp) + h * config.vocab_size)


def write_card(out: Path, log: dict, domains: tuple[str, ...]) -> None:
    """Write ``MODEL_CARD.md`` from the training log.

    Parameters
    ----------
    out : Path
    log : dict
        As written to ``training_log.json``.
    domains : tuple of str
    """
    final = log["final"]
    rows = "\n".join(
        f"| {d} | {final[d]['draft_loss']:.3f} | {final[d]['target_loss']:.3f} | {final[d]['agreement']:.3f} | "
        f"{final[d]['target_prob_of_draft_top1']:.3f} | {final[d]['sampling_acceptance']:.3f} | "
        f"{final[d]['kl']:.3f} | {final[d]['positions']:,} |"
        for d in domains
    )
    header = (
        "| domain | draft loss | target loss | top-1 agreement | target prob. of draft top-1 | 1 - TV "
        "| KL(target ‖ draft) | positions |\n|---|---|---|---|---|---|---|---|"
    )
    cfg = log["model_config"]
    cost = log["cost"]
    stopped = (
        f" (the schedule was planned for {log['planned_steps']} steps; the {log['minutes']:g}-minute limit stopped it)"
        if log["stopped_by_time_limit"]
        else ""
    )
    card = f"""# tiny-qwen3-draft (xshare-sglang speculative-decoding draft)

A {log["parameters"] / 1e6:.2f} M-parameter dense language model in Hugging Face's `Qwen3ForCausalLM`
architecture, distilled on CPU by `scripts/train_tiny_draft.py` from the demo's MoE model
(`../tiny_moe`, tiny-qwen3-moe) so that speculative decoding of that model can be tried without a
GPU. Like its target it is a test article, not a useful language model.

## Architecture
{cfg["num_hidden_layers"]} decoder layer, hidden size {cfg["hidden_size"]}, dense SwiGLU MLP of intermediate
size {cfg["intermediate_size"]}, {cfg["num_attention_heads"]} attention heads ({cfg["num_key_value_heads"]} KV heads,
head dim {cfg["head_dim"]}), tied embeddings, up to {cfg["max_position_embeddings"]} positions. The vocabulary and
tokenizer are the target's: `tokenizer.json` and `tokenizer_config.json` are byte-for-byte copies of `../tiny_moe`'s.
Weights are stored in bfloat16.

Cost per token (weight matmuls, attention scores excluded): {cost["draft_flops_per_token"]:,} FLOPs for the draft,
{cost["target_flops_per_token"]:,} for the target ({cost["flops_ratio"]:.2f}x); {cost["draft_layers"]} decoder layer
against {cost["target_layers"]}. Both share the cost of the {cfg["vocab_size"]}-token LM head, which is most of the
draft's. Parameters: {log["parameters"]:,} (draft) against {log["target_parameters"]:,} (target, all experts).

## Data and licences
The training text is the target's training corpus, gathered by the same functions of
`scripts/train_tiny_moe.py` (see `../tiny_moe/MODEL_CARD.md`): code — Python {log["python_version"]} standard library
sources (PSF License, `../tiny_moe/LICENSE.Python-PSF`); math — GSM8K test problems with worked answers, 9 of every
10 (MIT, `../tiny_moe/LICENSE.gsm8k.MIT`); prose — the `pydoc_data.topics` reference topics, 4 of every 5 (PSF
License). The supervision is the target's next-token distribution on that text. The held-out texts are the target's
(`../tiny_moe/heldout_*.jsonl`: HumanEval prompts with canonical solutions — MIT,
`../tiny_moe/LICENSE.human-eval.MIT` —, the 10th GSM8K problem of every 10, the 5th topic of every 5).

## Training
{log["steps"]} steps{stopped} of AdamW (lr {log["lr"]}, cosine to 10%, {log["warmup"]} warm-up steps), batches of
{log["batch_per_domain"]} sequences x {log["seq_len"]} tokens from each domain; loss = KL(target || draft) per
position + {log["ce_weight"]} x cross-entropy on the text; {log["init"]}; seed {log["seed"]};
{log["train_seconds"] / 60:.1f} minutes on {log["threads"]} CPU thread(s) ({log["tokens_seen"]:,} training tokens seen).
Every logged step: `training_log.json`. Final training KL (last 50 steps' mean): {final["train_kl"]:.3f} nats/token.

## Results (end of training, whole held-out set)
{header}
{rows}

Losses are next-token cross-entropy in nats/token over non-overlapping {log["seq_len"]}-token windows (the target's
own numbers here come from its bf16 checkpoint run in float32). *Top-1 agreement* is the share of positions where
the draft's argmax is the target's argmax — the per-token acceptance rate of greedy speculative decoding on this
text; *1 - TV* is the mean of sum_x min(p_target(x), p_draft(x)), the per-token acceptance probability of
speculative sampling at temperature 1.

Reproduce: `python scripts/train_tiny_draft.py --seed {log["seed"]} --steps {log["planned_steps"]} \\
--stop-at {log["steps"]} --threads {log["threads"]}`
(data, schedule and step count fix the result up to floating-point reduction order and the Python version's
standard library).
"""
    (out / "MODEL_CARD.md").write_text(card)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--target", type=Path, default=TARGET_DIR, help="folder of the target model")
    tm = load_target_trainer()
    tm.add_run_arguments(parser, steps=2400, minutes=12.0, batch_per_domain=4, threads=1)
    parser.add_argument("--ce-weight", type=float, default=0.1, help="weight of cross-entropy on the text")
    parser.add_argument(
        "--no-init-from-target",
        action="store_true",
        help="start from random embeddings instead of the target's token embeddings and final norm",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    from tokenizers import Tokenizer
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from xshare_sglang.tiny.tiny_model import load_tiny_model

    domains = tm.DOMAINS
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    target, _ = load_tiny_model(args.target)
    for p in target.parameters():
        p.requires_grad_(False)
    tokenizer = Tokenizer.from_file(str(args.target / "tokenizer.json"))
    if tokenizer.get_vocab_size() != target.config.vocab_size:
        raise SystemExit(f"tokenizer has {tokenizer.get_vocab_size()} tokens, target {target.config.vocab_size}")

    corpus = tm.collect_corpus(tm._eval_sets_dir(args.eval_sets), args.code_bytes)
    streams = {d: tm.token_stream(tokenizer, corpus[d]["train"]) for d in domains}
    heldout = {d: tm.token_stream(tokenizer, docs) for d, docs in load_heldout(args.target, domains).items()}
    eval_windows = {d: windows(heldout[d], args.seq_len, 10_000) for d in domains}
    for d in domains:
        logger.info("%s: %d training tokens, %d held-out tokens", d, len(streams[d]), len(heldout[d]))

    config = Qwen3Config(
        **DRAFT_CONFIG,
        bos_token_id=None,
        eos_token_id=tokenizer.token_to_id(tm.EOS),
        rms_norm_eps=target.config.rms_norm_eps,
    )
    if config.vocab_size != target.config.vocab_size:
        raise SystemExit(f"draft vocabulary {config.vocab_size} != target vocabulary {target.config.vocab_size}")
    draft = Qwen3ForCausalLM(config)
    init = "embeddings initialized at random"
    if not args.no_init_from_target:
        with torch.no_grad():
            draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            draft.model.norm.weight.copy_(target.model.norm.weight)
        init = "token embeddings (tied to the LM head) and final norm initialized from the target's, then trained"
    draft.train()
    parameters = sum(p.numel() for p in draft.parameters())
    target_parameters = sum(p.numel() for p in target.parameters())
    logger.info("draft: %.3f M parameters (target %.2f M)", parameters / 1e6, target_parameters / 1e6)

    optimizer = torch.optim.AdamW(draft.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def forward(gen: torch.Generator):
        batch = tm.sample_batch(streams, args.batch_per_domain, args.seq_len, gen)
        inputs = batch[:, :-1]
        with torch.no_grad():
            target_logits = target(input_ids=inputs).logits
        logits = draft(input_ids=inputs).logits
        kl = distillation_loss(logits, target_logits)
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss = kl + args.ce_weight * ce
        return loss, kl, {"loss": loss, "kl": kl, "ce": ce}

    def evaluate(step: int) -> dict:
        numbers = {d: compare(draft, target, eval_windows[d][:16]) for d in domains}
        logger.info("held-out agreement: %s", {d: round(v["agreement"], 3) for d, v in numbers.items()})
        draft.train()
        return {"step": step, "windows": 16, **numbers}

    gen = torch.Generator().manual_seed(args.seed)
    run = tm.run_training(
        draft.parameters(), optimizer, args, warmup=warmup, gen=gen, forward=forward, evaluate=evaluate
    )
    log, recent, step = run.log, run.recent, run.steps_done - 1
    steps_done, train_seconds = run.steps_done, run.train_seconds

    draft = draft.to(torch.bfloat16).float()  # measure the weights as they are shipped
    final = {d: compare(draft, target, eval_windows[d]) for d in domains}
    log["eval"].append({"step": step, "windows": "all", **final})
    draft.to(torch.bfloat16).save_pretrained(args.out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(args.target / name, args.out / name)

    target_flops, draft_flops = matmul_flops_per_token(target.config), matmul_flops_per_token(config)
    log.update(
        model_config=DRAFT_CONFIG,
        parameters=parameters,
        target_parameters=target_parameters,
        cost={
            "draft_flops_per_token": draft_flops,
            "target_flops_per_token": target_flops,
            "flops_ratio": target_flops / draft_flops,
            "draft_layers": config.num_hidden_layers,
            "target_layers": target.config.num_hidden_layers,
        },
        **tm.run_record(args, run, warmup=warmup, domains=domains, streams=streams, heldout=heldout),
        ce_weight=args.ce_weight,
        init=init,
        final={**final, "train_kl": sum(recent[-50:]) / len(recent[-50:])},
    )
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1))
    write_card(args.out, log, domains)
    for d in domains:
        print(
            f"{d:6s} draft loss {final[d]['draft_loss']:.3f}  target loss {final[d]['target_loss']:.3f}  "
            f"agreement {final[d]['agreement']:.3f}  target p(draft top-1) {final[d]['target_prob_of_draft_top1']:.3f}"
            f"  1-TV {final[d]['sampling_acceptance']:.3f}"
        )
    print(f"{steps_done} steps in {train_seconds / 60:.1f} min; wrote {args.out}")


if __name__ == "__main__":
    main()
