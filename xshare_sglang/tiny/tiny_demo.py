"""The demo: the tiny MoE model under every policy, teacher-forced and free-running.

For each policy the model reads held-out text of three domains (code, math, prose) one token per
step in decode batches of ``requests`` rows drawn from all domains, as a server batches requests,
and is compared position by position with the unpruned model on the same prefixes (KL of the
next-token distribution, top-1 agreement, NLL change; see :mod:`.quality`).  It also decodes one batch
of prompts greedily; agreement of those tokens with unpruned decoding is a secondary column: one
flipped token changes the rest of a continuation, so it mostly measures how thin the tiny model's
margins are.  Reported per policy as well: experts activated per decode layer call, retained gating
mass, held-out perplexity per domain, and the bandwidth model's MoE speed-up.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config import PrunerConfig
from ..replay.cost import modeled_speedup
from ..replay.trace import Trace
from .measures import METRICS, Interval, bootstrap_interval, teacher_forced_logprobs, token_measures
from .tiny_model import DOMAINS, RouterHook, tiny_model_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DemoSettings:
    """Sizes of one demo run."""

    prompts_per_domain: int = 4
    new_tokens: int = 40
    windows_per_domain: int = 8
    window_tokens: int = 64
    requests: int = 24  # held-out windows read per decode forward (all of them by default)
    bootstrap: int = 1000

    @classmethod
    def quick(cls) -> DemoSettings:
        return cls(
            prompts_per_domain=2, new_tokens=16, windows_per_domain=4, window_tokens=32, requests=12, bootstrap=200
        )


def demo_configs(top_k: int, num_experts: int, *, quick: bool = False) -> list[PrunerConfig]:
    """The settings the demo compares, scaled to the model's top-k (the first is the baseline)."""
    if quick:
        return [
            PrunerConfig(policy="none"),
            PrunerConfig(policy="xshare", k0=1, budget=2 * top_k),
            PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 3 * top_k)),
        ]
    return [
        PrunerConfig(policy="none"),
        PrunerConfig(policy="oea", k0=1),
        PrunerConfig(policy="oea", k0=2),
        PrunerConfig(policy="xshare", k0=1, budget=top_k),
        PrunerConfig(policy="xshare", k0=1, budget=2 * top_k),
        PrunerConfig(policy="xshare", k0=2, budget=2 * top_k),
        PrunerConfig(policy="xshare-threshold", k0=1, tau=0.9),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 2 * top_k)),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 4 * top_k)),
        PrunerConfig(policy="lynx", alpha=2.0, beta=4),
    ]


@dataclass(frozen=True)
class DemoRow:
    policy: str
    params: str
    activated: float
    baseline_activated: float
    kept: float
    retained_mass: float
    kl: Interval
    top1_agree: Interval
    nll_delta: Interval
    token_agreement: float
    prefix_kept: float
    perplexity: dict[str, float]
    speedup: float

    def as_dict(self) -> dict:
        return asdict(self)


def heldout_texts(model_dir: Path, domain: str) -> list[str]:
    path = model_dir / f"heldout_{domain}.jsonl"
    return [json.loads(line)["text"] for line in path.read_text().splitlines() if line.strip()]


def demo_prompts(model_dir: Path, per_domain: int) -> tuple[list[str], list[str]]:
    """Prompt texts and their domains: the beginning of held-out documents (a GSM8K problem up to
    ``Answer:``, the first 160 characters of code and prose)."""
    prompts, domains = [], []
    for domain in DOMAINS:
        for text in heldout_texts(model_dir, domain)[:per_domain]:
            cut = text.find("Answer:")
            prompts.append(text[: cut + len("Answer:")] if cut >= 0 else text[:160])
            domains.append(domain)
    return prompts, domains


def heldout_windows(model_dir: Path, tokenizer, per_domain: int, length: int) -> tuple[torch.Tensor, list[str]]:
    """Non-overlapping windows of ``length + 1`` tokens of each domain's held-out text, domains
    interleaved row by row.  Returns ids [3 * per_domain, length + 1] and each row's domain."""
    per_domain_rows = {}
    for domain in DOMAINS:
        ids: list[int] = []
        for text in heldout_texts(model_dir, domain):
            ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
            if len(ids) >= per_domain * (length + 1):
                break
        if len(ids) < per_domain * (length + 1):
            raise ValueError(f"held-out {domain} text has {len(ids)} tokens, fewer than the demo needs")
        per_domain_rows[domain] = torch.tensor(ids[: per_domain * (length + 1)]).reshape(per_domain, length + 1)
    rows = [per_domain_rows[d][i] for i in range(per_domain) for d in DOMAINS]
    return torch.stack(rows), [d for _ in range(per_domain) for d in DOMAINS]


