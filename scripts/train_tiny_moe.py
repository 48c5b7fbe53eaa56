"""Train the tiny Qwen3-MoE model that the demo ships with, on CPU, from text available offline.

Three domains, so that the router has something to specialize on:

* ``code``  — train: the Python standard library's own sources (PSF licence), read from the running
  interpreter's ``stdlib`` directory; held out: HumanEval prompts with their canonical solutions (MIT).
* ``math``  — GSM8K test problems with their worked answers (MIT): 9 of every 10 for training, the
  10th held out.
* ``prose`` — the Python language and library reference topics shipped in ``pydoc_data.topics`` (PSF
  licence): 4 of every 5 topics for training, the 5th held out.

The script trains a byte-level BPE tokenizer, then a ``Qwen3MoeForCausalLM`` (Hugging Face's own class,
no custom modelling code) with batches that take the same number of sequences from every domain, and
writes into ``--out`` (default: the package's ``data/tiny_moe``): the checkpoint (bf16 safetensors),
the tokenizer, the held-out texts the demo measures perplexity on, ``training_log.json``, a loss-curve
PNG and ``MODEL_CARD.md`` with this run's numbers.

Usage::

    python scripts/train_tiny_moe.py                 # ~25 minutes on 2 CPU cores
    python scripts/train_tiny_moe.py --minutes 2 --out /tmp/tiny   # a quick smoke run
    python scripts/train_tiny_moe.py --shape qwen3 --minutes 50    # the 128-expert top-8 model
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import math
import platform
import random
import shutil
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("train_tiny_moe")

REPO = Path(__file__).resolve().parents[1]
EVAL_SETS = REPO.parent / "shared" / "data" / "eval_sets"
DEFAULT_OUT = REPO / "xshare_sglang" / "data" / "tiny_moe"
DOMAINS = ("code", "math", "prose")
EOS = "<|endoftext|>"

MODEL_CONFIG = dict(
    vocab_size=4096,
    hidden_size=128,
    intermediate_size=256,  # unused: every layer is sparse
    moe_intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=32,
    num_experts_per_tok=4,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=1024,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    router_aux_loss_coef=0.01,
)


#: Routing shapes: ``tiny`` (the demo model: 32 experts, top-4) and ``qwen3`` (Qwen3-MoE's routing:
#: 128 experts, top-8, softmax renormalized over the top-k; thinner experts keep it under 30 MB).
SHAPES = {
    "tiny": dict(
        name="tiny-qwen3-moe", out="tiny_moe", num_experts=32, num_experts_per_tok=4, moe_intermediate_size=96
    ),
    "qwen3": dict(
        name="tiny-qwen3-moe-e128",
        out="tiny_moe_e128",
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=48,
    ),
}


def model_config(shape: str) -> dict:
    """``MODEL_CONFIG`` with the routing shape's expert count, top-k and expert width."""
    fields = {k: v for k, v in SHAPES[shape].items() if k not in ("name", "out")}
    return {**MODEL_CONFIG, **fields}


def cosine_lr(step: int, *, peak: float, steps: int, warmup: int) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to 10% of it at ``steps``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class TrainingRun:
    """What :func:`run_training` leaves behind."""

    log: dict
    recent: list[float]  # the tracked number of every step
    steps_done: int
    train_seconds: float
    time_limited: bool


def run_training(
    parameters,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
    *,
    warmup: int,
    gen: torch.Generator,
    forward: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]],
    evaluate: Callable[[int], dict],
) -> TrainingRun:
    """The loop both tiny-model scripts share.

    Per step: :func:`cosine_lr`, ``forward(gen)`` -> (loss to backpropagate, the number tracked for the
    final training figure, named numbers to log), an AdamW step with gradients clipped at norm 1.0; a
    training-log entry every 25 steps and at the last; ``evaluate(step)`` every 200 steps, its entry
    appended to the evaluation log; stops at ``--stop-at`` steps or after ``--minutes``.
    """
    parameters = list(parameters)  # clipped every step: a generator would be spent after the first
    log: dict = {"train": [], "eval": []}
    recent: list[float] = []
    time_limited = False
    start = time.monotonic()
    step = 0
    for step in range(args.steps):
        lr = cosine_lr(step, peak=args.lr, steps=args.steps, warmup=warmup)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss, tracked, numbers = forward(gen)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(parameters, 1.0)
        optimizer.step()
        recent.append(tracked.item())
        if step % 25 == 0 or step == args.steps - 1:
            entry = {"step": step, **{name: float(value) for name, value in numbers.items()}, "lr": lr}
            entry["seconds"] = round(time.monotonic() - start, 1)
            log["train"].append(entry)
            text = " ".join(f"{name} {entry[name]:.3f}" for name in numbers)
            logger.info("step %d %s (%.0f s)", step, text, entry["seconds"])
        if step % 200 == 0 and step > 0:
            log["eval"].append(evaluate(step))
        if args.stop_at is not None and step + 1 >= args.stop_at:
            break
        if time.monotonic() - start > args.minutes * 60:
            logger.warning("time limit of %.1f minutes reached at step %d", args.minutes, step)
            time_limited = True
            break
    return TrainingRun(log, recent, step + 1, time.monotonic() - start, time_limited)


