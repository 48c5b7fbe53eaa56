"""Teacher-forced quality of each policy on the tiny MoE model: what pruning costs per token.

Free-running greedy agreement mixes the pruner's effect with how thin a small model's margins are:
one flipped token sends the rest of the continuation elsewhere.  Here every configuration reads the
same held-out text (code, math, prose) and predicts each next token from the true prefix, so the
unpruned and the pruned next-token distributions can be compared position by position:

* ``kl`` - KL(unpruned || pruned) of the next-token distribution, in nats;
* ``top1_agree`` - whether the pruned model's most likely next token is the unpruned model's;
* ``nll_delta`` - the pruned model's negative log-likelihood of the true next token minus the
  unpruned model's, in nats (positive: pruning made the text less likely).

Batches are built as a server builds them.  Plain decoding policies see ``R`` requests decoded
together, one token each per forward (a decode batch of ``R`` rows, every layer call pruned).  The
verify policies (``xshare-spec``, ``moe-spec`` with ``scope="request"``) see ``R`` requests of ``D``
tokens per forward, each request's ``D`` tokens one group, as in an EAGLE-3 verify batch.  Each
configuration keeps its own KV cache, so earlier pruned layer calls shape later positions, as in
serving.

Intervals are 95% percentile bootstrap intervals over the held-out windows (a window's tokens are
not independent, so windows, not tokens, are resampled).  ``experts`` is the mean number of experts
one pruned MoE layer call reads, ``speedup`` the bandwidth model's MoE speed-up (natural over pruned
expert reads of the same calls).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..config import PrunerConfig
from ..replay.cost import modeled_speedup
from .measures import METRICS, Interval, bootstrap_interval, teacher_forced_logprobs, token_measures
from .tiny_model import RouterHook, tiny_model_dir

logger = logging.getLogger(__name__)

#: The command-line flag of each setting (errors name the flag).
FLAGS = {
    "requests": "--requests",
    "draft_tokens": "--draft-tokens",
    "windows_per_domain": "--windows",
    "window_tokens": "--tokens",
    "bootstrap": "--bootstrap",
}


@dataclass(frozen=True)
class QualitySettings:
    """Sizes of one run.

    Attributes
    ----------
    requests : int
        R, requests decoded (or verified) together in one forward.
    draft_tokens : int
        D, tokens per request in the verify policies' forwards.
    windows_per_domain : int
        Held-out windows per domain (code, math, prose); all windows are split into batches of R.
    window_tokens : int
        Predicted tokens per window (a multiple of D).
    bootstrap : int
        Bootstrap resamples of the windows for the intervals.
    seed : int
        Seed of the bootstrap.
    """

    requests: int = 8
    draft_tokens: int = 4
    windows_per_domain: int = 8
    window_tokens: int = 64
    bootstrap: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        for name, flag in FLAGS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{flag}={value!r} is invalid: must be an integer >= 1")
        if self.window_tokens % self.draft_tokens:
            raise ValueError(
                f"--tokens={self.window_tokens} is invalid: must be a multiple of --draft-tokens={self.draft_tokens}"
            )


def is_verify_policy(cfg: PrunerConfig) -> bool:
    """Policies that choose per request of D draft tokens: measured on verify batches."""
    return cfg.policy == "xshare-spec" or (cfg.policy == "moe-spec" and cfg.scope == "request")


@dataclass(frozen=True)
class QualityRow:
    """One configuration's teacher-forced measures (means over predicted tokens, with intervals)."""

    policy: str
    params: str
    batch: str  # "decode R=8" or "verify R=8 D=4"
    tokens: int
    kl: Interval
    top1_agree: Interval
    nll_delta: Interval
    experts: float
    natural_experts: float
    speedup: float
    accept_len: Interval | None = None  # verify policies with a draft model: accepted draft tokens per step
    unpruned_accept_len: Interval | None = None  # the same trees verified by the unpruned model
    family: str = ""  # policy_family(): the policy and the settings that make it a different method

    def as_dict(self) -> dict:
        return asdict(self)