@torch.no_grad()
def greedy_generate(model, tokenizer, prompts: list[str], new_tokens: int) -> torch.Tensor:
    """Batched greedy decoding (left padding, fixed length). Returns new token ids [B, new_tokens]."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[:, enc["input_ids"].shape[1] :]


def run_demo(
    configs: list[PrunerConfig],
    *,
    settings: DemoSettings,
    model_dir: Path | None = None,
    trace_path: Path | None = None,
    on_config_done=None,
) -> list[DemoRow]:
    """Decode and score under every config; the first config is the reference for agreement.

    With ``trace_path``, the router logits of the first config's generation are recorded there as an
    ``xshare-trace`` (requests labelled by domain).
    """
    from .tiny_model import load_tiny_model

    model_dir = Path(model_dir) if model_dir else tiny_model_dir()
    model, tokenizer = load_tiny_model(model_dir)
    prompts, prompt_domains = demo_prompts(model_dir, settings.prompts_per_domain)
    windows, window_domains = heldout_windows(model_dir, tokenizer, settings.windows_per_domain, settings.window_tokens)
    targets = windows[:, 1:]
    unpruned, _ = teacher_forced_logprobs(model, windows, None, requests=settings.requests, step_tokens=1)
    reference = None
    rows = []
    for index, cfg in enumerate(configs):
        record = trace_path is not None and index == 0
        with RouterHook(model, cfg, record=record, sources=dict(enumerate(prompt_domains))) as hook:
            tokens = greedy_generate(model, tokenizer, prompts, settings.new_tokens)
            if record:
                hook.trace("tiny-moe").save(trace_path)
                logger.info("recorded %d router calls to %s", len(hook.calls), trace_path)
        logprobs, stats = teacher_forced_logprobs(model, windows, cfg, requests=settings.requests, step_tokens=1)
        stats = hook.decode_stats() + stats
        measures = token_measures(unpruned, logprobs, targets)
        generator = torch.Generator().manual_seed(0)
        intervals = {name: bootstrap_interval(measures[name], settings.bootstrap, generator) for name in METRICS}
        if reference is None:
            reference = tokens
        same = tokens == reference
        prefix = same.long().cumprod(dim=1).sum(dim=1).float() / same.shape[1]
        nll = -logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double().sum(dim=1)
        perplexity = {
            domain: math.exp(
                float(sum(nll[i] for i, d in enumerate(window_domains) if d == domain))
                / (window_domains.count(domain) * settings.window_tokens)
            )
            for domain in DOMAINS
        }
        activated = sum(s.activated for s in stats)
        baseline = sum(s.natural_activated for s in stats)
        params = " ".join(f"{name}={value}" for name, value in cfg.policy_parameters().items())
        rows.append(
            DemoRow(
                policy=cfg.policy,
                params=params,
                activated=activated / len(stats),
                baseline_activated=baseline / len(stats),
                kept=sum(s.kept for s in stats) / len(stats),
                retained_mass=sum(s.retained_mass for s in stats) / len(stats),
                **intervals,
                token_agreement=float(same.float().mean()),
                prefix_kept=float(prefix.mean()),
                perplexity=perplexity,
                speedup=modeled_speedup(baseline, activated),
            )
        )
        if on_config_done is not None:
            on_config_done()
    return rows


@torch.no_grad()
def record_tiny_trace(settings: DemoSettings, *, model_dir: Path | None = None, prompts_per_domain: int = 8) -> Trace:
    """Decode held-out prompts with the unpruned tiny model and return the router calls of every
    decode step as an ``xshare-trace`` (one request per prompt, labelled by its domain)."""
    from .tiny_model import load_tiny_model

    model_dir = Path(model_dir) if model_dir else tiny_model_dir()
    model, tokenizer = load_tiny_model(model_dir)
    prompts, domains = demo_prompts(model_dir, prompts_per_domain)
    with RouterHook(model, None, record=True, sources=dict(enumerate(domains))) as hook:
        greedy_generate(model, tokenizer, prompts, settings.new_tokens)
    return hook.trace("tiny-moe")