def add_run_arguments(
    parser: argparse.ArgumentParser, *, steps: int, minutes: float, batch_per_domain: int, threads: int
) -> None:
    """The data, schedule and machine flags both tiny-model scripts take (what :func:`run_record` logs)."""
    parser.add_argument("--eval-sets", help="folder with gsm8k_test.jsonl and HumanEval.jsonl.gz")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--minutes", type=float, default=minutes, help="stop early after this much training time")
    parser.add_argument("--stop-at", type=int, help="stop after this many steps, keeping the --steps schedule")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-per-domain", type=int, default=batch_per_domain)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--code-bytes", type=int, default=3_000_000)
    parser.add_argument("--threads", type=int, default=threads)


def run_record(args: argparse.Namespace, run: TrainingRun, *, warmup: int, domains, streams, heldout) -> dict:
    """The schedule, data and machine facts both scripts write into ``training_log.json``."""
    return dict(
        steps=run.steps_done,
        planned_steps=args.steps,
        minutes=args.minutes,
        stopped_by_time_limit=run.time_limited,
        lr=args.lr,
        warmup=warmup,
        seq_len=args.seq_len,
        batch_per_domain=args.batch_per_domain,
        seed=args.seed,
        threads=args.threads,
        train_seconds=round(run.train_seconds, 1),
        tokens_seen=run.steps_done * len(domains) * args.batch_per_domain * args.seq_len,
        python_version=platform.python_version(),
        tokens={d: {"train": len(streams[d]), "heldout": len(heldout[d])} for d in domains},
    )


def _eval_sets_dir(arg: str | None) -> Path:
    path = Path(arg) if arg else EVAL_SETS
    if not (path / "gsm8k_test.jsonl").exists():
        raise SystemExit(f"--eval-sets {path}: gsm8k_test.jsonl not found (point it at shared/data/eval_sets)")
    return path


def collect_corpus(eval_sets: Path, code_bytes: int) -> dict[str, dict[str, list[str]]]:
    """Training and held-out documents of every domain (deterministic)."""
    corpus: dict[str, dict[str, list[str]]] = {}

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in stdlib.rglob("*.py")
        if not {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"} & set(p.parts)
    )
    random.Random(0).shuffle(files)
    code_train, total = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > code_bytes:
            continue
        code_train.append(text)
        total += len(text)
    with gzip.open(eval_sets / "HumanEval.jsonl.gz", "rt") as handle:
        humaneval = [json.loads(line) for line in handle]
    code_heldout = [item["prompt"] + item["canonical_solution"] for item in humaneval]
    corpus["code"] = {"train": code_train, "heldout": code_heldout}

    gsm8k = [json.loads(line) for line in (eval_sets / "gsm8k_test.jsonl").read_text().splitlines() if line]
    math_docs = [f"Question: {item['question']}\nAnswer: {item['answer']}\n" for item in gsm8k]
    corpus["math"] = {
        "train": [doc for i, doc in enumerate(math_docs) if i % 10 != 9],
        "heldout": [doc for i, doc in enumerate(math_docs) if i % 10 == 9],
    }

    from pydoc_data.topics import topics

    prose_docs = [topics[name] for name in sorted(topics)]
    corpus["prose"] = {
        "train": [doc for i, doc in enumerate(prose_docs) if i % 5 != 4],
        "heldout": [doc for i, doc in enumerate(prose_docs) if i % 5 == 4],
    }
    return corpus