def calibration_windows(model_dir: Path, tokenizer, per_domain: int, length: int) -> torch.Tensor:
    """Windows of ``length + 1`` tokens from the *end* of each domain's held-out text, domains
    interleaved: calibration data that the evaluation windows (taken from the start) never read.

    Raises
    ------
    ValueError
        If a domain's text is too short to keep the calibration and evaluation tokens apart.
    """
    from .tiny_demo import heldout_texts
    from .tiny_model import DOMAINS

    rows = {}
    for domain in DOMAINS:
        ids: list[int] = []
        for text in heldout_texts(model_dir, domain):
            ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
        needed = per_domain * (length + 1)
        if len(ids) < 2 * needed:
            raise ValueError(
                f"held-out {domain} text has {len(ids)} tokens: too few for {per_domain} calibration windows of "
                f"{length + 1} tokens apart from as many evaluation windows"
            )
        rows[domain] = torch.tensor(ids[-needed:]).reshape(per_domain, length + 1)
    return torch.stack([rows[d][i] for i in range(per_domain) for d in DOMAINS])


@torch.no_grad()
def calibrate_model_dir(model_dir: Path, settings: QualitySettings, path: Path):
    """Load the model of ``model_dir`` and :func:`calibrate_tiny` it on :func:`calibration_windows`
    (as many windows, as long, as the evaluation reads)."""
    from .tiny_model import load_tiny_model

    model, tokenizer = load_tiny_model(model_dir)
    windows = calibration_windows(model_dir, tokenizer, settings.windows_per_domain, settings.window_tokens)
    return calibrate_tiny(model, windows, requests=settings.requests, path=path)


def calibrate_tiny(model, windows: torch.Tensor, *, requests: int, path: Path):
    """Write the calibration file of ``xshare-sglang calibrate --from-trace`` for ``windows`` decoded
    ``requests`` at a time by the unpruned model (the layer calls a decode server would run).

    Returns the :class:`~xshare_sglang.calibration_file.StaticRanking` written to ``path``.
    """
    from ..serving.calibration.recorder_dump import ExpertCounts, write_static_ranking
    from ..serving.calibration.routing_stats import stats_from_trace

    stats = None
    steps = 0
    for start in range(0, windows.shape[0], requests):
        batch = windows[start : start + requests]
        past = None
        with RouterHook(model, None, record=True) as hook:
            for pos in range(batch.shape[1] - 1):
                past = model(input_ids=batch[:, pos : pos + 1], past_key_values=past, use_cache=True).past_key_values
        batch_stats = stats_from_trace(hook.trace())
        steps += batch.shape[1] - 1
        if stats is None:
            stats = batch_stats
        else:
            stats.merge(batch_stats)
    counts = ExpertCounts(counts=stats.counts(), forward_passes=steps, files=(), kinds=(), stats=stats)
    return write_static_ranking(counts, path, str(getattr(model.config, "_name_or_path", "") or None))


@dataclass(frozen=True)
class RoutingProfile:
    """How much the model's own routing leaves a pruner to do, measured on verify batches (R x D).

    Attributes
    ----------
    entropy : list of float
        Per layer, the router softmax's mean entropy in nats (ln E = uniform).
    union : list of float
        Per layer, mean distinct experts one unpruned R x D layer call reads.
    uniform_union : float
        What independent uniform top-k picks would give: ``E (1 - (1 - k/E) ** (R D))``.
    """

    num_experts: int
    top_k: int
    requests: int
    draft_tokens: int
    entropy: list[float]
    union: list[float]
    uniform_union: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class QualityReport:
    model: str
    rows: list[QualityRow]
    routing: RoutingProfile

    def as_dict(self) -> dict:
        return {"model": self.model, "routing": self.routing.as_dict(), "rows": [r.as_dict() for r in self.rows]}


