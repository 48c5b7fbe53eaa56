"""``xshare-sglang spec-eval``: ECHO's elastic budget in real tree speculative decoding, tiny MoE on CPU.

The shipped tiny Qwen3-MoE is the target, a tiny dense Qwen3 (``data/tiny_draft``, same tokenizer)
the draft.  Prompts come from the target's held-out texts, domains mixed in every batch: the first
half of each domain's texts calibrates, the rest evaluates.

1. calibration: static SGLang trees (D slots per request) on the calibration prompts, one ECHO log
   record per verify step (``echo_log.jsonl``), then :func:`~xshare_sglang.spec.echo.calibrate`
   (``echo_calibration.json``);
2. evaluation: for every per-request budget b (``k_max = b x R``), static, echo and echo-ragged
   (:mod:`.tiny_spec`) on the same evaluation batch: accepted draft tokens per request and step
   (MAT), draft utilisation, verified nodes, the experts each verify policy would activate, and
   whether the output equals the target's own greedy decoding (``spec_eval.json``);
3. acceptance under pruned verify: the first budget's static trees verified by a target whose verify
   forward each verify policy prunes (:func:`pruned_verify_configs`), accepted length per request and
   step with a bootstrap interval over requests, against the same trees verified unpruned.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..config import PrunerConfig
from ..spec.echo import EchoCalibration, calibrate, read_echo_log
from ..spec.echo.calibrate import DEFAULT_AUC_THRESHOLD
from ..spec.echo.report import calibration_table
from .measures import bootstrap_interval
from .tiny_demo import heldout_texts
from .tiny_model import DOMAINS, load_tiny_model, tiny_model_dir
from .tiny_spec import MODES, SpecRun, SpecSettings, greedy_reference, model_probs, policy_label, speculative_generate


def default_draft_dir() -> Path:
    return tiny_model_dir().parent / "tiny_draft"


@dataclass(frozen=True)
class SpecEvalSettings:
    """The experiment around :class:`SpecSettings`: batch size, budgets and calibration."""

    spec: SpecSettings = field(default_factory=SpecSettings)
    requests: int = 12
    budgets: tuple[int, ...] = (7, 4)
    calibration_batches: int = 2
    auc_threshold: float = DEFAULT_AUC_THRESHOLD

    def __post_init__(self) -> None:
        if self.requests < 1 or self.calibration_batches < 1:
            raise ValueError("--requests and --calibration-batches must be >= 1")
        if not self.budgets or min(self.budgets) < 0:
            raise ValueError(f"--budgets {self.budgets} must be non-negative draft nodes per request")

    @classmethod
    def quick(cls) -> SpecEvalSettings:
        return cls(spec=SpecSettings(new_tokens=16), requests=6, budgets=(4,), calibration_batches=1)


def spec_eval_configs(top_k: int, num_experts: int) -> list[PrunerConfig]:
    """The verify policies whose activated experts the ECHO runs report (their verify is unpruned)."""
    return [
        PrunerConfig(policy="none"),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=1, budget=0),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 2 * top_k), scope="request"),
    ]


def pruned_verify_configs(top_k: int, num_experts: int) -> list[PrunerConfig]:
    """The verify policies whose pruned verify forwards are run: acceptance against the unpruned verify."""
    return [
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=1, budget=0),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=top_k, budget=0),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, top_k), scope="request"),
        PrunerConfig(policy="moe-spec", max_experts=min(num_experts, 2 * top_k), scope="request"),
        PrunerConfig(policy="lynx", alpha=2.0, beta=4),
    ]


def acceptance_interval(run: SpecRun, resamples: int = 1000, seed: int = 0) -> dict:
    """Mean accepted draft tokens per request and step, with a 95% bootstrap interval over requests."""
    per_request = torch.tensor(run.accepted_by_request, dtype=torch.float64)[:, None] / max(run.steps, 1)
    interval = bootstrap_interval(per_request, resamples, torch.Generator().manual_seed(seed))
    return {"mean": interval.mean, "low": interval.low, "high": interval.high}


def _prompt(text: str) -> str:
    cut = text.find("Answer:")
    return text[: cut + len("Answer:")] if cut >= 0 else text[:160]


def split_prompts(model_dir: Path) -> tuple[list[str], list[str]]:
    """(calibration, evaluation) prompts: first / second half of each domain's held-out texts,
    domains interleaved."""
    halves = {}
    for domain in DOMAINS:
        texts = [_prompt(t) for t in heldout_texts(model_dir, domain)]
        halves[domain] = (texts[: len(texts) // 2], texts[len(texts) // 2 :])

    def interleave(part: int) -> list[str]:
        lists = [halves[d][part] for d in DOMAINS]
        return [lst[i] for i in range(max(map(len, lists))) for lst in lists if i < len(lst)]

    return interleave(0), interleave(1)


def load_draft(path: str | Path, vocab_size: int):
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(
            f"--draft {path}: no draft model there (train one with scripts/train_tiny_draft.py, or pass a folder)"
        )
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    draft.eval()
    if draft.config.vocab_size != vocab_size:
        raise ValueError(f"--draft {path}: vocabulary {draft.config.vocab_size}, the target's is {vocab_size}")
    return draft


def run_spec_eval(
    settings: SpecEvalSettings,
    out: Path,
    *,
    model_dir: Path | None = None,
    draft_dir: Path | None = None,
    on_run=None,
) -> tuple[dict, EchoCalibration]:
    """The whole experiment (module doc); writes the log, calibration and ``spec_eval.json`` into ``out``.
    Returns what ``spec_eval.json`` holds and the calibration."""
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(model_dir) if model_dir else tiny_model_dir()
    draft_dir = Path(draft_dir) if draft_dir else default_draft_dir()
    target, tokenizer = load_tiny_model(model_dir)
    next_probs = model_probs(load_draft(draft_dir, target.config.vocab_size))
    cfg = target.config
    configs = spec_eval_configs(cfg.num_experts_per_tok, cfg.num_experts)
    spec = settings.spec
    calib_texts, eval_texts = split_prompts(model_dir)
    r = settings.requests
    if len(eval_texts) < r or len(calib_texts) < r:
        raise ValueError(f"--requests {r}: only {len(calib_texts)} calibration / {len(eval_texts)} evaluation prompts")
    encode = lambda texts: [tokenizer(t)["input_ids"] for t in texts]  # noqa: E731
    log_path = out / "echo_log.jsonl"
    runs: list[tuple[SpecRun, list[list[int]]]] = []
    with open(log_path, "w") as log:
        for batch in range(settings.calibration_batches):
            texts = [calib_texts[(batch * r + i) % len(calib_texts)] for i in range(r)]
            prompts = encode(texts)
            run = speculative_generate(
                target, next_probs, prompts, spec, mode="static", log=lambda line: log.write(line + "\n")
            )
            run.mode = "static (calibration)"
            runs.append((run, prompts))
            if on_run:
                on_run(run)
    calibration = calibrate(read_echo_log(log_path), auc_threshold=settings.auc_threshold)
    calibration.save(out / "echo_calibration.json")
    prompts = encode(eval_texts[:r])
    for budget in settings.budgets:
        for mode in MODES:
            run = speculative_generate(
                target, next_probs, prompts, spec, mode=mode, k_max=budget * r, calibration=calibration, configs=configs
            )
            runs.append((run, prompts))
            if on_run:
                on_run(run)
    # acceptance under pruned verify: the first budget's static trees, the target's verify forward
    # pruned by each verify policy, against the same trees verified unpruned
    budget = settings.budgets[0]
    baseline = next(run for run, _ in runs if run.mode == "static" and run.k_max == budget * r)
    none_label = policy_label(PrunerConfig())
    pruned_verify = []
    for verify_cfg in pruned_verify_configs(cfg.num_experts_per_tok, cfg.num_experts):
        run = speculative_generate(
            target,
            next_probs,
            prompts,
            spec,
            mode="static",
            k_max=budget * r,
            configs=[verify_cfg],
            verify_cfg=verify_cfg,
        )
        run.mode = f"static, verify pruned by {verify_cfg.policy}"
        if on_run:
            on_run(run)
        pruned_verify.append(
            {
                "policy": policy_label(verify_cfg),
                "k_max": budget * r,
                "accept_len": acceptance_interval(run),
                "unpruned_accept_len": acceptance_interval(baseline),
                "experts": run.activated[policy_label(verify_cfg)] / max(run.layer_calls, 1),
                "unpruned_experts": baseline.activated[none_label] / max(baseline.layer_calls, 1),
                "steps": run.steps,
                "unpruned_steps": baseline.steps,
            }
        )
    # one greedy reference per prompt batch, as long as the longest output
    references: dict[int, list[list[int]]] = {}
    for run, batch_prompts in runs:
        key = id(batch_prompts)
        longest = max(map(len, run.outputs))
        if key not in references or min(map(len, references[key])) < longest:
            references[key] = greedy_reference(target, batch_prompts, longest)
        run.exact = all(o == ref[: len(o)] for o, ref in zip(run.outputs, references[key], strict=True))
    result = {
        "settings": asdict(settings),
        "target": str(model_dir),
        "draft": str(draft_dir),
        "policies": [policy_label(c) for c in configs],
        "calibration": calibration.to_dict(),
        "calibration_runs": [run.summary() for run, _ in runs[: settings.calibration_batches]],
        "runs": [run.summary() for run, _ in runs[settings.calibration_batches :]],
        "pruned_verify": pruned_verify,
        "seconds": time.perf_counter() - started,
    }
    (out / "spec_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result, calibration


# ---------------------------------------------------------------------------------------------- CLI


def add_spec_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="6 requests x 16 tokens, budget 4 (under a minute)")
    parser.add_argument("--out", default="xshare-spec-eval", help="output folder (default: %(default)s)")
    parser.add_argument("--num-steps", type=int, default=5, help="draft steps S (default: %(default)s)")
    parser.add_argument("--topk", type=int, default=4, help="draft beam K (default: %(default)s)")
    parser.add_argument("--draft-tokens", type=int, default=8, help="verify slots D per request, root included (8)")
    parser.add_argument("--requests", type=int, help="concurrent requests R (default: 12, --quick 6)")
    parser.add_argument("--new-tokens", type=int, help="tokens every request decodes (default: 48, --quick 16)")
    parser.add_argument("--budgets", help="draft nodes per request, comma-separated; k_max = budget x R (7,4)")
    parser.add_argument("--calibration-batches", type=int, help="batches of R calibration prompts (2, --quick 1)")
    parser.add_argument("--default-width", type=int, default=1, help="ECHO nodes per depth (default: %(default)s)")
    parser.add_argument("--max-width", type=int, help="ECHO width at the truncation depth (default: --topk)")
    parser.add_argument(
        "--auc-threshold",
        type=float,
        default=DEFAULT_AUC_THRESHOLD,
        help="calibration: AUC an intermediate depth needs to be gated (default: %(default)s)",
    )
    parser.add_argument("--draft", help="draft model folder (default: the package's data/tiny_draft)")
    parser.add_argument("--model", help="target Qwen3-MoE folder (default: the shipped tiny model)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default: %(default)s)")


def _runs_table(result: dict):
    from rich.table import Table

    s, spec = result["settings"], result["settings"]["spec"]
    table = Table(
        title=f"tree speculative decoding, {s['requests']} requests x {spec['new_tokens']} tokens, "
        f"S={spec['num_steps']} K={spec['topk']} D={spec['num_draft_tokens']} (means per verify step)",
        title_justify="left",
    )
    columns = ["mode", "k_max", "MAT", "tokens/step", "utilization", "kept nodes", "slots"]
    columns += [f"experts {p.split()[0]}" for p in result["policies"]] + ["steps", "exact"]
    for column in columns:
        table.add_column(column, justify="left" if column == "mode" else "right", no_wrap=True)
    for row in result["runs"]:
        table.add_row(
            row["mode"],
            str(row["k_max"]),
            f"{row['mat']:.3f}",
            f"{row['tokens_per_step']:.3f}",
            f"{row['utilization']:.3f}",
            f"{row['kept_nodes_per_step']:.1f}",
            f"{row['slots_per_step']:.1f}",
            *(f"{row['activated'][p]:.2f}" for p in result["policies"]),
            str(row["steps"]),
            "yes" if row["exact"] else "NO",
        )
    return table


def _pruned_verify_table(result: dict):
    from rich.table import Table

    table = Table(
        title="acceptance under pruned verify: the same static trees, the target's verify forward pruned "
        "(accept_len = accepted draft tokens per request and step, mean [95% interval over requests])",
        title_justify="left",
    )
    for column in ("verify policy", "k_max", "accept_len", "unpruned accept_len", "experts", "steps"):
        table.add_column(column, justify="left" if column == "verify policy" else "right", no_wrap=True)
    for row in result["pruned_verify"]:
        fmt = lambda a: f"{a['mean']:.3f} [{a['low']:.3f}, {a['high']:.3f}]"  # noqa: E731
        table.add_row(
            row["policy"],
            str(row["k_max"]),
            fmt(row["accept_len"]),
            fmt(row["unpruned_accept_len"]),
            f"{row['experts']:.1f}/{row['unpruned_experts']:.1f}",
            f"{row['steps']}/{row['unpruned_steps']}",
        )
    return table


def spec_eval_handler(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(width=max(Console().width, 170))
    base = SpecEvalSettings.quick() if args.quick else SpecEvalSettings()
    for flag, value in (
        ("--requests", args.requests),
        ("--new-tokens", args.new_tokens),
        ("--calibration-batches", args.calibration_batches),
        ("--default-width", args.default_width),
        ("--max-width", args.max_width),
    ):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value} is invalid: must be an integer >= 1")
    try:
        budgets = tuple(int(b) for b in args.budgets.split(",")) if args.budgets else base.budgets
    except ValueError:
        raise ValueError(f"--budgets {args.budgets!r} is invalid: give integers, e.g. --budgets 7,4") from None
    slots = args.draft_tokens - 1
    if not budgets or any(not 1 <= b <= slots for b in budgets):
        raise ValueError(
            f"--budgets {args.budgets!r} is invalid: each budget is draft nodes per request, an integer in "
            f"[1, {slots}] (--draft-tokens {args.draft_tokens} minus the root)"
        )
    spec = SpecSettings(
        num_steps=args.num_steps,
        topk=args.topk,
        num_draft_tokens=args.draft_tokens,
        new_tokens=args.new_tokens if args.new_tokens is not None else base.spec.new_tokens,
        default_width=args.default_width,
        max_width=args.max_width,
    )
    settings = SpecEvalSettings(
        spec=spec,
        requests=args.requests if args.requests is not None else base.requests,
        budgets=budgets,
        calibration_batches=(
            args.calibration_batches if args.calibration_batches is not None else base.calibration_batches
        ),
        auc_threshold=args.auc_threshold,
    )
    if args.threads < 1:
        raise ValueError(f"--threads {args.threads} must be >= 1")
    torch.set_num_threads(args.threads)
    out = Path(args.out)

    def progress(run: SpecRun) -> None:
        console.print(f"  {run.mode:22s} k_max={run.k_max:4d}: {run.steps} steps, MAT {run.mat:.3f}")

    result, calibration = run_spec_eval(settings, out, model_dir=args.model, draft_dir=args.draft, on_run=progress)
    console.print(calibration_table(calibration))
    console.print(_runs_table(result))
    console.print(_pruned_verify_table(result))
    console.print(
        "MAT = accepted draft tokens per request and step (bonus excluded); utilization = accepted / depth of the "
        "verified tree (deepest kept node); kept nodes / slots = draft nodes verified per step in the batch (slots "
        "include cut ones); experts = distinct experts per verify layer call the policy would activate for the "
        "voting rows (root + kept nodes): "
        + "; ".join(result["policies"])
        + "; exact = output equals the target's greedy decoding.\n"
        f"wrote {out / 'echo_log.jsonl'}, {out / 'echo_calibration.json'}, {out / 'spec_eval.json'} "
        f"({result['seconds']:.1f} s)"
    )
    return 0 if all(row["exact"] for row in result["runs"]) else 1