def copy_licences(eval_sets: Path, out: Path) -> None:
    """The licences of the text the model was trained on and of the held-out files shipped with it."""
    shutil.copyfile(eval_sets / "LICENSE.gsm8k.MIT", out / "LICENSE.gsm8k.MIT")
    shutil.copyfile(eval_sets / "LICENSE.human-eval.MIT", out / "LICENSE.human-eval.MIT")
    shutil.copyfile(Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt", out / "LICENSE.Python-PSF")


def train_tokenizer(corpus: dict, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = [doc for domain in DOMAINS for doc in corpus[domain]["train"]]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_stream(tokenizer, docs: list[str]) -> torch.Tensor:
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs):
        ids += [*encoding.ids, eos]
    return torch.tensor(ids, dtype=torch.int64)


def sample_batch(streams: dict[str, torch.Tensor], per_domain: int, seq_len: int, gen: torch.Generator):
    rows = []
    for domain in DOMAINS:
        stream = streams[domain]
        starts = torch.randint(0, len(stream) - seq_len - 1, (per_domain,), generator=gen)
        rows += [stream[s : s + seq_len + 1] for s in starts.tolist()]
    return torch.stack(rows)


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, max_windows: int) -> float:
    """Mean next-token loss over non-overlapping windows of a held-out stream."""
    model.eval()
    windows = stream[: (len(stream) - 1) // seq_len * seq_len + 1]
    starts = list(range(0, len(windows) - 1, seq_len))[:max_windows]
    total, count = 0.0, 0
    for i in range(0, len(starts), 16):
        chunk = torch.stack([windows[s : s + seq_len + 1] for s in starts[i : i + 16]])
        out = model(input_ids=chunk[:, :-1], output_router_logits=False)
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(loss)
        count += chunk[:, 1:].numel()
    model.train()
    return total / max(count, 1)


@torch.no_grad()
def expert_usage(model, streams: dict[str, torch.Tensor], seq_len: int) -> dict[str, list[list[float]]]:
    """Share of each domain's top-k picks that go to each expert, per layer: [L][E] per domain."""
    model.eval()
    usage = {}
    top_k = model.config.num_experts_per_tok
    for domain in DOMAINS:
        chunk = streams[domain][: 8 * seq_len].reshape(8, seq_len)
        out = model(input_ids=chunk, output_router_logits=True)
        per_layer = []
        for logits in out.router_logits:
            picks = logits.float().topk(top_k, dim=-1).indices.reshape(-1)
            counts = torch.bincount(picks, minlength=model.config.num_experts).float()
            per_layer.append((counts / counts.sum()).tolist())
        usage[domain] = per_layer
    model.train()
    return usage


def specialization(usage: dict[str, list[list[float]]]) -> float:
    """Mean over layers of the total-variation distance between domains' expert-usage profiles."""
    layers = len(next(iter(usage.values())))
    distances = []
    for layer in range(layers):
        for i, a in enumerate(DOMAINS):
            for b in DOMAINS[i + 1 :]:
                pa, pb = torch.tensor(usage[a][layer]), torch.tensor(usage[b][layer])
                distances.append(0.5 * float((pa - pb).abs().sum()))
    return sum(distances) / len(distances)


def write_card(out: Path, log: dict) -> None:
    final = log["final"]
    rows = "\n".join(
        f"| {d} | {final['heldout_loss'][d]:.3f} | {math.exp(final['heldout_loss'][d]):.1f} | "
        f"{log['tokens'][d]['train']:,} | {log['tokens'][d]['heldout']:,} |"
        for d in DOMAINS
    )
    cfg = log["model_config"]
    data_rows = "\n".join(
        f"| {domain} | {train} | {heldout} |"
        for domain, train, heldout in (
            (
                "code",
                f"Python {log['python_version']} stdlib sources ({log['bytes']['code']:,} bytes; PSF License)",
                "HumanEval prompts + canonical solutions (MIT, openai/human-eval)",
            ),
            ("math", "GSM8K test set, 9 of every 10 problems (MIT, openai/grade-school-math)", "the 10th of every 10"),
            ("prose", "`pydoc_data.topics` (Python reference topics; PSF License), 4 of every 5", "the 5th of every 5"),
        )
    )
    architecture = (
        f"{cfg['num_hidden_layers']} decoder layers, hidden size {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} attention heads ({cfg['num_key_value_heads']} KV heads, head dim "
        f"{cfg['head_dim']}), every layer an MoE block of {cfg['num_experts']} experts (intermediate size "
        f"{cfg['moe_intermediate_size']}), top-{cfg['num_experts_per_tok']} softmax routing renormalized over the "
        "top-k, embeddings trained tied and stored untied (`lm_head.weight` is a copy of the input embeddings and "
        "`tie_word_embeddings` is false, because SGLang 0.5.23's `Qwen3MoeForCausalLM` never ties the two: from a "
        "tied checkpoint it would predict with an unloaded head; transformers gives identical logits either way), "
        f"a byte-level BPE vocabulary of {cfg['vocab_size']} tokens trained by the same script. Weights are stored "
        "in bfloat16."
    )
    during = log["eval"][:-1]  # the last entry is the whole held-out set at the end
    best = (
        ", ".join(
            f"{d} {min(e['heldout_loss'][d] for e in during):.3f} (step "
            f"{min(during, key=lambda e, d=d: e['heldout_loss'][d])['step']})"
            for d in DOMAINS
        )
        if during
        else "none made (fewer than 200 steps)"
    )
    planned = log.get("planned_steps", log["steps"])
    stopped = (
        f" (the schedule was planned for {planned} steps; the {log['minutes']:.0f}-minute limit stopped it)"
        if planned != log["steps"]
        else ""
    )
    shape_flag = f" --shape {log['shape']}" if log.get("shape", "tiny") != "tiny" else ""
    reproduce = f"{shape_flag} --seed {log['seed']} --steps {planned} --stop-at {log['steps']}"
    card = f"""# {log.get("name", "tiny-qwen3-moe")} (xshare-sglang demo model)

A {log["parameters"] / 1e6:.1f} M-parameter Mixture-of-Experts language model in Hugging Face's
`Qwen3MoeForCausalLM` architecture, trained from scratch on CPU by `scripts/train_tiny_moe.py` so
that the xshare-sglang demo has a real MoE router to prune on a machine without a GPU. It is a
test article, not a useful language model.

## Architecture
{architecture}

## Data and licences
| domain | training text | held-out text |
|---|---|---|
{data_rows}

The held-out texts are shipped next to the model (`heldout_*.jsonl`) under the same licences.

## Training
{log["steps"]} steps{stopped} of AdamW (lr {log["lr"]}, cosine to 10%, {log["warmup"]} warm-up steps), batches of
{log["batch_per_domain"]} sequences x {log["seq_len"]} tokens from each domain, router load-balancing
loss weight {cfg["router_aux_loss_coef"]}, seed {log["seed"]}; {log["train_seconds"] / 60:.1f} minutes on
{log["threads"]} CPU thread(s) ({log["tokens_seen"]:,} training tokens seen). Loss curve: `loss_curve.png`;
every logged step: `training_log.json`.

## Results (end of training)
| domain | held-out loss (nats/token) | held-out perplexity | training tokens | held-out tokens |
|---|---|---|---|---|
{rows}

Final training loss (language-model part, last 50 steps' mean): {final["train_loss"]:.3f}. The gap to
the held-out losses is memorization: the math and prose training sets are small and are seen many
times over. The evaluations during training (the first 32 held-out windows of each domain, not the
whole held-out set of the table) were lowest at: {best}.
Expert specialization (mean total-variation distance between the domains' expert-usage profiles,
over layers; 0 = same experts for every domain, 1 = disjoint): {final["specialization"]:.2f}.

Reproduce: `python scripts/train_tiny_moe.py{reproduce}`
(timings vary with the machine; data, schedule and step count fix the result up to floating-point
reduction order and the Python version's standard library).
"""
    (out / "MODEL_CARD.md").write_text(card)


def plot_losses(out: Path, log: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    steps = [entry["step"] for entry in log["train"]]
    ax.plot(steps, [entry["loss"] for entry in log["train"]], label="train (LM loss)", color="black", lw=1)
    for i, domain in enumerate(DOMAINS):
        points = [(entry["step"], entry["heldout_loss"][domain]) for entry in log["eval"][:-1]]
        ax.plot(*zip(*points, strict=True), marker="o", ms=3, color=f"C{i}", label=f"held-out {domain} (32 windows)")
        final = log["eval"][-1]
        ax.plot(final["step"], final["heldout_loss"][domain], marker="x", ms=7, color=f"C{i}")
    ax.plot([], [], "kx", label="end: whole held-out set")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(f"{log.get('name', 'tiny-qwen3-moe')} training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss_curve.png")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="tiny",
        help="routing shape: tiny (32 experts, top-4) or qwen3 (128 experts, top-8) (default: %(default)s)",
    )
    parser.add_argument("--out", type=Path, help="output folder (default: the package's data/tiny_moe[_e128])")
    add_run_arguments(parser, steps=3200, minutes=28.0, batch_per_domain=8, threads=2)
    args = parser.parse_args()
    if args.out is None:
        args.out = DEFAULT_OUT.parent / SHAPES[args.shape]["out"]
    config_fields = model_config(args.shape)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from xshare_sglang.tiny.tiny_model import untie_lm_head

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    eval_sets = _eval_sets_dir(args.eval_sets)
    corpus = collect_corpus(eval_sets, args.code_bytes)
    tokenizer = train_tokenizer(corpus, MODEL_CONFIG["vocab_size"])
    streams = {d: token_stream(tokenizer, corpus[d]["train"]) for d in DOMAINS}
    heldout = {d: token_stream(tokenizer, corpus[d]["heldout"]) for d in DOMAINS}
    for d in DOMAINS:
        logger.info("%s: %d training tokens, %d held-out tokens", d, len(streams[d]), len(heldout[d]))

    config = Qwen3MoeConfig(**config_fields, bos_token_id=None, eos_token_id=tokenizer.token_to_id(EOS))
    model = Qwen3MoeForCausalLM(config)
    model.train()
    parameters = sum(p.numel() for p in model.parameters())
    logger.info("model: %.2f M parameters", parameters / 1e6)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, args.steps // 20)

    def forward(gen: torch.Generator):
        batch = sample_batch(streams, args.batch_per_domain, args.seq_len, gen)
        out = model(input_ids=batch, labels=batch, output_router_logits=True)
        lm_loss = out.loss - config.router_aux_loss_coef * out.aux_loss
        return out.loss, lm_loss, {"loss": lm_loss, "aux_loss": out.aux_loss}

    def evaluate(step: int) -> dict:
        losses = {d: heldout_loss(model, heldout[d], args.seq_len, 32) for d in DOMAINS}
        logger.info("held-out: %s", {d: round(v, 3) for d, v in losses.items()})
        return {"step": step, "heldout_loss": losses}

    gen = torch.Generator().manual_seed(args.seed)
    run = run_training(model.parameters(), optimizer, args, warmup=warmup, gen=gen, forward=forward, evaluate=evaluate)
    log, recent, step = run.log, run.recent, run.steps_done - 1

    final_losses = {d: heldout_loss(model, heldout[d], args.seq_len, 10_000) for d in DOMAINS}
    log["eval"].append({"step": step, "heldout_loss": final_losses})
    usage = expert_usage(model, heldout, args.seq_len)
    model = model.to(torch.bfloat16)
    untie_lm_head(model)  # SGLang's Qwen3-MoE class never ties lm_head: store it
    model.save_pretrained(args.out, safe_serialization=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS)
    fast.save_pretrained(args.out)
    for d in DOMAINS:
        with (args.out / f"heldout_{d}.jsonl").open("w") as handle:
            for doc in corpus[d]["heldout"]:
                handle.write(json.dumps({"text": doc}) + "\n")

    copy_licences(eval_sets, args.out)

    log.update(
        name=SHAPES[args.shape]["name"],
        shape=args.shape,
        model_config=config_fields,
        parameters=parameters,
        **run_record(args, run, warmup=warmup, domains=DOMAINS, streams=streams, heldout=heldout),
        bytes={d: sum(len(doc) for doc in corpus[d]["train"]) for d in DOMAINS},
        expert_usage=usage,
        final={
            "heldout_loss": final_losses,
            "train_loss": sum(recent[-50:]) / len(recent[-50:]),
            "specialization": specialization(usage),
        },
    )
    (args.out / "training_log.json").write_text(json.dumps(log, indent=1))
    plot_losses(args.out, log)
    write_card(args.out, log)
    logger.info("held-out perplexity: %s", {d: round(math.exp(v), 2) for d, v in final_losses.items()})
    logger.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