def routing_profile(model, windows: torch.Tensor, settings: QualitySettings) -> RoutingProfile:
    """Per-layer router entropy and expert union of the unpruned model on R x D verify batches."""
    _, stats = teacher_forced_logprobs(
        model, windows, None, requests=settings.requests, step_tokens=settings.draft_tokens
    )
    full = settings.requests * settings.draft_tokens
    layers = sorted({s.layer for s in stats})
    entropy = []
    union = []
    for layer in layers:
        calls = [s for s in stats if s.layer == layer]
        entropy.append(sum(s.entropy for s in calls) / len(calls))
        whole = [s for s in calls if s.rows == full] or calls
        union.append(sum(s.natural_activated for s in whole) / len(whole))
    cfg = model.config
    num_experts = int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)
    top_k = int(cfg.num_experts_per_tok)
    uniform = num_experts * (1 - (1 - top_k / num_experts) ** full)
    return RoutingProfile(num_experts, top_k, settings.requests, settings.draft_tokens, entropy, union, uniform)


#: Speculative decoding for ``accept_len``: SGLang's EAGLE tree of 3 steps x top-4, D slots per request,
#: 32 new tokens for each of 3 batches of R held-out prompts.
ACCEPT_STEPS, ACCEPT_TOPK, ACCEPT_NEW_TOKENS, ACCEPT_BATCHES = 3, 4, 32, 3


class Acceptance:
    """Accepted draft tokens per request and step under pruned verify, against unpruned verify.

    Real tree speculative decoding (:func:`~.tiny_spec.speculative_generate`, static SGLang trees,
    ``D - 1`` draft nodes per request) of :data:`ACCEPT_BATCHES` batches of ``R`` held-out prompts with
    the draft model; the target's verify forwards are pruned by the policy.  The interval resamples
    requests.
    """

    def __init__(self, model, tokenizer, model_dir: Path, draft, settings: QualitySettings) -> None:
        from .spec_eval import split_prompts
        from .tiny_spec import SpecSettings, model_probs

        self.model, self.settings = model, settings
        self.next_probs = model_probs(draft)
        texts = split_prompts(model_dir)[1][: ACCEPT_BATCHES * settings.requests]
        prompts = [tokenizer(t)["input_ids"] for t in texts]
        self.batches = [prompts[i : i + settings.requests] for i in range(0, len(prompts), settings.requests)]
        self.spec = SpecSettings(
            num_steps=ACCEPT_STEPS,
            topk=ACCEPT_TOPK,
            num_draft_tokens=settings.draft_tokens,
            new_tokens=ACCEPT_NEW_TOKENS,
        )
        self.unpruned = self.measure(None)

    def measure(self, cfg: PrunerConfig | None) -> Interval:
        from .tiny_spec import speculative_generate

        per_request = []
        for prompts in self.batches:
            k_max = (self.settings.draft_tokens - 1) * len(prompts)
            run = speculative_generate(
                self.model, self.next_probs, prompts, self.spec, mode="static", k_max=k_max, verify_cfg=cfg
            )
            per_request += [accepted / max(run.steps, 1) for accepted in run.accepted_by_request]
        return bootstrap_interval(
            torch.tensor(per_request, dtype=torch.float64)[:, None],
            self.settings.bootstrap,
            torch.Generator().manual_seed(self.settings.seed),
        )


def run_quality(
    configs: list[PrunerConfig],
    *,
    settings: QualitySettings,
    model_dir: Path | None = None,
    draft_dir: Path | None = None,
    on_config_done: Callable[[], None] | None = None,
) -> QualityReport:
    """Teacher-forced measures of every configuration on the held-out windows (``none`` included),
    one row per configuration in order, and the unpruned model's routing profile.  With a draft
    model (``draft_dir``), verify policies also get ``accept_len`` (:class:`Acceptance`)."""
    from .tiny_demo import heldout_windows
    from .tiny_model import load_tiny_model

    model_dir = Path(model_dir) if model_dir else tiny_model_dir()
    model, tokenizer = load_tiny_model(model_dir)
    acceptance = None
    if draft_dir is not None and any(is_verify_policy(c) for c in configs):
        from .spec_eval import load_draft

        draft = load_draft(draft_dir, model.config.vocab_size)
        acceptance = Acceptance(model, tokenizer, model_dir, draft, settings)
    windows, _ = heldout_windows(model_dir, tokenizer, settings.windows_per_domain, settings.window_tokens)
    targets = windows[:, 1:]
    references: dict[int, torch.Tensor] = {}
    rows = []
    for cfg in configs:
        step = settings.draft_tokens if is_verify_policy(cfg) else 1
        if step not in references:
            references[step], _ = teacher_forced_logprobs(
                model, windows, None, requests=settings.requests, step_tokens=step
            )
        pruned, stats = teacher_forced_logprobs(model, windows, cfg, requests=settings.requests, step_tokens=step)
        measures = token_measures(references[step], pruned, targets)
        generator = torch.Generator().manual_seed(settings.seed)
        intervals = {name: bootstrap_interval(measures[name], settings.bootstrap, generator) for name in METRICS}
        activated = sum(s.activated for s in stats)
        natural = sum(s.natural_activated for s in stats)
        batch = f"verify R={settings.requests} D={step}" if step > 1 else f"decode R={settings.requests}"
        rows.append(
            QualityRow(
                policy=cfg.policy,
                params=" ".join(f"{k}={v}" for k, v in cfg.policy_parameters().items()),
                family=policy_family(cfg),
                batch=batch,
                tokens=int(targets.numel()),
                experts=activated / max(len(stats), 1),
                natural_experts=natural / max(len(stats), 1),
                speedup=modeled_speedup(natural, activated),
                accept_len=acceptance.measure(cfg) if acceptance and step > 1 else None,
                unpruned_accept_len=acceptance.unpruned if acceptance and step > 1 else None,
                **intervals,
            )
        )
        if on_config_done is not None:
            on_config_done()
    return QualityReport(model_dir.name, rows, routing_profile(model, windows, settings))


def quality_configs(top_k: int, num_experts: int, calibration: Path | None = None) -> list[PrunerConfig]:
    """The default comparison: the demo's decode settings (without its near-lossless ``xshare k0=2``),
    ``moe-spec`` with the coverage ranking at the demo's budgets (and with calibrated per-layer budgets
    when a ``calibration`` file is given), and three verify settings, scaled to the model's top-k."""
    from .tiny_demo import demo_configs

    decode = [c for c in demo_configs(top_k, num_experts) if not (c.policy == "xshare" and c.k0 == 2)]
    budgets = [min(num_experts, 2 * top_k), min(num_experts, 4 * top_k)]
    decode += [PrunerConfig(policy="moe-spec", max_experts=b, ranking="coverage") for b in budgets]
    if calibration is not None:
        decode.append(
            PrunerConfig(
                policy="moe-spec",
                max_experts=budgets[0],
                ranking="coverage",
                budget_allocation="calibrated",
                static_ranking_path=str(calibration),
            )
        )
    return [
        *decode,
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=top_k, budget=0),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, top_k), scope="request"),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 2 * top_k), scope="request"),
    ]


def policy_family(cfg: PrunerConfig) -> str:
    """The method a configuration runs: its policy, plus the ranking and budget allocation for
    ``moe-spec`` when they are not the paper's (``router``, ``uniform``)."""
    parts = [cfg.policy]
    if cfg.policy == "moe-spec":
        if cfg.ranking != "router":
            parts.append(f"ranking={cfg.ranking}")
        if cfg.budget_allocation != "uniform":
            parts.append(f"budget_allocation={cfg.budget_allocation}")
        if cfg.scope != "batch":
            parts.append(f"scope={cfg.scope}")
    return " ".join(parts)


#: Families no paper describes: judged against the seed policies' frontier.
NEW_FAMILY_MARKERS = ("ranking=coverage", "ranking=coactivation", "budget_allocation=calibrated")


def is_new_family(family: str) -> bool:
    return any(marker in family for marker in NEW_FAMILY_MARKERS)


def study_configs(top_k: int, num_experts: int, calibration: Path) -> list[PrunerConfig]:
    """The Pareto study on decode batches: every seed policy at several operating points, then
    ``moe-spec`` with each new ranking and budget allocation at the budgets of the plain one.

    ``calibration`` is the file ``xshare-sglang calibrate`` wrote for this model (see
    :func:`calibrate_tiny`)."""
    path = str(calibration)
    budgets = sorted({min(num_experts, max(1, round(top_k * m))) for m in (1, 1.5, 2, 3, 4, 5)})
    configs = [PrunerConfig(policy="none")]
    configs += [PrunerConfig(policy="xshare", k0=1, budget=b) for b in sorted({0, 1, 2, top_k, 2 * top_k, 3 * top_k})]
    configs += [PrunerConfig(policy="xshare-threshold", k0=1, tau=tau) for tau in (0.6, 0.7, 0.8, 0.9)]
    configs += [PrunerConfig(policy="oea", k0=k0) for k0 in (1, 2) if k0 <= top_k]
    configs += [PrunerConfig(policy="lynx", alpha=alpha, beta=4) for alpha in (1.0, 2.0, 4.0)]
    variants = (
        {},
        {"ranking": "coverage"},
        {"budget_allocation": "calibrated", "static_ranking_path": path},
        {"ranking": "coverage", "budget_allocation": "calibrated", "static_ranking_path": path},
        {"ranking": "coactivation", "static_ranking_path": path},
    )
    for variant in variants:
        configs += [PrunerConfig(policy="moe-spec", max_experts=b, **variant) for b in budgets]
    return configs


@dataclass(frozen=True)
class Verdict:
    """How one new family compares with the seed policies on one batch shape.

    ``dominated`` lists the seed operating points on the seeds' own Pareto frontier (speed-up against
    top1_agree) that some point of the family beats outright: at least the same modeled speed-up
    and a top1_agree interval entirely above the seed's.  ``beaten_by`` lists the family's points
    that a seed point beats the same way.
    """

    family: str
    batch: str
    dominated: tuple[str, ...]
    beaten_by: tuple[str, ...]
    #: per budget B shared with plain ``moe-spec`` (router ranking, uniform budgets): ``"better"`` or
    #: ``"worse"`` when the top1_agree intervals do not overlap, else ``"same"``
    versus_router: tuple[tuple[int, str], ...] = ()

    @property
    def dominates(self) -> bool:
        """The issue's bar: the seed frontier is beaten at two or more operating points."""
        return len(self.dominated) >= 2


def _beats(a: QualityRow, b: QualityRow) -> bool:
    return a.speedup >= b.speedup and a.top1_agree.low > b.top1_agree.high


def pareto_verdicts(rows: list[QualityRow]) -> list[Verdict]:
    """One :class:`Verdict` per new family and batch shape of ``rows`` (from :func:`run_quality`)."""
    verdicts = []
    for batch in dict.fromkeys(r.batch for r in rows):
        same = [r for r in rows if r.batch == batch and r.policy != "none"]
        seeds = [r for r in same if not is_new_family(r.family)]
        frontier = [
            s
            for s in seeds
            if not any(
                o is not s
                and o.speedup >= s.speedup
                and o.top1_agree.mean >= s.top1_agree.mean
                and (o.speedup, o.top1_agree.mean) != (s.speedup, s.top1_agree.mean)
                for o in seeds
            )
        ]
        for family in dict.fromkeys(r.family for r in same if is_new_family(r.family)):
            points = [r for r in same if r.family == family]
            dominated = tuple(f"{s.policy} {s.params}" for s in frontier if any(_beats(p, s) for p in points))
            beaten = tuple(p.params for p in points if any(_beats(s, p) for s in seeds))
            router = {_budget(r): r for r in same if r.family == "moe-spec"}
            versus = tuple((_budget(p), _compare(p, router[_budget(p)])) for p in points if _budget(p) in router)
            verdicts.append(Verdict(family, batch, dominated, beaten, versus))
    return verdicts


def _budget(row: QualityRow) -> int | None:
    for part in row.params.split():
        if part.startswith("max_experts="):
            return int(part.split("=", 1)[1])
    return None


def _compare(a: QualityRow, b: QualityRow) -> str:
    if a.top1_agree.low > b.top1_agree.high:
        return "better"
    if a.top1_agree.high < b.top1_agree.low:
        return "worse"
    return "same"
